#!/usr/bin/env bash
# Session 7, device call 3 (one H200; from the repo root with .whl/ and .data/ (the long-context genomes) carried):
#   issue 16: the chunked dispatch's overhead with ep = 1 (call 1's try with all 288 experts ran out of memory:
#             fp32 expert weights, their gradients and each replayed chunk's bf16 copies; 64 experts here)
#   issue 17: the first 4 layers of Qwen3-30B-A3B with LoRA at 128K by layer and phase, after the MoE combine fix
#   issue 18: long_context.sh short: stage 1 (16K, 3 minutes of steps) with its own evaluation, then the
#             trained-weights log-prob check at 16K, 128K and 256K (the fp32 reference's attention fixed)
set -u
export DEADLINE=$(( $(date +%s) + 580 ))  # long_context.sh's last part stops there
OUT=${OUT:-out}
mkdir -p "$OUT"
source benchmarks/device_env.sh
timeout 60 python3 benchmarks/ep_dispatch_overhead_gpu.py --experts 64 --tokens 16384,65536 --chunks 4096,16384 \
  --repeats 3 --out "$OUT/ep_dispatch_overhead.json" 2>&1 | tail -8
date -u +%FT%TZ
python3 benchmarks/truncated_config.py recipes/qwen3-30b-a3b/config.json 4 /tmp/q4
timeout 90 python3 benchmarks/memory_phases.py recipes/qwen3-30b-a3b-lora.yaml 128K --model.name /tmp/q4/config.json \
  --memory.auto false --memory.chunked_loss true --memory.tiled_mlp true --memory.mlp_tile_tokens 8K \
  --memory.recompute true --out "$OUT/memory_phases_q4_lora_128k.json" 2>&1 | tail -12
date -u +%FT%TZ
GENOMES=.data PY=python3 T1=${T1:-180} bash benchmarks/long_context.sh short 2>&1 | tail -60
date -u +%FT%TZ
ls -la "$OUT"
