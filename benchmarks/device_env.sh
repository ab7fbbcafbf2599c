# Sourced by the session call scripts on a lent device machine (from the repo root, .whl/ carried): the carried
# wheels into /tmp/site, the environment the measurements ran under, and the GPU and versions for the record.
# Not for speed measurements: MEGASEQ_FLA_AUTOTUNE=one runs every autotuned Triton kernel (fla's and megaseq's) on
# one conservative config, a lower bound (session 17's s17c ran so by mistake); benchmarks/h200.sh runs `full`.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1 MEGASEQ_FLA_AUTOTUNE=${MEGASEQ_FLA_AUTOTUNE:-one}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"
date -u +%FT%TZ
