"""The long-context protocol end to end at tiny scale on the CPU: a start at a short length, a long fine-tune
from it, a control at the start's length, then ``megaseq eval before=,after=,control=`` with the context
ablation and the copy oracle; the JSON's schema, and its numbers recomputed independently."""

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from megaseq.cli.main import main
from megaseq.config import build_config
from megaseq.data import build_data
from megaseq.eval import build_kmer_baseline
from megaseq.eval.loss import per_token_loss_fn
from megaseq.train.convert import load_megaseq_checkpoint
from megaseq.train.parallel_env import ParallelEnv
from megaseq.train.trainer import run_training

torch.set_num_threads(2)
SHORT, LONG, WIDTH, CUT = 128, 384, 96, 128


def _genome(path: Path, n: int, seed: int) -> Path:
    """A random genome carrying a 150-base repeat 200 bases after its first copy, every 600 bases."""
    rng = np.random.default_rng(seed)
    bases = rng.choice(list("ACGT"), n)
    for start in range(0, n - 400, 600):
        bases[start + 200:start + 350] = bases[start:start + 150]
    path.write_text(">g\n" + "".join(bases) + "\n")
    return path


def _train(tmp_path: Path, run: str, seq_len: int, steps: int, batch: int, init: str | None = None):
    raw = {
        "model": {"name": "glm5-flash-tiny", "dtype": "fp32", **({"init_from": init} if init else {})},
        "data": {"train": [str(tmp_path / "train_a.fa"), str(tmp_path / "train_b.fa")],
                 "heldout": [str(tmp_path / "heldout.fa")], "seq_len": seq_len},
        "train": {"steps": steps, "batch_size": batch, "run_dir": str(tmp_path / run), "eval_after": False,
                  "export_hf": init is None},
        "optim": {"lr": 3e-3, "warmup_steps": 1},
        "eval": {"by_position": WIDTH, "max_windows": 3, "kmer_k": 3, "seq_len": LONG},
        "log": {"progress": False, "tensorboard": False},
    }
    return run_training(build_config(raw))


@pytest.fixture(scope="module")
def protocol(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("protocol")
    for name, seed in (("train_a", 0), ("train_b", 1), ("heldout", 2)):
        _genome(tmp / f"{name}.fa", 3000, seed)
    start = _train(tmp, "start", SHORT, 3, 3)
    _train(tmp, "long", LONG, 2, 1, str(start.hf_export))  # 768 tokens
    _train(tmp, "control", SHORT, 2, 3, str(start.hf_export))  # the same 768 tokens at the start's length
    rc = main(["eval", f"before={tmp / 'start'},after={tmp / 'long'},control={tmp / 'control'}",
               "--ablation-cut-to", str(CUT), "--ablation-chunk", "32", "--oracle-k", "12",
               "--oracle-distance", "100", "--out", str(tmp / "eval")])
    assert rc == 0
    return tmp, json.loads((tmp / "eval" / "eval_protocol.json").read_text())


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
    for f in ("eval_protocol.md", "eval_protocol.png", "eval_by_position.json", "eval_by_position.png"):
        assert (tmp / "eval" / f).stat().st_size > 0


def test_numbers_are_computed(protocol):
    """Every model's bits, the k-mer baseline's and the ablation's full arm, recomputed another way."""
    tmp, result = protocol
    cfg = build_config(yaml.safe_load((tmp / "long" / "config.yaml").read_text()))
    data = build_data(cfg.data, cfg.eval)
    windows = [b for group in data.heldout_batches(1).values() for b in group]
    env = ParallelEnv(torch.device("cpu"))
    for name, run in (("before", "start"), ("after", "long"), ("control", "control")):
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
