"""The protocol's result: per-window spread against a hand computation, paired gains, early against late in
words, refusals; broken variants (a per-token error, unpaired windows) fail the checks."""

import math

import numpy as np
import pytest
import torch

import megaseq.eval.spread as spread
from megaseq.data.windows import make_batch
from megaseq.eval.protocol import protocol_result
from megaseq.eval.protocol_report import write_protocol_report
from megaseq.eval.spread import WindowBuckets, window_buckets

S, WIDTH, W = 12, 4, 5  # 3 buckets


def windows(seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(W):
        batch = make_batch([rng.integers(4, 8, size=S + 1)])
        batch["labels"][0, 2] = -100
        out.append(batch)
    return out


def model(offset, late_gain=0.0, seed=0):
    """Per-token nats: a per-window level (so windows differ), a per-token wobble, and a gain after position 8."""
    def fn(batch):
        g = torch.Generator().manual_seed(seed + int(batch["input_ids"].sum()))
        level = 0.3 * torch.rand(1, generator=g, dtype=torch.float64)
        wobble = 0.05 * torch.rand(batch["labels"].shape, generator=g, dtype=torch.float64)
        pos = torch.arange(batch["labels"].shape[1], dtype=torch.float64)
        return 1.0 + offset + level + wobble - late_gain * (pos >= 8)
    return fn


def hand(fn, bs):
    bits = np.full((W, 3), np.nan)
    for w, b in enumerate(bs):
        loss = fn(b)[0].numpy()
        for i in range(3):
            sel = [p for p in range(i * WIDTH, (i + 1) * WIDTH) if int(b["labels"][0, p]) != -100]
            bits[w, i] = loss[sel].mean() / math.log(2)
    return bits


def test_spread_against_hand_computation():
    bs = windows()
    got = window_buckets(model(0.0), bs, WIDTH).summary()
    bits = hand(model(0.0), bs)
    np.testing.assert_allclose(got["window_bucket_bits_per_base"], bits, rtol=1e-12)
    np.testing.assert_allclose(got["bucket_se"], bits.std(axis=0, ddof=1) / math.sqrt(W), rtol=1e-12)


def test_a_per_token_error_is_caught(monkeypatch):
    """A standard error that treats tokens as independent (the per-token spread) is not the windows' spread."""
    monkeypatch.setattr(spread, "_se", lambda v: float(np.nanstd(v) / math.sqrt(4 * len(v))))
    with pytest.raises(AssertionError):
        test_spread_against_hand_computation()


def result(late_gain_after=0.2):
    bs = windows()
    scored = {"before": window_buckets(model(0.3), bs, WIDTH),
              "after": window_buckets(model(0.1, late_gain_after), bs, WIDTH),
              "control": window_buckets(model(0.1), bs, WIDTH)}
    return protocol_result(scored, ("kmer-k2", window_buckets(model(0.5), bs, WIDTH)))


def test_late_gain_beyond_noise_in_words():
    r = result()
    after, control = r["change"]["after"], r["change"]["control"]
    # the per-window level cancels in the paired difference: late minus early is exactly the built-in 0.2 nats
    np.testing.assert_allclose(after["late_minus_early"], 0.2 / math.log(2), rtol=1e-6)
    assert after["late_buckets"] == [2] and after["early_buckets"] == [0]
    assert "gain more, beyond the spread" in after["words"]
    assert "no more than the spread" in control["words"]
    before = r["models"]["before"]["bits_per_base"]
    np.testing.assert_allclose(control["percent"], 100 * (before - r["models"]["control"]["bits_per_base"]) / before)
    assert r["baselines"]["kmer"]["name"] == "kmer-k2" and r["baselines"]["uniform"]["bits_per_base"] == 2.0


def check_paired(r):
    """The control differs from before by a constant 0.2 nats on every token: paired by window, its gain has no
    spread at all; the per-window level (up to 0.3 nats) would show in an unpaired error."""
    c = r["change"]["control"]
    np.testing.assert_allclose(c["bucket_gain"], [0.2 / math.log(2)] * 3, rtol=1e-6)
    assert max(c["bucket_gain_se"]) < 1e-9 and c["late_minus_early_se"] < 1e-9


def test_paired_gain_has_no_spread_for_a_constant_shift(monkeypatch):
    check_paired(result())

    def unpaired(base_W, model_W):  # broken: windows matched in another order
        d = np.asarray(base_W)[::-1] - np.asarray(model_W)
        d = d[np.isfinite(d)]
        return float(d.mean()), float(d.std(ddof=1) / math.sqrt(len(d)))

    monkeypatch.setattr("megaseq.eval.protocol.paired_gain", unpaired)
    with pytest.raises(AssertionError):
        check_paired(result())


def test_models_on_other_windows_are_refused():
    a = window_buckets(model(0.0), windows(0), WIDTH)
    b = window_buckets(model(0.0), windows(0)[:3], WIDTH)
    with pytest.raises(ValueError, match="other windows"):
        protocol_result({"before": a, "after": b})
    with pytest.raises(ValueError, match="no held-out windows"):
        WindowBuckets(WIDTH, S).summary()


def test_report_files(tmp_path):
    paths = write_protocol_report(result(), tmp_path)
    text = paths["md"].read_text()
    assert "after against before" in text and "± " in text and paths["png"].stat().st_size > 0


class TwoGroups:
    """Held-out data of two groups (a genome after its relatives, and alone) without a k-mer baseline."""

    unit, score_ids, train_records = "base", (4, 5, 6, 7), []

    def heldout_batches(self, batch_size=1):
        bs = windows()
        return {"after relatives": bs[:2], "alone": bs[2:]}


def test_run_protocol_by_group(tmp_path):
    from megaseq.eval.protocol_run import ProtocolSettings, run_protocol

    settings = ProtocolSettings(bucket_width=WIDTH, kmer_k=0, ablation_cut_to=4, ablation_chunk=2, oracle_k=3,
                                oracle_distance=2)
    r = run_protocol({"before": model(0.3), "after": model(0.1, 0.2)}, TwoGroups(), settings, tmp_path)
    assert set(r["groups"]) == {"after relatives", "alone"} and r["num_windows"] == W
    assert [g["num_windows"] for g in r["groups"].values()] == [2, 3]
    tokens = [sum(g["models"]["after"]["bucket_tokens"]) for g in r["groups"].values()]
    bits = [g["models"]["after"]["bits_per_base"] for g in r["groups"].values()]
    np.testing.assert_allclose(r["models"]["after"]["bits_per_base"], np.dot(tokens, bits) / sum(tokens), rtol=1e-12)
    assert r["context_ablation"]["num_windows"] == W and r["groups"]["alone"]["context_ablation"]["num_windows"] == 3
    assert "**alone** (3 windows)" in (tmp_path / "eval_protocol.md").read_text()
    classic = (tmp_path / "eval_by_position.json").read_text()
    assert '"after relatives"' in classic and '"alone"' in classic
