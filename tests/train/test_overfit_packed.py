"""benchmarks/long_context/overfit.py --packed: the overfit test whose task is the same at every length. A window packed
with copies of one short window as separate documents must train as that window alone, step for step (on
the CPU in float32, with the memory fixes forced: to rounding); the check is sensitive, since attention
across the documents (no ``doc_ids``) moves the long run's losses."""

from __future__ import annotations

import gzip

import pytest
import yaml

import bench_scripts


def _overfit_module():
    return bench_scripts.load("long_context/overfit", "overfit_bench")


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A run directory as the test reads one: config.yaml (qwen3-moe-tiny, fp32, a synthetic genome), no hf/."""
    d = tmp_path_factory.mktemp("run")
    import random

    rng = random.Random(0)
    genome = "".join(rng.choice("ACGT") for _ in range(20000))
    paths = []
    for name, part in (("train", genome[:10000]), ("heldout", genome[10000:])):
        paths.append(d / f"{name}.fa.gz")
        with gzip.open(paths[-1], "wt") as f:
            f.write(f">{name}\n{part}\n")
    cfg = {"model": {"name": "qwen3-moe-tiny", "dtype": "fp32"}, "data": {"kind": "fasta", "train": [str(paths[0])],
           "heldout": [str(paths[1])], "seq_len": 1024}, "train": {"steps": 1}, "optim": {"lr": 1e-3},
           "memory": {"auto": False, "chunked_loss": True, "loss_chunk_tokens": 256, "tiled_mlp": True,
                      "mlp_tile_tokens": 384, "recompute": True}}
    (d / "config.yaml").write_text(yaml.safe_dump(cfg))
    return d


def test_packed_window_trains_as_the_short_one(run_dir, tmp_path):
    of = _overfit_module()
    row = of.packed(run_dir, 1024, 256, steps=4, lr=3e-3, target=0.2, out=tmp_path / "p", period=64)
    assert row["documents"] == 4 and len(row["losses_packed"]) == 4
    assert row["max_abs_diff"] < 1e-5, row
    assert row["losses_short"][-1] < row["losses_short"][0]  # it trains at all
    assert (tmp_path / "p.md").read_text().startswith("Packed overfit test")


def test_packed_check_sees_attention_across_documents(run_dir, tmp_path, monkeypatch):
    """The deliberately broken long run (its doc_ids dropped: every document attends to the ones before)."""
    of = _overfit_module()
    real = of._train_on

    def no_docs(cfg, init, batch, steps):
        if batch["input_ids"].shape[1] > 256:
            batch = {k: v for k, v in batch.items() if k != "doc_ids"}
        return real(cfg, init, batch, steps)

    monkeypatch.setattr(of, "_train_on", no_docs)
    row = of.packed(run_dir, 1024, 256, steps=2, lr=3e-3, target=0.2, out=tmp_path / "p", period=64)
    assert row["max_abs_diff"] > 1e-3, row
