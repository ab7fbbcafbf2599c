"""The planner's error on every measured row: each ``megaseq bench`` result under benchmarks/results/ (a JSON with
``meta`` and ``rows`` holding ``memory_plan`` and ``measured_gpu_gib``) planned again with this checkout's planner
for the memory plan the row ran, against its measured peak (``torch.cuda.max_memory_allocated``, and the host's
resident set where measured).

    PYTHONPATH=src python benchmarks/memory/planner_error.py            # the markdown table (stdout)
    PYTHONPATH=src python benchmarks/memory/planner_error.py --write    # ... into docs/planner.md, and the JSON

Each row is planned as ``megaseq train`` plans it (``plan_from_config`` on one H200 with ``memory.auto`` false and
the row's settings), from the row's recipe (``meta.recipe`` where the bench recorded it; else a LoRA run's
``*_lora.json`` beside it names the LoRA recipe; else ``meta.model``) with its ``meta`` dtype, weights and kernels.
A one-step row (``--steps 0``) is compared with the plan's first-step peak (no optimizer state before the first
update). Rows that did not run (``status`` not ok) are left out. The error is ``plan / measured - 1``: positive when
the plan over-predicts."""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
DOC = ROOT / "docs" / "planner.md"
OUT = RESULTS / "memory" / "planner_error.json"
BEGIN, END = "<!-- planner-error table: begin -->", "<!-- planner-error table: end -->"
GIB = 1 << 30


def bench_files() -> list[Path]:
    """Every bench result JSON (``meta`` + ``rows`` with a memory plan and a measured peak): the published ones,
    and those under a ``runs/`` folder whose ``meta`` records the settings the planner needs (dtype, weights,
    kernels; older runs ran other code with settings the recipe no longer has, and are left out)."""
    out = []
    for f in sorted(RESULTS.rglob("*.json")):
        try:
            d = json.loads(f.read_text())
        except ValueError:
            continue
        if not isinstance(d, dict) or "meta" not in d:
            continue
        if "runs" in f.relative_to(RESULTS).parts and not {"dtype", "weights", "kernels"} <= set(d["meta"]):
            continue
        if any(
                isinstance(r, dict) and "memory_plan" in r and "measured_gpu_gib" in r for r in d.get("rows", [])):
            out.append(f)
    return out


def recipe_of(f: Path, meta: dict[str, Any]) -> tuple[str | None, dict[str, Any]]:
    """(recipe path or None, overrides) of a bench file: its LoRA sibling's recipe, else ``meta.model`` as a
    path, a recipe name under recipes/ or a preset name; ``meta``'s dtype / weights / kernels as overrides."""
    over = {f"model.{k}": meta[k] for k in ("dtype", "weights", "kernels") if k in meta}
    if meta.get("recipe"):  # recorded by megaseq bench from a YAML recipe
        over.update(dict(o.split("=", 1) for o in meta.get("overrides", [])))
        return str(ROOT / meta["recipe"]), over
    lora = f.with_name(f.stem + "_lora.json")
    if lora.is_file():
        d = json.loads(lora.read_text())
        over.update(dict(o.split("=", 1) for o in d.get("overrides", [])))
        return str(ROOT / d["recipe"]), over
    model = meta["model"]
    for cand in (ROOT / model, ROOT / "recipes" / f"{model}.yaml"):
        if cand.is_file():
            return str(cand), over
    return None, {"model.name": model, **over}


def replan(recipe: str | None, over: dict[str, Any], row: dict[str, Any]) -> tuple[float, float]:
    """(planned GPU tensors GiB, planned host GB per host) for one row's length and memory settings."""
    from megaseq.config import load_config
    from megaseq.plan.planner import plan_from_config

    memory = {f"memory.{k}": v for k, v in row["memory_plan"].items()}
    cfg = load_config(recipe, {**over, **memory, "memory.auto": False, "data.seq_len": row["seq_len"]})
    p = plan_from_config(cfg, world_size=1, gpus_per_host=1, device_type=None, explain=False)
    cold = str(row.get("timed_steps", "")).startswith("1 (cold")
    return (p.first_step_gpu_tensors if cold else p.peak_gpu_tensors) / GIB, p.peak_host / 1e9


