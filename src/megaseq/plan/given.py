"""One given setting, choosing nothing: whether the mesh can run the model (``validate_mesh``: the cp group
splits the sequence and every token mixer's heads; ``mla_modes``: how MLA may run under cp), the planner's
``Run`` of a setting (``run_for``) and its evaluation (``peak_for``: the phase peaks and the breakdown).

Pure Python. ``planner`` searches over these; benchmarks and the runtime's checks evaluate one setting.
"""

from __future__ import annotations

from typing import Any

from megaseq.config import AdapterSettings, ExpertDispatchSettings, MemorySettings
from megaseq.models.spec import ModelSpec
from megaseq.plan import components as C
from megaseq.plan.choice import base_settings
from megaseq.plan.mesh import CAL, Calibration, Mesh
from megaseq.plan.params import trained_counts
from megaseq.plan.phases import evaluate
from megaseq.plan.run import Evaluation, Run


# ---- validation -------------------------------------------------------------------------------------
def validate_mesh(spec: ModelSpec, seq_len: int, mesh: Mesh) -> None:
    """ValueError when the cp group cannot split the sequence or a token mixer's heads."""
    cp = mesh.cp
    if seq_len % cp:
        raise ValueError(
            f"data.seq_len = {seq_len} is not divisible by parallel.cp = {cp}: each GPU holds "
            f"seq_len / cp tokens; use a multiple of {cp}"
        )
    if mesh.ep > 1 and spec.num_experts % mesh.ep:
        raise ValueError(f"parallel.ep = {mesh.ep} must divide num_experts = {spec.num_experts}")
    if mesh.ep > 1 and spec.expert_bias:
        raise ValueError(f"parallel.ep = {mesh.ep} is not supported for {spec.family}: its experts' biases do not "
                         "travel with the expert-parallel dispatch; set --parallel.ep 1 and shard with "
                         "--parallel.fsdp instead")
    if cp == 1:
        return
    checks = []
    kinds = set(spec.layer_types)
    if "kda" in kinds:
        checks.append(("KDA layers", "linear_num_heads", spec.linear_num_heads))
    if "attention" in kinds:
        checks.append(("attention layers", "num_attention_heads", spec.num_attention_heads))
    if "mla" in kinds:  # dense MLA: Ulysses over its heads (every head has its own keys)
        checks.append(("MLA layers", "num_attention_heads", spec.num_attention_heads))
    if "gdn" in kinds:  # gated DeltaNet: Ulysses over the key and the value heads
        checks.append(("gated DeltaNet layers", "linear_num_key_heads", spec.linear_num_heads))
        checks.append(("gated DeltaNet layers", "linear_num_value_heads",
                       spec.linear_num_value_heads or spec.linear_num_heads))
    if "dsa" in kinds and mesh.mla_mode == "ulysses":
        # the indexer is split by queries in both modes (each rank scores its own): its heads need not divide
        checks.append(
            ("DSA layers (parallel.mla_mode ulysses)", "num_attention_heads", spec.num_attention_heads)
        )
    for what, name, heads in checks:
        if heads % cp:
            divisors = [d for d in range(1, heads + 1) if heads % d == 0]
            extra = " or set --parallel.mla_mode gather_kv (no head limit)" if "mla_mode" in what else ""
            raise ValueError(
                f"{what}: {name} = {heads} cannot be split over parallel.cp = {cp} ranks (Ulysses "
                f"gives each rank heads / cp): use a cp among {divisors}{extra}"
            )


def mla_modes(spec: ModelSpec, mesh: Mesh) -> list[str]:
    """The DSA context-parallel modes to consider: the configured one, or both when ``auto``."""
    if "dsa" not in spec.layer_types or mesh.cp == 1 or mesh.mla_mode != "auto":
        return ["gather_kv" if mesh.mla_mode == "auto" else mesh.mla_mode]
    return ["gather_kv", "ulysses"] if spec.num_attention_heads % mesh.cp == 0 else ["gather_kv"]


def run_for(
    spec: ModelSpec,
    seq_len: int,
    memory: dict[str, Any] | MemorySettings,
    mesh: Mesh | None = None,
    batch_size: int = 1,
    *,
    model_dtype: str = "bf16",
    grad_accum: int = 1,
    moe_imbalance: float = 4.0,
    mla_mode: str | None = None,
    calibration: Calibration = CAL,
    loss_in_compute_dtype: bool = True,
    ep_dispatch: ExpertDispatchSettings | None = None,
    weights: str = "fp32",
    reduce_dtype: str = "fp32",
    adapters: AdapterSettings | None = None,
    fast_ops: frozenset[str] = frozenset(),
    indexer_objective: bool = False,
    packed_documents: bool = False,
    counts: C.ParamCounts | None = None,
) -> Run:
    """The planner's ``Run`` for one given setting (``MemorySettings``, or a dict of some of its fields, the
    rest at the planner's base), choosing nothing: the one place a ``Run`` is built (``planner.plan`` builds
    each MLA mode's through it). ``mla_mode`` defaults to the mesh's (``auto`` meaning gather_kv, as the
    runtime); ``counts``: the GPU's parameters where the caller has them (``gpu_param_counts``), which says the
    caller has validated the mesh (``planner.plan`` does once for every MLA mode); without them it is validated here."""
    mesh = mesh or Mesh()
    if counts is None:
        validate_mesh(spec, seq_len, mesh)
    mode = mla_mode or ("gather_kv" if mesh.mla_mode == "auto" else mesh.mla_mode)
    given = memory.to_dict() if isinstance(memory, MemorySettings) else memory
    full = base_settings(None, batch_size * seq_len // mesh.cp).replace(**given)
    if counts is None:
        counts = gpu_param_counts(spec, mesh, adapters, indexer_objective)
    return Run(
        spec=spec,
        seq_len=seq_len,
        batch=batch_size,
        mesh=mesh,
        model_dtype=model_dtype,
        memory=full,
        counts=counts,
        mla_mode=mode,
        imbalance=moe_imbalance,
        grad_accum=grad_accum,
        cal=calibration,
        loss_in_compute_dtype=loss_in_compute_dtype,
        ep_dispatch=ep_dispatch or ExpertDispatchSettings(),
        weights=weights,
        reduce_dtype=reduce_dtype,
        fast_ops=frozenset(fast_ops),
        indexer_objective=indexer_objective,
        packed_documents=packed_documents,
    )


def gpu_param_counts(spec: ModelSpec, mesh: Mesh, adapters: AdapterSettings | None,
                     indexer_objective: bool) -> C.ParamCounts:
    """The parameters one GPU holds (the experts and their adapters under ep), with what trains: the adapters or
    ``train.trainable`` of a frozen base, and the indexers when their objective is on."""
    counts = indexer_trains(C.count_params(spec), indexer_objective)
    counts.trained = trained_counts(spec, adapters, indexer_objective)
    return C.gpu_counts(counts, mesh)


def indexer_trains(counts: C.ParamCounts, objective: bool) -> C.ParamCounts:
    """With the indexer objective the DSA indexers' parameters train: counted with the dense trained ones."""
    if objective:
        counts.layers = [(dense + no_grad, experts, 0) for dense, experts, no_grad in counts.layers]
    return counts


def peak_for(spec: ModelSpec, seq_len: int, memory: dict[str, Any] | MemorySettings, mesh: Mesh | None = None,
             batch_size: int = 1,
             **kw: Any) -> Evaluation:
    """Evaluate one given setting (``run_for``'s arguments) without choosing anything: the phase peaks and
    the breakdown."""
    return evaluate(run_for(spec, seq_len, memory, mesh, batch_size, **kw))
