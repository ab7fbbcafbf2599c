#!/usr/bin/env bash
# Session 7, device call 1 (one H200; from the repo root with .whl/ carried; results under $OUT):
#   issue 16: the chunked dispatch's overhead against plain dispatch with ep = 1 (GLM-5.3-Flash expert shapes)
#   issue 14: glm5-flash-1gpu at 1M with bf16 weights + fp32 master: one warm-up step and one timed (today, fp32
#             weights: 93.9 GiB, 208 s warm); the rest of the call's 600 s is its limit
set -u
OUT=${OUT:-out}
mkdir -p "$OUT"
source benchmarks/device_env.sh
timeout 80 python3 benchmarks/ep_dispatch_overhead_gpu.py --tokens 16384,65536 --chunks 4096,16384 --repeats 3 \
  --out "$OUT/ep_dispatch_overhead.json"
date -u +%FT%TZ
timeout $((590 - SECONDS)) python3 -m megaseq bench recipes/glm5-flash-1gpu.yaml --seq-lens 1M --steps 1 \
  --model.weights bf16 --out "$OUT/bench_1gpu_bf16w_1m"
date -u +%FT%TZ
ls -la "$OUT"
