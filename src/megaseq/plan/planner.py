"""The memory planner: predict each component's GPU and host bytes, choose the cheapest fixes that fit.

Pure Python (no torch). ``plan(spec, seq_len, mesh)`` sweeps the phases of one training step and takes
the largest (``docs/planner.md``, ``phases.py``; one given setting in ``given.py``, the advice when
nothing fits in ``shortfall.py``):

- forward at layer l: the saved activations of layers < l (or, with recompute, the boundaries kept on
  the GPU) + layer l's own forward working set (the largest at the last layers);
- loss: every layer's saved state + the final norm + the vocabulary projection;
- backward at layer l: what layers <= l still hold + layer l's backward working set (its recomputed
  graph under recompute) + the gradients of layers >= l (the largest at the first layers);
- optimizer step: parameters + gradients + optimizer state;

each on top of the parameters and optimizer state. The fixes are tried cheapest first (``fixes.py``):
chunked loss, indexer query chunking, MLP/MoE tiling, full recompute, SCO, OffloadStreamAdamW;
context parallelism needs more GPUs and is only advised, with the other ways to fit, when nothing fits.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any

from megaseq.config import AdapterSettings, ExpertDispatchSettings, MemorySettings
from megaseq.memory.rules import check_stream_base
from megaseq.models.spec import ModelSpec
from megaseq.ops.kernels import PLANNED_FAST_OPS, planned_fast_ops  # noqa: F401  (PLANNED_FAST_OPS re-exported)
from megaseq.plan import components as C
from megaseq.plan.choice import base_settings, choose, enabled_fixes, fix_costs
from megaseq.plan.expert import dispatch_terms, expected_step_bytes
from megaseq.plan.fixes import (  # noqa: F401  (Budgets, H200_GPU_BYTES, HOST_BYTES_PER_GPU: re-exported)
    FIXES,
    H200_GPU_BYTES,
    HOST_BYTES_PER_GPU,
    LADDER,
    Budgets,
    check_model_segments,
)
from megaseq.plan.flops import comm_volume, step_flops
from megaseq.plan.given import gpu_param_counts, mla_modes, run_for, validate_mesh
from megaseq.plan.mesh import CAL, GIB, Calibration, Mesh
from megaseq.plan.phases import evaluate, pinned_host_bytes
from megaseq.plan.run import Run
from megaseq.plan.shortfall import binding_component, no_fit_advice

# the memory settings a plan carries, in order (``Plan.memory``: ``MemorySettings.to_dict``)
MEMORY_KEYS = tuple(f.name for f in fields(MemorySettings))


@dataclass
class Plan:
    """A memory plan: components at the peak phase, the chosen fixes and the settings to apply."""

    model: str
    seq_len: int
    batch_size: int
    mesh: dict[str, Any]
    components: list[tuple[str, int, int, str]]  # (name, GPU bytes at the peak, host bytes per GPU, note)
    peak_gpu: int  # tensors + allocator reserve + CUDA context: what must fit in gpu_budget
    peak_gpu_tensors: int  # what torch.cuda.max_memory_allocated should read (steady state: after the first step)
    peak_host: int  # per host (all its GPUs' processes)
    gpu_budget: int
    host_budget: int
    fixes: list[tuple[str, float, str]]  # (setting, estimated step-time cost fraction, why)
    memory: dict[str, Any]  # the chosen MemorySettings (``MemorySettings.from_dict`` reads it back)
    fits: bool
    binding: str
    advice: str
    headroom: int
    peak_phase: str = ""
    first_step_gpu_tensors: int = 0  # the first step's peak: the optimizer state does not exist before its update
    phases: dict[str, int] = field(default_factory=dict)
    comm: dict[str, Any] = field(default_factory=dict)
    flops: dict[str, float] = field(default_factory=dict)
    expert_dispatch: dict[str, Any] = field(default_factory=dict)  # the MoE dispatch under ep > 1
    offloaded_layers: int = 0  # layer inputs SCO puts in pinned host memory in each forward (the rest stay)
    pinned_host: int = 0  # host bytes per GPU process page-locked (every host term but the process's own)

    def to_dict(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["components"] = [list(c) for c in self.components]
        d["fixes"] = [list(f) for f in self.fixes]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Plan:
        d = dict(d)
        d["components"] = [tuple(c) for c in d["components"]]
        d["fixes"] = [tuple(f) for f in d["fixes"]]
        return cls(**d)


# ---- entry points -------------------------------------------------------------------------------------
def _forced(memory_cfg: Any, n: int, run: Run) -> MemorySettings:
    """The user's settings (``memory.auto`` false), checked to run as given before anything runs."""
    m = memory_cfg.settings()
    m = m.replace(offload_host_budget=m.offload_host_budget if m.checkpoint_offload else 0)
    m.check_combination()
    if m.model_segment_tokens:
        check_model_segments(run.spec.family, m.model_segment_tokens, run.mesh.cp)
    if m.stream_base:
        check_stream_base(run.counts.trained is not None, run.mesh.ep)
    return m


