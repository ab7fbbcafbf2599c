"""Loss by position: bucketing against a hand computation, comparison, reports written atomically."""

import json
import math

import numpy as np
import pytest
import torch

import megaseq.eval.report as report
from megaseq.config import DataConfig, EvalConfig
from megaseq.data import build_data
from megaseq.data.windows import make_batch
from megaseq.eval import (
    PositionLoss,
    build_kmer_baseline,
    compare,
    evaluate_by_position,
    position_loss,
    write_report,
)

S, WIDTH = 10, 3  # buckets [0,3) [3,6) [6,9) [9,10)


def batches(seed=0, rows=(2, 3)):
    rng = np.random.default_rng(seed)
    out = []
    for b in rows:
        windows = [rng.integers(4, 9, size=S + 1) for _ in range(b)]  # includes N (8)
        batch = make_batch(windows)
        batch["labels"][0, 1] = -100
        out.append(batch)
    return out


def fake_loss(scale):
    """A deterministic per-token loss: depends on the row's first token, the position and the label."""
    def fn(batch):
        pos = torch.arange(S, dtype=torch.float64)
        first = batch["input_ids"][:, :1] / 11
        return scale * (0.1 * pos + batch["labels"].clamp(min=0).double() / 7 + first)
    return fn


def hand_buckets(fn, bs, score_ids):
    sums, counts = [0.0] * 4, [0] * 4
    for batch in bs:
        loss = fn(batch)
        for r in range(loss.shape[0]):
            for p in range(S):
                lab = int(batch["labels"][r, p])
                if lab != -100 and (score_ids is None or lab in score_ids):
                    sums[p // WIDTH] += float(loss[r, p])
                    counts[p // WIDTH] += 1
    return sums, counts


@pytest.mark.parametrize("score_ids", [None, (4, 5, 6, 7)])
def test_buckets_against_hand_computation(score_ids):
    bs = batches()
    r = position_loss(fake_loss(1.0), bs, WIDTH, score_ids)
    sums, counts = hand_buckets(fake_loss(1.0), bs, score_ids)
    assert r.count.tolist() == counts and r.num_windows == 5
    np.testing.assert_allclose(r.bucket_loss(), np.array(sums) / np.array(counts), rtol=1e-13)
    np.testing.assert_allclose(r.loss, sum(sums) / sum(counts), rtol=1e-13)


def test_compare_relative_improvement_and_baseline():
    bs = {"g1.fa": batches(0), "g2.fa": batches(1, rows=(1,))}
    result = evaluate_by_position({"before": fake_loss(1.0), "after": fake_loss(0.8)}, bs, WIDTH,
                                  baseline=("kmer", fake_loss(1.5)), score_ids=(4, 5, 6, 7))
    assert result["model_names"] == ["before", "after"] and result["baseline"] == "kmer"
    rel = result["relative_improvement"]
    assert rel["before"] == "before" and rel["after"] == "after"
    np.testing.assert_allclose(rel["buckets"], [0.2] * 4, rtol=1e-12)
    np.testing.assert_allclose(rel["overall"], 0.2, rtol=1e-12)
    before = result["models"]["before"]
    np.testing.assert_allclose(before["bits_per_base"], before["loss_nats"] / math.log(2), rtol=1e-14)
    assert set(before["groups"]) == {"g1.fa", "g2.fa"}
    total = sum(g["tokens"] for g in before["groups"].values())
    assert total == before["tokens"] == sum(before["bucket_tokens"]) == result["tokens"]
    np.testing.assert_allclose(result["models"]["kmer"]["loss_nats"], 1.5 * before["loss_nats"], rtol=1e-12)
    assert result["buckets"] == [[0, 3], [3, 6], [6, 9], [9, 10]]


def test_accumulators_round_trip_and_checks():
    bs = batches()
    a = position_loss(fake_loss(1.0), bs, WIDTH)
    b = PositionLoss.from_dict(json.loads(json.dumps(a.to_dict())))
    np.testing.assert_array_equal(b.sum_nats, a.sum_nats)
    np.testing.assert_array_equal(b.count, a.count)
    assert b.groups == a.groups
    other = position_loss(fake_loss(1.0), bs, WIDTH, score_ids=(4,))
    with pytest.raises(ValueError, match="other windows or buckets"):
        compare({"a": a, "b": other})
    with pytest.raises(ValueError, match="no results named 'x'"):
        compare({"a": a, "b": b}, before="x", after="a")
    assert "relative_improvement" not in compare({"only": a})


def test_bad_losses():
    bs = batches()
    with pytest.raises(ValueError, match="non-finite loss"):
        position_loss(lambda b: torch.full(b["labels"].shape, float("nan")), bs, WIDTH, name="m")
    with pytest.raises(ValueError, match=r"shape \(2, 9\)"):
        position_loss(lambda b: torch.zeros(b["labels"].shape[0], S - 1), bs, WIDTH)
    with pytest.raises(ValueError, match="no held-out windows"):
        position_loss(fake_loss(1.0), [], WIDTH)
    with pytest.raises(ValueError, match="eval.by_position"):
        PositionLoss(0, S)


def test_report_files(tmp_path, monkeypatch):
    result = evaluate_by_position({"before": fake_loss(1.0), "after": fake_loss(0.9)}, batches(), WIDTH,
                                  baseline=("kmer-k8", fake_loss(1.2)), score_ids=(4, 5, 6, 7))
    paths = write_report(result, tmp_path / "eval")
    assert json.loads(paths["json"].read_text()) == json.loads(json.dumps(result))
    md = paths["md"].read_text()
    head = ("| positions | before | after | kmer-k8 | uniform | gain of before over kmer-k8 "
            "| gain of after over kmer-k8 ")
    for word in (head + "| after vs before |", "+10.00%", "| all |", "after beats the kmer-k8 baseline"):
        assert word in md
    assert paths["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(p.name for p in (tmp_path / "eval").iterdir()) == [
        "eval_by_position.json", "eval_by_position.md", "eval_by_position.png"]  # no temporary files left

    def crash(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(report.os, "replace", crash)
    with pytest.raises(OSError):
        report.write_json(paths["json"], {"half": "written"})
    assert json.loads(paths["json"].read_text()) == json.loads(json.dumps(result))  # the old file survives
    assert len(list((tmp_path / "eval").iterdir())) == 3


def test_end_to_end_on_the_phage_genome(tmp_path):
    """Held-out windows of the real genome: uniform model vs the k-mer baseline, report written."""
    data = build_data(DataConfig(seq_len=2048), EvalConfig(by_position=512, max_windows=4), heldout_tail=0.2)
    kmer = build_kmer_baseline(data, 6)
    uniform = lambda b: torch.full(b["labels"].shape, math.log(4), dtype=torch.float64)  # noqa: E731
    bs = data.heldout_batches(batch_size=2)
    result = evaluate_by_position({"uniform": uniform}, bs, 512, (kmer.name, kmer.batch_loss), data.score_ids)
    assert result["num_windows"] == 4 and len(result["buckets"]) == 4
    np.testing.assert_allclose(result["models"]["uniform"]["bits_per_base"], 2.0, rtol=1e-12)
    assert result["models"]["kmer-k6"]["bits_per_base"] < 2.0
    assert write_report(result, tmp_path)["png"].stat().st_size > 0
