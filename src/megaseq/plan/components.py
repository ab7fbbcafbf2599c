"""Per-component GPU and host memory formulas, in bytes: parameter counts and the bytes of what scales with
them, per GPU (the weights, their gradients, the optimizer's state on the GPU or the host, FSDP's gathered
copies and buffers). The activation terms are in ``activations.py`` and the mesh, dtypes and calibration in
``mesh.py``; this module re-exports both, so ``plan.components`` names every component term.

Pure Python (no torch). Notation as in ``activations``: ``s`` the parameter dtype's bytes, ``f`` float32.
Every formula is written out in ``docs/planner.md``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from megaseq.memory.rules import SLOT_ALIGN, WEIGHT_GRAD_ROWS, round_up  # noqa: F401  (the runtime's sizes; re-exported)
from megaseq.models.spec import ModelSpec
from megaseq.plan.activations import (  # noqa: F401  (re-exported: plan.components names every component term)
    SCOPlan,
    Trains,
    allocator_reserve,
    boundary_bytes,
    comm_buffer_bytes,
    hc_saved,
    if_trained,
    layer_input_bytes,
    liger_loss_bytes,
    linear_inputs,
    loss_bytes,
    merge_saved,
    merge_temp,
    norm_saved,
    sco_plan,
    trained_inputs,
    vocab_loss_bytes,
)
from megaseq.plan.mesh import CAL, FP32_WEIGHTS, GB, GIB, Calibration, Mesh, Precision, precision_for  # noqa: F401
from megaseq.plan.params import Trained


# ---- parameters ------------------------------------------------------------------------------------
@dataclass
class ParamCounts:
    """Parameter counts. ``layers[i]`` = (dense, experts, no-grad) of layer i; no-grad = DSA indexer.
    ``trained``: with a frozen base (``train.trainable``, LoRA; ``plan.params.trained_counts``) what trains,
    adapters included; None: everything but the indexer."""

    embed: int
    head: int
    final_norm: int
    layers: list[tuple[int, int, int]] = field(default_factory=list)
    fp32_kept: list[int] = field(default_factory=list)  # per layer: parameters a bf16 model keeps fp32 (of dense)
    trained: Trained | None = None

    @property
    def kept(self) -> int:
        """Parameters a bf16 model keeps in fp32 (all trainable): whole on every rank under FSDP."""
        return sum(self.fp32_kept)

    @property
    def total(self) -> int:
        adapters = self.trained.adapters if self.trained is not None else 0
        return self.embed + self.head + self.final_norm + sum(sum(t) for t in self.layers) + adapters

    @property
    def trainable(self) -> int:
        """Parameters that receive a gradient (the indexer runs under no_grad)."""
        if self.trained is not None:
            return self.trained.total
        return self.total - sum(t[2] for t in self.layers)

    def layer_trained(self, i: int) -> tuple[int, int]:
        """(non-expert, expert) parameters of layer i that get a gradient."""
        if self.trained is not None:
            return self.trained.layers[i]
        d, x, _ = self.layers[i]
        return d, x

    def head_trained(self) -> bool:
        return self.trained is None or self.trained.head > 0

    def layer(self, i: int) -> int:
        return sum(self.layers[i])

    def active(self, spec: ModelSpec) -> int:
        """Parameters one token touches: routed experts counted K of E."""
        frac = spec.num_experts_per_tok / spec.num_experts if spec.num_experts else 0.0
        return int(
            self.embed + self.head + self.final_norm + sum(d + x * frac + g for d, x, g in self.layers)
        )


def kda_params(spec: ModelSpec) -> int:
    H, Hh, Dk = spec.hidden_size, spec.linear_num_heads, spec.linear_head_dim
    D = Hh * Dk
    return (
        3 * H * D
        + 3 * D * spec.linear_conv_kernel  # q/k/v proj, depthwise conv
        + H * Dk
        + Dk * D
        + D
        + Hh  # forget gate: f_a, f_b, dt_bias, A_log
        + H * Hh
        + H * Dk
        + Dk * D
        + Dk
        + D * H
    )  # b_proj, g_a, g_b, o_norm, o_proj


def mla_params(spec: ModelSpec) -> int:
    H, Hh, b = spec.hidden_size, spec.num_attention_heads, spec.attention_bias
    ql, kl, r = spec.q_lora_rank, spec.kv_lora_rank, spec.qk_rope_head_dim
    q = H * ql + ql * (1 + b) + ql * Hh * spec.qk_head_dim if ql else H * Hh * spec.qk_head_dim  # or one q_proj
    kv = H * (kl + r) + (kl + r) * b + kl + kl * Hh * (spec.qk_nope_head_dim + spec.v_head_dim)
    return q + kv + Hh * spec.v_head_dim * H + H * b


def indexer_params(spec: ModelSpec) -> int:
    H, I, Di = spec.hidden_size, spec.index_n_heads, spec.index_head_dim
    pooled = spec.index_kpool * Di + Di * H if spec.family != "deepseek_v32" else 0  # GLM-5's pooled indexer
    return spec.q_lora_rank * I * Di + H * Di + 2 * Di + H * I + pooled


def attention_params(spec: ModelSpec) -> int:
    H, Hq, Hkv = spec.hidden_size, spec.num_attention_heads, spec.num_key_value_heads
    D = spec.head_dim or H // Hq
    b = 1 if spec.attention_bias else 0
    q = Hq * D * (2 if spec.attn_output_gate else 1)  # Qwen3-Next's output gate rides on q_proj
    qkv = H * (q + 2 * Hkv * D) + b * (q + 2 * Hkv * D)
    norms = (2 * D if spec.qk_norm_scope == "head" else (Hq + Hkv) * D) if spec.qk_norm else 0  # OLMoE: all heads
    sinks = Hq if spec.attention_sinks else 0  # gpt-oss: a sink logit per query head
    return qkv + Hq * D * H + (H if spec.o_proj_bias else 0) + norms + sinks


def gdn_params(spec: ModelSpec) -> int:
    """Gated DeltaNet (``models.common.gdn``): in_proj_qkvz, in_proj_ba, the depthwise conv, dt_bias, A_log,
    the gated norm, out_proj."""
    H, Hk, Dk = spec.hidden_size, spec.linear_num_heads, spec.linear_head_dim
    Hv, Dv = spec.linear_num_value_heads or Hk, spec.linear_value_head_dim or Dk
    conv = 2 * Hk * Dk + Hv * Dv
    return H * (2 * Hk * Dk + 2 * Hv * Dv) + H * 2 * Hv + conv * spec.linear_conv_kernel + 2 * Hv + Dv + Hv * Dv * H


def mlp_params(spec: ModelSpec, kind: str) -> tuple[int, int]:
    """(dense, routed experts) parameters of an MLP kind."""
    H = spec.hidden_size
    if kind == "dense":
        return 3 * H * spec.intermediate_size, 0
    Is = spec.shared_expert_intermediate_size or spec.moe_intermediate_size * spec.num_shared_experts
    shared = 3 * H * Is + (H if spec.shared_expert_gate else 0) if Is else 0  # Qwen3-Next: the shared gate
    E, I = spec.num_experts, spec.moe_intermediate_size
    router = E * (H + 1 if spec.router_bias else H)
    biases = E * (2 * I + H) if spec.expert_bias else 0  # gpt-oss: per-expert, counted with the experts
    return router + shared, 3 * E * H * I + biases


def gpu_counts(counts: ParamCounts, mesh: Mesh) -> ParamCounts:
    """The parameters one GPU holds: the routed experts split over ep (``parallel.expert.shard_experts``), with
    their LoRA factors and a frozen base's expert part. FSDP shards the rest (``Mesh.shard``); the experts stay
    whole on their GPU (``expert_params``)."""
    if mesh.ep == 1:
        return counts
    ep, tr = mesh.ep, counts.trained
    if tr is not None:
        adapters = sum(x - (b - f) for (_, x), (_, b, _), (_, f) in zip(tr.layers, counts.layers, tr.frozen_layers))
        tr = replace(tr, layers=[(d, x // ep) for d, x in tr.layers],
                     frozen_layers=[(d, x // ep) for d, x in tr.frozen_layers],
                     frozen=tr.frozen - sum(x - x // ep for _, x in tr.frozen_layers),
                     adapters=tr.adapters - (adapters - adapters // ep))
    return replace(counts, layers=[(d, x // ep, g) for d, x, g in counts.layers], trained=tr)


def expert_params(counts: ParamCounts, mesh: Mesh, part: str = "all") -> int:
    """Routed-expert parameters one GPU holds whole under expert parallelism (``counts`` per GPU:
    ``gpu_counts``; 0 with ep 1, where FSDP shards the experts with their layer): ``all``, those that train
    (``trained``: a frozen base's expert adapters and trained expert weights) or the frozen ones (``frozen``)."""
    if mesh.ep == 1:
        return 0
    tr = counts.trained
    if part == "frozen":
        return sum(x for _, x in tr.frozen_layers) if tr is not None else 0
    if part == "trained" and tr is not None:
        return sum(x for _, x in tr.layers)
    if tr is not None:  # what trains (adapters included) and what is frozen
        return sum(x for _, x in tr.layers) + sum(x for _, x in tr.frozen_layers)
    return sum(x for _, x, _ in counts.layers)


def fp32_kept_params(spec: ModelSpec, i: int) -> int:
    """Parameters of layer i a bf16 model keeps in fp32 (``Family.fp32_params``, the family's
    ``FP32_PARAM_SUFFIXES``): the MoE router ``E * H``, the KDA conv ``3 * D * K`` and decay ``D + Hh``, the mHC
    base and scale ``2 * ((2 + N) * N + 3)``."""
    from megaseq.models.registry import family

    kinds = family(spec.family).fp32_params
    H, N, n = spec.hidden_size, spec.hc_mult, 0
    if "router" in kinds and spec.mlp_types[i] == "moe":
        n += spec.num_experts * H
    if "kda" in kinds and spec.layer_types[i] == "kda":
        D = spec.linear_num_heads * spec.linear_head_dim
        n += 3 * D * spec.linear_conv_kernel + D + spec.linear_num_heads
    if "hc" in kinds and N > 1:
        n += 2 * ((2 + N) * N + 3)
    return n


def count_params(spec: ModelSpec) -> ParamCounts:
    """Parameter counts of the megaseq model built from ``spec`` (models/families)."""
    H, N = spec.hidden_size, spec.hc_mult
    hc = 2 * ((2 + N) * N * N * H + (2 + N) * N + 3) if N > 1 else 0  # attn_hc + ffn_hc: fn, base, scale
    counts = ParamCounts(
        embed=spec.vocab_size * H, head=0 if spec.tie_word_embeddings else spec.vocab_size * H, final_norm=H
    )
    for i, kind in enumerate(spec.layer_types):
        no_grad = 0
        if kind == "kda":
            mixer = kda_params(spec)
        elif kind == "dsa":
            mixer = mla_params(spec)
            no_grad = indexer_params(spec) if spec.indexer_types[i] == "full" else 0
        elif kind == "mla":
            mixer = mla_params(spec)
        elif kind == "gdn":
            mixer = gdn_params(spec)
        else:
            mixer = attention_params(spec)
        dense, experts = mlp_params(spec, spec.mlp_types[i])
        counts.layers.append((hc + 2 * H + mixer + dense, experts, no_grad))
        counts.fp32_kept.append(fp32_kept_params(spec, i))
    return counts


# ---- state: parameters, gradients, optimizer ---------------------------------------------------------
# A bf16-weight model (``Precision.master``) keeps ``ParamCounts.kept`` parameters in fp32; FSDP2 groups need
# one dtype, so those stay whole on every rank (``parallel.fsdp``: ``ignored_params``) and are all-reduced.
def _split(counts: ParamCounts, prec: Precision, params: int) -> tuple[int, int]:
    """(sharded, whole fp32) parts of ``params`` parameters (the kept ones are whole only in bf16 models)."""
    kept = min(counts.kept, params) if prec.master else 0
    return params - kept, kept


def state_mesh(counts: ParamCounts, mesh: Mesh) -> Mesh:
    """The mesh the trained parameters, their gradients and optimizer state are split over: ``mesh``, but
    unsharded with a frozen base (LoRA, ``train.trainable``: ``ParamCounts.trained``), whose FSDP shards the
    frozen parameters only and keeps what trains whole on every rank (``parallel.fsdp``), its gradient
    all-reduced."""
    return replace(mesh, fsdp="off") if counts.trained is not None else mesh


def state_shard(counts: ParamCounts, mesh: Mesh) -> int:
    """Ranks the trained state is split over (``state_mesh``)."""
    return state_mesh(counts, mesh).shard


def frozen_bytes(prec: Precision) -> int:
    """Bytes of a frozen base's element: the compute dtype under autocast (``models.common.lora.frozen_dtype``:
    bf16), else the parameter dtype."""
    return prec.compute if prec.autocast and prec.compute < prec.param else prec.param


def param_bytes(counts: ParamCounts, mesh: Mesh, prec: Precision) -> int:
    """Parameters resident on one GPU: ``P * param / shard`` (+ the kept fp32 ones whole: ``4 * K``). A frozen
    base (``models.common.lora.frozen_dtype``) is stored in the compute dtype under autocast, but for the
    tensors the family keeps in float32 (routers, KDA conv/decay, mHC: ``ParamCounts.kept``, taken as frozen),
    and FSDP shards it alone (what trains stays whole, ``state_shard``):
    ``(P - F) * param + (F - K_F) * frozen / shard + K_F * 4`` (``K_F`` whole: another dtype than the shards)."""
    frozen = counts.trained.frozen if counts.trained is not None else 0
    if frozen:
        fb = frozen_bytes(prec)
        kept_frozen = min(counts.kept, frozen) if fb < 4 else 0
        whole = expert_params(counts, mesh, "frozen")  # under ep: not FSDP-sharded
        return ((counts.total - frozen) * prec.param + (frozen - kept_frozen - whole) * fb // mesh.shard
                + kept_frozen * 4 + whole * fb)
    whole = expert_params(counts, mesh)
    sharded, kept = _split(counts, prec, counts.total - whole)
    return sharded * prec.param // mesh.shard + kept * 4 + whole * prec.param


def grad_bytes(params: int, mesh: Mesh, prec: Precision, kept: int = 0, accumulate: bool = False,
               whole: int = 0) -> int:
    """Gradients of ``params`` parameters (``kept`` of them fp32 and whole, ``whole`` of them routed experts
    under ep: not FSDP-sharded): ``params * grad / shard``; bf16 weights whose step sums several backward
    passes keep the sum in fp32 (``MasterAdamW``'s ``accumulate``: 4 B, one process or FSDP shards) instead of
    the bf16 ``.grad``."""
    g = 4 if (accumulate and prec.master and (mesh.sharded or mesh.world == 1)) else prec.grad
    return (params - kept - whole) * g // mesh.shard + kept * max(4, prec.grad) + whole * prec.grad


def offload_adam_bytes(num_params: int, bucket_params: int, master_bytes: int = 4) -> dict[str, int]:
    """OffloadStreamAdamW (``memory/offload_adam.py``). Host: master, two moments and the gradient per
    parameter (16 bytes in fp32), exactly. GPU: two staging slots of four bucket-sized arrays plus one
    bucket-sized temporary (the denominator)."""
    n = min(bucket_params, num_params)
    return {"host": 4 * num_params * master_bytes, "gpu_staging": (2 * 4 + 1) * n * master_bytes}


def optimizer_gpu_bytes(
    counts: ParamCounts, mesh: Mesh, prec: Precision, offload: bool, bucket_params: int
) -> int:
    """AdamW moments on the GPU (``P_trainable * moments / shard``; with bf16 weights ``MasterAdamW``'s fp32
    master too, ``(4 + 8) / shard``, the kept fp32 parameters' whole), or OffloadStreamAdamW's staging
    (``offload_adam_bytes``: two slots of master, both moments and the gradient plus one temporary)."""
    if offload:
        return offload_adam_bytes(counts.trainable, bucket_params)["gpu_staging"]
    whole = expert_params(counts, mesh, "trained")
    sharded, kept = _split(counts, prec, counts.trainable - whole)
    per = prec.moments + prec.master
    return sharded * per // state_shard(counts, mesh) + (kept + whole) * per


def optimizer_host_bytes(counts: ParamCounts, mesh: Mesh, offload: bool, prec: Precision = FP32_WEIGHTS) -> int:
    """OffloadStreamAdamW host state per GPU: fp32 master, m, v and gradient, ``P_trainable * 16 / shard``."""
    if not offload:
        return 0
    whole = expert_params(counts, mesh, "trained")
    sharded, kept = _split(counts, prec, counts.trainable - whole)
    return (offload_adam_bytes(sharded, 1)["host"] // state_shard(counts, mesh)
            + offload_adam_bytes(kept + whole, 1)["host"])


def weight_copy_bytes(layer_params: int, prec: Precision, mesh: Mesh) -> int:
    """bf16 copies of a layer's weights held for backward: autocast casts each fp32 weight per use
    (``2 * params``), FSDP or not (FSDP gathers the fp32 weights; ``fsdp_buffers``). bf16 weights need none."""
    return 2 * layer_params if prec.autocast else 0


def gathered_params(counts: ParamCounts, i: int, mesh: Mesh, prec: Precision) -> int:
    """Parameters FSDP gathers for layer i: its dense part (the kept fp32 ones are whole already) and its
    routed experts (with ep 1; under expert parallelism each GPU holds its experts whole, never gathered:
    ``expert_params``); with a frozen base its frozen parameters only (what trains is whole on every rank:
    ``state_shard``)."""
    if counts.trained is not None:  # a frozen base: its frozen part (the kept fp32 ones whole when it is narrower)
        dense, experts = counts.trained.frozen_layers[i]
        kept = min(counts.fp32_kept[i], dense) if frozen_bytes(prec) < 4 or prec.master else 0
        return dense - kept + (experts if mesh.ep == 1 else 0)
    dense, experts, no_grad = counts.layers[i]
    kept = counts.fp32_kept[i] if prec.master else 0
    return dense + no_grad - kept + (experts if mesh.ep == 1 else 0)


def fsdp_buffers(current: int, other: int, head: int, mesh: Mesh, prec: Precision, reduce_bytes: int,
                 backward: bool, frozen: bool = False) -> int:
    """FSDP2 unsharded buffers (``parallel.fsdp``) while a block of ``current`` parameters runs: it and the
    block whose all-gather is prefetched (``other``: the next in forward, the previous in backward) in the
    parameter dtype, and the root's head (``head``: the head weight and final norm, gathered from the
    forward to the end of the backward). In backward also the block's unsharded gradient (parameter dtype),
    the reduce-scatter input in ``reduce_bytes`` and its output ``/ shard``, and the head's unsharded
    gradient (reduce-scattered when the backward ends). ``frozen``: a frozen base's shards, gathered in its
    storage dtype (``frozen_bytes``) with no gradient to reduce-scatter (what trains is whole)."""
    if not mesh.sharded:
        return 0
    p = frozen_bytes(prec) if frozen else prec.param
    fwd = (current + other) * p + head * p
    if not backward or frozen:
        return fwd
    return fwd + current * (p + reduce_bytes) + current * reduce_bytes // mesh.shard + head * p
