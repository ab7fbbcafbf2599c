#!/usr/bin/env bash
# Speed where users run, on one H200: balanced MoE routing, the transformers + PEFT + Liger peer in the same job,
# and the first step on an empty cache against a warm one. Standalone (from the repo root, .whl/ carried as for
# benchmarks/run.sh: fla-core, liger-kernel, transformers, peft wheels); results as JSON + markdown under $OUT.
#   bash benchmarks/speed/speed_gpu.sh glm     # at most 10 minutes: (b) glm5-flash-1gpu 8K,32K --baseline on an empty
#                                        #   cache (its rows' first_step_s against step_s are (c): the first step
#                                        #   on an empty cache against a warm one), then, time permitting, 8K
#                                        #   with the tuned tables it wrote but no compiled kernels (compilation
#                                        #   alone)
#   bash benchmarks/speed/speed_gpu.sh qwen    # about 4 minutes: (a) qwen3-30b-a3b-lora 32K --baseline, balanced routing
#   bash benchmarks/speed/speed_gpu.sh kept    # about 4 minutes: qwen3-30b-a3b-lora at 32K, the planner's choice (kept attention)
#                                        #   against recompute without it, interleaved twice
#   bash benchmarks/speed/speed_gpu.sh first   # about 8 minutes: the first step on empty caches, glm5-flash-1gpu at 8K and
#                                        #   qwen3-30b-a3b-lora at 32K (FIRST_CASES="recipe:length ..."), each way
#                                        #   of FIRST_RUNS (default "1 compile 0": MEGASEQ_PRECOMPILE's values: the
#                                        #   shipped kernel packs seeded and the manifests precompiled, the default;
#                                        #   the manifests compiled without the packs; neither); FIRST_ARGS are
#                                        #   added to each bench (e.g. --profile-first), and the environment
#                                        #   passes through (e.g. MEGASEQ_PIN_AHEAD=0; FIRST_TAG names such runs)
#   bash benchmarks/speed/speed_gpu.sh pack    # about 2 minutes: the kernel pack of each shipped manifest for this GPU
#                                        #   (ops.kernel_pack.build) into src/megaseq/ops/tuned/kernels/ and $OUT
#   bash benchmarks/speed/speed_gpu.sh ops     # about a minute: glm5-flash-1gpu's op manifests (ops.op_warmup) at OPS_LENS
#                                        #   (default "8K 32K"), each recorded by a first step on an empty cache,
#                                        #   into src/megaseq/ops/tuned/ops/ and $OUT
#   bash benchmarks/speed/speed_gpu.sh tune    # up to 10 minutes: this GPU's tuned table (full tuning at TUNE_LENS,
#                                        #   default 8K,32K, added to the shipped one) into $OUT/<gpu>.json, to
#                                        #   commit as src/megaseq/ops/tuned/<gpu>.json
# Each stage ends with $OUT/speed_<stage>.json (benchmarks/speed/speed_summary.py): per length megaseq's and the peer's
# tokens/s, MFU, peak, the first and warm step, the routing and its max/mean load, and the ratio.
set -u
STAGE=${1:-glm}
OUT=${OUT:-out}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
fi
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1
unset MEGASEQ_FLA_AUTOTUNE MEGASEQ_AUTOTUNE  # the defaults: pruned spaces, tuned tables read first
# an empty cache, as on a new machine: Triton's compiled kernels and megaseq's tuned tables
export TRITON_CACHE_DIR=$PWD/.speed_cache/triton MEGASEQ_CACHE_DIR=$PWD/.speed_cache/megaseq
rm -rf .speed_cache
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu_$STAGE.txt"
python3 -c "import torch, triton, transformers, peft; print(torch.__version__, triton.__version__, transformers.__version__, peft.__version__)" | tee -a "$OUT/gpu_$STAGE.txt"
python3 -c "import liger_kernel, importlib.metadata as m; print('liger-kernel', m.version('liger-kernel'))" 2>&1 | tail -1 | tee -a "$OUT/gpu_$STAGE.txt"
ms() { python3 -m megaseq "$@"; }
t0=$(date +%s)
case "$STAGE" in
  glm)
    timeout -k 5 420 python3 -m megaseq bench recipes/glm5-flash-1gpu.yaml --seq-lens 8K,32K --steps 3 --baseline \
      --out "$OUT/glm_cold" 2>&1 | tail -40
    echo "cold bench: $(( $(date +%s) - t0 )) s end to end" | tee "$OUT/glm_wall.txt"
    cp .speed_cache/megaseq/autotune/*.json "$OUT/" 2>/dev/null
    # 8K again with the tuned tables this run wrote but Triton's compiled kernels gone: the first step's
    # compilation alone (no timing of configs), if the call has the time left
    if [ $(( $(date +%s) - t0 )) -lt 430 ]; then
      rm -rf .speed_cache/triton
      t1=$(date +%s)
      timeout -k 5 140 python3 -m megaseq bench recipes/glm5-flash-1gpu.yaml --seq-lens 8K --steps 2 --out "$OUT/glm_tables" 2>&1 | tail -8
      echo "8K with tables, no compiled kernels: $(( $(date +%s) - t1 )) s end to end" | tee -a "$OUT/glm_wall.txt"
    fi
    python3 benchmarks/speed/speed_summary.py "$OUT/speed_glm.json" "$OUT/glm_cold.json" "$OUT/glm_tables.json"
    ;;
  qwen)
    timeout -k 5 540 python3 -m megaseq bench recipes/qwen3-30b-a3b-lora.yaml --seq-lens 32K --steps 2 --baseline \
      --out "$OUT/qwen_lora" 2>&1 | tail -30
    echo "qwen bench: $(( $(date +%s) - t0 )) s end to end" | tee "$OUT/qwen_wall.txt"
    python3 benchmarks/speed/speed_summary.py "$OUT/speed_qwen.json" "$OUT/qwen_lora.json"
    ;;
  kept)
    # kept attention under recompute: the planner's choice and recompute without it, each its own process,
    # interleaved twice (KEPT_LEN, default 32K; KEPT_WITHOUT: the settings without it, default what the planner
    # chooses on an 80 GB GPU without kept attention)
    without=${KEPT_WITHOUT:-"--memory.auto false --memory.recompute true --memory.tiled_mlp true --memory.mlp_tile_tokens 16K --memory.checkpoint_offload true --memory.offload_host_budget 6G"}
    for run in kept_a without_a kept_b without_b; do
      case $run in kept*) args="" ;; *) args=$without ;; esac
      timeout -k 5 150 python3 -m megaseq bench recipes/qwen3-30b-a3b-lora.yaml --seq-lens "${KEPT_LEN:-32K}" \
        --steps 3 $args --out "$OUT/kept_$run" 2>&1 | grep -E "^\| [0-9]|rror|first step"
    done
    python3 benchmarks/speed/speed_summary.py "$OUT/speed_kept.json" "$OUT"/kept_*.json
    ;;
  first)
    for run in ${FIRST_RUNS:-1 compile 0}; do
      for rl in ${FIRST_CASES:-glm5-flash-1gpu:8K qwen3-30b-a3b-lora:32K}; do
        rm -rf .speed_cache  # a new machine: no compiled kernels, no tuned tables of its own
        name="${rl%%:*}_${rl#*:}_$(case $run in 1) echo pack ;; compile) echo compile ;; *) echo sequential ;; esac)${FIRST_TAG:+_$FIRST_TAG}"
        t1=$(date +%s)
        MEGASEQ_PRECOMPILE=$run timeout -k 5 300 python3 -m megaseq bench "recipes/${rl%%:*}.yaml" \
          --seq-lens "${rl#*:}" --steps 2 --out "$OUT/first_$name" ${FIRST_ARGS:-} 2>&1 | tail -6
        echo "$name: $(( $(date +%s) - t1 )) s end to end" | tee -a "$OUT/first_wall.txt"
      done
    done
    python3 benchmarks/speed/speed_summary.py "$OUT/speed_first.json" "$OUT"/first_*.json
    ;;
  pack)
    for m in src/megaseq/ops/tuned/kernels/*-cuda90.json; do
      python3 -c "import json, sys; from pathlib import Path; from megaseq.ops import kernel_pack
m = Path(sys.argv[1])
print(json.dumps(kernel_pack.build(m, kernel_pack.pack_path(m))))" "$m" | tee -a "$OUT/packs.jsonl"
      cp "${m%.json}.tar.xz" "$OUT/"
    done
    ;;
  ops)
    # a first step with no op manifest records one into the user's cache (MEGASEQ_CACHE_DIR, emptied above)
    for L in ${OPS_LENS:-8K 32K}; do
      rm -rf "$MEGASEQ_CACHE_DIR/ops"
      find src/megaseq/ops/tuned/ops -name "*-$(python3 -c "from megaseq.config import parse_size; print(parse_size('$L'))")x*.json" -delete 2>/dev/null
      timeout -k 5 200 python3 -m megaseq bench recipes/glm5-flash-1gpu.yaml --seq-lens "$L" --steps 1 \
        --out "$OUT/ops_$L" 2>&1 | tail -3
      mkdir -p src/megaseq/ops/tuned/ops && cp "$MEGASEQ_CACHE_DIR"/ops/*.json src/megaseq/ops/tuned/ops/ && \
        cp "$MEGASEQ_CACHE_DIR"/ops/*.json "$OUT/"
    done
    ;;
  tune)
    # this GPU's shipped table (e.g. nvidia-h100-80gb-hbm3.json) with the tunings at TUNE_LENS added or replaced
    table=$(python3 -c "import torch; from megaseq.ops import autotune
print(autotune.device_slug(torch.cuda.get_device_name()))").json
    [ -f "src/megaseq/ops/tuned/$table" ] && cp "src/megaseq/ops/tuned/$table" "$OUT/$table"
    timeout -k 5 570 python3 -m megaseq tune recipes/glm5-flash-1gpu.yaml --seq-lens "${TUNE_LENS:-8K,32K}" \
      --out "$OUT/$table" 2>&1 | tail -20
    echo "tune: $(( $(date +%s) - t0 )) s end to end" | tee "$OUT/tune_wall.txt"
    ;;
  *) echo "stage $STAGE: use glm, qwen, kept, first, pack, ops or tune" >&2; exit 2 ;;
esac