def _make_plan(run: Run, budgets: Budgets, memory_cfg: Any | None, name: str, explain: bool = True) -> Plan:
    auto = memory_cfg is None or getattr(memory_cfg, "auto", True)
    if auto:
        memory, fixes, _ = choose(run, budgets, memory_cfg)
    else:
        memory = _forced(memory_cfg, run.n, run)
        fixes = enabled_fixes(run, memory)
    run = replace(run, memory=memory)
    ev = evaluate(run)
    fits = ev.peak_gpu <= budgets.gpu_bytes and ev.peak_host <= budgets.host(run.mesh)
    costs = fix_costs(run)
    binding = binding_component(ev)
    advice = (
        f"fits: GPU peak {ev.peak_gpu / GIB:.1f} of {budgets.gpu_bytes / GIB:.1f} GiB at {ev.phase}"
        if fits
        else no_fit_advice(run, ev, budgets, memory_cfg, binding) if explain else f"does not fit ({binding})"
    )
    host = ev.host_per_gpu
    components = [(k, v, 0, ev.notes.get(k, "")) for k, v in ev.breakdown.items()]
    components += [(f"host: {k}", 0, v, "per GPU process") for k, v in host.items() if v]
    sf = step_flops(run.spec, run.seq_len)
    return Plan(
        model=name,
        seq_len=run.seq_len,
        batch_size=run.batch,
        mesh={
            "dp": run.mesh.dp,
            "cp": run.mesh.cp,
            "ep": run.mesh.ep,
            "gpus_per_host": run.mesh.gpus_per_host,
            "fsdp": run.mesh.fsdp,
            "mla_mode": run.mla_mode,
            "weights": run.weights,
            "fast_kernels": sorted(run.fast_ops & ops_of_model(run.spec)),
        },
        components=components,
        peak_gpu=ev.peak_gpu,
        peak_gpu_tensors=ev.peak_tensors,
        first_step_gpu_tensors=ev.first_step_tensors,
        offloaded_layers=ev.offloaded_layers,
        pinned_host=pinned_host_bytes(host),
        peak_host=ev.peak_host,
        gpu_budget=budgets.gpu_bytes,
        host_budget=budgets.host(run.mesh),
        fixes=[(f, round(costs[f], 4), FIXES[f].why(memory)) for f in fixes],
        memory=memory.to_dict(),
        fits=fits,
        binding=binding,
        advice=advice,
        headroom=budgets.gpu_bytes - ev.peak_gpu,
        peak_phase=ev.phase,
        phases=ev.phases,
        comm=_comm(run),
        expert_dispatch=_expert_dispatch(run),
        flops={
            "per_token": sf.per_token,
            "per_step": sf.total * run.batch,
            "loss": sf.loss,
            "mlp": sf.mlp,
            "layers": sf.layers,
            "indexer": sf.indexer,
        },
    )


def _expert_dispatch(run: Run) -> dict[str, Any]:
    """The dispatch component of one MoE layer under ep > 1: rows, chunks, the buffer bound, and the rows the
    measured imbalance would give (what plain EP would plan with)."""
    if run.mesh.ep == 1 or "moe" not in run.spec.mlp_types:
        return {}
    n = run.n if not run.memory.tiled_mlp else min(run.memory.mlp_tile_tokens, run.n)
    xb = C.norm_saved(run.spec.hidden_size, run.prec.stream, run.prec)[1]
    t = dispatch_terms(run.spec, n, run.mesh, run.ep_dispatch, xb, run.prec, run.imbalance, run.cal)
    plain = dispatch_terms(run.spec, n, run.mesh, replace(run.ep_dispatch, mode="plain"), xb, run.prec,
                           run.imbalance, run.cal)
    return {"mode": t.mode, "chunks": t.chunks, "c_eff": t.c_eff, "rows_in": t.rows_in,
            "rows_in_bound": t.rows_in_bound, "rows_in_expected": t.rows_in_expected,
            "buffer_bound": t.buffer_bound, "working_set": sum(t.saved.values()) + max(t.fwd_temp, t.bwd_temp),
            "imbalance": run.imbalance,
            "plain_working_set": sum(plain.saved.values()) + max(plain.fwd_temp, plain.bwd_temp)}


