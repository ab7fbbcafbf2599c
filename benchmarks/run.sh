#!/usr/bin/env bash
# The benchmark suite's one entry point: a named stage, each within one 10-minute GPU job.
#
#   bash benchmarks/run.sh STAGE          (from the repository root; or: make bench STAGE=...)
#
# Stages (by what they measure):
#   gpu_suite     the GPU tests (what `make test-gpu` runs: pytest -m "gpu or triton" tests), one H200, about 6 minutes
#   speed         glm5-flash-1gpu: tokens/s and MFU at 8K and 32K beside the transformers reference in the
#                 same job, then a warm 1M step (one H200, about 8 minutes)
#   lora          Qwen3-30B-A3B (published shapes, 48 layers) LoRA rank 16 at 128K as the planner plans it:
#                 measured peak against the plan, tokens/s, MFU (one H200, about 8 minutes)
#   memory        the exact memory schemes' peaks against the plain computation (one H200, about 3 minutes)
#   kernels       every fast kernel against its reference, with timings (one H200, about 4 minutes)
#   indexer       the DSA indexer objective's cost (with and without it, the plan's memory fixes in both, five
#                 timed steps each, profiles) and one step's saved bytes by layer against the plan, glm5-flash-1gpu
#                 at INDEXER_LEN (default 32K; it fits an 80 GB GPU with MoE tiles), about 4 minutes; 1M:
#                 INDEXER_LEN=1M INDEXER_STEPS=1 INDEXER_TIMEOUT=540 INDEXER_SAVED=0 INDEXER_PROFILE=0 (about 9
#                 minutes; INDEXER_PROFILE=0 leaves out the profiled step)
#   stream        Qwen3-30B-A3B LoRA at 96K with the frozen base streamed from host memory, then resident (the
#                 plan's other fixes forced): each step's peak against the plan, and the blocks live at it by the
#                 code that allocated them (benchmarks/memory/peak_by_frame.py), about 6 minutes
#   longest       the planned longest LoRA steps of the published checkpoints, to the last layers' backward:
#                 Kimi-Linear-48B-A3B at 1M on a genome window (sequence segments, the base streamed; the
#                 forward of every segment, the loss and the last segment's backward, in two jobs on one machine:
#                 PART=a then PART=b, about 10 and 6 minutes), then
#                 with LONGEST=qwen Qwen3-30B-A3B at its planned longest, 647K (the forward, the loss and the
#                 last 2 layers' backward, about 8 minutes); one H200 each (needs the genomes as .data/)
#   long_context  the long-context experiment in one job (docs/long_context.md; needs the genomes as .data/)
#   parallel      FSDP2 over 8 GPUs: glm5-flash-slice at 64K, dp 2 x cp 4, bf16 weights (8 H200s)
#   plans         the planner's tables (CPU, seconds): the model table of the README, families, FSDP,
#                 expert parallelism, communication volume
#
# Each run writes a dated file per benchmark, RESULTS/<topic>/<benchmark>/<date>_<what>.{json,md,png}, and copies
# it to current_<what>.* beside it: the figure the docs cite. RESULTS defaults to benchmarks/results; on a lent
# machine set RESULTS=$OUT, and TCACHE_PACK=$OUT/tcpart to bring the Triton cache back for the next job's
# .tcpart/. GPU packages (fla-core, liger-kernel) come from `pip install .[gpu]`, or from wheels in .whl/
# (bash benchmarks/wheels.sh) when the machine has no package index.
set -u
[ $# -eq 1 ] || { sed -n '2,/^set -u$/{/^set -u$/!p}' "$0"; exit 2; }
RESULTS=${RESULTS:-benchmarks/results}
DATE=$(date -u +%F)
PY=${PY:-python3}
if ls .whl/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
GIVEN_FLA_AUTOTUNE=${MEGASEQ_FLA_AUTOTUNE:-}  # the GPU suite's default is one config each (gpu_suite.py)
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 MEGASEQ_FLA_AUTOTUNE=${MEGASEQ_FLA_AUTOTUNE:-full}
export TRITON_CACHE_AUTOTUNING=1 TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$PWD/.tcache}
# a Triton cache from an earlier job (without one the first step compiles and autotunes for minutes): the cache
# directory itself, or its parts .tcpart/tcache.tgz.part* (what TCACHE_PACK=DIR writes after the stage: the
# cache's files packed and split into 15 MB parts, to carry to the next job as .tcpart/)
if ls .tcpart/tcache.tgz.part* >/dev/null 2>&1; then
  mkdir -p "$TRITON_CACHE_DIR" && cat .tcpart/tcache.tgz.part* | tar xz -C "$TRITON_CACHE_DIR"
