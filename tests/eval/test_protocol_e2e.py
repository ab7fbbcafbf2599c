"""The long-context protocol end to end at tiny scale on the CPU, through its driver
(benchmarks/long_context/genome_protocol.sh) and recipes: a start at a short length, a long fine-tune from it,
a control at the start's length, then ``megaseq eval before=,after=,control=`` with the context ablation and
the copy oracle; the JSON's schema, and its numbers recomputed independently."""

import dataclasses
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from megaseq.config import ModelConfig, build_config
from megaseq.data import build_data
from megaseq.eval import build_kmer_baseline
from megaseq.eval.loss import per_token_loss_fn
from megaseq.train.convert import load_megaseq_checkpoint
from megaseq.train.parallel_env import ParallelEnv

torch.set_num_threads(2)
# about 40 s of the driver's four steps: under `make test-all`; the protocol's evaluation and recipes are tested
# in `make test` by test_eval_protocol.py and test_protocol_recipes.py
pytestmark = pytest.mark.slow
SHORT, LONG, WIDTH, CUT = 128, 384, 96, 128
ROOT = Path(__file__).resolve().parents[2]
RECIPES, DRIVER = ROOT / "recipes" / "long-context", ROOT / "benchmarks" / "long_context" / "genome_protocol.sh"


def _genome(path: Path, n: int, seed: int) -> Path:
    """A random genome carrying a 150-base repeat 200 bases after its first copy, every 600 bases."""
    rng = np.random.default_rng(seed)
    bases = rng.choice(list("ACGT"), n)
    for start in range(0, n - 400, 600):
        bases[start + 200:start + 350] = bases[start:start + 150]
    path.write_text(">g\n" + "".join(bases) + "\n")
    return path


def _recipes(dest: Path) -> Path:
    """The protocol's recipes, less the settings this checkout's config does not have yet (the indexer's
    objective lands with its own change): the rest of each recipe is loaded as written."""
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    dest.mkdir()
    for recipe in RECIPES.glob("genome-*.yaml"):
        raw = yaml.safe_load(recipe.read_text())
        raw["model"] = {k: v for k, v in raw["model"].items() if k in known}
        (dest / recipe.name).write_text(yaml.safe_dump(raw))
    return dest


def _driver(tmp: Path, step: str) -> subprocess.CompletedProcess:
    files = {n: str(tmp / f"{n}.fa") for n in ("train_a", "train_b", "heldout")}
    env = {**os.environ, "PY": sys.executable, "RECIPES": str(tmp / "recipes"), "RUNS": str(tmp / "runs"),
           "RESULTS": str(tmp / "results"), "OMP_NUM_THREADS": "1",
           "COMMON_ARGS": f"--model.name glm5-flash-tiny --model.dtype fp32 --data.train {files['train_a']},"
                          f"{files['train_b']} --data.heldout {files['heldout']} --data.related 0 "
                          "--data.related_jitter 0 --data.reverse_complement false --eval.kmer_k 3 "
                          "--eval.max_windows 3 --train.eval_after false --optim.warmup_steps 1 "
                          "--log.tensorboard false",
           "START_ARGS": f"--data.seq_len {SHORT} --train.batch_size 3 --train.steps 3 --eval.seq_len {SHORT}",
           "LONG_ARGS": f"--data.seq_len {LONG} --train.steps 2 --eval.seq_len {LONG} --eval.by_position {WIDTH}",
           "CONTROL_ARGS": f"--data.seq_len {SHORT} --train.batch_size 3 --eval.seq_len {SHORT}",
           "EVAL_ARGS": f"--ablation-cut-to {CUT} --ablation-chunk 32 --oracle-k 12 --oracle-distance 100"}
    return subprocess.run(["bash", str(DRIVER), step], env=env, capture_output=True, text=True, cwd=ROOT)


@pytest.fixture(scope="module")
def protocol(tmp_path_factory):
    """The driver's four steps at tiny scale; then ``all`` again, which skips the control (at its target)."""
    tmp = tmp_path_factory.mktemp("protocol")
    for name, seed in (("train_a", 0), ("train_b", 1), ("heldout", 2)):
        _genome(tmp / f"{name}.fa", 3000, seed)
    _recipes(tmp / "recipes")
    for step in ("pretrain", "long", "control", "eval"):
        done = _driver(tmp, step)
        assert done.returncode == 0, f"{step}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    assert "control: already at step 2" in _driver(tmp, "control").stdout
    return tmp / "runs", json.loads((tmp / "results" / "eval_protocol.json").read_text())


