#!/usr/bin/env bash
# Session 6, device call 3 (one H200): where the LoRA step's memory goes (Qwen3-30B-A3B's first 4 layers at
# 128K, the fixes the 110G plan chose for 48 layers: chunked loss, tiled MoE, recompute), by layer and
# phase beside the planner; then the first 4 layers at the 48-layer model's planned longest length (576K)
# with the fixes the planner chose for all 48 there (warm-up + 1 timed step).
set -u
OUT=${OUT:-out}; R=$OUT/r; mkdir -p "$R"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1 MEGASEQ_FLA_AUTOTUNE=one
date -u +%FT%TZ
python3 benchmarks/truncated_config.py recipes/qwen3-30b-a3b/config.json 4 /tmp/q4
timeout 150 python3 benchmarks/memory_phases.py recipes/qwen3-30b-a3b-lora.yaml 128K --model.name /tmp/q4/config.json \
  --memory.auto false --memory.chunked_loss true --memory.tiled_mlp true --memory.mlp_tile_tokens 8K \
  --memory.recompute true --out "$R/memory_phases_q4_lora_128k.json" > "$R/memory_phases.log" 2>&1
grep -v Warning "$R/memory_phases.log" | tail -45
date -u +%FT%TZ
timeout 360 python3 benchmarks/lora_h200.py --layers 4 --lengths 589824 --steps 1 --out "$R/lora_q4_576k" \
  memory.auto=false memory.chunked_loss=true memory.tiled_mlp=true memory.mlp_tile_tokens=16K \
  memory.recompute=true memory.checkpoint_offload=true memory.optimizer_offload=true \
  > "$R/lora_q4_576k.log" 2>&1; grep -v Warning "$R/lora_q4_576k.log" | tail -30
date -u +%FT%TZ
tar czf "$OUT/call3.tgz" -C "$OUT" r
