"""Which published model fits where: ``megaseq plan`` on every recipes/<model>/config.json, on 1, 8 and 64
H200 (FSDP over every GPU beyond one; on 64 also with expert parallelism 8), full fine-tuning and LoRA, at
32K, 128K and the longest length that fits (docs/models.md's table).

    python benchmarks/memory/family_plan_rows.py --out benchmarks/results/memory/family_plan_rows.json

Arithmetic assumptions (the planner's, ``docs/planner.md``): one H200 = 139.8 GiB usable; 128 GB of host RAM
per GPU, 8 GPUs a host (1 TB per 8-GPU host); ``model.dtype bf16``; full fine-tuning with ``model.weights
bf16`` (bf16 weights and gradients, MasterAdamW's fp32 master + moments, or OffloadStreamAdamW on the host
when the planner chooses it); LoRA rank 16 (alpha 32) on every projection (``lora.targets all``: token
mixers, dense MLPs, shared and routed experts) with the base frozen in bf16; batch 1, one micro-batch;
``parallel.fsdp dp_cp`` (parameters, gradients and optimizer state sharded over all GPUs) with the largest
context-parallel size <= the GPU count that splits the model's heads (Ulysses), the rest data parallel;
``ep 8``: experts split over 8 GPUs (PipelinedLLEP, planned at its routing-independent bound), the rest of the
state replicated (FSDP does not run with expert parallelism: ``parallel.fsdp`` needs ``parallel.ep 1``). The
memory schemes are the planner's choice (the cheapest set that fits); a family that refuses expert
parallelism gets no ep 8 column (n/a). The longest length
is searched in multiples of 1024 x cp up to 4M tokens (doubling, then three bisection steps: a lower
bound within 1/8 of the true longest). Pure Python: the planner only, nothing runs on a GPU; the MLA and
GDN terms are checked against the CPU blocks (tests/plan/test_plan_families.py), not yet against an H200.
"""

from __future__ import annotations

import argparse
import json
import time
import warnings
from pathlib import Path
from typing import Any

from megaseq.config import AdapterSettings, LoraConfig
from megaseq.models.spec import from_hf_config
from megaseq.plan import Mesh, plan
from megaseq.plan.fixes import Budgets
from megaseq.plan.given import validate_mesh
from megaseq.plan.mesh import GB, GIB

K = 1024
ROOT = Path(__file__).resolve().parents[2]
LIMIT = 4 * K * K
LENGTHS = {"32K": 32 * K, "128K": 128 * K}
LORA = AdapterSettings(LoraConfig(rank=16, alpha=32.0, targets=["all"]), frozen_dtype="bf16")


