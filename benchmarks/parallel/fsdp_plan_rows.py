"""The rows of docs/fsdp.md: ``megaseq plan`` on published config.json files (tests/fixtures/configs) with FSDP2
and bf16 weights, on H200s (139.8 GiB, 128 GB of host RAM per GPU, 8 GPUs a host), and the state arithmetic.

    python benchmarks/parallel/fsdp_plan_rows.py --out benchmarks/results/parallel/fsdp_plan_rows.json

For each model and GPU count it tries the cp sizes that split the model's heads and reports, per mesh, the
longest sequence that fits (``plan.planner.longest_length``), its peak, the fixes and the binding component;
and whether a given length (128K for Qwen3-30B-A3B on 8 GPUs, 1M for GLM-5.3-Flash on 64) fits. Pure
Python: the planner only, nothing is run on a GPU.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from megaseq.models.spec import from_hf_config
from megaseq.plan import Mesh, plan
from megaseq.plan import components as C
from megaseq.plan.mesh import GB, GIB
from megaseq.plan.planner import Budgets, longest_length

K = 1024
FIXTURES = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "configs"
# model -> (GPU counts, cp sizes to try, the length asked about). Under parallel.fsdp dp_cp the state is
# sharded over every GPU whatever the split, so the largest cp (fewest tokens per GPU) reaches furthest;
# dp > 1 only multiplies the batch.
CASES = {
    "qwen3-30b-a3b": ([1, 8], [1, 8], 128 * K),
    "qwen3-235b-a22b": ([8, 16, 32, 64], [8, 16, 32, 64], 128 * K),
    "glm-5.3-flash": ([8, 16, 32, 64], [8, 16, 32, 64], 1 << 20),
}


def state_arithmetic(spec, mesh: Mesh) -> dict[str, float]:
    """Per GPU, in GB: bf16 weights and gradients sharded, the fp32 kept ones whole, master + moments
    (GPU) or the OffloadStreamAdamW host state, and the largest layer's gathered bytes."""
    counts, prec = C.count_params(spec), C.precision_for("bf16", "bf16")
    layers = [C.gathered_params(counts, i, mesh, prec) for i in range(spec.num_layers)]
    return {"params_B": counts.total / 1e9, "kept_fp32_B": counts.kept / 1e9, "shard": mesh.shard,
            "weights_GB": C.param_bytes(counts, mesh, prec) / GB,
            "master_moments_GB": C.optimizer_gpu_bytes(counts, mesh, prec, False, 1) / GB,
            "offload_host_GB": C.optimizer_host_bytes(counts, mesh, True, prec) / GB,
            "largest_layer_gathered_GB": max(layers) * prec.param / GB}


def rows(model: str, gpus: list[int], cps: list[int], asked: int) -> list[dict]:
    spec = from_hf_config(FIXTURES / model)
    out = []
    for n in gpus:
        for cp in [c for c in cps if n % c == 0 and (c == n or c == 1)]:
            mesh = Mesh(dp=n // cp, cp=cp, gpus_per_host=min(n, 8), fsdp="dp_cp" if n > 1 else "off")
            try:
                longest = longest_length(spec, mesh, Budgets(), weights="bf16")
            except ValueError:  # cp does not split the heads
                continue
            p = plan(spec, max(longest, 1024 * cp), mesh, Budgets(), weights="bf16")
            at = plan(spec, asked, mesh, Budgets(), weights="bf16")
            out.append({"model": model, "gpus": n, "dp": n // cp, "cp": cp, "longest": longest,
                        "peak_gib": p.peak_gpu / GIB, "peak_host_gb": p.peak_host / GB,
                        "fixes": [f[0] for f in p.fixes],
                        "binding": p.binding, "memory": p.memory, "comm_fsdp": p.comm.get("fsdp", {}),
                        "asked": asked, "asked_fits": at.fits, "asked_peak_gib": at.peak_gpu / GIB,
                        "asked_peak_host_gb": at.peak_host / GB, "asked_binding": at.binding,
                        "asked_advice": at.advice, "host_budget_gb": at.host_budget / GB,
                        "state": state_arithmetic(spec, mesh)})
            print(f"{model} {n} GPUs dp {n // cp} cp {cp}: longest {longest // K}K (peak {p.peak_gpu / GIB:.1f} GiB, "
                  f"{'+'.join(r for r in out[-1]['fixes'])}); {asked // K}K fits={at.fits} "
                  f"({at.peak_gpu / GIB:.1f} GiB, {at.binding})", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="benchmarks/results/parallel/fsdp_plan_rows.json")
    ap.add_argument("--only", default="", help="comma-separated model names (default: all)")
    args = ap.parse_args()
    names = [m for m in CASES if not args.only or m in args.only.split(",")]
    result = [r for m in names for r in rows(m, *CASES[m])]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
