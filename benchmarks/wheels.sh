#!/usr/bin/env bash
# The packages the device machine lacks, as wheels in .whl/ (gitignored; carried to each device call, 16 MB):
#   bash benchmarks/wheels.sh        (from the repo root, on a machine that reaches the package index)
set -eu
mkdir -p .whl
python3 -m pip download -q --no-deps -d .whl fla-core==0.6.0 liger-kernel==0.8.5 transformers==5.24.0 peft==0.21.0
ls -la .whl
