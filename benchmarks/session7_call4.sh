#!/usr/bin/env bash
# Session 7, device call 4 (issue 18; with .whl/ and .data/ carried): why does stage 1 (16K, related 4) reach a
# training loss of 0.8 nats while its held-out windows after relatives score 1.9 bits, no better than alone?
# Stage 1 again (150 s of steps), then benchmarks/related_copy_probe.py: bits per region of fresh training
# windows and of held-out windows after relatives, beside the 12-mer copy oracle; the weights come back in bf16.
set -u
OUT=${OUT:-out}
mkdir -p "$OUT"
source benchmarks/device_env.sh
TRAIN=$(python3 benchmarks/recipe_files.py recipes/long-context-genomes.yaml train .data)
HELD=$(python3 benchmarks/recipe_files.py recipes/long-context-genomes.yaml heldout .data)
R=runs/lc16k
timeout 260 python3 -m megaseq train recipes/long-context-genomes.yaml --data.train "$TRAIN" --data.heldout "$HELD" \
  --data.seq_len 16K --train.batch_size 16 --train.steps 330 --optim.lr 2e-3 --train.time_limit 150s \
  --train.save_every 0 --train.eval_every 0 --train.eval_after false --eval.seq_len 16K --eval.by_position 4K \
  --train.run_dir $R 2>&1 | grep -v "^step " | tail -8
cp $R/metrics.jsonl "$OUT/stage1_metrics.jsonl"
date -u +%FT%TZ
timeout 120 python3 benchmarks/related_copy_probe.py $R --windows 8 --out "$OUT/copy_probe"
date -u +%FT%TZ
python3 benchmarks/hf_bf16.py $R/hf /tmp/w/hf && cp $R/config.yaml /tmp/w/ && tar cf - -C /tmp/w . | split -b 15M - "$OUT/w16k.part"
ls -la "$OUT"
