#!/usr/bin/env bash
# Session 6, device call 2 (one H200): issue 17's LoRA step on Qwen3-30B-A3B (all 48 layers) at 128K: the
# planner's own choice (cold, to see where it runs out) and with a 110G budget (tiled MoE + recompute), warm.
set -u
OUT=${OUT:-out}; R=$OUT/r; mkdir -p "$R"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1 MEGASEQ_FLA_AUTOTUNE=one
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
date -u +%FT%TZ
timeout 150 python3 benchmarks/lora_h200.py --lengths 128K --steps 0 --out "$R/lora_128k_auto" \
  > "$R/lora_128k_auto.log" 2>&1; grep -v Warning "$R/lora_128k_auto.log" | tail -25
date -u +%FT%TZ
timeout 400 python3 benchmarks/lora_h200.py --lengths 128K --steps 1 --out "$R/lora_128k_b110" \
  memory.gpu_budget=110G > "$R/lora_128k_b110.log" 2>&1; grep -v Warning "$R/lora_128k_b110.log" | tail -25
date -u +%FT%TZ
tar czf "$OUT/call2.tgz" -C "$OUT" r
