"""The report rules: a model worse than the baseline is reported as worse, in words, table and plot; the
baselines (k-mer, uniform A/C/G/T) are in the table and the plot; 'before' only when it is a real model;
the plot is scaled to the region that matters. Each rule's check also runs against a deliberately broken
report, which it must catch."""

import math

import numpy as np
import pytest

import megaseq.eval.report as report
import megaseq.eval.verdict as verdict
from megaseq.eval.by_position import PositionLoss, compare

S, WIDTH = 2048, 512
LN2 = math.log(2)


def loss(bits, slope=0.0, seed=0, windows=4, sd=0.3):
    """A PositionLoss whose per-token loss is ``bits`` (+ ``slope`` over the window) bits, with noise."""
    rng = np.random.default_rng(seed)
    r = PositionLoss(WIDTH, S)
    for _ in range(windows):
        mean = (bits + slope * np.arange(S) / S) * LN2
        r.add(rng.normal(mean, sd, size=(1, S)).clip(0.01), np.ones((1, S), bool))
    return r


def figure_of(result, monkeypatch):
    """The matplotlib Figure ``plot_by_position`` draws (captured instead of saved)."""
    seen = {}
    monkeypatch.setattr(report, "save_figure", lambda fig, path: seen.setdefault("fig", fig))
    report.plot_by_position(result, "unused.png")
    return seen["fig"]


# ---- a model worse than the baseline is reported as such ----------------------------------------
def check_worse_is_reported(result):
    assert result["gain_over_baseline"]["after"]["overall"] < 0
    assert "does not beat the kmer-k6 baseline" in result["verdict"][0]
    md = report.markdown_table(result)
    assert md.startswith("**after does not beat the kmer-k6 baseline")
    assert "worse overall" in md
    all_row = next(line for line in md.splitlines() if line.startswith("| all |"))
    assert all_row.split("|")[-2].strip().startswith("-")  # the gain over the baseline is negative


def worse_result():
    return compare({"after": loss(2.003, seed=1)}, ("kmer-k6", loss(1.975, seed=2)), "base")


def test_a_model_worse_than_the_baseline_is_reported_as_worse():
    check_worse_is_reported(worse_result())


def test_broken_report_that_hides_a_worse_model_is_caught(monkeypatch):
    real = verdict.baseline_gain

    def flipped(model, base):  # a report with no sign and no word for "worse"
        g = real(model, base)
        return {**g, "overall": abs(g["overall"]), "buckets": [abs(b) for b in g["buckets"]]}

    monkeypatch.setattr(verdict, "baseline_gain", flipped)
    with pytest.raises(AssertionError):
        check_worse_is_reported(worse_result())


def test_a_better_model_and_its_trend_by_position():
    result = compare({"after": loss(1.90, slope=-0.2, seed=3)}, ("kmer-k6", loss(1.975, seed=2)), "base")
    g = result["gain_over_baseline"]["after"]
    assert g["overall"] > 0 and g["late"] > g["early"]
    assert result["verdict"][0].startswith("after beats the kmer-k6 baseline")
    assert any("later positions, with more context before them, show more gain" in v for v in result["verdict"])
    # by hand: the gain in the last bucket
    m = result["models"]
    np.testing.assert_allclose(g["buckets"][-1], m["kmer-k6"]["bucket_bits_per_base"][-1]
                               - m["after"]["bucket_bits_per_base"][-1], rtol=1e-12)


def edge_result():
    """Worse than the baseline everywhere but in a bucket holding one token per window (a separator's
    edge: the scored region starts at the first bucket's last position), where it is far better."""
    rng = np.random.default_rng(7)
    mask_S = np.arange(S) >= WIDTH - 1
    model, base = PositionLoss(WIDTH, S), PositionLoss(WIDTH, S)
    for _ in range(4):
        for r, bits, edge in ((model, 2.02, 0.5), (base, 1.95, 3.0)):
            bits_S = rng.normal(bits, 0.3, size=S).clip(0.01)
            bits_S[WIDTH - 1] = edge
            r.add((bits_S * LN2)[None], mask_S[None])
    return compare({"after": model}, ("kmer-k6", base), "base")


def check_edge_bucket_not_counted(result):
    g = result["gain_over_baseline"]["after"]
    assert g["buckets"][0] > 2 and all(b < 0 for b in g["buckets"][1:])
    line = next(v for v in result["verdict"] if "position buckets" in v)
    assert "better than kmer-k6 in 0 of 3 position buckets" in line, line
    assert "1 bucket with under a tenth of the largest bucket's tokens left out" in line


def test_a_bucket_of_a_few_edge_tokens_does_not_count_as_a_win():
    check_edge_bucket_not_counted(edge_result())


def test_broken_verdict_that_counts_edge_buckets_is_caught(monkeypatch):
    real = verdict.baseline_gain
    monkeypatch.setattr(verdict, "baseline_gain",  # a looser rule: every bucket with a token counts
                        lambda m, b: {**real(m, b), "scored_buckets": list(range(len(m.count)))})
    with pytest.raises(AssertionError):
        check_edge_bucket_not_counted(edge_result())


def test_a_difference_within_noise_is_called_so():
    result = compare({"after": loss(1.975, seed=5)}, ("kmer-k6", loss(1.975, seed=6)), "base")
    assert "not distinguishable" in result["verdict"][0]


