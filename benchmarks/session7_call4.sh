#!/usr/bin/env bash
# Session 7, device call 4 (issue 18; with .whl/ and .data/ carried): why does stage 1 (16K, related 4) reach a
# training loss of 0.8 nats while its held-out windows after relatives score 1.9 bits, no better than alone?
# Stage 1 again (150 s of steps), then benchmarks/related_copy_probe.py: bits per region of fresh training
# windows and of held-out windows after relatives, beside the 12-mer copy oracle; the weights come back in bf16.
set -u
OUT=${OUT:-out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1
date -u +%FT%TZ
G=.data
TRAIN=$(python3 -c "import yaml,os; d=yaml.safe_load(open('recipes/long-context-genomes.yaml'))['data']; \
print(','.join(os.path.join('$G', os.path.basename(p)) for p in d['train']))")
HELD=$(python3 -c "import yaml,os; d=yaml.safe_load(open('recipes/long-context-genomes.yaml'))['data']; \
print(','.join(os.path.join('$G', os.path.basename(p)) for p in d['heldout']))")
R=runs/lc16k
timeout 260 python3 -m megaseq train recipes/long-context-genomes.yaml --data.train "$TRAIN" --data.heldout "$HELD" \
  --data.seq_len 16K --train.batch_size 16 --train.steps 330 --optim.lr 2e-3 --train.time_limit 150s \
  --train.save_every 0 --train.eval_every 0 --train.eval_after false --eval.seq_len 16K --eval.by_position 4K \
  --train.run_dir $R 2>&1 | grep -v "^step " | tail -8
cp $R/metrics.jsonl "$OUT/stage1_metrics.jsonl"
date -u +%FT%TZ
timeout 120 python3 benchmarks/related_copy_probe.py $R --windows 8 --out "$OUT/copy_probe"
date -u +%FT%TZ
python3 -c "
import shutil; from pathlib import Path; from safetensors.torch import load_file, save_file; import torch
src, dst = Path('$R/hf'), Path('/tmp/w/hf'); dst.mkdir(parents=True, exist_ok=True)
for f in src.iterdir():
    if f.name.endswith('.safetensors'):
        save_file({k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in load_file(f).items()}, dst / f.name)
    elif f.is_file():
        shutil.copy(f, dst / f.name)
shutil.copy('$R/config.yaml', dst.parent / 'config.yaml')
" && tar cf - -C /tmp/w . | split -b 15M - "$OUT/w16k.part"
ls -la "$OUT"
