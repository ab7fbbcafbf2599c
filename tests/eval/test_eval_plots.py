"""The by-position plot stays readable at any bucket count (one bucket does not clip 'before' off a scale of a
hundredth of a bit), every shaded band has its legend entry, and "after vs before: X% fewer bits" says whether
it is beyond noise (2 standard errors). Each check also runs against the broken variant it guards against."""

import math

import numpy as np
import pytest
from test_eval_report import figure_of  # the Figure plot_by_position draws

import megaseq.eval.report as report
import megaseq.eval.verdict as verdict
from megaseq.eval.by_position import PositionLoss, compare

LN2 = math.log(2)


def loss(bits, seq=2048, width=2048, seed=0, windows=4, sd=0.3):
    rng = np.random.default_rng(seed)
    r = PositionLoss(width, seq)
    for _ in range(windows):
        r.add(rng.normal(bits * LN2, sd, size=(1, seq)).clip(0.01), np.ones((1, seq), bool))
    return r


def old_y_range(result):
    """The scale as it was: the main model, the baseline and uniform only, padded by 0.005 at least."""
    vals = [v for v in report._values(result, verdict.main_model(result)) if v == v]
    if result.get("baseline"):
        vals += [v for v in report._values(result, result["baseline"]) if v == v]
    if result.get("uniform_bits") is not None:
        vals.append(result["uniform_bits"])
    lo, hi = min(vals), max(vals)
    pad = max(0.15 * (hi - lo), 0.005)
    return lo - pad, hi + pad


# ---- one bucket: every model on a visible scale ----------------------------------------------------
def check_readable(result, fig):
    top = fig.axes[0]
    lo, hi = top.get_ylim()
    unit = result["unit"]
    for name in result["model_names"]:
        v = result["models"][name][f"bits_per_{unit}"]
        assert lo < v < hi, (name, v, lo, hi)
    assert not any("off the scale" in line.get_label() for line in top.get_lines())
    level = max(abs(lo), abs(hi))
    assert hi - lo >= 0.02 * level  # models a few hundredths apart read as separate lines


def one_bucket_text():
    """Text (no uniform reference), one bucket: after and before 0.03 bits apart, no baseline."""
    return compare({"before": loss(3.03, seed=7), "after": loss(3.0, seed=1)}, None, "token")


def one_bucket_dna():
    return compare({"before": loss(1.99, seed=7), "after": loss(1.985, seed=1)}, ("kmer-k6", loss(1.984, seed=2)),
                   "base")


@pytest.mark.parametrize("make", [one_bucket_text, one_bucket_dna])
def test_one_bucket_keeps_before_on_a_readable_scale(make, monkeypatch):
    result = make()
    assert len(result["buckets"]) == 1
    check_readable(result, figure_of(result, monkeypatch))


def test_the_old_scale_fails_the_check(monkeypatch):
    result = one_bucket_text()
    monkeypatch.setattr(report, "_y_range", old_y_range)
    with pytest.raises(AssertionError):
        check_readable(result, figure_of(result, monkeypatch))


def test_many_buckets_and_a_far_before_still_clip_it():
    """A 'before' of random weights (8 bits) would squeeze the region that matters: it is clipped instead."""
    result = compare({"before": loss(8.0, width=256, seed=7), "after": loss(1.96, width=256, seed=1)},
                     ("kmer-k6", loss(1.975, width=256, seed=2)), "base")
    lo, hi = report._y_range(result)
    assert hi < 2.2 and len(result["buckets"]) == 8


# ---- every band in the legend -------------------------------------------------------------------------
def check_bands_in_legend(result, fig):
    bottom = fig.axes[1]
    texts = [t.get_text() for t in bottom.get_legend().get_texts()]
    for name in result["gain_over_baseline"]:
        assert report.band_label(name) in texts, texts
        assert "2 standard errors" in report.band_label(name)


def gains_result():
    return compare({"after": loss(1.9, width=512, seed=1)}, ("kmer-k6", loss(1.975, width=512, seed=2)), "base")


def test_the_band_has_its_legend_entry(monkeypatch):
    result = gains_result()
    check_bands_in_legend(result, figure_of(result, monkeypatch))


def test_a_band_without_a_label_fails_the_check(monkeypatch):
    result = gains_result()
    real = report.band_label
    monkeypatch.setattr(report, "band_label", lambda name: "_nolegend_")  # as drawn before: no legend entry
    fig = figure_of(result, monkeypatch)
    monkeypatch.setattr(report, "band_label", real)
    with pytest.raises(AssertionError):
        check_bands_in_legend(result, fig)


# ---- after vs before: beyond noise or not -----------------------------------------------------------
def sentence(result):
    return next(s for s in result["verdict"] if " vs before " in s)


def check_noise_stated(close, far):
    assert "within noise" in sentence(close) and "2 standard errors" in sentence(close)
    assert "beyond noise" in sentence(far)


def test_the_comparison_states_whether_it_is_beyond_noise():
    close = compare({"before": loss(1.951, seed=7), "after": loss(1.95, seed=1)}, None, "base")
    far = compare({"before": loss(2.3, seed=7), "after": loss(1.95, seed=1)}, None, "base")
    check_noise_stated(close, far)
    assert "within noise" in report.markdown_table(close)


def test_the_standard_error_is_the_two_models_errors_combined():
    b, a = loss(2.1, seed=7, windows=3), loss(2.0, seed=1, windows=3)
    rel = compare({"before": b, "after": a}, None, "base")["relative_improvement"]
    xs_b = b.sum_nats.sum() / b.count.sum(), b.sum_sq_nats.sum() / b.count.sum()
    xs_a = a.sum_nats.sum() / a.count.sum(), a.sum_sq_nats.sum() / a.count.sum()
    n = b.count.sum()
    se = math.sqrt((xs_b[1] - xs_b[0] ** 2) / n + (xs_a[1] - xs_a[0] ** 2) / n) / xs_b[0]
    assert rel["overall"] == pytest.approx((xs_b[0] - xs_a[0]) / xs_b[0], rel=1e-12)
    assert rel["overall_se"] == pytest.approx(se, rel=1e-9)


def test_a_comparison_without_noise_fails_the_check(monkeypatch):
    """The sentence as it was: the percentage alone."""
    monkeypatch.setattr(verdict, "change_sentence", lambda rel, unit: (
        f"{rel['after']} vs {rel['before']} (the model fine-tuning started from): {100 * abs(rel['overall']):.2f}% "
        f"{'fewer' if rel['overall'] >= 0 else 'more'} bits per {unit}"))
    close = compare({"before": loss(1.951, seed=7), "after": loss(1.95, seed=1)}, None, "base")
    far = compare({"before": loss(2.3, seed=7), "after": loss(1.95, seed=1)}, None, "base")
    with pytest.raises(AssertionError):
        check_noise_stated(close, far)


def test_without_squares_the_comparison_says_so():
    b, a = loss(2.1, seed=7), loss(2.0, seed=1)
    old = {k: PositionLoss.from_dict({f: v for f, v in r.to_dict().items() if f != "sum_sq_nats"})
           for k, r in (("before", b), ("after", a))}
    assert "no standard error" in sentence(compare(old, None, "base"))
