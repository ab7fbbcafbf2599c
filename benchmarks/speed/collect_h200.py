"""Collect the H200 bench outputs of one run into benchmarks/results/speed/ (JSON + markdown + plot).

    python benchmarks/speed/collect_h200.py OUT1/bench_a.json OUT2/bench_b.json ... --out benchmarks/results/speed/NAME

Rows are taken as measured; each row's predicted peak is re-evaluated with this checkout's planner for
the memory plan the row ran (``memory_plan``), so the table states the committed planner's error (for a
one-step row, ``--steps 0``, its first-step peak: the optimizer state does not exist yet). Rows
listed in ``--drop`` (``LEN:SOURCE@FILE``) are left out with the reason in ``meta.dropped``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from megaseq.bench.measure import GIB
from megaseq.bench.report import write_outputs
from megaseq.models.presets import resolve_spec
from megaseq.plan.given import peak_for


def replan(model: str, row: dict, fp32_loss: bool) -> None:
    e = peak_for(resolve_spec(model), row["seq_len"], row["memory_plan"], loss_in_compute_dtype=not fp32_loss)
    row["predicted_at_run_gib"] = row.get("predicted_gpu_tensors_gib")
    cold = str(row.get("timed_steps", "")).startswith("1 (cold")  # --steps 0: the first step's peak
    row["predicted_gpu_tensors_gib"] = (e.first_step_tensors if cold else e.peak_tensors) / GIB
    row["predicted_is_first_step"] = cold
    row["predicted_gpu_gib"] = e.peak_gpu / GIB
    row["predicted_host_at_run_gb"] = row.get("predicted_host_gib")
    row["predicted_host_gib"] = e.peak_host / 1e9  # (GB, as the bench writes it)
    row["predicted_phase"] = e.phase


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("inputs", nargs="+")
    ap.add_argument("--out", required=True)
    ap.add_argument("--drop", action="append", default=[], help="LEN:SOURCE@FILENAME=why")
    ap.add_argument("--note", default="")
    ap.add_argument("--reference-from", default=None,
                    help="a bench JSON whose reference rows (and maximum lengths) to carry over")
    ap.add_argument("--fp32-loss", action="store_true",
                    help="the rows ran the loss in fp32 outside autocast (megaseq before 2026-11-29 13:00 UTC)")
    args = ap.parse_args()
    drops = {}
    for d in args.drop:
        key, why = d.split("=", 1)
        drops[key] = why
    result: dict = {"rows": [], "reference_rows": [], "meta": None}
    dropped = []
    for f in args.inputs:
        r = json.loads(Path(f).read_text())
        result["meta"] = result["meta"] or dict(r["meta"])
        for row in r["rows"]:
            key = f"{row['seq_len']}:{row['source']}@{Path(f).name}"
            if key in drops:
                dropped.append({"row": key, "why": drops[key]})
                continue
            if row.get("status") == "ok" and "memory_plan" in row:
                replan(r["meta"]["model"], row, args.fp32_loss)
            row["file"] = Path(f).name
            result["rows"].append(row)
        result["reference_rows"] += r.get("reference_rows", [])
        for k in ("max_len", "logprob_check"):
            if k in r:
                result[k] = r[k]
    if args.reference_from:
        old = json.loads(Path(args.reference_from).read_text())
        result["reference_rows"] += old.get("reference_rows", [])
        result["meta"]["reference_from"] = Path(args.reference_from).name
    result["meta"]["dropped"] = dropped
    result["meta"]["note"] = args.note
    result["meta"]["planner"] = "re-evaluated" + (" with the fp32 loss the rows ran" if args.fp32_loss else "")
    result["meta"]["lengths"] = sorted({row["seq_len"] for row in result["rows"]})
    write_outputs(result, Path(args.out))
    print(Path(args.out).with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
