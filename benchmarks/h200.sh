#!/usr/bin/env bash
# The H200 measurements of this repository, in stages that each fit one 10-minute device call.
#   bash benchmarks/h200.sh STAGE            (from the repo root, with .whl/ and .data/ carried)
# .whl/ holds fla-core, liger-kernel, transformers and peft wheels (bash benchmarks/wheels.sh); .data/ the E. coli genomes from
# ../shared/data/genomes; .tcache/ (optional) a Triton cache from an earlier call. Results go to $OUT.
set -u
OUT=${OUT:-out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1 MEGASEQ_FLA_AUTOTUNE=${MEGASEQ_FLA_AUTOTUNE:-full}
export TRITON_CACHE_AUTOTUNING=1  # fla's autotune results persist in .tcache (carried between calls)
export TRITON_CACHE_DIR=$PWD/.tcache
mkdir -p .tcache
# a cache from an earlier call comes as its parts (181 MB unpacked, 27 MB packed: past what a call carries
# unpacked): carry .tcpart/ holding tcache.tgz.part*
if ls .tcpart/tcache.tgz.part* >/dev/null 2>&1; then cat .tcpart/tcache.tgz.part* | tar xz; fi
G=.data/ecoli_MG1655.fa.gz
ms() { python3 -m megaseq "$@"; }
# the memory settings `megaseq plan` picks for the Qwen3-30B-A3B LoRA recipe at length $1, each as printf
# format $2 of (key, value) (default: command-line flags)
lora_fix() { python3 -m megaseq plan recipes/qwen3-30b-a3b-lora.yaml --seq-len "$1" --json 2>/dev/null | python3 -c "
import json, sys; m = json.load(sys.stdin)['memory']
print(' '.join(sys.argv[1] % (k, str(v).lower() if isinstance(v, bool) else v) for k, v in m.items()))" "${2:---memory.%s %s}"; }
# one glm5-flash-1gpu bench at 32K, five warm steps, its table row printed (an A/B's one side: the caller sets
# PYTHONPATH or the variable it compares): bench32k OUT_NAME
bench32k() { timeout -k 5 120 python3 -m megaseq bench recipes/glm5-flash-1gpu.yaml --seq-lens 32K --steps 5 \
  --out "$OUT/$1" | grep "^| 32,768"; }
# the 32K A/B of the tree in .ab/$1 against today's: twice each, interleaved (bench_32k_<tree>_<run>)
ab32k() {
  local run tree src
  for run in 1 2; do
    for tree in "$1" now; do
      src=$PWD/src; [ "$tree" = now ] || src=$PWD/.ab/$tree/src
      PYTHONPATH=/tmp/site:$src bench32k "bench_32k_${tree}_$run"
    done
  done
}
# the 32K A/B of settings in the environment, each side twice, interleaved (bench_32k_<name>_<run>): abenv
# NAME:VAR=VALUE[+VAR=VALUE...] ...
abenv() {
  local run side vars
  for run in 1 2; do
    for side in "$@"; do
      vars=${side#*:}
      (export ${vars//+/ }; bench32k "bench_32k_${side%%:*}_$run") 2>&1 | sed "s/^/${side%%:*}: /"
    done
  done
}
# the gpu-marked tests of one file into gpu_tests_NAME.log, its last line and failures printed: gpu_tests FILE NAME
# TIMEOUT (returns the tests' status)
gpu_tests() {
  local rc
  timeout -k 5 "$3" python3 -m pytest -q -m gpu -p no:cacheprovider "$1" > "$OUT/gpu_tests_$2.log" 2>&1; rc=$?
  echo "$2: $(tail -1 "$OUT/gpu_tests_$2.log")"
  grep -E "^(FAILED|ERROR)" "$OUT/gpu_tests_$2.log" | head -10 | cut -c1-300
  return $rc
}
# today's idle gaps in a 32K step, until $1 s into the call, the first $2 lines of them printed
gaps_profile() {
  timeout -k 5 $(($1 - SECONDS)) python3 benchmarks/profile_step.py recipes/glm5-flash-1gpu.yaml 32K \
    --json "$OUT/profile_32k_gaps.json" > "$OUT/profile_1gpu_32k_gaps.txt" 2>&1
  sed -n '/GPU idle between/,$p' "$OUT/profile_1gpu_32k_gaps.txt" | head -"$2" | cut -c1-250
}
# issue 13's benches: its command until $1 s into the call, then a warm 1M step until $2 s
issue_benches() {
  timeout -k 5 $(($1 - SECONDS)) python3 -m megaseq bench recipes/glm5-flash-1gpu.yaml --seq-lens 8K,32K --baseline \
    --out "$OUT/bench_1gpu_issue" | grep -E "^\| (8,192|32,768)"
  timeout -k 5 $(($2 - SECONDS)) python3 -m megaseq bench recipes/glm5-flash-1gpu.yaml --seq-lens 1M --steps 1 \
    --out "$OUT/bench_1gpu_1m" | grep -E "^\| 1,048,576"
}
# a session's final call: the GPU tests of $1 (if they fail, the benches run the tree in .ab/$2 instead), then
# issue_benches $3 $4
final_benches() {
  local name
  name=$(basename "$1" .py)
  if ! gpu_tests "$1" "${name#test_}" 90; then
    echo "GPU tests failed: benches on .ab/$2"; export PYTHONPATH=/tmp/site:$PWD/.ab/$2/src
  fi
  issue_benches "$3" "$4"
}
# the GPU tests of the streams' carry and of fla's forget gate, one config per autotuned kernel (numerics, not
# speed), into gpu_tests.log; a failure is reported, the stage goes on
carry_gate_tests() {
  MEGASEQ_FLA_AUTOTUNE=one timeout -k 5 150 python3 -m pytest -q -p no:cacheprovider tests/test_hc_carry.py \
    tests/test_kda_gate.py > "$OUT/gpu_tests.log" 2>&1; local rc=$?
  tail -3 "$OUT/gpu_tests.log"
  [ $rc -eq 0 ] || { echo "GPU tests failed (rc $rc)"; grep -E "^(FAILED|ERROR)|Error" "$OUT/gpu_tests.log" | head -20 | cut -c1-300; }
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"
case "$1" in
  1)  # kernels vs references, indexer + tiled MoE on genome routing, first full bench
    timeout 100 python3 benchmarks/gpu_smoke.py --only kda,dispatch --out "$OUT/gpu_smoke.json"
    timeout 130 python3 benchmarks/bench_memory_schemes.py --only indexer,tiled_moe --genome $G \
      --out "$OUT/memory_schemes_b.json"
    timeout 320 python3 -m megaseq bench recipes/glm5-flash-1gpu.yaml --seq-lens 32K,128K --steps 2 \
      --source both --baseline --logprob-check 16K,8K --data.train $G --out "$OUT/bench_1gpu_a"
    ;;
  2)  # where a step's time goes; log-probs vs the reference; the planner at three lengths, random and genome
    timeout 80 python3 benchmarks/profile_step.py recipes/glm5-flash-1gpu.yaml 32K > "$OUT/profile_1gpu_32k.txt" 2>&1
    tail -32 "$OUT/profile_1gpu_32k.txt"
    timeout 70 python3 -m megaseq bench recipes/glm5-flash-1gpu.yaml --seq-lens 8K --steps 1 \
      --logprob-check 16K,8K --out "$OUT/bench_1gpu_logprob"
    timeout 400 python3 -m megaseq bench recipes/glm5-flash-1gpu.yaml --seq-lens 32K,128K,256K --steps 1 \
      --source both --data.train $G --out "$OUT/bench_1gpu"
    ;;
  3)  # log-probs (weights built on the CPU for both); a second preset at 3 lengths; genome rows isolated
    timeout 80 python3 -m megaseq bench recipes/glm5-flash-1gpu.yaml --seq-lens 8K --steps 1 \
      --logprob-check 16K,8K --out "$OUT/bench_1gpu_logprob"
    timeout 170 python3 -m megaseq bench recipes/glm5-flash-tiny-dna.yaml --model.dtype bf16 \
      --seq-lens 128K,512K,1M --steps 1 --source both --data.train $G --out "$OUT/bench_tiny"
    timeout 250 python3 -m megaseq bench recipes/glm5-flash-1gpu.yaml --seq-lens 32K,128K,256K --steps 1 \
      --source genome --data.train $G --out "$OUT/bench_1gpu_genome"
    ;;
  4)  # sequence segments: bf16 gradients vs the plain step; log-probs vs the reference; 256K, both sources
    timeout 150 python3 benchmarks/model_segments_gpu.py --out "$OUT/model_segments.json"
    timeout 230 python3 -m megaseq bench recipes/glm5-flash-1gpu.yaml --seq-lens 8K --steps 1 \
      --logprob-check 16K,8K --out "$OUT/bench_1gpu_logprob"
    timeout 250 python3 -m megaseq bench recipes/glm5-flash-1gpu.yaml --seq-lens 256K --steps 0 \
      --source both --data.train $G --out "$OUT/bench_1gpu_256k"
    ;;
  5)  # 1M tokens on one H200 (one cold step: a step is minutes long)
    timeout 500 python3 -m megaseq bench recipes/glm5-flash-1gpu.yaml --seq-lens 1M --steps 0 \
      --source ${SOURCE:-random} --data.train $G --out "$OUT/bench_1gpu_1m_${SOURCE:-random}"
    ;;
  6)  # the second preset at 3 lengths on genome windows and random tokens; 512K of the first
    timeout 200 python3 -m megaseq bench recipes/glm5-flash-tiny-dna.yaml --model.dtype bf16 \
      --seq-lens 128K,512K,1M --steps 1 --source both --data.train $G --out "$OUT/bench_tiny"
    timeout 300 python3 -m megaseq bench recipes/glm5-flash-1gpu.yaml --seq-lens 512K --steps 0 \
      --source both --data.train $G --out "$OUT/bench_1gpu_512k"
    ;;
  7)  # sequence segments at fp32 (exact) and bf16 (noise vs the plain step run twice); plain 16K (the
      # planner's per-layer terms at a segment's length); 1M tokens, one cold step
    timeout 120 python3 benchmarks/model_segments_gpu.py --fp32 --seq-len 8192 --segment 2048 \
      --out "$OUT/model_segments_fp32.json"
    timeout 100 python3 benchmarks/model_segments_gpu.py --out "$OUT/model_segments.json"
    timeout 90 python3 -m megaseq bench recipes/glm5-flash-1gpu.yaml --seq-lens 16K --steps 1 \
      --memory.auto false --memory.indexer_query_chunk 4K --out "$OUT/bench_1gpu_16k_plain"
    timeout 330 python3 -m megaseq bench recipes/glm5-flash-1gpu.yaml --seq-lens 1M --steps 0 \
      --out "$OUT/bench_1gpu_1m_random"
    ;;
  8)  # bf16 segments vs plain with every pool selected (no near-tie can flip the DSA selection) and with
      # the preset's top-k (how many selections flip); the tiny preset's memory by layer and phase;
      # 1M on a genome window; 32K on both sources
    timeout 80 python3 benchmarks/model_segments_gpu.py --topk-all --out "$OUT/model_segments_topk_all.json"
    timeout 70 python3 benchmarks/model_segments_gpu.py --out "$OUT/model_segments.json"
    timeout 60 python3 benchmarks/memory_phases.py recipes/glm5-flash-tiny-dna.yaml 128K --model.dtype bf16 \
      --out "$OUT/memory_phases_tiny_128k.json"
    timeout 300 python3 -m megaseq bench recipes/glm5-flash-1gpu.yaml --seq-lens 1M --steps 0 \
      --source genome --data.train $G --out "$OUT/bench_1gpu_1m_genome"
    timeout 80 python3 -m megaseq bench recipes/glm5-flash-1gpu.yaml --seq-lens 32K --steps 1 \
      --source both --data.train $G --out "$OUT/bench_1gpu_32k"
    ;;
  9)  # the second preset at 3 lengths on both sources (steady state); its memory by layer at 1M (tiled);
      # bf16 segments vs plain with every pool selected
    timeout 80 python3 benchmarks/model_segments_gpu.py --topk-all --out "$OUT/model_segments_topk_all.json"
    timeout 260 python3 -m megaseq bench recipes/glm5-flash-tiny-dna.yaml --model.dtype bf16 \
      --seq-lens 128K,512K,1M --steps 1 --source both --data.train $G --out "$OUT/bench_tiny"
    timeout 90 python3 benchmarks/memory_phases.py recipes/glm5-flash-tiny-dna.yaml 1M --model.dtype bf16 \
      --out "$OUT/memory_phases_tiny_1m.json"
    NOTAR=1
    ;;
  10) # next: sequence segments' GPU tests (bf16 vs float64, with packed documents); 1M with the kept DSA
      # selections (opt-in, not yet measured); log-probs at 32K (the longest the reference was seen to run)
    timeout 150 python3 -m pytest -q -m gpu tests/test_model_segments.py > "$OUT/pytest_segments.log" 2>&1
    tail -3 "$OUT/pytest_segments.log"
    timeout 330 python3 -m megaseq bench recipes/glm5-flash-1gpu.yaml --seq-lens 1M --steps 0 \
      --memory.segment_keep_selection true --out "$OUT/bench_1gpu_1m_kept"
    timeout 200 python3 -m megaseq bench recipes/glm5-flash-1gpu.yaml --seq-lens 8K --steps 1 \
      --logprob-check 32K,16K --out "$OUT/bench_1gpu_logprob32k"
    ;;
  11) # the speed issue's figures with the fast kernels (8K + 32K against the reference: about 6 minutes)
    timeout 540 python3 -m megaseq bench recipes/glm5-flash-1gpu.yaml --seq-lens 8K,32K --baseline \
      --model.kernels fast --out "$OUT/bench_1gpu_fast"
    ;;
  12) # a profile of a 32K step with the fast kernels (it hit 120 s compiling from an empty Triton cache in
      # session 5), and glm5-flash-slice at 256K, warm (the issue's 35K layer-tokens/s; not yet run)
    timeout 240 python3 benchmarks/profile_step.py recipes/glm5-flash-1gpu.yaml 32K --model.kernels fast \
      > "$OUT/profile_1gpu_32k_fast.txt" 2>&1
    tail -32 "$OUT/profile_1gpu_32k_fast.txt"
    timeout $((590 - SECONDS)) python3 -m megaseq bench recipes/glm5-flash-slice.yaml --seq-lens 256K --steps 2 \
      --model.kernels fast --out "$OUT/bench_slice_256k_fast"
    ;;
  fsdp1)  # bf16 weights + fp32 master (model.weights bf16, issue #14) on one H200 against today's fp32 weights
      # (32K: 130.3 GiB, 10.1K tok/s): 32K both ways, the planned peaks and the planned longest length
    timeout 150 python3 -m megaseq bench recipes/glm5-flash-1gpu.yaml --seq-lens 32K --steps 2 \
      --model.weights bf16 --out "$OUT/bench_1gpu_bf16w_32k"
    timeout 150 python3 -m megaseq bench recipes/glm5-flash-1gpu.yaml --seq-lens 32K --steps 2 \
      --out "$OUT/bench_1gpu_fp32w_32k"
    python3 -m megaseq plan recipes/glm5-flash-1gpu.yaml --seq-len 32K --model.weights bf16 --json \
      > "$OUT/plan_1gpu_bf16w_32k.json"
    python3 -c "from megaseq.models.presets import get_preset; from megaseq.plan.planner import longest_length; \
print('planned longest, bf16 weights:', longest_length(get_preset('glm5-flash-1gpu'), weights='bf16'))" \
      | tee "$OUT/longest_1gpu_bf16w.txt"
    NOTAR=1
    ;;
  fsdp2)  # the same at 1M (today warm: 93.9 GiB, 208 s per step): one warm-up step and one measured (a try
      # with 440 s was killed before its row, 2026-12-01: give it the whole call)
    timeout 580 python3 -m megaseq bench recipes/glm5-flash-1gpu.yaml --seq-lens 1M --steps 1 \
      --model.weights bf16 --out "$OUT/bench_1gpu_bf16w_1m"
    NOTAR=1
    ;;
  lora1)  # (issue 17) after the MoE combine fix: Qwen3-30B-A3B LoRA at 128K, the planner's own plan (it ran out
      # of memory with the float32 stream, 2026-12-01) and the first 4 layers by layer and phase; want +-5%
    python3 benchmarks/truncated_config.py recipes/qwen3-30b-a3b/config.json 4 /tmp/q4
    timeout 90 python3 benchmarks/memory_phases.py recipes/qwen3-30b-a3b-lora.yaml 128K --model.name /tmp/q4/config.json \
      --memory.auto false --memory.chunked_loss true --memory.tiled_mlp true --memory.mlp_tile_tokens 8K \
      --memory.recompute true --out "$OUT/memory_phases_q4_lora_128k.json" > /dev/null 2>&1
    timeout 420 python3 benchmarks/lora_h200.py --lengths 128K --steps 1 --out "$OUT/lora_128k" 2>&1 | tail -30
    NOTAR=1
    ;;
  lora2)  # (issue 17) SDPA per KV head (session 8): the GPU tests of its memory, the first 4 layers at 128K by phase
      # (planned 21.88 GiB; 24.28 measured in one call, session 7), then at the 48-layer planned longest (600K)
      # with the fixes the planner picks for all 48 there, and where that step's memory goes
    timeout 120 python3 -m pytest -q -m gpu tests/test_attention.py 2>&1 | tail -8
    python3 benchmarks/truncated_config.py recipes/qwen3-30b-a3b/config.json 4 /tmp/q4
    timeout 90 python3 benchmarks/memory_phases.py recipes/qwen3-30b-a3b-lora.yaml 128K --model.name /tmp/q4/config.json \
      --memory.auto false --memory.chunked_loss true --memory.tiled_mlp true --memory.mlp_tile_tokens 8K \
      --memory.recompute true --out "$OUT/memory_phases_q4_lora_128k.json" 2>&1 | tail -12
    FIX=$(lora_fix 600K "memory.%s=%s")
    timeout 240 python3 benchmarks/lora_h200.py --layers 4 --lengths 600K --steps 1 --out "$OUT/lora_q4_600k" \
      memory.auto=false $FIX 2>&1 | tail -25
    timeout 150 python3 benchmarks/memory_census.py recipes/qwen3-30b-a3b-lora.yaml 600K --model.name /tmp/q4/config.json \
      --memory.auto false $(echo $FIX | sed 's/memory\./--memory./g; s/=/ /g') --out "$OUT/census_q4_lora_600k.json" \
      > /dev/null 2>&1
    NOTAR=1
    ;;
  lora3)  # (issue 17) session 9: where the 4-layer 128K step's peak is (census; lora2 measured 24.28 GiB, the same
      # as before SDPA per KV head), then the 4 layers' forward and backward at the 48-layer planned longest (600K)
    python3 benchmarks/truncated_config.py recipes/qwen3-30b-a3b/config.json 4 /tmp/q4
    timeout 130 python3 benchmarks/memory_census.py recipes/qwen3-30b-a3b-lora.yaml 128K --model.name /tmp/q4/config.json \
      --memory.auto false --memory.chunked_loss true --memory.tiled_mlp true --memory.mlp_tile_tokens 8K \
      --memory.recompute true --out "$OUT/census_q4_lora_128k.json" 2>&1 | tail -3
    FIX=$(lora_fix 600K)
    echo "$FIX"
    timeout 260 python3 benchmarks/memory_phases.py recipes/qwen3-30b-a3b-lora.yaml 600K --model.name /tmp/q4/config.json \
      --memory.auto false $FIX --out "$OUT/memory_phases_q4_lora_600k.json" 2>&1 | tail -12
    NOTAR=1
    ;;
  lora4)  # (issue 17) session 9: the op that makes the 4-layer step's peak (memory_ops: every op's allocation) at
      # 128K and 256K, the fixes of lora2's 128K row (measured 24.28 GiB, planned 21.88)
    python3 benchmarks/truncated_config.py recipes/qwen3-30b-a3b/config.json 4 /tmp/q4
    for S in 128K 256K; do
      timeout 200 python3 benchmarks/memory_ops.py recipes/qwen3-30b-a3b-lora.yaml $S --model.name /tmp/q4/config.json \
        --memory.auto false --memory.chunked_loss true --memory.tiled_mlp true --memory.mlp_tile_tokens 8K \
        --memory.recompute true --out "$OUT/ops_q4_lora_$S.json" 2>&1 | tail -28
    done
    NOTAR=1
    ;;
  lora5)  # (issue 17) session 9, after the RMSNorm's backward in row chunks: the 4-layer step's ops at 128K (lora2's
      # fixes; 24.28 GiB before) and at the 48-layer planned longest, 600K, with the fixes planned for it
    python3 benchmarks/truncated_config.py recipes/qwen3-30b-a3b/config.json 4 /tmp/q4
    timeout 120 python3 benchmarks/memory_ops.py recipes/qwen3-30b-a3b-lora.yaml 128K --model.name /tmp/q4/config.json \
      --memory.auto false --memory.chunked_loss true --memory.tiled_mlp true --memory.mlp_tile_tokens 8K \
      --memory.recompute true --out "$OUT/ops_q4_lora_128K.json" 2>&1 | tail -16
    FIX=$(lora_fix 600K)
    timeout 330 python3 benchmarks/memory_ops.py recipes/qwen3-30b-a3b-lora.yaml 600K --model.name /tmp/q4/config.json \
      --memory.auto false $FIX --out "$OUT/ops_q4_lora_600K.json" 2>&1 | tail -16
    NOTAR=1
    ;;
  lora6)  # (issue 17) the 48-layer Qwen3-30B-A3B LoRA step at 128K as the planner plans it (no gpu_budget margin),
      # after the chunked RMSNorm and the corrected backward terms (session 9): measured peak vs plan, tokens/s, MFU;
      # first the GPU tests of the chunked norm's and SDPA's backward memory
    timeout 90 python3 -m pytest -q -m gpu tests/test_norm.py tests/test_attention.py 2>&1 | tail -8
    timeout 470 python3 benchmarks/lora_h200.py --lengths 128K --steps 1 --out "$OUT/lora_48l_128k" 2>&1 | tail -25
    NOTAR=1
    ;;
  s10a)  # session 10, call 1: lora6 (the GPU tests of the chunked norm and SDPA per KV head, the 48-layer
      # Qwen3-30B-A3B LoRA step at 128K as planned), then the annotated profile of a fast-kernels 32K step of
      # glm5-flash-1gpu (issue 13: GPU time by kernel, by module part and by backward function)
    timeout 90 python3 -m pytest -q -m gpu tests/test_norm.py tests/test_attention.py 2>&1 | tail -8
    timeout 400 python3 benchmarks/lora_h200.py --lengths 128K --steps 1 --out "$OUT/lora_48l_128k" 2>&1 | tail -25
    timeout $((575 - SECONDS)) python3 benchmarks/profile_step.py recipes/glm5-flash-1gpu.yaml 32K \
      --json "$OUT/profile_32k_fast.json" --model.kernels fast > "$OUT/profile_1gpu_32k_fast.txt" 2>&1
    tail -120 "$OUT/profile_1gpu_32k_fast.txt"
    ;;
  s10b)  # session 10, call 2 (issue 17): all 48 layers of Qwen3-30B-A3B LoRA at 512K, the planner's plan: the whole
      # forward, the loss and the backward of the last 2 layers, then stopped (a whole step is ~20 minutes); first
      # the chunked norm's GPU test (its rule corrected to the measured 16 B per chunk element); then (issue 18)
      # the overfit test at 128K on the calibrated region (carry .ovf/ instead of .data/)
    timeout 60 python3 -m pytest -q -m gpu tests/test_norm.py 2>&1 | tail -3
    timeout 470 python3 benchmarks/lora_partial_step.py 512K --backward-layers 2 --out "$OUT/lora_48l_512k_partial.json"
    timeout $((590 - SECONDS)) python3 benchmarks/overfit.py .ovf/w16k --seq-len 128K --steps 30 --out "$OUT/overfit_128k"
    NOTAR=1
    ;;
  s10c)  # session 10, call 3 (issue 18): why the overfit test falls slower on the H200 at 128K (77.5% in 30 steps) than
      # on the CPU at 4K (29% in 20, float32, the same region and weights): the same test at 4K in bf16 and in
      # fp32 (the dtype), at 128K with no memory fixes (the fixes), at 16K and at 128K in fp32 (the length)
    mkdir -p /tmp/ovf
    of() { name=$1; shift; timeout $((585 - SECONDS)) python3 benchmarks/overfit.py .ovf/w16k --steps 30 "$@" \
      --out /tmp/ovf/$name 2>&1 | grep -v "^step \|model weights"; tar czf "$OUT/overfit_s10.tgz" -C /tmp ovf; }
    of 4k_bf16 --seq-len 4K
    of 4k_fp32 --seq-len 4K --set model.dtype=fp32
    of 128k_bf16_nofix --seq-len 128K --set memory.auto=false
    of 16k_bf16 --seq-len 16K
    of 128k_fp32 --seq-len 128K --set model.dtype=fp32
    NOTAR=1
    ;;
  s11a)  # session 11, call 2 (issues 13, 18): the GPU tests of the fused MoE permute/combine, hc_mix and Liger's
      # chunked loss; the packed overfit test at 128K; the annotated profile of a fast 32K step
    timeout 150 python3 -m pytest -q -m gpu tests/test_triton_moe_glue.py tests/test_hc_mix.py tests/test_liger_loss.py 2>&1 | tail -5
    # (issue 18) the packed overfit test: 128K as 32 documents of the calibrated 4K window, beside the 4K window
    # alone (carry .ovf/ with .whl/)
    [ -d .ovf/w16k ] && timeout 150 python3 benchmarks/overfit.py .ovf/w16k --seq-len 128K --packed 4K --steps 30 \
      --out "$OUT/overfit_packed_128k" 2>&1 | grep -v "^step \|model weights"
    timeout $((560 - SECONDS)) python3 benchmarks/profile_step.py recipes/glm5-flash-1gpu.yaml 32K \
      --json "$OUT/profile_32k_fast.json" --model.kernels fast > "$OUT/profile_1gpu_32k_fast.txt" 2>&1
    tail -150 "$OUT/profile_1gpu_32k_fast.txt"
    ;;
  s11b)  # session 11, call 1 (issue 17): the 48-layer LoRA step at the planner's longest, 632K, as s10b did at
      # 512K (forward 423 s; a whole step there is ~26 minutes, past a call and a session's budget)
    timeout 585 python3 benchmarks/lora_partial_step.py 632K --backward-layers 2 --out "$OUT/lora_48l_632k_partial.json"
    NOTAR=1
    ;;
  s12a)  # prepared in session 11 (issue 13), not yet run: the glue kernels' GPU tests (now with a bf16 block output
      # beside fp32 streams in the merge), then the speed issue's figures with the fast kernels against the
      # reference in one job (about 6 minutes; the bench rows list any op of the fast set that fell back), then
      # 32K fast without the planner's KDA segments if time is left (their replay took 50 ms of the step)
    timeout 90 python3 -m pytest -q -m gpu tests/test_triton_glue.py 2>&1 | tail -3
    timeout 460 python3 -m megaseq bench recipes/glm5-flash-1gpu.yaml --seq-lens 8K,32K --baseline \
      --model.kernels fast --out "$OUT/bench_1gpu_fast"
    timeout $((585 - SECONDS)) python3 -m megaseq bench recipes/glm5-flash-1gpu.yaml --seq-lens 32K --steps 2 \
      --model.kernels fast --memory.auto false --memory.chunked_loss true --memory.indexer_query_chunk 4K \
      --out "$OUT/bench_1gpu_fast_32k_nosegments"
    PACK=1  # no Triton cache came with this session's checkout: return the one this call builds
    ;;
  s12p)  # session 12, call 2 (issue 13): with the cache s12a built, the profiles of fast steps at 8K (the 1.58x
      # length), 32K and 256K, then glm5-flash-slice at 256K, fast and warm (target: 35K layer-tokens/s)
    for L in 8K 32K 256K; do
      timeout -k 10 200 python3 benchmarks/profile_step.py recipes/glm5-flash-1gpu.yaml $L \
        --json "$OUT/profile_${L,,}_fast.json" --model.kernels fast > "$OUT/profile_1gpu_${L,,}_fast.txt" 2>&1
      head -30 "$OUT/profile_1gpu_${L,,}_fast.txt"
    done
    timeout $((585 - SECONDS)) python3 -m megaseq bench recipes/glm5-flash-slice.yaml --seq-lens 256K --steps 2 \
      --model.kernels fast --out "$OUT/bench_slice_256k_fast"
    PACK=1; NOTAR=1  # the cache came with the call (.tcpart/)
    ;;
  s12f)  # session 12, call 3 (issue 13): the fast set now the default and Liger's loss in 4096-token chunks: its
      # GPU test, then the issue's own command (no --model.kernels) with the baseline in the same job
    timeout -k 5 45 python3 -m pytest -q -m gpu tests/test_liger_loss.py 2>&1 | tail -3
    timeout -k 5 $((295 - SECONDS)) python3 -m megaseq bench recipes/glm5-flash-1gpu.yaml --seq-lens 8K,32K \
      --baseline --out "$OUT/bench_1gpu"
    NOTAR=1
    ;;
  s12b)  # prepared in session 11 (issue 13), not yet run: the profiles the issue asks for after the work, a fast 32K
      # step (session 11's: 1.155 s under the profiler, before the merge fix) and a fast 256K step (where the
      # indexer's quadratic scoring starts to show), then glm5-flash-slice at 256K with the fast kernels, warm
      # (target: at least 35K layer-tokens/s, i.e. 8.75K tokens/s over its 4 layers; never measured)
    timeout 200 python3 benchmarks/profile_step.py recipes/glm5-flash-1gpu.yaml 32K \
      --json "$OUT/profile_32k_fast.json" --model.kernels fast > "$OUT/profile_1gpu_32k_fast.txt" 2>&1
    head -40 "$OUT/profile_1gpu_32k_fast.txt"
    timeout 240 python3 benchmarks/profile_step.py recipes/glm5-flash-1gpu.yaml 256K \
      --json "$OUT/profile_256k_fast.json" --model.kernels fast > "$OUT/profile_1gpu_256k_fast.txt" 2>&1
    head -40 "$OUT/profile_1gpu_256k_fast.txt"
    timeout $((585 - SECONDS)) python3 -m megaseq bench recipes/glm5-flash-slice.yaml --seq-lens 256K --steps 1 \
      --model.kernels fast --out "$OUT/bench_slice_256k_fast"
    PACK=1
    ;;
  s12c)  # prepared in session 11 (issue 13), not yet run: the fast set with bf16 weights (bf16 streams: half the
      # bytes of the mHC glue, no per-matmul weight casts) at 32K, then a warm 1M step with the fast kernels
      # (session 5's was 188 s cold; the target is under 60 s)
    timeout 150 python3 -m megaseq bench recipes/glm5-flash-1gpu.yaml --seq-lens 32K --steps 2 \
      --model.kernels fast --model.weights bf16 --out "$OUT/bench_1gpu_fast_bf16w_32k"
    timeout $((585 - SECONDS)) python3 -m megaseq bench recipes/glm5-flash-1gpu.yaml --seq-lens 1M --steps 1 \
      --model.kernels fast --out "$OUT/bench_1gpu_fast_1m"
    PACK=1
    ;;
  s13a)  # session 13, call 1 (issue 13): MasterAdamW's fused path on the GPU, then the issue's command with bf16
      # weights (fp32 masters in MasterAdamW; no per-matmul weight casts), the reference in the same job; where
      # a fast 32K step's memory sits at its peak without KDA segments (for a planner that knows the fast set);
      # glm5-flash-slice at 256K, warm (target: 35K layer-tokens/s)
    timeout -k 5 60 python3 -m pytest -q -m gpu tests/test_master_adam.py 2>&1 | tail -3
    timeout -k 5 320 python3 -m megaseq bench recipes/glm5-flash-1gpu.yaml --seq-lens 8K,32K --baseline \
      --model.weights bf16 --out "$OUT/bench_1gpu_bf16w"
    timeout -k 5 100 python3 benchmarks/memory_census.py recipes/glm5-flash-1gpu.yaml 32K --memory.auto false \
      --memory.chunked_loss true --memory.indexer_query_chunk 4K --model.weights bf16 \
      --out "$OUT/census_32k_fast_bf16w.json" > /dev/null 2>&1
    timeout -k 5 $((585 - SECONDS)) python3 -m megaseq bench recipes/glm5-flash-slice.yaml --seq-lens 256K \
      --steps 1 --model.weights bf16 --out "$OUT/bench_slice_256k"
    NOTAR=1
    ;;
  s13b)  # session 13, call 2 (issue 13): a warm 1M step of glm5-flash-1gpu (the fast set, bf16 weights; one
      # warm-up step, then one measured; session 5's cold step with the base kernels took 188 s, the target is
      # under 60 s)
    timeout -k 5 $((585 - SECONDS)) python3 -m megaseq bench recipes/glm5-flash-1gpu.yaml --seq-lens 1M \
      --steps 1 --model.weights bf16 --out "$OUT/bench_1gpu_1m"
    NOTAR=1
    ;;
  s14a)  # prepared in session 13 (issue 13), not yet run (call 5 of session 13 found no machine): the recipe's
      # defaults now (bf16 weights, the fast set, a plan that counts the fast set's working sets: the indexer
      # scores 4096 queries a chunk at 1M, not 128, in 16K-token sequence segments, not 8K): a warm 1M step
      # (session 13's, before the plan change: 160.5 s), then where a fast 32K step's memory sits at its peak
      # without KDA segments (the census now runs the kernels model.kernels names); first 256K, where the plan
      # that counts the fast set picks 32K sequence segments (session 13 measured tiled MLP + KDA
      # segments there: 30.8K tokens/s, 119.6 GiB)
    timeout -k 5 150 python3 -m megaseq bench recipes/glm5-flash-1gpu.yaml --seq-lens 8K,32K,256K \
      --steps 1 --out "$OUT/bench_1gpu_plan2"  # 32K: the plan now picks no fix (session 13: KDA segments)
    timeout -k 5 $((520 - SECONDS)) python3 -m megaseq bench recipes/glm5-flash-1gpu.yaml --seq-lens 1M \
      --steps 1 --out "$OUT/bench_1gpu_1m_plan"
    timeout -k 5 $((585 - SECONDS)) python3 benchmarks/memory_census.py recipes/glm5-flash-1gpu.yaml 32K \
      --memory.auto false --memory.indexer_query_chunk 32K --out "$OUT/census_32k_fast.json" > "$OUT/census.log" 2>&1
    tail -3 "$OUT/census.log"
    NOTAR=1
    ;;
  s14m)  # session 14, call 1 (issue 13): s14a's 1M step first, on a cold machine (this checkout has no Triton cache:
      # the warm-up step autotunes): the recipe's defaults, whose plan now scores the indexer 4096 queries a chunk at
      # 1M (session 13: 128) in 16K-token sequence segments (session 13: 8K); session 13's warm step took 160.5 s
    timeout -k 5 $((560 - SECONDS)) python3 -m megaseq bench recipes/glm5-flash-1gpu.yaml --seq-lens 1M \
      --steps 1 --out "$OUT/bench_1gpu_1m_plan"
    ;;
  s14s)  # session 14, call 2 (issue 13), on the machine s14m warmed: the rest of s14a (8K, 32K, 256K with the plan
      # that counts the fast set: no fix at 32K, 32K sequence segments at 256K), then the fast 32K memory census
    timeout -k 5 300 python3 -m megaseq bench recipes/glm5-flash-1gpu.yaml --seq-lens 8K,32K,256K \
      --steps 1 --out "$OUT/bench_1gpu_plan2"
    timeout -k 5 $((560 - SECONDS)) python3 benchmarks/memory_census.py recipes/glm5-flash-1gpu.yaml 32K \
      --memory.auto false --memory.indexer_query_chunk 32K --out "$OUT/census_32k_fast.json" > "$OUT/census.log" 2>&1
    tail -3 "$OUT/census.log"
    ;;
  s15a)  # prepared in session 14 (issue 13), not yet run: the issue's own command after the sparse MLA kernels'
      # timed launch configurations, the sync-free MoE counts and the sparse MLA backward's smaller working set
      # (carry .tcpart: session 14's cache); then 256K, where the plan picks tiled MLP + KDA segments again
      # (session 13 measured them at 30.8K tokens/s; session 14's 32K sequence segments 28.3K)
    timeout -k 5 420 python3 -m megaseq bench recipes/glm5-flash-1gpu.yaml --seq-lens 8K,32K --baseline \
      --out "$OUT/bench_1gpu_issue"
    timeout -k 5 $((585 - SECONDS)) python3 -m megaseq bench recipes/glm5-flash-1gpu.yaml --seq-lens 256K \
      --steps 1 --out "$OUT/bench_1gpu_256k"
    NOTAR=1
    ;;
  s15b)  # prepared in session 14 (issue 13), not yet run, on the machine s15a warmed: a warm 1M step (session 14:
      # 47.2 s before the changes above), then where an 8K and a 32K step go now (the profiles after the work)
    timeout -k 5 250 python3 -m megaseq bench recipes/glm5-flash-1gpu.yaml --seq-lens 1M --steps 1 \
      --out "$OUT/bench_1gpu_1m"
    timeout -k 5 150 python3 benchmarks/profile_step.py recipes/glm5-flash-1gpu.yaml 8K \
      --json "$OUT/profile_8k.json" > "$OUT/profile_1gpu_8k.txt" 2>&1
    timeout -k 5 $((585 - SECONDS)) python3 benchmarks/profile_step.py recipes/glm5-flash-1gpu.yaml 32K \
      --json "$OUT/profile_32k.json" > "$OUT/profile_1gpu_32k.txt" 2>&1
    tail -40 "$OUT/profile_1gpu_32k.txt"
    NOTAR=1
    ;;
  s15p)  # session 15, call 1 (issue 13), on a machine without a Triton cache: where an 8K and a 32K step go with
      # the session-14 kernels (sparse MLA launch configurations, sync-free MoE counts), then warm 8K/32K steps;
      # returns the Triton cache (PACK=1) for the later calls
    timeout -k 5 330 python3 benchmarks/profile_step.py recipes/glm5-flash-1gpu.yaml 8K \
      --json "$OUT/profile_8k.json" > "$OUT/profile_1gpu_8k.txt" 2>&1
    tail -12 "$OUT/profile_1gpu_8k.txt"
    timeout -k 5 $((420 - SECONDS)) python3 benchmarks/profile_step.py recipes/glm5-flash-1gpu.yaml 32K \
      --json "$OUT/profile_32k.json" > "$OUT/profile_1gpu_32k.txt" 2>&1
    timeout -k 5 $((540 - SECONDS)) python3 -m megaseq bench recipes/glm5-flash-1gpu.yaml --seq-lens 8K,32K \
      --steps 2 --out "$OUT/bench_1gpu_now"
    ;;
  s15c)  # session 15, call 2 (issue 13; carry .tcpart: call 1's cache): the new fast kernels' GPU tests (Triton
      # hc_mix, fla's gated norm), hc_mix timed alone, then the issue's own command; the bench only if the tests pass
    timeout -k 5 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_triton_hc_mix.py tests/test_fla_norm.py \
      tests/test_hc_mix.py > "$OUT/gpu_tests.log" 2>&1; rc=$?
    tail -5 "$OUT/gpu_tests.log"
    [ $rc -eq 0 ] || { echo "GPU tests failed (rc $rc): no bench"; exit 1; }
    timeout -k 5 90 python3 benchmarks/glue_gpu.py --only hc_mix --no-loss --dtypes bfloat16 --out "$OUT/glue_hc_mix.json"
    timeout -k 5 $((590 - SECONDS)) python3 -m megaseq bench recipes/glm5-flash-1gpu.yaml --seq-lens 8K,32K --baseline \
      --out "$OUT/bench_1gpu_issue"
    NOTAR=1
    ;;
  s15d)  # session 15, call 3, on the machine s15c warmed: a warm 1M step (the plan now runs 32K sequence segments,
      # session 14 measured 47.2 s with 16K ones), then where a 32K step goes now
    timeout -k 5 300 python3 -m megaseq bench recipes/glm5-flash-1gpu.yaml --seq-lens 1M --steps 1 \
      --out "$OUT/bench_1gpu_1m"
    timeout -k 5 $((560 - SECONDS)) python3 benchmarks/profile_step.py recipes/glm5-flash-1gpu.yaml 32K \
      --json "$OUT/profile_32k.json" > "$OUT/profile_1gpu_32k.txt" 2>&1
    tail -40 "$OUT/profile_1gpu_32k.txt"
    NOTAR=1
    ;;
  s15e)  # session 15, call 4 (issue 13): hc_mix's forward as three bf16 tensor-core products (bf16 streams): its GPU
      # tests, its time alone, then warm 8K and 32K steps (no baseline: s15c measured it in this session)
    timeout -k 5 120 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_triton_hc_mix.py > "$OUT/gpu_tests.log" 2>&1
    rc=$?; tail -3 "$OUT/gpu_tests.log"
    [ $rc -eq 0 ] || { echo "GPU tests failed (rc $rc): no bench"; exit 1; }
    timeout -k 5 60 python3 benchmarks/glue_gpu.py --only hc_mix --no-loss --dtypes bfloat16 --out "$OUT/glue_hc_mix.json"
    timeout -k 5 $((330 - SECONDS)) python3 -m megaseq bench recipes/glm5-flash-1gpu.yaml --seq-lens 8K,32K --steps 2 \
      --out "$OUT/bench_1gpu_split"
    NOTAR=1
    ;;
  s16a)  # prepared in session 15 (issue 13), not yet run: the key-major latent gradient (MEGASEQ_MLA_DC=pool) on
      # the GPU: its tests, the kernels alone against the atomics at 8K, 32K and a 32K segment of 256K, then the
      # issue's command with it (the atomics' run is session 15's: 2.22x / 3.35x, MFU 26.0%; 27.1% with hc_mix's
      # bf16x3 forward)
    timeout -k 5 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_triton_sparse_mla.py \
      > "$OUT/gpu_tests.log" 2>&1; rc=$?
    tail -5 "$OUT/gpu_tests.log"
    [ $rc -eq 0 ] || { echo "GPU tests failed (rc $rc): no bench"; exit 1; }
    (cd benchmarks && timeout -k 5 150 python3 sparse_mla_configs.py --defaults-only --out "$OUT/sparse_mla_pool.json")
    MEGASEQ_MLA_DC=pool timeout -k 5 $((585 - SECONDS)) python3 -m megaseq bench recipes/glm5-flash-1gpu.yaml \
      --seq-lens 8K,32K --baseline --out "$OUT/bench_1gpu_pool"
    NOTAR=1
    ;;
  s16b)  # session 16, call 2 (issue 13): where a 32K step goes with the key-major latent gradient (pool); returns
      # the Triton cache (PACK=1)
    MEGASEQ_MLA_DC=pool timeout -k 5 300 python3 benchmarks/profile_step.py recipes/glm5-flash-1gpu.yaml 32K \
      --json "$OUT/profile_32k_pool.json" > "$OUT/profile_1gpu_32k_pool.txt" 2>&1
    head -60 "$OUT/profile_1gpu_32k_pool.txt" | cut -c1-200
    ;;
  s16c)  # session 16, call 2 (issue 13): the pool pass as the default (timed launch config, sort 32K queries at a
      # time) and MasterAdamW in one Triton pass (ops.triton_adamw): their GPU tests, where a 32K step goes, the
      # issue's command, then a warm 1M step
    timeout -k 5 120 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_triton_sparse_mla.py \
      > "$OUT/gpu_tests.log" 2>&1; rc=$?
    tail -5 "$OUT/gpu_tests.log"
    [ $rc -eq 0 ] || { echo "GPU tests failed (rc $rc): no bench"; exit 1; }
    timeout -k 5 60 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_triton_adamw.py -rA \
      > "$OUT/gpu_tests_adamw.log" 2>&1 || { echo "AdamW kernel's GPU test failed: torch's AdamW"; export MEGASEQ_ADAMW=torch; }
    tail -5 "$OUT/gpu_tests_adamw.log"
    timeout -k 5 150 python3 benchmarks/profile_step.py recipes/glm5-flash-1gpu.yaml 32K \
      --json "$OUT/profile_32k.json" > "$OUT/profile_1gpu_32k.txt" 2>&1
    head -45 "$OUT/profile_1gpu_32k.txt" | cut -c1-160
    timeout -k 5 240 python3 -m megaseq bench recipes/glm5-flash-1gpu.yaml --seq-lens 8K,32K --baseline \
      --out "$OUT/bench_1gpu_issue"
    timeout -k 5 $((585 - SECONDS)) python3 -m megaseq bench recipes/glm5-flash-1gpu.yaml --seq-lens 1M --steps 1 \
      --out "$OUT/bench_1gpu_1m"
    NOTAR=1
    ;;
  s16d)  # session 16, call 3 (issue 13): the AdamW kernel's GPU test (its weights compared as their masters'
      # rounding), then the issue's command with it
    timeout -k 5 90 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_triton_adamw.py \
      > "$OUT/gpu_tests_adamw.log" 2>&1; rc=$?
    tail -8 "$OUT/gpu_tests_adamw.log" | cut -c1-400
    [ $rc -eq 0 ] || { echo "AdamW kernel's GPU test failed (rc $rc): no bench"; exit 1; }
    timeout -k 5 $((400 - SECONDS)) python3 -m megaseq bench recipes/glm5-flash-1gpu.yaml --seq-lens 8K,32K \
      --baseline --out "$OUT/bench_1gpu_adamw"
    NOTAR=1
    ;;
  s17a)  # session 17, call 1 (issue 13): where a 32K step goes now (pool default, the AdamW kernel); returns the
      # Triton cache (PACK=1)
    timeout -k 5 400 python3 benchmarks/profile_step.py recipes/glm5-flash-1gpu.yaml 32K \
      --json "$OUT/profile_32k.json" > "$OUT/profile_1gpu_32k.txt" 2>&1
    head -70 "$OUT/profile_1gpu_32k.txt" | cut -c1-220
    ;;
  s17b)  # session 17, call 2 (issue 13): the streams' gradient carried through hc_mix / hc_collapse, the DSA
      # selection from pool starts, the pool-layout check in one Triton pass, KDA's q / k / v convolved apart:
      # their GPU tests, then the issue's command (only if the tests pass)
    timeout -k 5 150 python3 -m pytest -q -p no:cacheprovider tests/test_hc_carry.py > "$OUT/gpu_tests.log" 2>&1; rc=$?
    timeout -k 5 $((170 - SECONDS)) python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_triton_hc_mix.py \
      tests/test_triton_glue.py tests/test_model_segments.py >> "$OUT/gpu_tests.log" 2>&1 || rc=$((rc + 1))
    grep -E "passed|failed|error" "$OUT/gpu_tests.log" | tail -6
    [ $rc -eq 0 ] || { echo "GPU tests failed (rc $rc): no bench"; tail -40 "$OUT/gpu_tests.log" | cut -c1-300; exit 1; }
    timeout -k 5 $((545 - SECONDS)) python3 -m megaseq bench recipes/glm5-flash-1gpu.yaml --seq-lens 8K,32K \
      --baseline --out "$OUT/bench_1gpu_issue"
    NOTAR=1
    ;;
  s17c)  # session 17, call 3 (issue 13): the issue's own command on the final code
    timeout -k 5 590 python3 -m megaseq bench recipes/glm5-flash-1gpu.yaml --seq-lens 8K,32K --baseline \
      --out "$OUT/bench_1gpu_issue"
    NOTAR=1
    ;;
  s18a)  # prepared in session 17 (issue 13), not yet run: the GPU tests of the carry and of fla's forget gate
      # (op kda_gate, not yet run on a GPU), session 17's changes A/B at 32K in one job (s17c ran with
      # device_env.sh's MEGASEQ_FLA_AUTOTUNE=one, every autotuned Triton kernel on one conservative config, so its
      # 26.5% MFU is a lower bound), then the issue's command. Carry .ab/s16 (the tree before them:
      # mkdir -p .ab/s16 && git archive f62017c src | tar x -C .ab/s16) and .tcpart
    # one config per autotuned kernel for the tests (numerics, not speed: s17b's ran out of time autotuning)
    MEGASEQ_FLA_AUTOTUNE=one timeout -k 5 150 python3 -m pytest -q -p no:cacheprovider tests/test_hc_carry.py \
      tests/test_kda_gate.py > "$OUT/gpu_tests.log" 2>&1; rc=$?
    tail -3 "$OUT/gpu_tests.log"
    [ $rc -eq 0 ] || { echo "GPU tests failed (rc $rc): no bench"; tail -40 "$OUT/gpu_tests.log" | cut -c1-300; exit 1; }
    for tree in s16 s17; do
      src=$PWD/src; [ $tree = s16 ] && src=$PWD/.ab/s16/src
      PYTHONPATH=/tmp/site:$src timeout -k 5 150 python3 -m megaseq bench recipes/glm5-flash-1gpu.yaml --seq-lens 32K \
        --steps 3 --out "$OUT/bench_32k_$tree"
    done
    timeout -k 5 $((590 - SECONDS)) python3 -m megaseq bench recipes/glm5-flash-1gpu.yaml --seq-lens 8K,32K \
      --baseline --out "$OUT/bench_1gpu_issue"
    NOTAR=1
    ;;
  s18c)  # session 18, call 1 (issue 13), no Triton cache with the checkout: the carry's and fla forget gate's GPU
      # tests (one config per autotuned kernel: numerics, not speed), then today's tree at 8K and 32K (the warm-up
      # steps autotune every kernel: full tuning), then session 16's tree (.ab/s16: mkdir -p .ab/s16 && git archive
      # f62017c src | tar x -C .ab/s16) at 32K in the time left. PACK=1: the Triton cache comes back
    carry_gate_tests
    timeout -k 5 $((440 - SECONDS)) python3 -m megaseq bench recipes/glm5-flash-1gpu.yaml --seq-lens 8K,32K \
      --steps 3 --out "$OUT/bench_s18"
    PYTHONPATH=/tmp/site:$PWD/.ab/s16/src timeout -k 5 $((560 - SECONDS)) python3 -m megaseq bench \
      recipes/glm5-flash-1gpu.yaml --seq-lens 32K --steps 3 --out "$OUT/bench_32k_s16"
    ;;
  s19a)  # session 19, call 1 (issue 13; session 18's s18c results were lost with its machine): the carry's and fla
      # forget gate's GPU tests (one config per autotuned kernel: numerics, not speed), today's tree at 8K and 32K
      # (the warm-up steps autotune every kernel: full tuning), then where a 32K step goes in the time left.
      # PACK=1: the Triton cache comes back
    carry_gate_tests
    timeout -k 5 $((460 - SECONDS)) python3 -m megaseq bench recipes/glm5-flash-1gpu.yaml --seq-lens 8K,32K \
      --steps 3 --out "$OUT/bench_s19"
    timeout -k 5 $((555 - SECONDS)) python3 benchmarks/profile_step.py recipes/glm5-flash-1gpu.yaml 32K \
      --json "$OUT/profile_32k.json" > "$OUT/profile_1gpu_32k.txt" 2>&1
    head -70 "$OUT/profile_1gpu_32k.txt" | cut -c1-220
    ;;
  s19b)  # session 19, call 2 (issue 13): today's tree at 32K (warm steps, full tuning: s19a's bench ran out of time
      # after 8K), then where a 32K step goes with the GPU's idle gaps and the host syncs (profile_step's trace
      # tables); carry .whl, .tcpart
    timeout -k 5 200 python3 -m megaseq bench recipes/glm5-flash-1gpu.yaml --seq-lens 32K --steps 5 --out "$OUT/bench_32k"
    timeout -k 5 $((420 - SECONDS)) python3 benchmarks/profile_step.py recipes/glm5-flash-1gpu.yaml 32K \
      --json "$OUT/profile_32k_gaps.json" > "$OUT/profile_1gpu_32k_gaps.txt" 2>&1
    sed -n '/GPU idle between/,$p' "$OUT/profile_1gpu_32k_gaps.txt" | cut -c1-220
    NOTAR=1
    ;;
  s19c)  # session 19, call 3 (issue 13): the step's finiteness decided on the device (no host sync between the
      # backward and the update) A/B at 32K in one job: the tree before it (.ab/s19a: mkdir -p .ab/s19a && git
      # archive 547e80b src | tar x -C .ab/s19a) and today's, twice each, interleaved; then today's idle gaps. The
      # AdamW kernel's GPU tests (its masked stores) first. Carry .whl, .tcpart, .ab
    timeout -k 5 90 python3 -m pytest -q -p no:cacheprovider tests/test_triton_adamw.py > "$OUT/gpu_tests_adamw.log" 2>&1
    tail -2 "$OUT/gpu_tests_adamw.log"
    ab32k s19a
    timeout -k 5 $((500 - SECONDS)) python3 benchmarks/profile_step.py recipes/glm5-flash-1gpu.yaml 32K \
      --json "$OUT/profile_32k_gaps.json" > "$OUT/profile_1gpu_32k_gaps.txt" 2>&1
    sed -n '/GPU idle between/,$p' "$OUT/profile_1gpu_32k_gaps.txt" | head -40 | cut -c1-220
    PACK=1 NOTAR=1
    ;;
  s19d)  # session 19, call 4 (issue 13): hc_mix's backward on the tensor cores in bf16 pieces (bwd_split, commit
      # e4757c8, reverted after this call: its fn gradient 16x the fp32 reference's error at 4K tokens, 1.19 against
      # 1.26 ms for the op, the step within noise): its GPU tests, the op alone, then A/B at 32K in one job
      # (MEGASEQ_HC_MIX_BWD=ieee: the fp32 FMA dots as before), interleaved; carry .whl, .tcpart. Reproduce on
      # e4757c8's tree
    timeout -k 5 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_triton_hc_mix.py tests/test_hc_carry.py \
      > "$OUT/gpu_tests_hc_mix.log" 2>&1; rc=$?
    tail -3 "$OUT/gpu_tests_hc_mix.log"
    [ $rc -eq 0 ] || { echo "GPU tests failed (rc $rc)"; grep -E "^(FAILED|ERROR)|Error|assert" "$OUT/gpu_tests_hc_mix.log" | head -20 | cut -c1-300; }
    for v in split ieee; do
      MEGASEQ_HC_MIX_BWD=$v timeout -k 5 60 python3 benchmarks/glue_gpu.py --only hc_mix --no-loss --dtypes bfloat16 \
        --out "$OUT/glue_hc_mix_$v.json" 2>&1 | tail -4
    done
    for run in 1 2; do
      for v in ieee split; do
        MEGASEQ_HC_MIX_BWD=$v bench32k "bench_32k_${v}_$run"
      done
    done
    PACK=1 NOTAR=1
    ;;
  s19e)  # session 19, call 5 (issue 13): the final code: the indexer selection's GPU tests (its row sets by
      # nonzero_static: if they fail, the benches run the tree before that change, .ab/s19pre: mkdir -p .ab/s19pre
      # && git archive bb3ccee src | tar x -C .ab/s19pre), the issue's command, then a warm 1M step in the time left.
      # Carry .whl, .tcpart, .ab/s19pre
    final_benches tests/test_indexer_topk.py s19pre 420 540
    PACK=1 NOTAR=1
    ;;
  s20a)  # session 20, call 1 (issue 13): host syncs removed (the indexer selection 14 -> 3 a call and the pools' ends
      # from arange with one document; the sparse MLA backward's 2 -> 0, its layout check read with the forward's
      # empty-row check). GPU tests: the indexer's (rows that differ only at fp32-level ties allowed, counted) on
      # the tree before (.ab/base: mkdir -p .ab/base && git archive f695f64 src | tar x -C .ab/base) and today's,
      # sparse MLA's on today's; the two trees at 32K twice, interleaved; today's idle gaps. Carry .whl, .tcpart,
      # .ab/base
    for tree in base now; do
      src=$PWD/src; [ $tree = base ] && src=$PWD/.ab/base/src
      PYTHONPATH=/tmp/site:$src timeout -k 5 80 python3 -m pytest -q -s -m gpu -p no:cacheprovider \
        tests/test_indexer_topk.py > "$OUT/gpu_tests_indexer_$tree.log" 2>&1
      echo "$tree: $(tail -1 "$OUT/gpu_tests_indexer_$tree.log")"
      grep -E "^Q=|differs beyond" "$OUT/gpu_tests_indexer_$tree.log" | head -6 | cut -c1-300
    done
    gpu_tests tests/test_triton_sparse_mla.py sparse_mla 100
    ab32k base
    gaps_profile 560 45
    PACK=1 NOTAR=1
    ;;
  s20b)  # session 20, call 2 (issue 13): the pool pass's programs a query block at a time (L2 reuse of the q_abs and
      # do_lat rows). The op alone at 32K and a 32K segment of 256K keys in every block (0: pool order, as before),
      # the pass's launch configurations in the picked order; the sparse MLA GPU tests; the step at 32K, the tree
      # before (.ab/pre: mkdir -p .ab/pre && git archive <the commit before it> src | tar x -C .ab/pre) and today's,
      # twice, interleaved. Carry .whl, .tcpart, .ab/pre
    timeout -k 5 200 python3 benchmarks/sparse_mla_configs.py --defaults-only --shapes 32768:32768,32768:262144 \
      --pool-blocks 0,512,2048,4096,8192 --out "$OUT/sparse_mla_pool_order.json" > "$OUT/sparse_mla_pool_order.log" 2>&1
    grep -E "dc=pool|^Q=.*(fwd|bwd) Config" "$OUT/sparse_mla_pool_order.log" | cut -c1-200
    gpu_tests tests/test_triton_sparse_mla.py sparse_mla 100
    ab32k pre
    PACK=1 NOTAR=1
    ;;
  s20c)  # session 20, call 3 (issue 13): Liger's backward without its host sync, the router bias update in a few
      # launches: the loss's GPU tests; the step at 32K, the tree before (.ab/pre2: git archive 308ad50~1 src) and
      # today's, twice, interleaved; today's idle gaps with what ran before each of the longest. Carry .whl, .tcpart,
      # .ab/pre2
    gpu_tests tests/test_liger_loss.py liger 90
    ab32k pre2
    gaps_profile 400 60
    PACK=1 NOTAR=1
    ;;
  s20d)  # session 20, call 4 (issue 13): the final code. The AdamW kernel's GPU tests (if they fail, the benches run
      # the tree before the last change, .ab/pre3: git archive <final>~1 src), the issue's command, then a warm 1M
      # step in the time left. Carry .whl, .tcpart, .ab/pre3
    final_benches tests/test_triton_adamw.py pre3 430 575
    PACK=1 NOTAR=1
    ;;
  s20e)  # session 20, call 5 (issue 13): where a 256K step goes after the work (the last, session 13's, was before
      # the fast kernels' later sessions), in the device time left; carry .whl, .tcpart
    timeout -k 5 200 python3 benchmarks/profile_step.py recipes/glm5-flash-1gpu.yaml 256K \
      --json "$OUT/profile_256k.json" > "$OUT/profile_1gpu_256k.txt" 2>&1
    head -40 "$OUT/profile_1gpu_256k.txt" | cut -c1-160
    NOTAR=1
    ;;
  s21a)  # session 21, call 1 (issue 13): the latent gradient's pool pass from the p and ds the slot pass saved
      # (MEGASEQ_MLA_DC=saved) against the scores computed again (pool, the default). The sparse MLA GPU tests; the
      # op alone at 32K and a 32K segment of 256K keys, the saved pass's launch configurations; the step at 32K
      # with pool, saved, and saved with fla's backend dispatch off (FLA_DISABLE_BACKEND_DISPATCH=1), twice each,
      # interleaved. Carry .whl, .tcpart
    gpu_tests tests/test_triton_sparse_mla.py sparse_mla 170
    timeout -k 5 150 python3 benchmarks/sparse_mla_configs.py --defaults-only --no-pool-grid \
      --shapes 32768:32768,32768:262144 --saved 32:4:2,64:4:2,32:8:2,16:4:2 --out "$OUT/sparse_mla_saved.json" \
      > "$OUT/sparse_mla_saved.log" 2>&1
    grep -E "dc=|^Q=.*(fwd|bwd) Config" "$OUT/sparse_mla_saved.log" | cut -c1-200
    abenv pool:MEGASEQ_MLA_DC=pool saved:MEGASEQ_MLA_DC=saved \
      nodispatch:MEGASEQ_MLA_DC=saved+FLA_DISABLE_BACKEND_DISPATCH=1
    PACK=1 NOTAR=1
    ;;
  s21b)  # session 21, call 2 (issue 13): dc=saved the default. The sparse MLA GPU tests again; every launch
      # configuration of the forward and the slot pass at 32K (the slot pass now also stores p and ds); then
      # glm5-flash-slice at 256K, warm (the issue's 35K layer-tokens/s; last measured in session 13). Carry .whl, .tcpart
    gpu_tests tests/test_triton_sparse_mla.py sparse_mla 170
    timeout -k 5 230 python3 benchmarks/sparse_mla_configs.py --no-pool-grid --shapes 32768:32768 \
      --out "$OUT/sparse_mla_configs_32k.json" > "$OUT/sparse_mla_configs_32k.log" 2>&1
    grep -E "best|dc=" "$OUT/sparse_mla_configs_32k.log" | cut -c1-200
    timeout -k 5 $((590 - SECONDS)) python3 -m megaseq bench recipes/glm5-flash-slice.yaml --seq-lens 256K --steps 1 \
      --out "$OUT/bench_slice_256k" | grep -E "^\| 262,144"
    PACK=1 NOTAR=1
    ;;
  s21c)  # session 21, call 3 (issue 13): the final code's benches as final_benches runs them, without its GPU tests
      # (s21a and s21b ran them on this code): the issue's command, then a warm 1M step. Carry .whl, .tcpart
    issue_benches $((SECONDS + 400)) 585
    NOTAR=1
    ;;
  s21d)  # session 21, call 4 (issue 13): where a 32K step goes after dc=saved, in the device time left; carry .whl, .tcpart
    timeout -k 5 170 python3 benchmarks/profile_step.py recipes/glm5-flash-1gpu.yaml 32K \
      --json "$OUT/profile_32k.json" > "$OUT/profile_1gpu_32k.txt" 2>&1
    head -36 "$OUT/profile_1gpu_32k.txt" | cut -c1-160
    NOTAR=1
    ;;
  s18b)  # prepared in session 17 (issue 13), not yet run: MasterAdamW's launch configurations, a warm 1M step (the
      # last, session 16's s16c, 33.2 s, ran before the AdamW kernel), then where a 256K step goes (issue 13 asks for
      # a 256K profile after the work; session 13's is the last); carry .whl, .tcpart
    timeout -k 5 60 python3 benchmarks/adamw_configs.py --out "$OUT/adamw_configs.json"
    timeout -k 5 300 python3 -m megaseq bench recipes/glm5-flash-1gpu.yaml --seq-lens 1M --steps 1 \
      --out "$OUT/bench_1gpu_1m"
    timeout -k 5 $((585 - SECONDS)) python3 benchmarks/profile_step.py recipes/glm5-flash-1gpu.yaml 256K \
      --json "$OUT/profile_256k.json" > "$OUT/profile_1gpu_256k.txt" 2>&1
    head -45 "$OUT/profile_1gpu_256k.txt" | cut -c1-160
    NOTAR=1
    ;;
  fsdp8)  # (nvidia-h200-x8) FSDP2 over 8 GPUs, bf16 weights: glm5-flash-slice (the full model's layer shapes)
      # at 64K, dp_cp over dp 2 x cp 4; metrics.jsonl holds each step's measured and planned peak
    timeout 500 torchrun --nproc-per-node 8 -m megaseq train recipes/glm5-flash-slice.yaml --train.steps 3 \
      --parallel.dp 2 --parallel.cp 4 --parallel.fsdp dp_cp --model.weights bf16 \
      --train.run_dir "$OUT/fsdp8_slice_64k" --train.overwrite true
    NOTAR=1
    ;;
  *) echo "unknown stage $1"; exit 2 ;;
esac
# PACK=1: the results as one results.tar beside the logs (a call returns at most 8 files), so that the cache fits too
if [ -n "${PACK:-}" ]; then
  (cd "$OUT" && find . -mindepth 1 -maxdepth 1 ! -name '*.log' ! -name results.tar -printf '%P\n' | tar cf results.tar -T - \
    && find . -mindepth 1 -maxdepth 1 ! -name '*.log' ! -name results.tar -exec rm -rf {} +)
fi
# the Triton cache in parts of 15 MiB (a file comes back up to 16 MiB): cat tcache.tgz.part* | tar xz
[ -n "${NOTAR:-}" ] || tar czf - .tcache 2>/dev/null | split -b 15M - "$OUT/tcache.tgz.part"
ls -la "$OUT"
