#!/usr/bin/env bash
# The long-context experiment (docs/long_context.md) on one H200, in stages that each fit one 10-minute
# device call; run them in order on one warm machine (runs/ stays between calls), or all at once:
#   bash benchmarks/long_context.sh 1|2|3|4|all        (from the repo root; results go to $OUT)
# GENOMES: the directory holding the shared genomes (default: the recipe's ../../shared/data/genomes;
# on the device carry them as .data/ and set GENOMES=.data). .whl/ (optional): transformers for stage 4.
#   1  train at 16K (related 4: 4K regions), batch 16: the model learns to copy from a relative cheaply
#   2  train at 256K (related 4: 64K regions) from stage 1's weights; rerun until it reports step 150
#   3  evaluate the 256K model and stage 1's: held-out genomes after 3 relatives (the run's own report) and
#      alone (no relatives), in 32K position buckets, against the 12-mer baseline
#   4  trained weights: per-token log-probs, megaseq bf16 with the planned fixes vs fp32 (transformers where
#      it runs) at 128K and 256K; the overfit test on one 128K window
set -u
OUT=${OUT:-out}
mkdir -p "$OUT"
RECIPE=recipes/long-context-genomes.yaml
SHORT=runs/long-context-16k
LONG=runs/long-context-256k
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1
ms() { python3 -m megaseq "$@"; }
DATA=()
if [ -n "${GENOMES:-}" ]; then  # the recipe's files, from another directory
  DATA=(--data.train "$(python3 -c "import yaml,os,sys; d=yaml.safe_load(open('$RECIPE'))['data']; \
print(','.join(os.path.join('$GENOMES', os.path.basename(p)) for p in d['train']))")"
        --data.heldout "$(python3 -c "import yaml,os,sys; d=yaml.safe_load(open('$RECIPE'))['data']; \
print(','.join(os.path.join('$GENOMES', os.path.basename(p)) for p in d['heldout']))")")
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null
python3 -c "import torch; print('torch', torch.__version__)"
date -u +%FT%TZ
stage() {
  case "$1" in
    1)
      timeout 590 python3 -m megaseq train "$RECIPE" "${DATA[@]}" --train.run_dir $SHORT --data.seq_len 16K \
        --train.batch_size 16 --train.steps 600 --train.save_every 100 --train.eval_every 200 \
        --eval.seq_len 16K --eval.by_position 4K --eval.max_windows 16 --optim.lr 2e-3 --train.resume true
      cp -r $SHORT/eval "$OUT/stage1_eval" 2>/dev/null; cp $SHORT/metrics.jsonl $SHORT/loss_curve.png "$OUT/" 2>/dev/null
      ;;
    2)
      timeout 590 python3 -m megaseq train "$RECIPE" "${DATA[@]}" --model.init_from $SHORT/hf \
        --train.steps 150 --train.save_every 25 --train.eval_every 50 --train.resume true
      cp -r $LONG/eval "$OUT/stage2_eval" 2>/dev/null
      cp $LONG/metrics.jsonl "$OUT/stage2_metrics.jsonl"; cp $LONG/loss_curve.png "$OUT/stage2_loss_curve.png"
      ;;
    3)  # with relatives (as trained; before = stage 1's model), then each held-out genome alone
      timeout 290 python3 -m megaseq eval $LONG --by-position 32K --out "$OUT/eval_with_relatives"
      timeout 290 python3 -m megaseq eval $LONG --by-position 32K --data.related 0 --out "$OUT/eval_alone"
      ;;
    4)
      timeout 330 python3 benchmarks/logprob_trained.py $LONG --lengths 128K,256K --out "$OUT/logprob_trained"
      timeout 250 python3 benchmarks/overfit.py $LONG --seq-len 128K --steps 30 --out "$OUT/overfit_128k"
      ;;
    *) echo "unknown stage $1"; exit 2 ;;
  esac
}
if [ "$1" = all ]; then for s in 1 2 3 4; do stage $s; done; else stage "$1"; fi
ls -la "$OUT"
