"""The longest sequence ``megaseq plan`` fits on one H200 for published configs, and what binds just past it,
with one source tree against another: how sequence segments for every family (softmax attention's K/V,
dense MLA's latent and gated DeltaNet's state carried) move each model's longest length.

    # one tree's rows (run once per tree: PYTHONPATH picks the megaseq it plans with)
    PYTHONPATH=src python benchmarks/memory/segment_plan_rows.py --label after \
        --out benchmarks/results/memory/segment_plan_rows.json
    # the table of two runs' rows
    python benchmarks/memory/segment_plan_rows.py --render before.json after.json \
        --out benchmarks/results/memory/segment_plan_rows.md

Assumptions (``benchmarks/memory/family_plan_rows.py``'s): one H200 = 139.8 GiB usable, 128 GB host RAM; model.dtype
bf16; LoRA rank 16 (alpha 32) on every projection with the base frozen in bf16 (``recipes/qwen3-30b-a3b-lora.yaml``),
full fine-tuning with ``model.weights bf16``; batch 1; the planner's own choice of memory schemes. The longest
length is searched in steps of 16K tokens (doubling from 16K, then bisection) up to 4M. Pure Python: nothing
runs on a GPU.
"""

from __future__ import annotations

import argparse
import json
import time
import warnings
from pathlib import Path
from typing import Any

from family_plan_rows import LORA, ROOT  # noqa: E402  (benchmarks/ is the script's directory)

from megaseq.models.spec import from_hf_config
from megaseq.plan import Mesh, plan
from megaseq.plan.fixes import Budgets
from megaseq.plan.mesh import GIB

K = 1024
STEP, LIMIT = 16 * K, 4 * K * K
MODELS = ("qwen3-30b-a3b", "kimi-linear-48b-a3b-instruct", "mixtral-8x7b-v0.1", "olmoe-1b-7b-0924",
          "qwen3-next-80b-a3b-instruct")


def _plan(spec: Any, seq: int, lora: bool):
    return plan(spec, seq, Mesh(), Budgets(), weights="fp32" if lora else "bf16", adapters=LORA if lora else None)


def longest(spec: Any, lora: bool) -> tuple[int, Any, Any]:
    """(the longest length that fits in steps of ``STEP``, its plan, the plan one step longer)."""
    def fits(m: int) -> bool:
        return _plan(spec, m * STEP, lora).fits

    if not fits(1):
        return 0, None, _plan(spec, STEP, lora)
    lo, cap = 1, LIMIT // STEP
    while lo * 2 <= cap and fits(lo * 2):
        lo *= 2
    hi = min(lo * 2, cap + 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo * STEP, _plan(spec, lo * STEP, lora), _plan(spec, hi * STEP, lora) if hi <= cap else None


def rows(models: list[str], label: str) -> list[dict[str, Any]]:
    out = []
    for model in models:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            spec = from_hf_config(ROOT / "recipes" / model / "config.json")
        for lora in (True, False):
            t = time.time()
            n, at, past = longest(spec, lora)
            r = {"label": label, "model": model, "training": "LoRA r16 (all)" if lora else "full (bf16 weights)",
                 "longest": n, "peak_gib": round(at.peak_gpu / GIB, 1) if at else None,
                 "fixes": [f[0] for f in at.fixes] if at else [],
                 "segment_tokens": at.memory["model_segment_tokens"] if at else 0,
                 "binding_past": past.binding if past else "", "past": n + STEP if past else None}
            out.append(r)
            print(f"{label} {model:32s} {r['training']:20s} longest {n // K}K, past it: {r['binding_past']} "
                  f"({time.time() - t:.0f}s)", flush=True)
    return out


def _len(n: int | None) -> str:
    if not n:
        return "none"
    return f"{n / (K * K):.3g}M" if n >= K * K else f"{n // K}K"


def render(before: list[dict[str, Any]], after: list[dict[str, Any]]) -> str:
    lines = ["| model (recipes/<dir>/config.json) | training, 1 H200 | before: longest (schemes) "
             "| before: binds past it | after: longest (schemes) | after: binds past it |", "|---|---|---|---|---|---|"]

    def cellof(r: dict[str, Any]) -> str:
        if not r["longest"]:
            return "none"
        seg = f" x {r['segment_tokens'] // K}K" if r["segment_tokens"] else ""
        return f"{_len(r['longest'])} ({r['peak_gib']} GiB; {', '.join(r['fixes']) or 'none'}{seg})"

    for a in after:
        b = next((r for r in before if r["model"] == a["model"] and r["training"] == a["training"]), None)
        lines.append(f"| {a['model']} | {a['training']} | {cellof(b) if b else 'n/a'} | "
                     f"{b['binding_past'] if b else ''} | {cellof(a)} | {a['binding_past']} |")
    lines += ["", "'binds past it': the binding component of the plan the planner reports 16K tokens past the longest "
              "(its closest candidate that does not fit). A longest length the same before and after means the "
              "planner's cheapest fitting set is unchanged: there, sequence segments' store (K/V or latents with "
              "their fp32 gradients) is larger than what recompute + SCO keep."]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="benchmarks/results/memory/segment_plan_rows.json")
    ap.add_argument("--label", default="after")
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--render", nargs=2, metavar=("BEFORE_JSON", "AFTER_JSON"), help="write the markdown table")
    args = ap.parse_args()
    if args.render:
        before, after = (json.loads(Path(p).read_text()) for p in args.render)
        text = render(before, after)
        Path(args.out).write_text(text)
        print(text)
        return
    result = rows(args.models.split(","), args.label)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
