"""Write a by-position result (``by_position.compare``) as JSON, a markdown table and a PNG plot.

Every file is written atomically (``files.write_atomic``: a temporary file in the same directory, then
``os.replace``), so a crash never leaves a half-written report that a later step would trust. The plot uses
matplotlib's Agg canvas directly (no pyplot, no global backend switch), so it works headless
and does not disturb a caller's own figures.
"""

from __future__ import annotations

import io
import json
import os
from pathlib import Path
from typing import Any

from megaseq.config import format_size
from megaseq.files import write_atomic


def write_json(path: str | os.PathLike[str], obj: Any) -> Path:
    return write_atomic(path, json.dumps(obj, indent=2, allow_nan=False) + "\n")


def _fmt(v: float | None, digits: int = 4) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def _gain(v: float | None) -> str:
    return "-" if v is None else f"{v:+.4f}"


def _label(result: dict[str, Any], name: str) -> str:
    desc = (result.get("descriptions") or {}).get(name)
    return f"{name} ({desc})" if desc else name


def summary_table(result: dict[str, Any]) -> list[str]:
    """Each model and baseline overall, with its gain over the k-mer baseline and over uniform A/C/G/T."""
    unit, base, uniform = result["unit"], result.get("baseline"), result.get("uniform_bits")
    head = ["", f"bits per {unit}"] + ([f"gain over {base}"] if base else []) + \
        (["gain over uniform A/C/G/T"] if uniform is not None else [])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    base_bits = result["models"][base][f"bits_per_{unit}"] if base else None
    rows = [(_label(result, n), result["models"][n][f"bits_per_{unit}"]) for n in result["model_names"]]
    if base:
        rows.append((f"{base} (baseline)", base_bits))
    if uniform is not None:
        rows.append(("uniform A/C/G/T (baseline)", uniform))
    for label, bits in rows:
        own = label.endswith("(baseline)")
        row = [label, _fmt(bits)] + ([_gain(base_bits - bits) if label != f"{base} (baseline)" else "-"]
                                     if base else []) + \
            ([_gain(uniform - bits) if not (own and label.startswith("uniform")) else "-"]
             if uniform is not None else [])
        lines.append("| " + " | ".join(row) + " |")
    return lines


