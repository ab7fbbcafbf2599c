"""What a by-position result says, in numbers and in words: the gain over the baselines, and a verdict.

A newcomer reads a report's first lines: they must say whether the model beats the baselines that
matter for DNA, uniform over A/C/G/T (2 bits per base, knowing nothing) and the order-k Markov model
(what short context alone gives), never a drop from an untrained model. Everything here works on
``PositionLoss`` accumulators or on the JSON ``compare`` builds from them; no torch.

Shapes: NB position buckets.

Gains are ``baseline - model`` in bits per unit (positive: the model is better). Standard errors
treat scored tokens as independent (they are not: tokens of one window are correlated, so these are
a lower bound on the real uncertainty); the difference of two models on the same tokens is given
the conservative ``sqrt(se_a**2 + se_b**2)`` (its paired error is smaller when the two correlate).
"""

from __future__ import annotations

import math
from typing import Any, Protocol

import numpy as np

from megaseq.config import format_size


class PositionLoss(Protocol):
    """What the gains read of a ``by_position.PositionLoss`` (which imports this module, not the reverse)."""

    sum_nats: np.ndarray  # [NB] summed loss per bucket
    sum_sq_nats: np.ndarray | None  # [NB] summed squares (None: no standard errors)
    count: np.ndarray  # [NB] scored tokens per bucket

    @property
    def loss(self) -> float: ...

BITS = 1.0 / math.log(2)
UNIFORM_BITS = {"base": 2.0}  # uniform over A, C, G, T; a token vocabulary has no such reference


def _mean_se(sum_NB: np.ndarray, sq_NB: np.ndarray | None, n_NB: np.ndarray) -> tuple[float, float | None]:
    """Token-weighted mean (nats) of the buckets given, and its standard error (None without squares)."""
    n = int(n_NB.sum())
    if n == 0:
        return math.nan, None
    mean = float(sum_NB.sum() / n)
    if sq_NB is None or n < 2:
        return mean, None
    var = max(float(sq_NB.sum() / n) - mean * mean, 0.0)
    return mean, math.sqrt(var / n)