def plan(
    spec: ModelSpec,
    seq_len: int,
    mesh: Mesh | None = None,
    budgets: Budgets | None = None,
    memory_cfg: Any | None = None,
    batch_size: int = 1,
    *,
    model_dtype: str = "bf16",
    grad_accum: int = 1,
    moe_imbalance: float = 4.0,
    calibration: Calibration = CAL,
    name: str = "",
    packed_documents: bool = False,
    ep_dispatch: ExpertDispatchSettings | None = None,
    weights: str = "fp32",
    reduce_dtype: str = "fp32",
    adapters: AdapterSettings | None = None,
    fast_ops: frozenset[str] = frozenset(),
    indexer_objective: bool = False,
    explain: bool = True,
) -> Plan:
    """Plan one training step of ``spec`` at ``seq_len`` tokens per sequence on ``mesh``.

    ``memory_cfg`` (a ``megaseq.config.MemoryConfig``): with ``auto`` false its settings are used as
    given; otherwise the planner picks the cheapest fixes that fit. ``moe_imbalance`` is the max/mean
    expert load used under expert parallelism (about 4 on real long-context data); ``ep_dispatch``
    how routed rows travel then (default: PipelinedLLEP, planned at its routing-independent bound).
    ``adapters``: a frozen base (``train.trainable``, LoRA): the frozen parameters cost their compute-dtype
    bytes only, the trained ones (adapters included) their gradients and optimizer state
    (``plan.params.trained_counts``). ``indexer_objective`` (``model.train_indexer``): the DSA indexers train,
    so their parameters carry gradients and optimizer state, and each full-indexer layer its objective's
    working set (``phases``).
    """
    mesh = mesh or Mesh()
    budgets = budgets or Budgets()
    if seq_len < 1 or batch_size < 1:
        raise ValueError(f"seq_len ({seq_len}) and batch_size ({batch_size}) must be >= 1")
    validate_mesh(spec, seq_len, mesh)
    counts = gpu_param_counts(spec, mesh, adapters, indexer_objective)
    best: Plan | None = None
    for mode in mla_modes(spec, mesh):
        run = run_for(spec, seq_len, base_settings(memory_cfg, batch_size * seq_len // mesh.cp), mesh, batch_size,
                      model_dtype=model_dtype, grad_accum=grad_accum, moe_imbalance=moe_imbalance, mla_mode=mode,
                      calibration=calibration, ep_dispatch=ep_dispatch, weights=weights, reduce_dtype=reduce_dtype,
                      adapters=adapters, fast_ops=fast_ops, indexer_objective=indexer_objective,
                      packed_documents=packed_documents, counts=counts)
        p = _make_plan(run, budgets, memory_cfg, name or spec.family, explain)
        if best is None or _better(p, best):
            best = p
    assert best is not None
    return best


def _comm(run: Run) -> dict[str, Any]:
    """Bytes per GPU per step: context parallelism's per layer kind, expert parallelism's under ``moe`` and,
    under FSDP, the all-gathers and reduce-scatters of a step (``fsdp``: with sequence segments each
    segment's rerun gathers the weights again)."""
    comm: dict[str, Any] = comm_volume(run.spec, run.seq_len, run.mesh, run.batch) if run.mesh.cp > 1 else {}
    if run.mesh.ep > 1:
        comm["moe"] = expected_step_bytes(run.spec, run.seq_len, run.mesh, run.ep_dispatch, run.batch, run.prec)
        from megaseq.plan.flops import expert_grad_traffic

        grads = expert_grad_traffic(C.expert_params(run.counts, run.mesh, "trained"), run.prec.grad, run.mesh)
        if grads:  # the experts' gradients summed over the ranks holding them
            comm["expert_grads"] = grads
    if run.mesh.sharded:
        from megaseq.plan.fixes import fsdp_step_traffic, segments_of

        comm["fsdp"] = fsdp_step_traffic(run, segments_of(run) if run.segment else 1)
    return comm


def _better(a: Plan, b: Plan) -> bool:
    """Fits beats not; then the cheaper fixes (+ the DSA mode's communication); then the lower peak."""
    if a.fits != b.fits:
        return a.fits
    cost_a, cost_b = sum(f[1] for f in a.fixes), sum(f[1] for f in b.fixes)
    comm_a = a.comm.get("dsa", {}).get(a.mesh["mla_mode"], 0) if "dsa" in a.comm else 0
    comm_b = b.comm.get("dsa", {}).get(b.mesh["mla_mode"], 0) if "dsa" in b.comm else 0
    return (round(cost_a, 6), comm_a, a.peak_gpu) < (round(cost_b, 6), comm_b, b.peak_gpu)


def longest_length(spec: ModelSpec, mesh: Mesh | None = None, budgets: Budgets | None = None,
                   memory_cfg: Any | None = None, limit: int = 1 << 26, **kw: Any) -> int:
    """The longest sequence (a multiple of ``1024 * cp`` tokens, at most ``limit``) whose plan fits: doubling
    from ``1024 * cp`` while it fits, then bisecting. 0 when none does. ``kw`` as ``plan``'s."""
    mesh = mesh or Mesh()
    step, cap = 1024 * mesh.cp, max(1, limit // (1024 * mesh.cp))

    def fits(n: int) -> bool:
        return plan(spec, n * step, mesh, budgets, memory_cfg, **kw).fits

    if not fits(1):
        return 0
    lo = 1
    while lo * 2 <= cap and fits(lo * 2):
        lo *= 2
    hi = min(lo * 2, cap + 1)  # lo fits; hi does not (or is past the cap)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo * step


def plan_from_config(
    cfg: Any,
    world_size: int,
    gpu_bytes: int | None = None,
    host_bytes: int | None = None,
    gpus_per_host: int | None = None,
    device_type: str | None = None,
    spec: ModelSpec | None = None,
    explain: bool = True,
) -> Plan:
    """Plan a ``megaseq.config.Config`` run on ``world_size`` GPUs (H200s unless told otherwise).
    ``device_type``: where the run starts, when it starts here (``planned_fast_ops``); None (``megaseq plan``):
    a GPU run with the kernels the config names. ``spec``: the model's spec where the caller resolved it
    (None: resolved from ``cfg.model.name``)."""
    from megaseq.models.presets import resolve_spec

    spec = spec if spec is not None else resolve_spec(cfg.model.name)
    pc, mc = cfg.parallel, cfg.memory
    dp, _, _ = pc.axis_sizes(world_size)
    mesh = Mesh(
        dp=dp, cp=pc.cp, ep=pc.ep, gpus_per_host=gpus_per_host or min(world_size, 8), mla_mode=pc.mla_mode,
        fsdp=pc.fsdp,
    )
    gpu = [b for b in (gpu_bytes, None if mc.gpu_budget == "auto" else mc.gpu_budget) if b]
    host = host_bytes or (None if mc.host_budget == "auto" else mc.host_budget)
    budgets = Budgets(gpu_bytes=min(gpu) if gpu else H200_GPU_BYTES, host_bytes=host)
    return plan(
        spec,
        cfg.data.seq_len,
        mesh,
        budgets,
        mc,
        cfg.train.batch_size,
        model_dtype=cfg.model.dtype,
        grad_accum=cfg.train.grad_accum,
        name=cfg.model.name,
        packed_documents=cfg.data.kind == "text",
        ep_dispatch=pc.ep_dispatch_settings(),
        weights=cfg.model.weights,
        reduce_dtype=pc.reduce_dtype,
        adapters=AdapterSettings.of(cfg),
        fast_ops=planned_fast_ops(cfg.model.kernels, cfg.model.dtype, device_type),
        indexer_objective=getattr(cfg.model, "train_indexer", False),
        explain=explain,  # False: no search for what would fit when it does not (the advisor searches itself)
    )


def ops_of_model(spec: ModelSpec) -> frozenset[str]:
    """The planned fast ops a model's layers call (the plan names only these): the norms, SwiGLU and the loss
    in every model; DSA's indexer, its objective's target and KL (``model.train_indexer``) and sparse attention,
    mHC's mixing, weights and merge, KDA's forget gate and gated norm where the model has those layers."""
    ops = {"rms_norm", "swiglu", "linear_cross_entropy"}
    if "dsa" in spec.layer_types:
        ops |= {"indexer_topk", "indexer_target", "indexer_kl", "sparse_attention"}
    if spec.hc_mult > 1:
        ops |= {"hc_mix", "hc_weights", "hc_merge"}
    if "kda" in spec.layer_types:
        ops |= {"kda_gate", "gated_rms_norm"}
    return frozenset(ops)