def group_table(result: dict[str, Any]) -> list[str]:
    """Bits per base (token) per held-out group (file, or file and context kind), when there are several."""
    unit, base = result["unit"], result.get("baseline")
    names = list(result["model_names"])
    groups = list(result["models"][names[0]]["groups"])
    if len(groups) < 2:
        return []
    key = f"bits_per_{unit}"
    head = ["held-out group", "scored tokens", *names] + ([base] + [f"gain of {n} over {base}" for n in names]
                                                         if base else [])
    lines = ["By held-out group:", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for g in groups:
        bits = {n: result["models"][n]["groups"][g][key] for n in names + ([base] if base else [])}
        cells = [g, f"{result['models'][names[0]]['groups'][g]['tokens']:,}"] + [_fmt(bits[n]) for n in names]
        if base:
            cells += [_fmt(bits[base])] + [_gain(bits[base] - bits[n]) for n in names]
        lines.append("| " + " | ".join(cells) + " |")
    return lines + [""]


def markdown_table(result: dict[str, Any]) -> str:
    """The verdict in words, the summary against the baselines, then bits per base (or token) by position:
    every model, the baselines, each model's gain over the k-mer baseline, and after vs before where
    'before' is a real model."""
    from megaseq.eval.verdict import headline

    unit, base, uniform = result["unit"], result.get("baseline"), result.get("uniform_bits")
    key = f"bucket_bits_per_{unit}"
    names = list(result["model_names"])
    rel = result.get("relative_improvement")
    gains = result.get("gain_over_baseline") or {}
    head = ["positions", *names] + ([base] if base else []) + (["uniform"] if uniform is not None else []) + \
        [f"gain of {n} over {base}" for n in names if n in gains] + \
        ([f"{rel['after']} vs {rel['before']}"] if rel else [])
    lines = [f"**{headline(result)}.**", ""] + [f"- {v}" for v in result.get("verdict", [])[1:]] + [""]
    lines += summary_table(result) + [""] + group_table(result)
    lines += [f"Held-out bits per {unit} by position ({result['num_windows']} windows of "
              f"{format_size(result['seq_len'])}, {result['tokens']:,} scored tokens, buckets of "
              f"{format_size(result['bucket_width'])}). Gain = baseline - model: positive where the model is better.",
              "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]

    def row(label: str, i: int | None) -> str:
        def bits(n: str) -> float | None:
            return result["models"][n][key][i] if i is not None else result["models"][n][f"bits_per_{unit}"]

        cells = [label] + [_fmt(bits(n)) for n in names] + ([_fmt(bits(base))] if base else [])
        empty = i is not None and not result["models"][names[0]]["bucket_tokens"][i]  # context-only positions
        cells += [_fmt(None if empty else uniform)] if uniform is not None else []
        cells += [_gain(gains[n]["buckets"][i] if i is not None else gains[n]["overall"]) for n in names
                  if n in gains]
        if rel:
            v = rel["buckets"][i] if i is not None else rel["overall"]
            cells.append("-" if v is None else f"{100 * v:+.2f}%")
        return "| " + " | ".join(cells) + " |"

    lines += [row(f"{format_size(a)}-{format_size(b)}", i) for i, (a, b) in enumerate(result["buckets"])]
    lines.append(row("all", None))
    return "\n".join(lines) + "\n"


def _values(result: dict[str, Any], name: str) -> list[float]:
    return [float("nan") if v is None else v for v in result["models"][name][f"bucket_bits_per_{result['unit']}"]]


def _y_range(result: dict[str, Any]) -> tuple[float, float]:
    """The region that matters: the main model, the baseline and uniform A/C/G/T, widened to take in the other
    models (a 'before') unless that would squeeze the region into under a quarter of the height; then the far
    line is drawn clipped, its legend saying so. Padded by at least 2% of the level (0.01 bits at least), so a
    single bucket, or models a few hundredths apart, still read as separate lines on a visible scale."""
    from megaseq.eval.verdict import main_model

    main = main_model(result)
    core = [v for v in _values(result, main) if v == v]
    if result.get("baseline"):
        core += [v for v in _values(result, result["baseline"]) if v == v]
    if result.get("uniform_bits") is not None:
        core.append(result["uniform_bits"])
    lo, hi = min(core), max(core)
    floor = max(0.02 * max(abs(lo), abs(hi)), 0.01)
    limit = 4 * max(hi - lo, floor)
    for name in result["model_names"]:
        others = [v for v in _values(result, name) if v == v] if name != main else []
        if others and max(hi, *others) - min(lo, *others) <= limit:
            lo, hi = min(lo, *others), max(hi, *others)
    pad = max(0.15 * (hi - lo), floor / 2)
    return lo - pad, hi + pad


def band_label(name: str) -> str:
    """The legend entry of a model's shaded band of its gain over the baseline."""
    return f"{name}: gain +/- 2 standard errors"


def plot_by_position(result: dict[str, Any], path: str | Path) -> Path:
    """Top: bits per base (token) vs position, one line per model, the k-mer baseline dashed and uniform
    A/C/G/T dotted, scaled to the region that matters (``_y_range``). Bottom (with a baseline): each
    model's gain over the baseline by position, zero marked. PNG written atomically."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    from megaseq.eval.verdict import headline

    unit, base, uniform = result["unit"], result.get("baseline"), result.get("uniform_bits")
    mids = [(a + b) / 2 for a, b in result["buckets"]]
    gains = result.get("gain_over_baseline") or {}
    fig = Figure(figsize=(7.5, 6.5 if gains else 4.2), dpi=120)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(211) if gains else fig.add_subplot()
    lo, hi = _y_range(result)
    for name in result["model_names"] + ([base] if base else []):
        ys = _values(result, name)
        dashed = name == base
        off = any(v == v and not lo <= v <= hi for v in ys)
        label = f"{_label(result, name)}: {result['models'][name][f'bits_per_{unit}']:.3f}"
        ax.plot(mids, [min(max(v, lo), hi) if v == v else v for v in ys], "--" if dashed else "-",
                marker="x" if dashed else "o", markersize=3,
                label=label + (" (off the scale, clipped)" if off else "") + (" (baseline)" if dashed else ""))
    if uniform is not None:
        ax.axhline(uniform, color="gray", linestyle=":", label=f"uniform A/C/G/T: {uniform:.3f} (baseline)")
    ax.set_ylim(lo, hi)
    ax.set_ylabel(f"bits per {unit}")
    ax.set_title(headline(result), fontsize=8)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    if gains:
        gx = fig.add_subplot(212, sharex=ax)
        for name, g in gains.items():
            ys = [float("nan") if v is None else v for v in g["buckets"]]
            gx.plot(mids, ys, "-o", markersize=3, label=f"{name}: {g['overall']:+.4f} overall")
            se = [float("nan") if s is None else 2 * s for s in g["buckets_se"]]
            gx.fill_between(mids, [y - s for y, s in zip(ys, se)], [y + s for y, s in zip(ys, se)], alpha=0.15,
                            label=band_label(name))
        gx.axhline(0.0, color="black", linewidth=0.8)
        gx.set_ylabel(f"gain over {base}\n(bits per {unit}; > 0: better)")
        gx.grid(alpha=0.3)
        gx.legend(fontsize=7)
        gx.set_xlabel(f"position in window (tokens), buckets of {format_size(result['bucket_width'])}")
    else:
        ax.set_xlabel(f"position in window (tokens), buckets of {format_size(result['bucket_width'])}")
    fig.tight_layout()
    return save_figure(fig, path)


def save_figure(fig: Any, path: str | os.PathLike[str]) -> Path:
    """Save a matplotlib Figure as PNG (rendered in memory, written with ``files.write_atomic``)."""
    png = io.BytesIO()
    fig.savefig(png, format="png")
    return write_atomic(path, png.getvalue())


def write_report(result: dict[str, Any], out_dir: str | Path,
                 stem: str = "eval_by_position") -> dict[str, Path]:
    """``out_dir/stem.json``, ``.md`` and ``.png``; returns the paths by kind."""
    out_dir = Path(out_dir)
    return {
        "json": write_json(out_dir / f"{stem}.json", result),
        "md": write_atomic(out_dir / f"{stem}.md", markdown_table(result)),
        "png": plot_by_position(result, out_dir / f"{stem}.png"),
    }
