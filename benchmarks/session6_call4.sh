#!/usr/bin/env bash
# Session 6, device call 4 (one H200): which code holds the LoRA step's memory (Qwen3-30B-A3B's first 4
# layers, 128K, the 110G plan's fixes); then issue 14's 1M step with bf16 weights + fp32 master.
set -u
OUT=${OUT:-out}; R=$OUT/r; mkdir -p "$R"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1 MEGASEQ_FLA_AUTOTUNE=one
date -u +%FT%TZ
python3 benchmarks/truncated_config.py recipes/qwen3-30b-a3b/config.json 4 /tmp/q4
timeout 120 python3 benchmarks/memory_census.py recipes/qwen3-30b-a3b-lora.yaml 128K --model.name /tmp/q4/config.json \
  --memory.auto false --memory.chunked_loss true --memory.tiled_mlp true --memory.mlp_tile_tokens 8K \
  --memory.recompute true --out "$R/census_q4_lora_128k.json" > "$R/census.log" 2>&1
grep -v Warning "$R/census.log" | grep -v '^\s*"blocks"\|^\s*},\?$\|^\s*{$' | tail -70
date -u +%FT%TZ
timeout 440 python3 -m megaseq bench recipes/glm5-flash-1gpu.yaml --seq-lens 1M --steps 1 \
  --model.weights bf16 --out "$R/bench_1gpu_bf16w_1m" > "$R/bf16w_1m.log" 2>&1; tail -5 "$R/bf16w_1m.log"
date -u +%FT%TZ
tar czf "$OUT/call4.tgz" -C "$OUT" r
