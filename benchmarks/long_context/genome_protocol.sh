#!/usr/bin/env bash
# The long-context protocol on the held-out genomes (docs/long_context.md), one resumable step at a time:
#
#   bash benchmarks/long_context/genome_protocol.sh STEP      (from the repository root)
#
# Steps (each fits one 10-minute device call on one H200; the estimates are device time, start-up included):
#   pretrain  the start: recipes/long-context/genome-start.yaml at 16K for train.time_limit (8 min), then its HF
#             export (runs/genome-start/hf) and report. Run it again to continue (--train.resume true) until the
#             held-out loss in runs/genome-start/loss_curve.png flattens. About 9.5 min a call.
#   long      the long fine-tune from the start at 256K, the indexer's sparse stage on (genome-long.yaml):
#             7 min of steps, resumable the same way. About 8.5 min a call.
#   control   the start trained on as many tokens at 16K (genome-control.yaml), for the long fine-tune's number
#             of steps (read from runs/genome-long). About 3-5 min.
#   eval      megaseq eval before=start,after=long,control=control on the held-out genomes at 256K, 32K
#             buckets, with the context ablation (cut to 16K, the start's length) and the copy oracle; writes
#             $RESULTS/eval_protocol.{json,md,png} beside eval_by_position.{json,md,png}. About 4 min.
#   all       the four in order (about 26 min: more than one call; run the steps one call each).
#
# A step that already reached its target is skipped. Environment: RESULTS (default
# benchmarks/results/long_context/genome_protocol), PY (python3), RECIPES (recipes/long-context), RUNS (runs),
# and settings appended to a step's command: COMMON_ARGS (every training step), START_ARGS, LONG_ARGS,
# CONTROL_ARGS, EVAL_ARGS (word-split; a CPU check at tiny scale sets them: tests/eval/test_protocol_e2e.py).
# The genomes: shared/data/genomes carried as .data/ at the repository root (the recipes read ../../.data/).
set -u
[ $# -eq 1 ] || { sed -n '2,26p' "$0"; exit 2; }
PY=${PY:-python3}
RECIPES=${RECIPES:-recipes/long-context}
RUNS=${RUNS:-runs}
RESULTS=${RESULTS:-benchmarks/results/long_context/genome_protocol}
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
read -r -a COMMON <<< "${COMMON_ARGS:-}"
read -r -a START <<< "${START_ARGS:-}"
read -r -a LONG <<< "${LONG_ARGS:-}"
read -r -a CONTROL <<< "${CONTROL_ARGS:-}"
read -r -a EVALX <<< "${EVAL_ARGS:-}"

# the newest complete checkpoint's step of a run directory (0: none)
last_step() {
  $PY - "$1" <<'PY'
import sys
from pathlib import Path
from megaseq.train.checkpoint import list_complete
found = list_complete(Path(sys.argv[1])) if Path(sys.argv[1]).is_dir() else []
print(found[-1][0] if found else 0)
PY
}

train() {  # train RECIPE RUN_DIR ARGS...: resumable, its outputs copied to $RESULTS/NAME
  local recipe=$1 run=$2
  shift 2
  echo "== $(date -u +%T) megaseq train $recipe (run $run)"
  $PY -m megaseq train "$RECIPES/$recipe" --train.run_dir "$run" --train.resume true --log.progress false \
    ${COMMON[@]+"${COMMON[@]}"} "$@" || return 1
  mkdir -p "$RESULTS/$(basename "$run")"
  cp "$run"/{config.yaml,plan.json,metrics.jsonl,loss_curve.png} "$RESULTS/$(basename "$run")/" 2>/dev/null
  return 0
}

step_pretrain() {
  train genome-start.yaml "$RUNS/genome-start" ${START[@]+"${START[@]}"}
}

step_long() {
  [ -f "$RUNS/genome-start/hf/config.json" ] || { echo "long: run the pretrain step first (no $RUNS/genome-start/hf)"; return 1; }
  train genome-long.yaml "$RUNS/genome-long" --model.init_from "$RUNS/genome-start/hf" ${LONG[@]+"${LONG[@]}"}
}

step_control() {
  local n done_
  n=$(last_step "$RUNS/genome-long") || return 1
  [ "$n" -gt 0 ] || { echo "control: run the long step first (no checkpoint in $RUNS/genome-long)"; return 1; }
  done_=$(last_step "$RUNS/genome-control") || return 1
  if [ "$done_" -ge "$n" ]; then echo "control: already at step $done_ (the long fine-tune's $n)"; return 0; fi
  train genome-control.yaml "$RUNS/genome-control" --model.init_from "$RUNS/genome-start/hf" --train.steps "$n" \
    ${CONTROL[@]+"${CONTROL[@]}"}
}

step_eval() {
  echo "== $(date -u +%T) megaseq eval before/after/control"
  $PY -m megaseq eval "before=$RUNS/genome-start,after=$RUNS/genome-long,control=$RUNS/genome-control" \
    --ablation-cut-to 16K --ablation-chunk 8K --out "$RESULTS" ${EVALX[@]+"${EVALX[@]}"}
}

case $1 in
  pretrain|long|control|eval) "step_$1" ;;
  all) step_pretrain && step_long && step_control && step_eval ;;
  *) sed -n '2,26p' "$0"; exit 2 ;;
esac
