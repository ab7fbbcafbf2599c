#!/usr/bin/env bash
# Session 6, device call 5 (one H200): the LoRA step's memory after the MoE combine keeps the residual's
# dtype (Qwen3-30B-A3B's first 4 layers, 128K, the 110G plan's fixes; by layer and phase), and a step of
# the first 4 layers at 256K with the fixes the planner picks for all 48 there.
set -u
OUT=${OUT:-out}; R=$OUT/r; mkdir -p "$R"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1 MEGASEQ_FLA_AUTOTUNE=one
date -u +%FT%TZ
python3 - <<'PY'
import json; d = json.load(open("recipes/qwen3-30b-a3b/config.json"))
d["num_hidden_layers"] = d["max_window_layers"] = 4
import os; os.makedirs("/tmp/q4", exist_ok=True); json.dump(d, open("/tmp/q4/config.json", "w"))
PY
timeout 70 python3 benchmarks/memory_phases.py recipes/qwen3-30b-a3b-lora.yaml 128K --model.name /tmp/q4/config.json \
  --memory.auto false --memory.chunked_loss true --memory.tiled_mlp true --memory.mlp_tile_tokens 8K \
  --memory.recompute true --out "$R/memory_phases_q4_lora_128k_fixed.json" > "$R/memory_phases_fixed.log" 2>&1
grep -v Warning "$R/memory_phases_fixed.log" | grep "measured_gib\|peak\|planned_" | head -20
date -u +%FT%TZ
timeout 100 python3 benchmarks/lora_h200.py --layers 4 --lengths 256K --steps 1 --out "$R/lora_q4_256k_fixed" \
  memory.auto=false memory.chunked_loss=true memory.tiled_mlp=true memory.mlp_tile_tokens=16384 memory.recompute=true memory.checkpoint_offload=true memory.offload_host_budget=51539607552 > "$R/lora_q4_256k_fixed.log" 2>&1; grep -v Warning "$R/lora_q4_256k_fixed.log" | tail -22
date -u +%FT%TZ
