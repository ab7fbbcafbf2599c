#!/usr/bin/env bash
# The long-context experiment (docs/long_context.md) on one H200, in stages that each fit one 10-minute
# device call; run them in order on one warm machine (runs/ stays between calls), or all at once:
#   bash benchmarks/long_context/long_context.sh 1|2|3|4|all        (from the repo root; results go to $OUT)
# GENOMES: the directory holding the shared genomes (default: the recipe's ../../shared/data/genomes;
# on the device carry them as .data/ and set GENOMES=.data). .whl/ (optional): transformers for stage 4.
#   1  train at 16K (related 4: 4K regions), batch 16: the model learns to copy from a relative cheaply
#   2  train at 256K (related 4: 64K regions) from stage 1's weights; rerun until it reports step 150
#   3  evaluate the 256K model and stage 1's: held-out genomes after 3 relatives (the run's own report) and
#      alone (no relatives), in 32K position buckets, against the 12-mer baseline
#   4  trained weights: per-token log-probs, megaseq bf16 with the planned fixes vs fp32 (transformers where
#      it runs) at 128K and 256K; the overfit test on one 128K window
#   call  the whole experiment in ONE device call (a lent machine is released 30 s after a call, so runs/ does
#      not survive to the next): stage 1 for T1 seconds (train.time_limit), stage 2 for T2 seconds (its own
#      end-of-run report: the held-out genomes with relatives and alone, before = stage 1's model, EVAL_WINDOWS
#      per genome), then stage 4 (30 overfit steps); outputs copied to $OUT as each part ends, the stage-2
#      bf16 HF export too, split into 15 MiB parts (cat hf.part* | tar x) for a later call to carry
#   eq  the equal-regions design in one call (docs/long_context.md): equal regions and one layout for
#      every species (data.related 3, related_jitter 0: the positional copy the model does learn), trained at
#      256K for TEQ seconds (default 360) from carried stage-1 weights (INIT, default .ovf/w16k/hf), then the
#      run's own report: held-out genomes after 2 relatives in the same layout and alone, before = INIT, in 32K
#      buckets against the 12-mer (carry .ovf/w16k and .data/ without ecoli_MG1655: the tree's 6 MB on top
#      leaves them just under the 64 MiB a call carries). EQ_CHAIN=1: train only, and return the weights as
#      eq_hf.part* for the next call's INIT (a chain of calls trains past one call's ~85 steps at 256K)
#   short  stage 1 alone in one call (T1 seconds of steps, STEPS1 its schedule), evaluated at 16K by the run
#      itself, then the log-prob check at 16K, 128K and 256K on its weights
# SMOKE=1: every stage on a tiny CPU configuration (the H. pylori genomes only, windows of 2K and 4K, a few
# steps each; about 10 minutes on 2 cores): a pipeline check before device time is spent, not the experiment.
set -u
[ $# -eq 1 ] || { echo "usage: [SMOKE=1] [GENOMES=DIR] [OUT=DIR] bash benchmarks/long_context/long_context.sh 1|2|3|4|all|call|eq|short"
                 exit 2; }
OUT=${OUT:-out}
PY=${PY:-python3}   # PY=/path/to/venv/bin/python elsewhere
mkdir -p "$OUT"
RECIPE=recipes/long-context-genomes.yaml
SHORT=runs/long-context-16k
LONG=runs/long-context-256k
# the stages' settings: the experiment's, or SMOKE's tiny ones
S1=(--data.seq_len 16K --train.batch_size 16 --train.steps 600 --train.save_every 100 --train.eval_every 200
    --eval.seq_len 16K --eval.by_position 4K --eval.max_windows 16 --optim.lr 2e-3)
S2=(--train.steps 150 --train.save_every 25 --train.eval_every 50)
BUCKET=32K
S4_LOGPROB=(--lengths 128K,256K)
S4_OVERFIT=(--seq-len 128K --steps 30 --period 256 --lr 1e-3)  # as calibrated on the CPU (overfit.py)
T1D=150; T2D=110; EWD=4  # the call's budgets (seconds of steps) and evaluation windows per held-out genome
CALL1=(--train.steps 400 --train.save_every 0 --train.eval_every 0)   # the budget, not the steps, ends them
CALL2=(--train.steps 50 --train.save_every 0 --train.eval_every 0)
if [ -n "${SMOKE:-}" ]; then
  SHORT=runs/long-context-smoke-2k
  LONG=runs/long-context-smoke-4k
  S1=(--data.seq_len 2K --train.batch_size 2 --train.steps 6 --train.save_every 3 --train.eval_every 3
      --eval.seq_len 2K --eval.by_position 512 --eval.max_windows 2 --eval.kmer_k 6 --optim.lr 2e-3
      --optim.warmup_steps 2 --train.device cpu)
  S2=(--data.seq_len 4K --train.steps 4 --train.save_every 2 --train.eval_every 2 --eval.seq_len 4K
      --eval.by_position 1K --eval.max_windows 2 --eval.kmer_k 6 --optim.warmup_steps 2 --train.device cpu
      --train.run_dir $LONG)
  BUCKET=1K
  S4_LOGPROB=(--lengths 2K,4K)
  S4_OVERFIT=(--seq-len 1K --steps 8 --period 128 --lr 1e-2)
  T1D=60; T2D=40; EWD=2
  CALL1=(--train.steps 20 --train.save_every 0 --train.eval_every 0)
  CALL2=(--train.steps 10 --train.save_every 0 --train.eval_every 0)
  EQ=(--data.seq_len 4K --eval.seq_len 4K --eval.by_position 1K --eval.kmer_k 6 --train.steps 4
      --optim.warmup_steps 2 --train.device cpu)
