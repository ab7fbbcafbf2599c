#!/usr/bin/env bash
# Long runs of the data kinds on one H200, each stage one device call (from the repo root, .whl/ carried as for
# benchmarks/run.sh): peak memory against the plan, tokens/s and the held-out loss by position, into $OUT.
#   bash benchmarks/long_context/data_256k.sh protein   # a generated protein family at 256K, the tiny protein recipe model
#   bash benchmarks/long_context/data_256k.sh chat      # one tool-use conversation of >= 256K tokens, Qwen3-30B-A3B LoRA,
#                                                       # rendered by Qwen3's own chat template (data.chat_template)
# The data are generated (recipes/protein-family-tiny/make_families.py, recipes/agent-traces-tiny/
# make_checkpoint.py) and the weights random: the runs measure the pipeline at length, not what a model learns.
# The chat window is 272K: the generated conversation is at least 262,144 tokens and at most about 5% more
# (make_checkpoint.py grows it in steps of 5%), and the planner estimates about 290 s for the step at 272K, so
# the step and its evaluation fit one 10-minute device call.
# SEQ / RESIDUES (protein) and CHAT_SEQ / CHAT_TOKENS (chat) shrink a stage for a dry run on the CPU; WORK moves
# its generated data and run directories (default /tmp).
set -u
OUT=${OUT:-out}
WORK=${WORK:-/tmp}  # generated data and run directories
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
fi
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1
summary() {  # the run's last step, its plan's peak and the report, into $OUT/$1 (also what a stopped run left)
  local run=$2
  mkdir -p "$OUT/$1"
  cp "$run/metrics.jsonl" "$run/plan.json" "$OUT/$1/" 2>/dev/null
  cp -r "$run/eval" "$OUT/$1/" 2>/dev/null
  tail -n 1 "$run/metrics.jsonl"
  python3 -c "import json,sys; p=json.load(open(sys.argv[1])); print('plan: peak GPU %.2f GiB (tensors %.2f) at %s' % (
    p['peak_gpu'] / 2**30, p['peak_gpu_tensors'] / 2**30, p['peak_phase']))" "$run/plan.json"
  head -n 30 "$run/eval/eval_by_position.md"
}
case "${1:-}" in
  protein)
    mkdir -p "$WORK/prot"
    python3 recipes/protein-family-tiny/make_families.py "$WORK/prot" "${RESIDUES:-600000}" || exit 1
    python3 -m megaseq train recipes/protein-family-tiny/recipe.yaml --model.dtype bf16 \
      --data.train "$WORK/prot/long_train.fa" --data.heldout "$WORK/prot/long_heldout.fa" --data.seq_len "${SEQ:-256K}" \
      --train.steps 20 --train.eval_every 0 --eval.by_position "${BUCKET:-32K}" --eval.max_windows 2 \
      --train.run_dir "$WORK/runs/protein256k" --log.progress false
    rc=$?; summary protein256k "$WORK/runs/protein256k"; exit $rc ;;
  chat)
    python3 recipes/agent-traces-tiny/make_checkpoint.py "$WORK/agent" --long-tokens "${CHAT_TOKENS:-262144}" || exit 1
    python3 -m megaseq train recipes/qwen3-30b-a3b-lora.yaml --data.kind chat --data.tokenizer "$WORK/agent/checkpoint" \
      --data.chat_template tests/fixtures/qwen3_chat_template.jinja \
      --data.train "$WORK/agent/long_traces.jsonl" --data.heldout "$WORK/agent/heldout_long_traces.jsonl" \
      --data.seq_len "${CHAT_SEQ:-272K}" --train.steps 1 --train.eval_after true --eval.by_position 32K \
      --train.run_dir "$WORK/runs/chat256k" --log.progress false
    rc=$?; summary chat256k "$WORK/runs/chat256k"; exit $rc ;;
  *) echo "usage: bash benchmarks/long_context/data_256k.sh protein|chat" >&2; exit 2 ;;
esac
