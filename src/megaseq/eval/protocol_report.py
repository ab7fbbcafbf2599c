"""The protocol's result (``protocol.protocol_result``) as JSON, markdown and a plot a biologist can read.

The plot has up to three panels sharing the position axis: bits per base by position for every model
with a band of two standard errors across windows, the k-mer and uniform baselines as context; each
model's gain over ``before``, its band the spread of the per-window differences; and the context
ablation's two arms. Every line and every band is named in its panel's legend.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from megaseq.eval.report import save_figure, write_atomic, write_json

STEM = "eval_protocol"


def _nan(v: list[float | None]) -> list[float]:
    return [float("nan") if x is None else x for x in v]


def _line_band(ax: Any, xs: list[float], ys: list[float | None], se: list[float | None], label: str,
               band_label: str) -> None:
    """A line and, in its colour, the band of two standard errors around it; both named in the legend."""
    y, s = _nan(ys), _nan(se)
    (line,) = ax.plot(xs, y, "-o", markersize=3, label=label)
    ax.fill_between(xs, [a - 2 * b for a, b in zip(y, s)], [a + 2 * b for a, b in zip(y, s)], alpha=0.18,
                    color=line.get_color(), label=band_label)


def plot_protocol(result: dict[str, Any], path: str | Path) -> Path:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    scale, unit = (1024, "thousands of bases") if result["seq_len"] >= 8192 else (1, "bases")
    mids = [(a + b) / 2 / scale for a, b in result["buckets"]]
    panels = 1 + bool(result.get("change")) + bool(result.get("context_ablation"))
    fig = Figure(figsize=(8, 3.4 * panels), dpi=120)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(panels, 1, 1)
    for name in result["model_names"]:
        m = result["models"][name]
        _line_band(ax, mids, m["bucket_bits_per_base"], m["bucket_se"],
                   f"{name}: {m['bits_per_base']:.3f} bits per base overall",
                   f"{name}: 2 standard errors across windows")
    kmer = result["baselines"].get("kmer")
    if kmer:
        ax.plot(mids, _nan(kmer["bucket_bits_per_base"]), "--x", markersize=3, color="gray",
                label=f"{kmer['name']} (short-context baseline): {kmer['bits_per_base']:.3f}")
    ax.axhline(2.0, color="black", linestyle=":", label="uniform A/C/G/T: 2 bits (knows nothing)")
    oracle = result.get("copy_oracle")
    if oracle:
        ax.plot(mids, _nan(oracle["bits_per_base"]), ":s", markersize=3, color="purple",
                label=f"copy oracle (earlier {oracle['k']}-mer > {oracle['min_distance']:,} back): "
                      f"{oracle['overall_bits_per_base']:.3f}")
    ax.set_ylabel("bits per base (lower is better)")
    ax.set_title("Held-out genomes: bits per base by position in the window", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6)
    i = 2
    if result.get("change"):
        gx = fig.add_subplot(panels, 1, i, sharex=ax)
        i += 1
        for name, c in result["change"].items():
            _line_band(gx, mids, c["bucket_gain"], c["bucket_gain_se"],
                       f"{name} vs {c['against']}: {c['percent']:+.2f}% fewer bits overall",
                       f"{name}: 2 standard errors of the gain (paired by window)")
        gx.axhline(0.0, color="black", linewidth=0.8)
        gx.set_ylabel("gain over before\n(bits per base; > 0: better)")
        gx.grid(alpha=0.3)
        gx.legend(fontsize=6)
    abl = result.get("context_ablation")
    if abl:
        cx = fig.add_subplot(panels, 1, i, sharex=ax)
        xs = [mids[b] for b in abl["buckets"]]
        for arm, label in (("full", "full context"), ("cut", f"context cut to {abl['cut_to']:,} tokens")):
            _line_band(cx, xs, abl[f"bits_per_base_{arm}"], abl[f"bits_per_base_{arm}_se"],
                       f"{abl['model']}, {label}", f"{label}: 2 standard errors across windows")
        cx.set_ylabel("context ablation:\nbits per base, same tokens")
        cx.grid(alpha=0.3)
        cx.legend(fontsize=6)
    fig.axes[-1].set_xlabel(f"position in window ({unit}), buckets of {result['bucket_width']:,}")
    fig.tight_layout()
    return save_figure(fig, path)


def _f(v: float | None) -> str:
    return "-" if v is None else f"{v:.4f}"


def protocol_markdown(result: dict[str, Any]) -> str:
    lines = [f"- {v}" for v in result["verdict"]] + [""]
    for group, r in (result.get("groups") or {}).items():
        lines += [f"**{group}** ({r['num_windows']} windows):", ""] + [f"- {v}" for v in r["verdict"]] + [""]
    names = result["model_names"]
    kmer = result["baselines"].get("kmer")
    head = ["positions", *names] + ([kmer["name"]] if kmer else []) + [f"{n} gain" for n in result.get("change", {})]
    lines += ["Bits per base by position (± two standard errors across windows); gain = before - model.", "",
              "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for i, (a, b) in enumerate(result["buckets"]):
        cells = [f"{a:,}-{b:,}"]
        for n in names:
            m = result["models"][n]
            se = m["bucket_se"][i]
            cells.append(_f(m["bucket_bits_per_base"][i]) + ("" if se is None else f" ± {2 * se:.4f}"))
        cells += [_f(kmer["bucket_bits_per_base"][i])] if kmer else []
        cells += [_f(c["bucket_gain"][i]) for c in result.get("change", {}).values()]
        lines.append("| " + " | ".join(cells) + " |")
    abl = result.get("context_ablation")
    if abl:
        lines += ["", f"Context ablation ({abl['model']}, cut to {abl['cut_to']:,} tokens):", "",
                  "| bucket | full | cut | cut - full |", "|---|---|---|---|"]
        for j, bkt in enumerate(abl["buckets"]):
            a, b = result["buckets"][bkt]
            se = abl["context_gain_se"][j]
            lines.append(f"| {a:,}-{b:,} | {_f(abl['bits_per_base_full'][j])} | {_f(abl['bits_per_base_cut'][j])} | "
                         f"{_f(abl['context_gain'][j])}{'' if se is None else f' ± {2 * se:.4f}'} |")
    return "\n".join(lines) + "\n"


def write_protocol_report(result: dict[str, Any], out_dir: str | Path, stem: str = STEM) -> dict[str, Path]:
    """``out_dir/stem.json``, ``.md`` and ``.png``; returns the paths by kind."""
    out_dir = Path(out_dir)
    return {"json": write_json(out_dir / f"{stem}.json", result),
            "md": write_atomic(out_dir / f"{stem}.md", protocol_markdown(result)),
            "png": plot_protocol(result, out_dir / f"{stem}.png")}
