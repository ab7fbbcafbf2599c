"""When no memory setting fits: the advice naming what would (``no_fit_advice``: a larger cp, a shorter
sequence, sharded or smaller parameters and optimizer state) and the component that binds
(``binding_component``).

Pure Python. ``planner`` attaches the advice to a plan that does not fit.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from megaseq.plan import components as C
from megaseq.plan.choice import choose
from megaseq.plan.fixes import (
    Budgets,
)
from megaseq.plan.given import mla_modes, validate_mesh
from megaseq.plan.mesh import GB, GIB
from megaseq.plan.phases import evaluate
from megaseq.plan.run import Evaluation, Run


# ---- advice when nothing fits -------------------------------------------------------------------------
def _all_fixes_fit(run: Run, budgets: Budgets, memory_cfg: Any | None) -> bool:
    return choose(run, budgets, memory_cfg)[2]


def _smallest_cp(run: Run, budgets: Budgets, memory_cfg: Any | None) -> int | None:
    """The smallest cp above the current one (same dp, ep) with which some fix set fits."""
    spec = run.spec
    for cp in range(run.mesh.cp + 1, 1025):
        mesh = replace(
            run.mesh, cp=cp, mla_mode="gather_kv" if run.mesh.mla_mode == "auto" else run.mesh.mla_mode
        )
        try:
            validate_mesh(spec, run.seq_len, mesh)
        except ValueError:
            continue
        if _all_fixes_fit(replace(run, mesh=mesh, mla_mode=mla_modes(spec, mesh)[0]), budgets, memory_cfg):
            return cp
    return None


def _longest(run: Run, budgets: Budgets, memory_cfg: Any | None) -> int:
    """The longest multiple of 1024 * cp tokens that fits on this mesh (0 if none)."""
    step = 1024 * run.mesh.cp
    lo, hi = 0, max(1, run.seq_len // step)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if _all_fixes_fit(replace(run, seq_len=mid * step), budgets, memory_cfg):
            lo = mid
        else:
            hi = mid - 1
    return lo * step


def no_fit_advice(run: Run, ev: Evaluation, budgets: Budgets, memory_cfg: Any | None, binding: str) -> str:
    """Name the binding component and what would make the run fit."""
    if ev.peak_gpu > budgets.gpu_bytes:
        gib = f"{ev.peak_gpu / GIB:.1f} GiB > {budgets.gpu_bytes / GIB:.1f} GiB"
        lines = [f"does not fit: GPU peak {gib} at {ev.phase}; binding component: {binding}."]
    else:  # only the host overflows: never print a GPU peak under its budget as if it were over
        lines = [f"does not fit in host memory; the GPU peak, {ev.peak_gpu / GIB:.1f} GiB at {ev.phase}, is "
                 f"within {budgets.gpu_bytes / GIB:.1f} GiB."]
    if ev.peak_host > budgets.host(run.mesh):
        lines.append(
            f"host memory: needs {ev.peak_host / GB:.0f} GB per host, the budget is "
            f"{budgets.host(run.mesh) / GB:.0f} GB: give the host more RAM (--host-mem)."
        )
    big_host = replace(budgets, host_bytes=1 << 60)
    if ev.peak_host <= budgets.host(run.mesh) and _all_fixes_fit(run, big_host, memory_cfg):
        need = choose(run, big_host, memory_cfg)
        ev2 = evaluate(replace(run, memory=need[0]))
        takers = {"checkpoint_offload": "SCO", "optimizer_offload": "optimizer offload"}
        names = [takers[f] for f in need[1] if f in takers]
        names += ["sequence segments' K/V store (memory.segment_kv_host)"] if need[0].segment_kv_host else []
        lines.append(
            f"more host RAM would do: {ev2.peak_host / GB:.0f} GB per host lets {' / '.join(names) or 'it'} "
            "take the rest."
        )
    lines += _state_advice(run, budgets)
    if binding == "FSDP buffers" and run.mesh.ep == 1 and run.spec.num_experts > 1:
        lines.append(
            "most of the FSDP buffers are one layer's gathered routed experts: expert parallelism keeps each "
            "GPU's experts local, FSDP sharding the rest (--parallel.ep, a divisor of num_experts)."
        )
    cp = _smallest_cp(run, budgets, memory_cfg)
    if cp is not None:
        gpus = run.mesh.dp * run.mesh.ep * cp
        lines.append(f"context parallelism: --parallel.cp {cp} ({gpus} GPUs) fits.")
    longest = _longest(run, budgets, memory_cfg)
    lines.append(
        f"the longest length that fits this mesh is {longest} tokens ({longest // 1024}K)."
        if longest
        else "no length fits this mesh: the model state itself does not fit."
    )
    return " ".join(lines)


def _state_advice(run: Run, budgets: Budgets) -> list[str]:
    """When parameters + optimizer state (on the GPU) alone overflow it: what shards or shrinks them (the
    settings the runtime has: ``parallel.fsdp``, ``model.weights bf16``, ``memory.optimizer_offload``)."""
    counts, mesh, prec = run.counts, run.mesh, run.prec
    state = C.param_bytes(counts, mesh, prec) + C.optimizer_gpu_bytes(counts, mesh, prec, False, 1)
    if state <= budgets.gpu_bytes:
        return []
    line = f"parameters + optimizer state alone need {state / GIB:.0f} GiB per GPU"
    options = []
    if mesh.fsdp != "dp_cp" and mesh.world > 1:
        options.append("shard them over all the GPUs (FSDP: --parallel.fsdp dp_cp)")
    experts = C.expert_params(counts, mesh)
    if experts and mesh.sharded and experts * prec.param > budgets.gpu_bytes // 4:
        options.append(f"split the routed experts over more GPUs (--parallel.ep: each GPU holds its "
                       f"{experts / 1e9:.1f}B expert parameters whole, FSDP shards the rest)")
    if run.weights != "bf16" and run.model_dtype == "bf16":
        options.append("keep the weights in bf16 (--model.weights bf16: 2 B per weight and gradient, the fp32 "
                       "master with the optimizer)")
    if not run.memory.optimizer_offload:
        options.append("offload the optimizer (--memory.optimizer_offload true)")
    if mesh.world == 1:
        options.append("or shard them over more GPUs (FSDP: --parallel.fsdp dp_cp)")
    return [f"{line}: " + "; ".join(options) + "." if options else f"{line}."]


def binding_component(ev: Evaluation) -> str:
    """The largest component at the peak (allocator slack aside), with its dominant part."""
    comps = {k: v for k, v in ev.breakdown.items() if k not in ("allocator reserve", "CUDA context")}
    name = max(comps, key=comps.get)
    if name == "saved activations" and ev.saved_terms:
        top = max(ev.saved_terms, key=ev.saved_terms.get)
        return f"saved activations ({top})"
    if name in ("layer working set", "recomputed layer"):
        return f"{name} ({ev.notes.get(name, '')})"
    return name
