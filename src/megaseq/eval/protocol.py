"""The long-context protocol's evaluation: before, after and control on the same held-out windows.

Shapes: W windows, NB position buckets.

``before`` is the model fine-tuning started from, ``after`` the long fine-tune, ``control`` the same
number of tokens trained at the start's short length. Each is scored window by window
(``spread.WindowBuckets``); the result holds per model ``bits_per_base``, ``bucket_bits_per_base``, each
bucket's standard error across windows and the per-window values; the change against ``before`` in percent
and per bucket (paired by window); the early against the late half of the window in words; the k-mer and
uniform baselines as context; and, when given, the ``context_ablation`` and ``copy_oracle`` blocks.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from megaseq.config import format_size
from megaseq.eval.spread import WindowBuckets, beyond_noise, paired_gain

UNIFORM_BITS = 2.0
ORDER = ("before", "after", "control")


def halves(count_N: np.ndarray) -> tuple[list[int], list[int]]:
    """The earlier and the later half of the buckets holding a real share of the scored tokens (a tenth of
    the largest bucket's); the middle bucket is left out when their number is odd."""
    scored = [int(i) for i in np.flatnonzero(count_N >= max(0.1 * count_N.max(), 1))]
    n = len(scored)
    return scored[:n // 2], scored[n - n // 2:]


def change_block(base: WindowBuckets, model: WindowBuckets, base_name: str, name: str) -> dict[str, Any]:
    """``model`` against ``base``: the change in percent, the gain per bucket (``base - model`` bits, paired by
    window, with its standard error), the gain in the earlier and the later half, and the words."""
    b_WN, m_WN = base.bucket_window_bits(), model.bucket_window_bits()
    b_all, m_all = base.summary()["bits_per_base"], model.summary()["bits_per_base"]
    gains = [paired_gain(b_WN[:, i], m_WN[:, i]) for i in range(base.num_buckets)]
    out: dict[str, Any] = {
        "model": name, "against": base_name, "percent": 100.0 * (b_all - m_all) / b_all if b_all > 0 else None,
        "gain": b_all - m_all, "bucket_gain": [g for g, _ in gains], "bucket_gain_se": [s for _, s in gains],
    }
    early, late = halves(base.arrays()[1].sum(axis=0))
    if early and late:
        e_W = base.window_bits(early) - model.window_bits(early)
        l_W = base.window_bits(late) - model.window_bits(late)
        out["early_buckets"], out["late_buckets"] = early, late
        out["early"], out["early_se"] = paired_gain(e_W, np.zeros_like(e_W))
        out["late"], out["late_se"] = paired_gain(l_W, np.zeros_like(l_W))
        out["late_minus_early"], out["late_minus_early_se"] = paired_gain(l_W, e_W)
    out["words"] = change_words(out, base.bucket_width)
    return out


def change_words(c: dict[str, Any], width: int) -> str:
    head = (f"{c['model']} against {c['against']}: {abs(c['percent']):.2f}% "
            f"{'fewer' if c['percent'] >= 0 else 'more'} bits per base on held-out data")
    if c.get("late_minus_early") is None:
        return head + "."
    d, se = c["late_minus_early"], c["late_minus_early_se"]
    span = lambda bs: f"{format_size(bs[0] * width)}-{format_size((bs[-1] + 1) * width)}"  # noqa: E731
    if not beyond_noise(d, se):
        trend = "the two differ by no more than the spread across windows"
    elif d > 0:
        trend = "the later positions, with more context before them, gain more, beyond the spread across windows"
    else:
        trend = "the earlier positions gain more, beyond the spread across windows"
    noise = f" (2 s.e. {2 * se:.4f})" if se is not None else " (spread unknown: one window)"
    return (f"{head}. Gain in the later half ({span(c['late_buckets'])}) {c['late']:+.4f} bits per base, in the "
            f"earlier half ({span(c['early_buckets'])}) {c['early']:+.4f}; late minus early {d:+.4f}{noise}: "
            f"{trend}.")


def protocol_result(models: Mapping[str, WindowBuckets], baseline: tuple[str, WindowBuckets] | None = None,
                    ablation: dict[str, Any] | None = None, oracle: dict[str, Any] | None = None,
                    descriptions: Mapping[str, str] | None = None) -> dict[str, Any]:
    """One JSON-ready result (see the module docstring). Every model and the baseline must have been scored on
    the same windows and tokens."""
    if not models:
        raise ValueError("the protocol's evaluation needs at least one model")
    first_name, first = next(iter(models.items()))
    everything = {**models, **({baseline[0]: baseline[1]} if baseline else {})}
    for name, r in everything.items():
        if (r.bucket_width, r.seq_len) != (first.bucket_width, first.seq_len) or \
                not np.array_equal(r.arrays()[1], first.arrays()[1]):
            raise ValueError(f"{name} was scored on other windows or tokens than {first_name}: evaluate every "
                             "model on the same held-out windows and eval.by_position")
    S, width = first.seq_len, first.bucket_width
    out: dict[str, Any] = {
        "unit": "base", "bucket_width": width, "seq_len": S, "num_windows": len(first.sum_nats),
        "buckets": [[i * width, min((i + 1) * width, S)] for i in range(first.num_buckets)],
        "model_names": list(models), "descriptions": dict(descriptions or {}),
        "models": {name: r.summary() for name, r in models.items()},
        "baselines": {"uniform": {"bits_per_base": UNIFORM_BITS}},
    }
    if baseline:
        out["baselines"]["kmer"] = {"name": baseline[0], **baseline[1].summary()}
    if "before" in models:
        out["change"] = {n: change_block(models["before"], models[n], "before", n) for n in models if n != "before"}
    if ablation is not None:
        out["context_ablation"] = ablation
    if oracle is not None:
        out["copy_oracle"] = oracle
    out["verdict"] = protocol_words(out)
    return out


def protocol_words(result: dict[str, Any]) -> list[str]:
    """Sentences for the report's top: each model against the baselines, the changes, the ablation."""
    lines = []
    kmer = result["baselines"].get("kmer")
    for name in result["model_names"]:
        bits = result["models"][name]["bits_per_base"]
        ref = f"; {kmer['name']} {kmer['bits_per_base']:.4f}" if kmer else ""
        lines.append(f"{name}: {bits:.4f} bits per base on held-out data (uniform A/C/G/T {UNIFORM_BITS:.1f}{ref}).")
    lines += [c["words"] for c in (result.get("change") or {}).values()]
    if result.get("context_ablation"):
        lines.append(result["context_ablation"]["words"])
    if result.get("copy_oracle"):
        o = result["copy_oracle"]
        lines.append(f"Copy oracle: {100 * o['overall_share_with_copy']:.2f}% of the scored positions have their "
                     f"preceding {o['k']}-mer more than {o['min_distance']:,} tokens earlier in the window; a copy "
                     f"model would score {o['overall_bits_per_base']:.4f} bits per base.")
    return lines