def test_schema(protocol):
    tmp, result = protocol
    assert result["model_names"] == ["before", "after", "control"] and result["seq_len"] == LONG
    assert result["num_windows"] == 3 and len(result["buckets"]) == LONG // WIDTH
    for name in result["model_names"]:
        m = result["models"][name]
        assert set(m) >= {"bits_per_base", "bucket_bits_per_base", "bucket_se", "window_bits_per_base",
                          "window_bucket_bits_per_base"}
        assert len(m["window_bucket_bits_per_base"]) == 3 and all(se is not None for se in m["bucket_se"])
    assert set(result["change"]) == {"after", "control"} and result["baselines"]["uniform"]["bits_per_base"] == 2.0
    abl = result["context_ablation"]
    assert abl["cut_to"] == CUT and abl["model"] == "after" and abl["buckets"] == [1, 2, 3]
    for key in ("bits_per_base_full", "bits_per_base_cut", "context_gain_se"):
        assert len(abl[key]) == 3 and all(v is not None for v in abl[key])
    assert result["copy_oracle"]["k"] == 12 and "late" in result["change"]["after"]
    for f in ("eval_protocol.md", "eval_protocol.png", "eval_by_position.json", "eval_by_position.png",
              "genome-long/metrics.jsonl", "genome-start/loss_curve.png"):
        assert (tmp.parent / "results" / f).stat().st_size > 0


def test_numbers_are_computed(protocol):
    """Every model's bits, the k-mer baseline's and the ablation's full arm, recomputed another way."""
    tmp, result = protocol
    cfg = build_config(yaml.safe_load((tmp / "genome-long" / "config.yaml").read_text()))
    data = build_data(cfg.data, cfg.eval)
    windows = [b for group in data.heldout_batches(1).values() for b in group]
    env = ParallelEnv(torch.device("cpu"))
    for name, run in (("before", "genome-start"), ("after", "genome-long"), ("control", "genome-control")):
        model, _, _ = load_megaseq_checkpoint(tmp / run)
        fn = per_token_loss_fn(model.eval(), env, None, 1024)
        total = count = 0.0
        late = [0.0, 0]
        for b in windows:
            loss, mask = fn(b).double().numpy(), (b["labels"] >= 0).numpy() & np.isin(b["labels"], data.score_ids)
            total, count = total + loss[mask].sum(), count + mask.sum()
            late[0] += loss[:, 3 * WIDTH:][mask[:, 3 * WIDTH:]].sum()
            late[1] += mask[:, 3 * WIDTH:].sum()
        bits = total / count / math.log(2)
        np.testing.assert_allclose(result["models"][name]["bits_per_base"], bits, rtol=1e-6)
        if name == "after":
            np.testing.assert_allclose(result["context_ablation"]["bits_per_base_full"][-1],
                                       late[0] / late[1] / math.log(2), rtol=1e-6)
        assert result["models"][name]["bits_per_base"] != result["models"]["before" if name != "before"
                                                                            else "after"]["bits_per_base"]
    before, after = result["models"]["before"]["bits_per_base"], result["models"]["after"]["bits_per_base"]
    np.testing.assert_allclose(result["change"]["after"]["percent"], 100 * (before - after) / before, rtol=1e-9)
    kmer = build_kmer_baseline(data, 3)
    k_total = k_count = 0.0
    for b in windows:
        loss, mask = np.asarray(kmer.batch_loss(b)), np.isin(b["labels"].numpy(), data.score_ids)
        k_total, k_count = k_total + loss[mask].sum(), k_count + mask.sum()
    np.testing.assert_allclose(result["baselines"]["kmer"]["bits_per_base"], k_total / k_count / math.log(2),
                               rtol=1e-9)
    # the cut arm differs from the full one: the model reads its context (random-ish weights still do)
    assert result["context_ablation"]["bits_per_base_cut"] != result["context_ablation"]["bits_per_base_full"]
