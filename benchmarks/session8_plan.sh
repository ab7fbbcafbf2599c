#!/usr/bin/env bash
# The device calls prepared in session 8 (no GPU was lent then), in the order they should run on one H200,
# each one 10-minute call (from the repo root with .whl/ and .data/ carried; results under $OUT):
#   bash benchmarks/session8_plan.sh 1   issue 17: (ran in session 9, benchmarks/results/h200/session9/; next:
#                                        `bash benchmarks/h200.sh lora6`, the 48 layers at 128K as planned)
#   bash benchmarks/session8_plan.sh 2   issue 18: the long-context schedule with data.related_jitter 0.5 (the recipe's)
#                                        and the overfit test as calibrated on the CPU (a 256-base region, lr 1e-3)
#   bash benchmarks/session8_plan.sh 3   issue 13: the profile of a fast-kernels 32K step; glm5-flash-slice at 256K, warm
#                                        (h200.sh 12; carry .tcache/ from an earlier call to skip autotuning)
set -u
[ $# -eq 1 ] || { echo "usage: bash benchmarks/session8_plan.sh 1|2|3"; exit 2; }
OUT=${OUT:-out}
mkdir -p "$OUT"
case "$1" in
  1) bash benchmarks/h200.sh lora6 ;;
  2) GENOMES=.data T1=${T1:-170} T2=${T2:-140} bash benchmarks/long_context.sh call 2>&1 | tail -80 ;;
  3) bash benchmarks/h200.sh 12 ;;
  *) echo "unknown call $1"; exit 2 ;;
esac
ls -la "$OUT"