def meshes(spec: Any) -> list[tuple[str, Mesh]]:
    """(label, mesh) per GPU count: 1 GPU; 8 and 64 with FSDP and the largest cp that splits the heads; 64 with
    ep 8 (when 8 divides the experts) and the largest cp that fits beside it."""
    def largest_cp(world: int, cap: int) -> int:
        for cp in (64, 32, 16, 8, 4, 2, 1):
            if cp <= cap and world % cp == 0:
                try:
                    validate_mesh(spec, 1 << 20, Mesh(cp=cp))
                    return cp
                except ValueError:
                    continue
        return 1

    out = [("1 GPU", Mesh())]
    for n in (8, 64):
        cp = largest_cp(n, n)
        out.append((f"{n} GPUs", Mesh(dp=n // cp, cp=cp, gpus_per_host=8, fsdp="dp_cp")))
    if spec.num_experts and spec.num_experts % 8 == 0:
        cp = largest_cp(8, 8)
        # FSDP does not run with expert parallelism (parallel.fsdp needs parallel.ep 1): replicated state
        ep = Mesh(dp=8 // cp, ep=8, cp=cp, gpus_per_host=8)
        try:
            validate_mesh(spec, 32 * K, ep)
            out.append(("64 GPUs, ep 8", ep))
        except ValueError:  # a family without expert parallelism (gpt-oss: its experts' biases): n/a
            pass
    return out


def _plan(spec: Any, seq: int, mesh: Mesh, lora: bool):
    return plan(spec, seq, mesh, Budgets(), weights="fp32" if lora else "bf16", adapters=LORA if lora else None)


def longest(spec: Any, mesh: Mesh, lora: bool) -> int:
    """A lower bound on the longest length that fits (within 1/8), up to ``LIMIT``; 0 when none does."""
    step = K * mesh.cp

    def fits(m: int) -> bool:
        return _plan(spec, m * step, mesh, lora).fits

    if not fits(1):
        return 0
    lo, cap = 1, LIMIT // step
    while lo * 2 <= cap and fits(lo * 2):
        lo *= 2
    hi = min(lo * 2, cap + 1)
    for _ in range(3):
        if hi - lo <= 1:
            break
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo * step


def cell(p: Any) -> dict[str, Any]:
    return {"fits": p.fits, "peak_gib": round(p.peak_gpu / GIB, 1), "peak_host_gb": round(p.peak_host / GB),
            "binding": p.binding, "fixes": [f[0] for f in p.fixes]}


def rows(model: str) -> list[dict[str, Any]]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the MTP-module notes
        spec = from_hf_config(ROOT / "recipes" / model / "config.json")
    out = []
    for label, mesh in meshes(spec):
        for lora in (False, True):
            if lora and mesh.ep > 1:
                continue
            t = time.time()
            r: dict[str, Any] = {"model": model, "family": spec.family, "gpus": mesh.world, "mesh": label,
                                 "dp": mesh.dp, "cp": mesh.cp, "ep": mesh.ep, "fsdp": mesh.fsdp,
                                 "training": "LoRA r16 (all)" if lora else "full (bf16 weights)"}
            for name, seq in LENGTHS.items():
                r[name] = cell(_plan(spec, seq, mesh, lora))
            r["longest"] = longest(spec, mesh, lora)
            if r["longest"]:
                r["at_longest"] = cell(_plan(spec, r["longest"], mesh, lora))
            out.append(r)
            print(f"{model:32s} {label:14s} {r['training']:20s} 32K {r['32K']['fits']!s:5} 128K "
                  f"{r['128K']['fits']!s:5} longest {r['longest'] // K}K ({time.time() - t:.0f}s)", flush=True)
    return out


def _len(n: int) -> str:
    if n >= LIMIT:
        return ">= 4M"
    return f"{n / (K * K):.2g}M" if n >= K * K else f"{n // K}K"


def markdown(result: list[dict[str, Any]]) -> str:
    lines = ["| model | GPUs (mesh) | training | 32K | 128K | longest that fits (peak GiB, schemes) |",
             "|---|---|---|---|---|---|"]

    def yn(c: dict[str, Any]) -> str:
        return f"yes ({c['peak_gib']})" if c["fits"] else f"no ({c['binding']})"

    for r in result:
        m = f"{r['mesh']}: dp {r['dp']} x ep {r['ep']} x cp {r['cp']}" if r["gpus"] > 1 else "1 GPU"
        if r["longest"]:
            at = r["at_longest"]
            best = f"{_len(r['longest'])} ({at['peak_gib']}, {', '.join(at['fixes']) or 'none'})"
        else:
            best = "none"
        lines.append(f"| {r['model']} | {m} | {r['training']} | {yn(r['32K'])} | {yn(r['128K'])} | {best} |")
    return "\n".join(lines) + "\n"


def summary(result: list[dict[str, Any]]) -> str:
    """One row per model, one column per (GPUs, training): the longest length that fits ('-': none; 32K and
    128K fit wherever the longest is at least as long)."""
    cols = [("1 GPU", "full"), ("1 GPU", "LoRA"), ("8 GPUs", "full"), ("8 GPUs", "LoRA"), ("64 GPUs", "full"),
            ("64 GPUs", "LoRA"), ("64 GPUs, ep 8", "full")]
    lines = ["| model (recipes/<dir>/config.json) | " + " | ".join(f"{g} {t}" for g, t in cols) + " |",
             "|---|" + "---|" * len(cols)]
    for model in dict.fromkeys(r["model"] for r in result):
        cells = []
        for g, t in cols:
            r = next((r for r in result if r["model"] == model and r["mesh"] == g and r["training"].startswith(t)),
                     None)
            if r is None:
                cells.append("n/a")
            elif not r["longest"]:
                cells.append(f"- ({r['32K']['binding']})")
            else:
                cp = f", cp {r['cp']}" if r["cp"] > 1 else ""
                cells.append(f"{_len(r['longest'])}{cp}")
        lines.append(f"| {model} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="benchmarks/results/memory/family_plan_rows.json")
    ap.add_argument("--only", default="", help="comma-separated recipe directories (default: every config.json)")
    ap.add_argument("--from-json", action="store_true", help="only rewrite the markdown from --out's JSON")
    args = ap.parse_args()
    out = Path(args.out)
    if args.from_json:
        result = json.loads(out.read_text())
    else:
        # the published configs (a recipes/*-tiny/ directory is an example model of its own, not one of them)
        models = sorted(p.parent.name for p in (ROOT / "recipes").glob("*/config.json") if not
                        p.parent.name.endswith("-tiny"))
        models = [m for m in models if not args.only or m in args.only.split(",")]
        result = [r for m in models for r in rows(m)]
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1) + "\n")
    text = summary(result) + "\n" + markdown(result)
    out.with_suffix(".md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
