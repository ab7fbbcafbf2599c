"""``RUN/loss_curve.png``: the training loss and the held-out loss against the step, beside the baselines.

Read from ``metrics.jsonl`` (step records have ``loss``, held-out records ``eval_loss``), in bits
per token (bits per base for DNA): the per-step training loss (light) and its running mean, the
held-out points of ``train.eval_every`` and the final evaluation, the k-mer baseline's held-out bits
and uniform A/C/G/T (2 bits) as horizontal lines. The y-axis covers the region that matters (the
loss after its first tenth of steps, the held-out points and the baselines): the first steps from
random weights (4 bits per base) would otherwise squash everything else, so they are clipped and
the legend says so.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

BITS = 1.0 / math.log(2)
CURVE_FILE = "loss_curve.png"


def read_metrics(run_dir: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(step records, held-out records) of a run's metrics.jsonl."""
    steps, evals = [], []
    path = Path(run_dir) / "metrics.jsonl"
    if path.is_file():
        for line in path.read_text().splitlines():
            if line.strip():
                rec = json.loads(line)
                (evals if "eval_loss" in rec else steps).append(rec)
    return steps, evals


def _running_mean(xs: list[float], width: int) -> list[float]:
    out, acc = [], 0.0
    for i, x in enumerate(xs):
        acc += x - (xs[i - width] if i >= width else 0.0)
        out.append(acc / min(i + 1, width))
    return out


def plot_loss_curve(run_dir: Path, unit: str = "token", final: dict[str, Any] | None = None) -> Path | None:
    """Draw ``RUN/loss_curve.png`` (atomically); ``final``: the end-of-run by-position report, whose
    'after' point and baselines are added. None when there is no step record yet."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    from megaseq.eval.report import save_figure

    steps, evals = read_metrics(run_dir)
    if not steps:
        return None
    xs = [r["step"] for r in steps]
    ys = [r["loss"] * BITS for r in steps]
    fig = Figure(figsize=(7, 4), dpi=120)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.plot(xs, ys, color="tab:blue", alpha=0.3, linewidth=0.8, label="training loss (per step)")
    smooth = _running_mean(ys, max(len(ys) // 20, 1))
    ax.plot(xs, smooth, color="tab:blue", label="training loss (running mean)")
    ex = [r["step"] for r in evals]
    ey = [r["eval_loss"] * BITS for r in evals]
    base_bits = next((r.get(f"eval_baseline_bits_per_{unit}") for r in evals
                      if r.get(f"eval_baseline_bits_per_{unit}") is not None), None)
    base_name = next((r.get("eval_baseline") for r in evals if r.get("eval_baseline")), "k-mer")
    if final is not None:
        ex.append(xs[-1])
        ey.append(final["models"]["after"][f"bits_per_{final['unit']}"])
        if final.get("baseline"):
            base_name = final["baseline"]
            base_bits = final["models"][base_name][f"bits_per_{final['unit']}"]
    if ex:
        ax.plot(ex, ey, "o-", color="tab:red", markersize=4, label="held-out loss")
    refs = []
    if base_bits is not None:
        ax.axhline(base_bits, color="tab:orange", linestyle="--", label=f"{base_name} on held-out: {base_bits:.3f}")
        refs.append(base_bits)
    if unit == "base":
        ax.axhline(2.0, color="gray", linestyle=":", label="uniform A/C/G/T: 2.000")
        refs.append(2.0)
    later = ys[len(ys) // 10:] or ys
    lo = min(later + ey + refs)
    hi = max(later + ey + refs)
    pad = max(0.1 * (hi - lo), 0.01)
    if max(ys) > hi + pad:
        ax.plot([], [], " ", label="(the first steps are above the scale)")
    ax.set_ylim(lo - pad, hi + pad)
    ax.set_xlabel("step")
    ax.set_ylabel(f"bits per {unit}")
    ax.set_title(f"{Path(run_dir).name}: loss against step", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return save_figure(fig, Path(run_dir) / CURVE_FILE)
