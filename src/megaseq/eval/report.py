"""Write a by-position result (``by_position.compare``) as JSON, a markdown table and a PNG plot.

Every file is written atomically (a temporary file in the same directory, then ``os.replace``),
so a crash never leaves a half-written report that a later step would trust. The plot uses
matplotlib's Agg canvas directly (no pyplot, no global backend switch), so it works headless
and does not disturb a caller's own figures.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any


def write_atomic(path: str | Path, data: str | bytes) -> Path:
    """Write ``data`` to ``path`` through a temporary file in the same directory and a rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    raw = data.encode() if isinstance(data, str) else data
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(raw)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def write_json(path: str | Path, obj: Any) -> Path:
    return write_atomic(path, json.dumps(obj, indent=2, allow_nan=False) + "\n")


def _size(n: int) -> str:
    """32768 -> '32K', 1048576 -> '1M' (exact multiples only)."""
    for suffix, mult in (("M", 1 << 20), ("K", 1 << 10)):
        if n and n % mult == 0:
            return f"{n // mult}{suffix}"
    return str(n)


def _fmt(v: float | None, digits: int = 4) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def markdown_table(result: dict[str, Any]) -> str:
    """Loss per position bucket (bits per base or token) for every model, the baseline, and the change."""
    unit = result["unit"]
    key = f"bucket_bits_per_{unit}"
    names = list(result["models"])
    rel = result.get("relative_improvement")
    head = ["positions", *names] + ([f"{rel['after']} vs {rel['before']}"] if rel else [])
    lines = [f"Held-out bits per {unit} by position ({result['num_windows']} windows of "
             f"{_size(result['seq_len'])}, {result['tokens']:,} scored tokens, buckets of "
             f"{_size(result['bucket_width'])}).", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for i, (start, end) in enumerate(result["buckets"]):
        row = [f"{_size(start)}-{_size(end)}"] + [_fmt(result["models"][n][key][i]) for n in names]
        if rel:
            row.append("-" if rel["buckets"][i] is None else f"{100 * rel['buckets'][i]:+.2f}%")
        lines.append("| " + " | ".join(row) + " |")
    overall = ["all"] + [_fmt(result["models"][n][f"bits_per_{unit}"]) for n in names]
    if rel:
        overall.append("-" if rel["overall"] is None else f"{100 * rel['overall']:+.2f}%")
    lines.append("| " + " | ".join(overall) + " |")
    return "\n".join(lines) + "\n"


def plot_by_position(result: dict[str, Any], path: str | Path) -> Path:
    """Loss vs position: one line per model, the baseline dashed; PNG written atomically."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    unit = result["unit"]
    mids = [(a + b) / 2 for a, b in result["buckets"]]
    fig = Figure(figsize=(7, 4), dpi=120)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for name, entry in result["models"].items():
        ys = [float("nan") if v is None else v for v in entry[f"bucket_bits_per_{unit}"]]
        dashed = name == result.get("baseline")
        ax.plot(mids, ys, "--" if dashed else "-", marker="x" if dashed else "o", markersize=3,
                label=f"{name} ({entry[f'bits_per_{unit}']:.3f})")
    ax.set_xlabel("position in window (tokens)")
    ax.set_ylabel(f"bits per {unit}")
    ax.set_title(f"held-out loss by position (buckets of {_size(result['bucket_width'])})")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".png", dir=path.parent)
    os.close(fd)
    try:
        fig.savefig(tmp, format="png")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def write_report(result: dict[str, Any], out_dir: str | Path,
                 stem: str = "eval_by_position") -> dict[str, Path]:
    """``out_dir/stem.json``, ``.md`` and ``.png``; returns the paths by kind."""
    out_dir = Path(out_dir)
    return {
        "json": write_json(out_dir / f"{stem}.json", result),
        "md": write_atomic(out_dir / f"{stem}.md", markdown_table(result)),
        "png": plot_by_position(result, out_dir / f"{stem}.png"),
    }