fi
pack_cache() {
  [ -n "${TCACHE_PACK:-}" ] && [ -d "$TRITON_CACHE_DIR" ] || return 0
  mkdir -p "$TCACHE_PACK" && rm -f "$TCACHE_PACK"/tcache.tgz.part*
  tar czf - -C "$TRITON_CACHE_DIR" . | split -b 15M - "$TCACHE_PACK/tcache.tgz.part"
  echo "Triton cache packed: $(du -ch "$TCACHE_PACK"/tcache.tgz.part* | tail -1 | cut -f1) in $TCACHE_PACK"
}

# where one benchmark's files go: dest TOPIC/BENCHMARK WHAT -> prints the dated prefix
dest() { mkdir -p "$RESULTS/$1"; echo "$RESULTS/$1/${DATE}_$2"; }
# copy a dated run's files to current_WHAT.*: current TOPIC/BENCHMARK WHAT
current() {
  local f
  for f in "$RESULTS/$1/${DATE}_$2".*; do [ -e "$f" ] && cp "$f" "$RESULTS/$1/current_$2.${f##*.}"; done
}
machine() {
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "no GPU"
  $PY -c "import torch; print('torch', torch.__version__)"
}

stage_gpu_suite() {
  # what `make test-gpu` runs (benchmarks/gpu_suite.py: pytest -m gpu tests, recorded in latest.json), with this
  # interpreter (the machine's CUDA torch, not a fresh virtualenv)
  # no test starts after SUITE_LIMIT seconds (default 480), so the record is written within the job's 10 minutes;
  # SUITE_WORKERS processes share the GPU (default: the script's, 2 where pytest-xdist is installed)
  MEGASEQ_FLA_AUTOTUNE=${GIVEN_FLA_AUTOTUNE:-one} \
    $PY benchmarks/gpu_suite.py --out "$RESULTS/gpu_suite/latest.json" --time-limit "${SUITE_LIMIT:-480}" \
    ${SUITE_WORKERS:+--workers "$SUITE_WORKERS"} \
    --log "$RESULTS/gpu_suite/latest.jsonl" -- -p no:cacheprovider
}

stage_speed() {
  local b=speed/glm5-flash-1gpu
  timeout -k 5 330 $PY -m megaseq bench recipes/glm5-flash-1gpu.yaml --seq-lens 8K,32K --baseline \
    --out "$(dest $b 8k-32k-baseline)" | grep -E "^\| (length|8,192|32,768)"
  current $b 8k-32k-baseline
  timeout -k 5 200 $PY -m megaseq bench recipes/glm5-flash-1gpu.yaml --seq-lens 1M --steps 1 \
    --out "$(dest $b 1m)" | grep -E "^\| (length|1,048,576)"
  current $b 1m
}

stage_lora() {
  local b=lora/qwen3-30b-a3b
  timeout -k 5 520 $PY benchmarks/lora/lora_h200.py --lengths 128K --steps 1 --out "$(dest $b 128k)" | tail -20
  current $b 128k
}

stage_memory() {
  local b=memory/schemes
  timeout -k 5 300 $PY benchmarks/memory/bench_memory_schemes.py --out "$(dest $b gpu).json" | tail -20
  current $b gpu
}

stage_kernels() {
  local b=kernels/fast_set
  timeout -k 5 150 $PY benchmarks/kernels/gpu_smoke.py --out "$(dest $b smoke).json" | tail -15
  timeout -k 5 120 $PY benchmarks/kernels/glue_gpu.py --out "$(dest $b glue).json" | tail -15
  timeout -k 5 200 $PY benchmarks/kernels/sparse_mla_gpu.py --out "$(dest $b sparse_mla).json" | tail -15
  current $b smoke; current $b glue; current $b sparse_mla
  timeout -k 5 150 $PY benchmarks/kernels/mla_segment_gpu.py --prefixes 262144 --out "$(dest kernels/mla_segment gpu).json" \
    | tail -5
}

