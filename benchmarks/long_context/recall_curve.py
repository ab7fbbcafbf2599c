"""The DSA indexer's recall over a training run, from the run's own metrics: per full-indexer layer, the share of
the dense attention's top pools that the indexer picks (``indexer_recall/L``) beside random selection's expected
share on the same queries (``indexer_recall_random/L``), at init, at the end of the dense warm-up and at the end
of the run, with the curve by step.

    python benchmarks/long_context/recall_curve.py RUN_DIR_OR_METRICS_JSONL --out PREFIX

Writes ``PREFIX.json``, ``PREFIX.md`` and ``PREFIX.png``. The recall is measured on the step's own training
batch (``model.train_indexer``, ``docs/indexer.md``), so it is an in-sample figure; ``indexer_recall.py``
measures it on held-out windows.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from megaseq.train.loss_curve import read_metrics


def read_rows(path: Path) -> list[dict]:
    run_dir = path if path.is_dir() else path.parent
    if not (run_dir / "metrics.jsonl").is_file():
        raise SystemExit(f"{path}: no metrics.jsonl (pass a run directory or its metrics.jsonl)")
    steps, _ = read_metrics(run_dir)
    rows = [r for r in steps if "step" in r and any(k.startswith("indexer_recall/") for k in r)]
    if not rows:
        raise SystemExit(f"{run_dir / 'metrics.jsonl'}: no indexer_recall/L metrics (the run did not train its "
                         "indexer: model.train_indexer)")
    return rows


def layers_of(rows: list[dict]) -> list[int]:
    return sorted({int(k.split("/")[1]) for r in rows for k in r if k.startswith("indexer_recall/")})


def mean_over(rows: list[dict], key: str) -> float | None:
    vals = [r[key] for r in rows if r.get(key) is not None]
    return statistics.fmean(vals) if vals else None


def summarise(rows: list[dict], window: int = 10) -> dict:
    """Per layer: the recall and random baseline averaged over ``window`` steps at init, at the warm-up's end
    (the last steps with ``indexer_dense`` 1) and at the run's end."""
    dense = [r for r in rows if r.get("indexer_dense")]
    sparse = [r for r in rows if not r.get("indexer_dense")]
    stages = {"init": rows[:window], "after_warmup": dense[-window:] if dense else [],
              "end": sparse[-window:] if sparse else rows[-window:]}
    out: dict = {"steps": rows[-1]["step"], "warmup_steps": len(dense), "window": window, "layers": {}}
    for L in layers_of(rows):
        out["layers"][str(L)] = {
            stage: {"recall": mean_over(rs, f"indexer_recall/{L}"),
                    "random": mean_over(rs, f"indexer_recall_random/{L}"),
                    "steps": [rs[0]["step"], rs[-1]["step"]] if rs else None}
            for stage, rs in stages.items()}
    return out


def table(summary: dict) -> str:
    head = ("| layer | init (random) | end of the dense warm-up (random) | end of the run (random) | end / random |\n"
            "|---|---|---|---|---:|\n")
    lines = []
    for L, st in summary["layers"].items():
        cells = []
        for stage in ("init", "after_warmup", "end"):
            s = st[stage]
            cells.append("-" if s["recall"] is None else f"{s['recall']:.3f} ({s['random']:.3f})")
        end = st["end"]
        ratio = f"{end['recall'] / end['random']:.2f}x" if end["recall"] and end["random"] else "-"
        lines.append(f"| {L} | " + " | ".join(cells) + f" | {ratio} |")
    return head + "\n".join(lines) + "\n"


def plot(rows: list[dict], summary: dict, path: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    steps = [r["step"] for r in rows]
    for L in layers_of(rows):
        rec = [r.get(f"indexer_recall/{L}") for r in rows]
        rnd = [r.get(f"indexer_recall_random/{L}") for r in rows]
        line, = ax.plot(steps, rec, label=f"layer {L}: indexer", lw=1)
        ax.plot(steps, rnd, ls="--", color=line.get_color(), label=f"layer {L}: random", lw=1)
    if summary["warmup_steps"]:
        ax.axvline(summary["warmup_steps"] + 0.5, color="grey", lw=0.8)
        ax.text(summary["warmup_steps"] + 2, 0.02, "sparse stage", color="grey", fontsize=8)
    ax.set_xlabel("step")
    ax.set_ylabel("recall of the dense attention's top pools")
    ax.set_ylim(0, 1)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run", type=Path, help="a run directory or its metrics.jsonl")
    ap.add_argument("--out", type=Path, required=True, help="the output prefix: PREFIX.{json,md,png}")
    ap.add_argument("--window", type=int, default=10, help="steps averaged at each stage (default 10)")
    ap.add_argument("--title", default="", help="the plot's title (default: the run's path)")
    a = ap.parse_args(argv)
    rows = read_rows(a.run)
    summary = summarise(rows, a.window)
    summary["source"] = str(a.run)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.with_suffix(".json").write_text(json.dumps(summary, indent=1) + "\n")
    md = (f"# The DSA indexer's recall over {a.run}\n\n"
          f"{summary['steps']} steps, {summary['warmup_steps']} of them the dense warm-up; each cell is the mean of "
          f"{a.window} steps' recall on their own training batch, random selection's expected recall on the same "
          f"queries in brackets.\n\n" + table(summary))
    a.out.with_suffix(".md").write_text(md)
    plot(rows, summary, a.out.with_suffix(".png"), a.title or str(a.run))
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