fi
EQ=(${EQ[@]+"${EQ[@]}"})  # the eq stage's settings beyond the recipe's 256K (SMOKE: a 4K CPU check)
T1=${T1:-$T1D}; T2=${T2:-$T2D}; EVAL_WINDOWS=${EVAL_WINDOWS:-$EWD}
DEADLINE=${DEADLINE:-$(( $(date +%s) + 585 ))}  # the device call's end (epoch seconds; a calling script may set it)
left() { local l=$(( DEADLINE - $(date +%s) - ${1:-0} )); echo $(( l > 20 ? l : 20 )); }  # seconds to it, less $1
if ls .whl/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD/src
else
  export PYTHONPATH=$PWD/src
fi
export PYTHONUNBUFFERED=1
DATA=()
if [ -n "${SMOKE:-}" ]; then  # H. pylori only: 4 training strains, 1 held out
  G=${GENOMES:-../shared/data/genomes}
  DATA=(--data.train "$G/hpylori_ELS37.fa.gz,$G/hpylori_G27.fa.gz,$G/hpylori_Gambia94_24.fa.gz,$G/hpylori_Puno120.fa.gz"
        --data.heldout "$G/hpylori_SJM180.fa.gz")
elif [ -n "${GENOMES:-}" ]; then  # the recipe's files, from another directory
  DATA=(--data.train "$($PY benchmarks/long_context/recipe_files.py $RECIPE train "$GENOMES")"
        --data.heldout "$($PY benchmarks/long_context/recipe_files.py $RECIPE heldout "$GENOMES")")
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null
$PY -c "import torch; print('torch', torch.__version__)"
date -u +%FT%TZ
stage() {
  case "$1" in
    1)
      timeout 590 $PY -m megaseq train "$RECIPE" "${DATA[@]}" --train.run_dir $SHORT "${S1[@]}" \
        --train.resume true
      cp -r $SHORT/eval "$OUT/stage1_eval" 2>/dev/null; cp $SHORT/metrics.jsonl $SHORT/loss_curve.png "$OUT/" 2>/dev/null
      ;;
    2)
      timeout 590 $PY -m megaseq train "$RECIPE" "${DATA[@]}" --model.init_from $SHORT/hf "${S2[@]}" \
        --train.resume true
      cp -r $LONG/eval "$OUT/stage2_eval" 2>/dev/null
      cp $LONG/metrics.jsonl "$OUT/stage2_metrics.jsonl"; cp $LONG/loss_curve.png "$OUT/stage2_loss_curve.png"
      ;;
    3)  # with relatives (as trained; before = stage 1's model), then each held-out genome alone
      timeout 290 $PY -m megaseq eval $LONG --by-position $BUCKET --out "$OUT/eval_with_relatives"
      timeout 290 $PY -m megaseq eval $LONG --by-position $BUCKET --data.related 0 \
        --out "$OUT/eval_alone"
      ;;
    4)
      timeout 330 $PY benchmarks/long_context/logprob_trained.py $LONG "${S4_LOGPROB[@]}" --out "$OUT/logprob_trained"
      timeout 250 $PY benchmarks/long_context/overfit.py $LONG "${S4_OVERFIT[@]}" --out "$OUT/overfit"
      ;;
    call)  # everything in $L, packed into $OUT/long_context.tgz after each part (a call returns 8 files at most)
      L=${LC_DIR:-/tmp/long_context}/lc; mkdir -p $L
      pack() { tar czf "$OUT/long_context.tgz" -C "$(dirname $L)" lc; }
      timeout $((T1 + 120)) $PY -m megaseq train "$RECIPE" "${DATA[@]}" --train.run_dir $SHORT "${S1[@]}" \
        "${CALL1[@]}" --train.time_limit ${T1}s --train.eval_after false --train.overwrite true 2>&1 | tee $L/stage1.log
      cp $SHORT/metrics.jsonl $L/stage1_metrics.jsonl; cp $SHORT/loss_curve.png $L/stage1_loss_curve.png; pack
      date -u +%FT%TZ
      timeout $((T2 + 240)) $PY -m megaseq train "$RECIPE" "${DATA[@]}" --model.init_from $SHORT/hf "${S2[@]}" \
        "${CALL2[@]}" --train.time_limit ${T2}s --eval.max_windows $EVAL_WINDOWS --train.overwrite true 2>&1 \
        | grep -v "^step " | tee $L/stage2.log
      cp -r $LONG/eval $L/stage2_eval; cp $LONG/metrics.jsonl $LONG/config.yaml $L/
      cp $LONG/loss_curve.png $L/stage2_loss_curve.png; pack
      # the trained weights in bf16 (half the fp32 export), in 15 MiB parts: cat hf_bf16.part* | tar x
      $PY benchmarks/long_context/hf_bf16.py $LONG/hf /tmp/hf_bf16/hf && tar cf - -C /tmp/hf_bf16 hf | split -b 15M - "$OUT/hf_bf16.part"
      date -u +%FT%TZ
      timeout $(left 65) $PY benchmarks/long_context/logprob_trained.py $LONG \
        "${S4_LOGPROB[@]}" --out $L/logprob_trained 2>&1 | grep -v "Loading weights"; pack
      timeout $(left) $PY benchmarks/long_context/overfit.py $LONG "${S4_OVERFIT[@]}" \
        --out $L/overfit 2>&1 | grep -v "^step "; pack
      ;;
    eq)
      L=${LC_DIR:-/tmp/long_context}/eq; mkdir -p $L
      pack() { tar czf "$OUT/long_context_eq.tgz" -C "$(dirname $L)" eq; }
      TEQ=${TEQ:-360}  # seconds of steps (about 100 at 256K); the evaluation after takes about 2 minutes
      # EQ_CHAIN=1: no evaluation; the trained weights come back in bf16 parts (cat eq_hf.part* | tar x -> hf/)
      # for the next call to carry as INIT (one call trains ~85 steps at 256K; 82 such steps did not learn to copy)
      [ -n "${EQ_CHAIN:-}" ] && CHAIN=(--train.eval_after false) || CHAIN=()
      timeout $((TEQ + 200)) $PY -m megaseq train "$RECIPE" "${DATA[@]}" --model.init_from "${INIT:-.ovf/w16k/hf}" \
        --data.related 3 --data.related_jitter 0 --optim.lr ${LR:-2e-3} --train.steps 400 --train.save_every 0 \
        --train.eval_every 0 --train.time_limit ${TEQ}s --eval.max_windows $EVAL_WINDOWS --train.run_dir $LONG \
        --train.overwrite true "${EQ[@]}" ${CHAIN[@]+"${CHAIN[@]}"} 2>&1 | grep -v "^step " | tee $L/eq.log
      cp -r $LONG/eval $L/eval 2>/dev/null; cp $LONG/metrics.jsonl $LONG/config.yaml $LONG/loss_curve.png $L/; pack
      if [ -n "${EQ_CHAIN:-}" ]; then
        $PY benchmarks/long_context/hf_bf16.py $LONG/hf /tmp/hf_bf16/hf && tar cf - -C /tmp/hf_bf16 hf | split -b 15M - "$OUT/eq_hf.part"
      fi
      ;;
    short)  # stage 1 alone in one call: T1 seconds of steps, its own evaluation at 16K (held-out genomes after
      # 3 training relatives' homologous 4K regions, and alone), then the trained-weights log-prob check
      L=${LC_DIR:-/tmp/long_context}/lc16k; mkdir -p $L
      pack() { tar czf "$OUT/long_context_16k.tgz" -C "$(dirname $L)" lc16k; }
      timeout $((T1 + 200)) $PY -m megaseq train "$RECIPE" "${DATA[@]}" --train.run_dir $SHORT "${S1[@]}" \
        --train.steps ${STEPS1:-450} --train.save_every 0 --train.eval_every 0 --train.time_limit ${T1}s \
        --eval.max_windows 8 --train.overwrite true 2>&1 | grep -v "^step " | tee $L/stage1.log
      cp -r $SHORT/eval $L/stage1_eval; cp $SHORT/metrics.jsonl $SHORT/config.yaml $L/
      cp $SHORT/loss_curve.png $L/stage1_loss_curve.png; pack
      date -u +%FT%TZ
      timeout $(left) $PY benchmarks/long_context/logprob_trained.py $SHORT \
        --lengths ${LOGPROB_LENGTHS:-16K,128K,256K} --out $L/logprob_trained 2>&1 | grep -v "Loading weights"; pack
      ;;
    *) echo "unknown stage $1"; exit 2 ;;
  esac
}
if [ "$1" = all ]; then for s in 1 2 3 4; do stage $s; done; else stage "$1"; fi
ls -la "$OUT"