stage_indexer() {
  local len=${INDEXER_LEN:-32K} b=long_context/indexer_objective
  mkdir -p "$RESULTS/$b"
  timeout -k 5 "${INDEXER_TIMEOUT:-200}" $PY benchmarks/long_context/indexer_objective_cost.py --seq-len "$len" \
    --steps "${INDEXER_STEPS:-5}" $([ "${INDEXER_PROFILE:-1}" = 1 ] && echo --profile) \
    --out "$RESULTS/$b" \
    | tail -16
  [ "${INDEXER_SAVED:-1}" = 1 ] || return 0
  timeout -k 5 150 $PY benchmarks/memory/saved_by_layer.py recipes/glm5-flash-1gpu.yaml --seq-len "$len" \
    --out "$(dest memory/saved_by_layer glm5-flash-1gpu_$len).json" | tail -20
}

stage_stream() {
  local b=memory/stream_base s run
  local forced="--memory.auto false --memory.recompute true --memory.tiled_mlp true --memory.checkpoint_offload true"
  for s in true false; do
    run=$(dest $b qwen3-30b-a3b-lora_96k_stream-$s)
    rm -rf "/tmp/stream_$s"
    timeout -k 5 250 $PY benchmarks/memory/peak_by_frame.py --out "$run.txt" -- train recipes/qwen3-30b-a3b-lora.yaml \
      --data.seq_len 96K --train.steps 1 --train.eval_after false --train.run_dir "/tmp/stream_$s" \
      --log.progress false $forced --memory.offload_host_budget 60G --memory.stream_base $s | head -30
    # a run its plan refuses (the resident base on a GPU of less than about 85 GB) writes neither
    [ -f "/tmp/stream_$s/metrics.jsonl" ] && cp "/tmp/stream_$s/metrics.jsonl" "$run.metrics.jsonl"
    [ -f "/tmp/stream_$s/plan.json" ] && cp "/tmp/stream_$s/plan.json" "$run.plan.json"
  done
}

stage_longest() {
  local b
  if [ "${LONGEST:-kimi}" = qwen ]; then
    b=lora/qwen3-30b-a3b
    timeout -k 5 560 $PY benchmarks/lora/lora_partial_step.py 647K --backward-layers 2 \
      --out "$(dest $b 647k_partial).json" | tail -30
  else
    # the forward of 128 segments is longer than one job: PART=a runs it for 500 s and saves what the step
    # carries to CARRY (on the machine's disk), PART=b (the next job on the same machine) goes on from there
    b=lora/kimi-linear-48b-a3b
    local part=${PART:-a} carry=${CARRY:-/root/megaseq_carry} split
    if [ "$part" = a ]; then split="--forward-for 500 --carry $carry"; else split="--resume $carry --history"; fi
    timeout -k 5 570 $PY benchmarks/lora/segments_partial_step.py 1M --forward-loss --source genome $split \
      --out "$(dest $b 1m_partial_$part).json" data.train="${GENOMES:-.data}/ecoli_MG1655.fa.gz" | tail -30
  fi
}

stage_long_context() {
  OUT=$(dest long_context/experiment run) GENOMES=${GENOMES:-.data} bash benchmarks/long_context/long_context.sh call
}

stage_parallel() {
  local run
  run=$(dest parallel/fsdp8 slice_64k)
  timeout -k 5 500 torchrun --nproc-per-node 8 -m megaseq train recipes/glm5-flash-slice.yaml --train.steps 3 \
    --parallel.dp 2 --parallel.cp 4 --parallel.fsdp dp_cp --model.weights bf16 \
    --train.run_dir "$run" --train.overwrite true
  cp "$run/metrics.jsonl" "$RESULTS/parallel/fsdp8/current_slice_64k.jsonl" 2>/dev/null
}

stage_plans() {
  $PY benchmarks/memory/model_table.py --out "$RESULTS/memory/model_table.md"
  $PY benchmarks/memory/family_plan_rows.py --out "$RESULTS/memory/family_plan_rows.json"
  $PY benchmarks/parallel/fsdp_plan_rows.py --out "$RESULTS/parallel/fsdp_plan_rows.json"
  $PY benchmarks/parallel/ep_plans.py --out "$RESULTS/parallel/ep_plans.json"
  $PY benchmarks/parallel/comm_volume_table.py --out "$RESULTS/parallel/comm_volume.json"
}

case "$1" in
  gpu_suite|speed|lora|memory|kernels|indexer|stream|longest|long_context|parallel|plans)
    machine; "stage_$1"; rc=$?; pack_cache; exit $rc ;;
  *) echo "unknown stage '$1': one of gpu_suite speed lora memory kernels indexer stream longest long_context" \
       "parallel plans" >&2
     exit 2 ;;
esac