def rows() -> list[dict[str, Any]]:
    out = []
    for f in bench_files():
        d = json.loads(f.read_text())
        meta = d["meta"]
        recipe, over = recipe_of(f, meta)
        for r in d["rows"]:
            if r.get("status") != "ok" or "memory_plan" not in r or r.get("system", "megaseq") != "megaseq":
                continue
            row_over = {**over, **dict(o.split("=", 1) for o in r.get("overrides", []))}  # a row's own settings
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    gpu, host = replan(recipe, row_over, r)
            except ValueError as e:  # a setting this checkout no longer has: said, not hidden
                out.append({"file": str(f.relative_to(ROOT)), "seq_len": r["seq_len"], "error": str(e)[:120]})
                continue
            row = {"file": str(f.relative_to(ROOT)), "model": meta["model"], "date": meta.get("date", "")[:10],
                   "seq_len": r["seq_len"], "fixes": r.get("fixes", []), "measured_gpu_gib": r["measured_gpu_gib"],
                   "planned_gpu_gib": gpu, "gpu_error": gpu / r["measured_gpu_gib"] - 1}
            if r.get("measured_host_gib"):
                row.update(measured_host_gb=r["measured_host_gib"], planned_host_gb=host,
                           host_error=host / r["measured_host_gib"] - 1)
            out.append(row)
    return out


def _len(n: int) -> str:
    return f"{n >> 20}M" if n % (1 << 20) == 0 else f"{n >> 10}K"


def table(found: list[dict[str, Any]]) -> str:
    """One line per distinct measurement (the same setting measured again in other files: counted, the first
    file linked)."""
    lines = ["| result file (repeats) | model | date | length | fixes | measured GPU GiB | planned GiB | error | "
             "host measured / planned GB | host error |", "|---|---|---|---|---|---:|---:|---:|---|---:|"]
    seen: dict[tuple, list[dict[str, Any]]] = {}
    for r in found:
        key = (r.get("model"), r["seq_len"], round(r.get("measured_gpu_gib", 0), 1),
               round(r.get("planned_gpu_gib", 0), 1))
        seen.setdefault(key, []).append(r)
    for group in seen.values():
        r = group[0]
        link = f"[{Path(r['file']).name}](../{r['file']})" + (f" (x{len(group)})" if len(group) > 1 else "")
        if "error" in r:
            lines.append(f"| {link} | | | {_len(r['seq_len'])} | not planned: {r['error']} | | | | | |")
            continue
        host = (f"{r['measured_host_gb']:.2f} / {r['planned_host_gb']:.2f} | {r['host_error']:+.1%}"
                if "host_error" in r else " | ")
        lines.append(f"| {link} | {r['model']} | {r['date']} | {_len(r['seq_len'])} | {', '.join(r['fixes']) or '-'} "
                     f"| {r['measured_gpu_gib']:.1f} | {r['planned_gpu_gib']:.1f} | {r['gpu_error']:+.1%} | {host} |")
    errs = [abs(g[0]["gpu_error"]) for g in seen.values() if "gpu_error" in g[0]]
    within = sum(e <= 0.05 for e in errs)
    lines.append("")
    lines.append(f"{len(errs)} distinct measurements: the GPU plan within 5% of the measured peak on {within}, "
                 f"largest error {max(errs):.1%}." if errs else "no rows")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--write", action="store_true", help="write the table into docs/planner.md and the JSON")
    args = ap.parse_args()
    found = rows()
    text = table(found)
    print(text)
    if args.write:
        OUT.write_text(json.dumps(found, indent=1) + "\n")
        doc = DOC.read_text()
        if BEGIN not in doc:
            raise SystemExit(f"{DOC} has no '{BEGIN}' ... '{END}' block to fill")
        head, rest = doc.split(BEGIN, 1)
        DOC.write_text(head + BEGIN + "\n" + text + "\n" + END + rest.split(END, 1)[1])
    return 0


if __name__ == "__main__":
    sys.exit(main())