def test_worse_than_uniform_is_said_without_a_baseline():
    result = compare({"after": loss(2.01, seed=1)}, None, "base")
    assert result["verdict"][0].startswith("after does not beat uniform A/C/G/T")
    assert "gain_over_baseline" not in result


# ---- the baselines are in the table and the plot --------------------------------------------------
def check_baselines_shown(result, fig):
    md = report.markdown_table(result)
    assert "| kmer-k6 (baseline) |" in md and "| uniform A/C/G/T (baseline) | 2.0000 |" in md
    head = next(line for line in md.splitlines() if line.startswith("| positions |"))
    assert "| kmer-k6 |" in head and "| uniform |" in head and "gain of after over kmer-k6" in head
    top, bottom = fig.axes
    labels = [line.get_label() for line in top.get_lines()]
    assert any(lab.startswith("kmer-k6") and "(baseline)" in lab for lab in labels)
    assert any(lab.startswith("uniform A/C/G/T") for lab in labels)
    assert any(line.get_label().startswith("after") for line in bottom.get_lines())  # gain by position
    lo, hi = top.get_ylim()
    kmer = result["models"]["kmer-k6"]["bucket_bits_per_base"]
    assert lo <= min(kmer) and max(kmer + [2.0]) <= hi


def test_the_baselines_are_in_the_table_and_the_plot(monkeypatch):
    result = worse_result()
    check_baselines_shown(result, figure_of(result, monkeypatch))


def test_broken_plot_without_the_baselines_is_caught(monkeypatch):
    result = worse_result()
    result_without = {**result, "baseline": None, "uniform_bits": None, "gain_over_baseline": {}}
    fig = figure_of(result_without, monkeypatch)
    with pytest.raises((AssertionError, ValueError)):
        check_baselines_shown(result, fig)


# ---- before/after only where 'before' is a real model; the scale is the region that matters ------------
def test_no_before_after_without_a_real_before():
    result = compare({"after": loss(2.0, seed=1)}, ("kmer-k6", loss(1.975, seed=2)), "base", notes=["random init"])
    assert "relative_improvement" not in result
    md = report.markdown_table(result)
    assert "vs before" not in md and "- random init" in md
    # two named checkpoints are not a before/after pair unless the caller names them (eval does, for real ones)
    assert "relative_improvement" not in compare({"a": loss(2.0), "b": loss(1.9)})


def test_a_real_before_gets_its_column_and_does_not_set_the_scale(monkeypatch):
    result = compare({"before": loss(3.2, seed=7), "after": loss(1.96, seed=1)}, ("kmer-k6", loss(1.975, seed=2)),
                     "base")
    rel = result["relative_improvement"]
    assert rel["before"] == "before" and rel["overall"] > 0.3
    assert "| after vs before |" in report.markdown_table(result)
    top = figure_of(result, monkeypatch).axes[0]
    lo, hi = top.get_ylim()
    assert hi < 2.2  # the region of after, the k-mer baseline and uniform, not up to before's 3.2
    assert any("off the scale" in line.get_label() for line in top.get_lines() if line.get_label().startswith("before"))


def test_results_without_squares_still_report():
    """A PositionLoss read from an older JSON (no sums of squares): gains without standard errors."""
    a, b = loss(1.9, seed=1), loss(1.975, seed=2)
    a_old = PositionLoss.from_dict({k: v for k, v in a.to_dict().items() if k != "sum_sq_nats"})
    result = compare({"after": a_old}, ("kmer-k6", b), "base")
    assert result["gain_over_baseline"]["after"]["overall_se"] is None
    assert result["verdict"][0].startswith("after beats")


def test_each_held_out_group_has_its_row():
    """Several held-out groups (files, or one file after relatives and after its own bases): one row each."""
    rng = np.random.default_rng(0)

    def two_groups(a_bits, b_bits):
        r = PositionLoss(WIDTH, S)
        for group, bits in (("g.fa (after 3 training relatives)", a_bits), ("g.fa (after its own preceding bases)",
                                                                             b_bits)):
            r.add(rng.normal(bits * LN2, 0.2, size=(2, S)).clip(0.01), np.ones((2, S), bool), group)
        return r

    result = compare({"after": two_groups(1.5, 1.9)}, ("kmer-k6", two_groups(1.8, 1.8)), "base")
    md = report.markdown_table(result)
    rows = {line.split(" | ")[0][2:]: line for line in md.splitlines() if line.startswith("| g.fa")}
    assert set(rows) == {"g.fa (after 3 training relatives)", "g.fa (after its own preceding bases)"}
    assert rows["g.fa (after 3 training relatives)"].rstrip(" |").split(" | ")[-1].startswith("+0.3")
    assert rows["g.fa (after its own preceding bases)"].rstrip(" |").split(" | ")[-1].startswith("-0.1")



def test_outputs_are_readable_as_any_new_file(tmp_path):
    """A report written through a temporary file gets the mode open() gives a new file (0644 under umask 022),
    not mkstemp's 0600."""
    import os
    import stat

    from megaseq.eval.report import write_atomic

    mask = os.umask(0)
    os.umask(mask)
    mode = stat.S_IMODE(write_atomic(tmp_path / "r.md", "x").stat().st_mode)
    (tmp_path / "plain").write_text("x")
    assert mode == stat.S_IMODE((tmp_path / "plain").stat().st_mode) == 0o666 & ~mask
