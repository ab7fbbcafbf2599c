#!/usr/bin/env bash
# Session 6, device call 1 (one H200): issue 14's one-GPU rows at 32K (bf16 weights + fp32 master vs fp32
# weights) and issue 17's LoRA step on Qwen3-30B-A3B at 128K (all 48 layers).
set -u
OUT=${OUT:-out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1 MEGASEQ_FLA_AUTOTUNE=one
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"
date -u +%FT%TZ
timeout 110 python3 -m megaseq bench recipes/glm5-flash-1gpu.yaml --seq-lens 32K --steps 2 \
  --model.weights bf16 --out "$OUT/bench_1gpu_bf16w_32k" > "$OUT/bf16w_32k.log" 2>&1; tail -4 "$OUT/bf16w_32k.log"
timeout 110 python3 -m megaseq bench recipes/glm5-flash-1gpu.yaml --seq-lens 32K --steps 2 \
  --out "$OUT/bench_1gpu_fp32w_32k" > "$OUT/fp32w_32k.log" 2>&1; tail -4 "$OUT/fp32w_32k.log"
timeout 340 python3 benchmarks/lora_h200.py --lengths 128K --steps 1 --out "$OUT/lora_h200_128k" \
  > "$OUT/lora_128k.log" 2>&1; tail -30 "$OUT/lora_128k.log"
date -u +%FT%TZ