def _halves(scored: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The earlier and the later half of the scored buckets (the middle one left out when their number is
    odd). Buckets with no scored token (context-only positions) take no side."""
    n = len(scored)
    return scored[:n // 2], scored[n - n // 2:]


def baseline_gain(model: PositionLoss, base: PositionLoss) -> dict[str, Any]:
    """``base - model`` in bits: overall, per bucket, over the earlier and the later half of the window,
    each with a (conservative) standard error; NaN buckets (no scored token) become None."""
    out: dict[str, Any] = {"buckets": [], "buckets_se": []}
    sq_m, sq_b = model.sum_sq_nats, base.sum_sq_nats

    def gain(sel: Any) -> tuple[float | None, float | None]:
        m, se_m = _mean_se(model.sum_nats[sel], None if sq_m is None else sq_m[sel], model.count[sel])
        b, se_b = _mean_se(base.sum_nats[sel], None if sq_b is None else sq_b[sel], base.count[sel])
        if not (math.isfinite(m) and math.isfinite(b)):
            return None, None
        se = None if se_m is None or se_b is None else math.hypot(se_m, se_b) * BITS
        return (b - m) * BITS, se

    nb = len(model.count)
    for i in range(nb):
        g, se = gain(slice(i, i + 1))
        out["buckets"].append(g)
        out["buckets_se"].append(se)
    out["overall"], out["overall_se"] = gain(slice(0, nb))
    b_loss = base.loss
    out["relative"] = (out["overall"] / (b_loss * BITS)) if out["overall"] is not None and b_loss > 0 else None
    # the halves are over buckets holding a real share of the tokens: a bucket the scored region only
    # touches (a few tokens at a segment's edge) would otherwise be "the earlier half" on its own
    scored = np.flatnonzero(model.count >= max(0.1 * model.count.max(), 1))
    out["scored_buckets"] = [int(i) for i in scored]
    if len(scored) >= 2:
        early, late = _halves(scored)
        out["early"], out["early_se"] = gain(early)
        out["late"], out["late_se"] = gain(late)
        out["early_buckets"] = [int(early[0]), int(early[-1]) + 1]
        out["late_buckets"] = [int(late[0]), int(late[-1]) + 1]
    return out


def relative_change(before: PositionLoss, after: PositionLoss) -> dict[str, Any]:
    """``(before - after) / before`` overall and its standard error (the two models' errors combined as if
    independent: conservative, as ``baseline_gain``'s; None without squares), for "X% fewer bits"."""
    b, se_b = _mean_se(before.sum_nats, before.sum_sq_nats, before.count)
    a, se_a = _mean_se(after.sum_nats, after.sum_sq_nats, after.count)
    if not (math.isfinite(a) and math.isfinite(b)) or b <= 0:
        return {"overall": None, "overall_se": None}
    se = None if se_a is None or se_b is None else math.hypot(se_a, se_b) / b
    return {"overall": (b - a) / b, "overall_se": se}


def change_sentence(rel: dict[str, Any], unit: str) -> str:
    """'after vs before: 0.10% fewer bits per base, within noise (2 standard errors: 0.80%)'."""
    v, se = rel["overall"], rel.get("overall_se")
    words = f"{rel['after']} vs {rel['before']} (the model fine-tuning started from): " \
            f"{100 * abs(v):.2f}% {'fewer' if v >= 0 else 'more'} bits per {unit}"
    if se is None:
        return words + " (no standard error: the evaluation kept no squares)"
    noise = "within noise" if _within(v, se) else "beyond noise"
    return words + f", {noise} (2 standard errors: {200 * se:.2f}%, tokens taken as independent)"


def main_model(result: dict[str, Any]) -> str:
    """The model a report is about: 'after' when there is one, else the last model given."""
    names = result["model_names"]
    return "after" if "after" in names else names[-1]


def _span(result: dict[str, Any], lo: int, hi: int) -> str:
    """Positions covered by buckets [lo, hi), e.g. '0-1K'."""
    return f"{format_size(result['buckets'][lo][0])}-{format_size(result['buckets'][hi - 1][1])}"


def _within(g: float, se: float | None) -> bool:
    return se is not None and abs(g) < 2 * se


def headline(result: dict[str, Any]) -> str:
    """One sentence: does the main model beat the k-mer baseline (or uniform, when there is no baseline)."""
    unit, name = result["unit"], main_model(result)
    bits = result["models"][name][f"bits_per_{unit}"]
    base = result.get("baseline")
    if base is None:
        uniform = result.get("uniform_bits")
        if uniform is None:
            return f"{name}: {bits:.4f} bits per {unit} on held-out data (no baseline for this data)"
        word = "beats" if bits < uniform else "does not beat"
        return f"{name} {word} uniform A/C/G/T ({bits:.4f} vs {uniform:.4f} bits per {unit}; no k-mer baseline)"
    g = result["gain_over_baseline"][name]
    b_bits = result["models"][base][f"bits_per_{unit}"]
    if _within(g["overall"], g["overall_se"]):
        return (f"{name} is not distinguishable from the {base} baseline ({bits:.4f} vs {b_bits:.4f} bits per "
                f"{unit}: the difference is within noise)")
    if g["overall"] > 0:
        return f"{name} beats the {base} baseline ({bits:.4f} vs {b_bits:.4f} bits per {unit})"
    return f"{name} does not beat the {base} baseline ({bits:.4f} vs {b_bits:.4f} bits per {unit})"


def verdict(result: dict[str, Any]) -> list[str]:
    """Sentences for a report's top: the baselines, the gain by position, and before vs after."""
    unit, name = result["unit"], main_model(result)
    entry = result["models"][name]
    bits = entry[f"bits_per_{unit}"]
    lines = [headline(result) + "."]
    uniform = result.get("uniform_bits")
    if uniform is not None:
        rel = "worse than" if bits > uniform else "better than"
        lines.append(f"Uniform over A, C, G, T is {uniform:.4f} bits per {unit}: {name} is {abs(uniform - bits):.4f} "
                     f"{rel} that.")
    base = result.get("baseline")
    if base is not None:
        lines += _baseline_lines(result, name, base)
    rel = result.get("relative_improvement")
    if rel and rel.get("overall") is not None:
        lines.append(change_sentence(rel, unit) + ".")
    lines += list(result.get("notes") or [])
    return lines


def _baseline_lines(result: dict[str, Any], name: str, base: str) -> list[str]:
    unit = result["unit"]
    g = result["gain_over_baseline"][name]
    se = g["overall_se"]
    noise = f" (2 s.e. {2 * se:.4f}, tokens taken as independent)" if se is not None else ""
    word = "better" if g["overall"] > 0 else "worse"
    lines = [f"Against {base}: {abs(g['overall']):.4f} bits per {unit} {word} overall{noise}."]
    if g["overall"] <= 0 and not _within(g["overall"], se):
        lines.append(f"So {name} does not yet predict better than {base}, which counts what follows each short "
                     "context in the training data; it needs more training (steps, data, a larger model) "
                     "before its context length can matter.")
    # counted over the buckets holding a real share of the tokens, as the halves below: a bucket the
    # scored region only touches (one token per window at a separator) has a gain that is all noise
    shown = [i for i, b in enumerate(g["buckets"]) if b is not None]
    kept = [i for i in g.get("scored_buckets", shown) if g["buckets"][i] is not None]
    buckets = [g["buckets"][i] for i in kept]
    if len(buckets) >= 2:
        wins = sum(b > 0 for b in buckets)
        few = len(shown) - len(kept)
        aside = (f"; {few} bucket{'s' if few > 1 else ''} with under a tenth of the largest bucket's tokens "
                 "left out" if few else "")
        lines.append(f"{name} is better than {base} in {wins} of {len(buckets)} position buckets "
                     f"(gain {min(buckets):+.4f} to {max(buckets):+.4f} bits per {unit}{aside}).")
    if g.get("early") is not None and g.get("late") is not None:
        e, late = g["early"], g["late"]
        se_d = math.hypot(g["early_se"], g["late_se"]) if g["early_se"] is not None else None
        if _within(late - e, se_d):
            trend = "about the same gain (the difference is within noise)"
        else:
            trend = "more gain" if late > e else "less gain"
        lines.append(f"By position: the later half of the window ({_span(result, *g['late_buckets'])}) gains "
                     f"{late:+.4f}, the earlier half ({_span(result, *g['early_buckets'])}) {e:+.4f}: later "
                     f"positions, with more context before them, show {trend}.")
    return lines
