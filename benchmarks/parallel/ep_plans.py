"""The planner's plans for the full GLM-5.3-Flash (288 experts) on 64 H200 with FSDP + EP + CP + the memory
schemes, at 256K and 1M tokens: what fits, the peak, what binds, the dispatch component and the traffic.

    python benchmarks/parallel/ep_plans.py --out benchmarks/results/parallel/ep_plans.json

Pure Python (the planner); no GPU. Every mesh ``dp x ep x cp = 64`` the model allows (ep dividing 288,
cp dividing the 64 KDA heads, 8 GPUs per host, 1 TB of host RAM per host), FSDP over the world (the
experts' E / ep over dp x cp), the planner choosing the memory schemes; the expert dispatch as plain EP
planned at the measured max/mean load (``--imbalance``: 2.2-4 on genome windows, docs/expert_parallel.md) and as
PipelinedLLEP planned at its routing-independent bound. Nothing here runs on GPUs: the
figures are the planner's, not measurements. Writes the JSON and a markdown table beside it (``.md``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from megaseq.config import ExpertDispatchSettings
from megaseq.models.presets import get_preset
from megaseq.plan.fixes import Budgets
from megaseq.plan.mesh import GB, GIB, Mesh
from megaseq.plan.planner import plan

MODEL = "glm5-flash"
GPUS = 64
SEQ_LENS = {"256K": 256 * 1024, "1M": 1024 * 1024}
HOST_BYTES = 1024 * GB  # per 8-GPU host


def meshes(spec: Any) -> list[tuple[int, int, int]]:
    out = []
    for ep in (2, 4, 8, 16, 32):
        for cp in (1, 2, 4, 8, 16, 32):
            if spec.num_experts % ep or spec.linear_num_heads % cp or GPUS % (ep * cp):
                continue
            out.append((GPUS // (ep * cp), ep, cp))
    return out


def row(seq: str, dp: int, ep: int, cp: int, mode: str, imbalance: float) -> dict[str, Any]:
    spec = get_preset(MODEL)
    mesh = Mesh(dp=dp, ep=ep, cp=cp, gpus_per_host=8, fsdp=True)
    p = plan(spec, SEQ_LENS[seq], mesh, Budgets(host_bytes=HOST_BYTES), moe_imbalance=imbalance, name=MODEL,
             ep_dispatch=ExpertDispatchSettings(mode=mode))
    d, moe = p.expert_dispatch, p.comm.get("moe", {})
    cp_bytes = sum(v["per_step"] for k, v in p.comm.items() if k not in ("moe", "fsdp"))  # fsdp: no per_step
    return {"seq": seq, "dp": dp, "ep": ep, "cp": cp, "mode": mode, "imbalance": imbalance, "fits": p.fits,
            "peak_gpu_gib": round(p.peak_gpu / GIB, 1), "peak_host_gb": round(p.peak_host / GB), "binding": p.binding,
            "fixes": [f[0] for f in p.fixes], "dispatch_rows_in": d.get("rows_in"),
            "dispatch_working_set_gib": round(d.get("working_set", 0) / GIB, 2),
            "dispatch_buffer_bound_gib": round(d.get("buffer_bound", 0) / GIB, 2),
            "ep_gb_per_step": round(moe.get("per_step", 0) / GB), "cp_gb_per_step": round(cp_bytes / GB),
            "advice": p.advice}


def report(rows: list[dict[str, Any]]) -> str:
    lines = [f"# {MODEL} (288 experts) on {GPUS} H200: planned, FSDP + EP + CP + memory schemes", "",
             "The planner's figures (no GPU run; FSDP planned, not yet run). Dispatch: plain EP planned at the "
             "measured max/mean load, PipelinedLLEP at its bound (whatever the routing). EP / CP traffic: "
             "bytes one GPU sends per step (EP with even routing).", "",
             "| seq | dp x ep x cp | dispatch | fits | peak GiB | binding | MoE rows in a GPU at once | "
             "dispatch working set GiB | EP GB/step | CP GB/step | schemes |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['seq']} | {r['dp']} x {r['ep']} x {r['cp']} | {r['mode']} (max/mean {r['imbalance']:g}) "
                     f"| {'yes' if r['fits'] else 'no'} | {r['peak_gpu_gib']} | {r['binding']} | "
                     f"{r['dispatch_rows_in']} | {r['dispatch_working_set_gib']} | {r['ep_gb_per_step']} | "
                     f"{r['cp_gb_per_step']} | {', '.join(r['fixes'])} |")
    for seq in SEQ_LENS:
        fit = [r for r in rows if r["seq"] == seq and r["fits"] and r["mode"] == "pipelined_llep"]
        best = min(fit, key=lambda r: r["ep_gb_per_step"] + r["cp_gb_per_step"]) if fit else None
        lines.append("")
        if best:
            lines.append(f"{seq}: {len(fit)} meshes fit with PipelinedLLEP; the least traffic: dp {best['dp']} x ep "
                         f"{best['ep']} x cp {best['cp']}, peak {best['peak_gpu_gib']} GiB, binding {best['binding']}.")
        else:
            no = [r for r in rows if r["seq"] == seq and r["mode"] == "pipelined_llep"]
            least = min(no, key=lambda r: r["peak_gpu_gib"])
            lines.append(f"{seq}: nothing fits on {GPUS} GPUs; the lowest peak is dp {least['dp']} x ep {least['ep']} "
                         f"x cp {least['cp']} at {least['peak_gpu_gib']} GiB, binding {least['binding']}. "
                         f"{least['advice']}")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="benchmarks/results/parallel/ep_plans.json")
    ap.add_argument("--imbalance", type=float, default=4.0, help="max/mean expert load for plain EP")
    args = ap.parse_args()
    spec = get_preset(MODEL)
    rows = [row(seq, dp, ep, cp, mode, args.imbalance) for seq in SEQ_LENS for dp, ep, cp in meshes(spec)
            for mode in ("plain", "pipelined_llep")]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rows, indent=2))
    out.with_suffix(".md").write_text(report(rows))
    print(report(rows))


if __name__ == "__main__":
    main()
