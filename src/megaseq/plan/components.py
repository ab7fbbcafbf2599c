"""Per-component GPU and host memory formulas, in bytes, as plain functions of the shapes.

Pure Python (no torch): the planner must size the full 45-layer model for 64 GPUs on a laptop.
Every formula is written out with its arithmetic in ``docs/planner.md``; the per-layer-kind working
sets are in ``layers.py`` (``kda_saved``, ``dsa_saved``, ...), their named coefficients in
``Calibration`` below, so that a measured H200 peak can recalibrate one number.

Notation (per GPU): ``n = B * S / cp`` tokens this GPU holds, ``S`` the sequence length, ``H`` hidden,
``N`` = hc_mult residual streams, ``D`` = KDA heads x head dim, ``c`` compute bytes (bf16 = 2),
``f`` float32 bytes (4), ``s`` residual-stream bytes (the parameter dtype: fp32 master weights under
bf16 autocast keep the stream, norms and embeddings in fp32).

What "saved" means: the tensors autograd keeps from a layer's forward until its backward, in the
megaseq implementation (``models/blocks``), op by op, under ``torch.autocast(bf16)`` with fp32
parameters (the trainer's mode), or in a bf16 model (``optimizer_offload``: see ``precision_for``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, replace

from megaseq.memory.rules import SLOT_ALIGN, WEIGHT_GRAD_ROWS, round_up  # noqa: F401  (the runtime's sizes; re-exported)
from megaseq.models.spec import ModelSpec
from megaseq.ops.workspace import LIGER_CHUNK_ROWS
from megaseq.plan.params import Trained

GIB = 2**30
GB = 10**9


# ---- mesh and dtypes -----------------------------------------------------------------------------
FSDP_MODES = ("off", "dp", "dp_cp")


@dataclass(frozen=True)
class Mesh:
    """The GPUs of a run: ``world = dp * ep * cp`` (megaseq.parallel.mesh lays ranks out the same way).

    ``fsdp`` (``parallel.fsdp``) shards parameters, gradients and optimizer state per layer (FSDP2): over the
    dp x ep ranks (``dp``, replicated over cp) or over the whole world (``dp_cp``); ``off`` replicates them.
    Under expert parallelism the routed experts are not among them: each GPU holds its ``E / ep`` experts
    whole, their gradients and optimizer state too (``expert_params``).
    ``True`` / ``False`` are read as ``dp_cp`` / ``off``.
    ``mla_mode``: how DSA/MLA layers go context-parallel (``auto``, ``gather_kv`` or ``ulysses``).
    """

    dp: int = 1
    cp: int = 1
    ep: int = 1
    gpus_per_host: int = 1
    fsdp: bool | str = "off"
    mla_mode: str = "auto"

    def __post_init__(self) -> None:
        for name in ("dp", "cp", "ep", "gpus_per_host"):
            if getattr(self, name) < 1:
                raise ValueError(f"mesh {name} must be >= 1, got {getattr(self, name)}")
        if self.mla_mode not in ("auto", "gather_kv", "ulysses"):
            raise ValueError(f"parallel.mla_mode must be auto, gather_kv or ulysses, got {self.mla_mode!r}")
        if isinstance(self.fsdp, bool):
            object.__setattr__(self, "fsdp", "dp_cp" if self.fsdp else "off")
        if self.fsdp not in FSDP_MODES:
            raise ValueError(f"parallel.fsdp must be off, dp or dp_cp, got {self.fsdp!r}")

    @property
    def world(self) -> int:
        return self.dp * self.ep * self.cp

    @property
    def gpus_on_host(self) -> int:
        """GPUs sharing one host's RAM (a world smaller than a host uses only part of it)."""
        return min(self.world, self.gpus_per_host)

    @property
    def hosts(self) -> int:
        return -(-self.world // self.gpus_per_host)

    @property
    def shard(self) -> int:
        """Ranks the parameters, gradients and optimizer state are split over."""
        return {"off": 1, "dp": self.dp * self.ep, "dp_cp": self.world}[self.fsdp]

    @property
    def sharded(self) -> bool:
        """Whether FSDP runs (it shards over more than one rank)."""
        return self.shard > 1


@dataclass(frozen=True)
class Precision:
    """Bytes per element of each class of tensor."""

    param: int = 4  # parameters on the GPU (fp32 weights under autocast, or bf16 weights)
    grad: int = 4
    moments: int = 8  # AdamW exp_avg + exp_avg_sq
    compute: int = 2  # matmul outputs (bf16 under autocast)
    stream: int = 4  # residual stream, norm outputs, embeddings: the parameter dtype
    f32: int = 4  # what the blocks compute "in float32" (promote_types(dtype, fp32))
    autocast: bool = True  # a linear casts its fp32 input: each linear saves its own bf16 copy
    master: int = 0  # the optimizer's fp32 master copy of bf16 weights (MasterAdamW), made with the optimizer
    norm: int = 0  # the norms' weights (0: the parameter dtype); a frozen bf16 base: 2, so their outputs are bf16
    frozen_norms: bool = False  # the norms' weights get no gradient: their normalised value is not kept


BF16_WEIGHTS = Precision(param=2, grad=2, moments=8, compute=2, stream=2, f32=4, autocast=False, master=4)


@functools.lru_cache(maxsize=64)  # a plan asks for it per term; Precision is frozen
def precision_for(model_dtype: str = "bf16", weights: str = "fp32", frozen_embedding: bool = False,
                  frozen_norms: bool = False) -> Precision:
    """The trainer's dtypes (``train/build.py: dtypes``) for a GPU run.

    bf16: fp32 parameters + bf16 autocast, or with ``model.weights bf16`` bf16 parameters (no autocast, a
    bf16 residual stream) and the optimizer's fp32 master beside them (``BF16_WEIGHTS``). fp32 / fp64:
    everything in that dtype. ``frozen_embedding`` / ``frozen_norms``: a frozen base stored in bf16 (LoRA)
    with the embedding / the norms among it, so the residual stream / the norms' outputs are bf16 as in the
    transformers bf16 model; autocast still casts the fp32 adapters. (With bf16 weights the base is bf16
    already: only the norms' kept value changes.)"""
    if model_dtype == "fp64":
        return Precision(param=8, grad=8, moments=16, compute=8, stream=8, f32=8, autocast=False,
                         frozen_norms=frozen_norms)
    if model_dtype == "fp32":
        return Precision(param=4, grad=4, moments=8, compute=4, stream=4, f32=4, autocast=False,
                         frozen_norms=frozen_norms)
    if model_dtype != "bf16":
        raise ValueError(f"model.dtype must be bf16, fp32 or fp64, got {model_dtype!r}")
    if weights not in ("fp32", "bf16"):
        raise ValueError(f"model.weights must be fp32 or bf16, got {weights!r}")
    if weights == "bf16":
        return replace(BF16_WEIGHTS, frozen_norms=frozen_norms)
    return Precision(stream=2 if frozen_embedding else 4, norm=2 if frozen_norms else 0, frozen_norms=frozen_norms)


@dataclass(frozen=True)
class Calibration:
    """Named coefficients of the working-set formulas (to be fitted to measured H200 peaks).

    Temporaries are in units of (bytes x width) per token, e.g. ``kda_fwd_temp_cd = 7`` means
    ``7 * c * D`` bytes per token above the saved set while a KDA layer's forward runs.
    """

    kda_conv_copies: int = 1  # fla's causal_conv1d saves only its input (SiLU fused, recomputed); the
    # torch reference conv would keep its output too (2)
    kda_fwd_temp_cd: float = 7.0  # fla chunk_kda: contiguous q/k/v copies, w, u, kg, v_new, o
    kda_bwd_temp_fd: float = 0.0  # fla backward: its fp32 grads (fitted to 0 on the H200, see docs/planner.md)
    kda_segment_bwd_temp_fd: float = 8.0  # the same, for one recomputed segment (segmented KDA, H200)
    kda_bwd_temp_cd: float = 4.0  # fla backward: recomputed w, u, v_new, conv grads
    mlp_fwd_temp_ci: float = 2.0  # SwiGLU forward temporaries (x c x I per token or row)
    mlp_bwd_temp_ci: float = 4.0  # SwiGLU backward: grads of gate/up/activation
    moe_fwd_temp_rows: float = 2.0  # per routed row, x (xb x H): gathered x / weighted y / unsorted y (H200)
    moe_bwd_temp_rows: float = 1.4  # per routed row, x (xb x H): grads of the rows and of y (H200)
    attn_block_elems: int = 1 << 26  # score elements per query block of the reference sparse attention
    nograd_fraction: float = 0.35  # peak of a layer's no-grad forward, as a fraction of its saved set
    sinkhorn_saved: bool = True  # Sinkhorn's 2*iters-1 divisions each save [N, N] + [N] in fp32
    hc_mix_torch: bool = False  # the fast set with hc_mix as the closed-form torch op
    # (ops/mhc/mix_fused.py, its input's copy kept in the GEMM's dtype; the Triton op keeps none) and KDA's gated norm
    # the reference; True plans a run whose fast set runs those two
    process_host_bytes: int = 2_010_000_000  # one training process: Python, torch, CUDA host state, data
    # (H200, torch 2.11: VmHWM 1.95-2.07 GB, mean 2.01 GB, over 14 runs of glm5-flash-1gpu 8K-1M and
    # glm5-flash-tiny 128K-1M without offload, benchmarks/results/speed/runs/2026-11-29_base-kernels/)
    cuda_context_bytes: int = int(0.6 * GIB)  # CUDA context + cuBLAS/cuDNN workspaces, outside torch's count
    allocator_fixed: int = 2 * GIB  # caching-allocator reserve: a fixed part ...
    allocator_fraction: float = 0.05  # ... plus 5% of the tensors for fragmentation


CAL = Calibration()


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


def optimizer_host_bytes(counts: ParamCounts, mesh: Mesh, offload: bool, prec: Precision = Precision()) -> int:
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


# ---- small shared pieces -----------------------------------------------------------------------------
def layer_input_bytes(tokens: int, hidden: int, hc_mult: int, dtype_bytes: int) -> int:
    """One layer input: ``tokens x hc x H`` elements (4 x a hidden state for mHC)."""
    return tokens * hc_mult * hidden * dtype_bytes


def boundary_bytes(spec: ModelSpec, n: int, prec: Precision) -> int:
    """One checkpoint boundary (a layer input): ``n * N * H * s`` (4 x a hidden state with mHC)."""
    return layer_input_bytes(n, spec.hidden_size, spec.hc_mult, prec.stream)


@dataclass
class SCOPlan:
    num_offloaded: int  # layers whose boundary goes to host memory (the first ones)
    slot_bytes: int  # one boundary, rounded up to SLOT_ALIGN
    host_pinned_bytes: int  # the pool: num_offloaded x slot_bytes, exactly
    gpu_boundary_bytes: int  # boundaries resident on the GPU at the peak of backward


def sco_plan(num_layers: int, boundary: int, host_budget: int) -> SCOPlan:
    """What SCO (``memory/offload.py``: ``BoundaryOffloader`` sizes its pool with ``round_up``) keeps where,
    given one boundary's bytes and the host budget.

    GPU boundary bytes: the kept layers' boundaries plus at most two offloaded ones (the one in use and
    the one prefetched); with no offload (``host_budget`` 0) this is plain recompute, ``L x boundary``.
    """
    slot = round_up(boundary)
    k = min(num_layers, host_budget // slot) if slot else 0
    gpu = (num_layers - k + min(k, 2)) * boundary
    return SCOPlan(num_offloaded=k, slot_bytes=slot, host_pinned_bytes=k * slot, gpu_boundary_bytes=gpu)


def linear_inputs(width: int, num_linears: int, in_bytes: int, prec: Precision) -> int:
    """Per token: what ``num_linears`` linears reading one tensor save. Under autocast a tensor wider
    than bf16 is cast per linear (``k * c * width``: autocast caches weights, not activations);
    otherwise they share the tensor itself (``in_bytes * width``, counted once here)."""
    if prec.autocast and in_bytes != prec.compute:
        return num_linears * prec.compute * width
    return in_bytes * width


def norm_saved(width: int, in_bytes: int, prec: Precision, fast: bool = False) -> tuple[int, int]:
    """RMSNorm (``blocks/norm.py``) per token: (saved bytes, output bytes per element).

    Saved: the fp32 input (``x.to(f32)``; the input itself when already fp32) for the variance and the
    normalised value cast back to the input dtype (kept by ``weight *``): ``(f + in) * width``. The
    output is ``weight * x``, promoted to the wider of the weight and input dtypes. A frozen weight needs
    no gradient, so the normalised value is not kept: ``f * width``.

    ``fast``: the fast set's Triton norm (``ops/rms_norm/fused.py``) keeps the input itself and the fp32
    ``rstd`` of each row, ``in * width + 4``, whether the weight trains or not."""
    out = max(prec.norm or prec.param, in_bytes)
    if fast:
        return in_bytes * width + 4, out
    kept = 0 if prec.frozen_norms else in_bytes
    return (prec.f32 + kept) * width, out


def hc_saved(spec: ModelSpec, prec: Precision, cal: Calibration = CAL, fn_trains: bool = True,
             fast: bool = False) -> int:
    """One HyperConnection (``blocks/mhc.py``) per token, its residual input not counted.

    The flattened streams in fp32 (a copy unless the stream is fp32), the normalised flat input of the
    ``fn`` linear (its bf16 cast under autocast, else fp32; kept only when ``fn`` trains) and the small
    [N]/[N, N] weights, of which Sinkhorn's ``2 * iters - 1`` divisions each save comb and its sums.
    ``fast``: the Triton ``hc_mix`` (``ops/mhc/mix_triton.py``) keeps the streams themselves (no copy) and
    its fp32 GEMM output ``u`` and RMS scale ``r``: ``f * (M + 1)`` with ``M = (2 + N) * N``, whether ``fn``
    trains or not (``cal.hc_mix_torch``: the closed-form torch op's, the streams and their copy in the GEMM's
    dtype where that differs from theirs)."""
    N, H, f = spec.hc_mult, spec.hidden_size, prec.f32
    if fast and cal.hc_mix_torch:  # ``torch_fused``: the streams and their copy in the GEMM's dtype
        mm = prec.compute if prec.autocast else f
        flat, normed = (0 if mm == prec.stream else mm * N * H), 0
    elif fast:
        flat, normed = 0, f * ((2 + N) * N + 1)
    else:
        flat = 0 if prec.stream == f else f * N * H
        normed = (prec.compute * N * H if prec.autocast else f * N * H) if fn_trains else 0
    sink = (2 * spec.hc_sinkhorn_iters - 1) * (N * N + N) if cal.sinkhorn_saved else 0
    return flat + normed + f * (sink + 3 * N * N + 4 * N)


def merge_temp(spec: ModelSpec, prec: Precision) -> int:
    """``HyperConnection.merge``'s forward temporaries per token: ``post * y`` in the stream dtype, the
    matmul's output (bf16 under autocast) and their sum, the new streams: ``(2s + c) * N * H``."""
    N, H, s = spec.hc_mult, spec.hidden_size, prec.stream
    return (2 * s + (prec.compute if prec.autocast else s)) * N * H


def merge_saved(spec: ModelSpec, y_bytes: int, prec: Precision, fast: bool = False) -> int:
    """``HyperConnection.merge`` per token: the block output ``y`` (kept by ``post * y``), ``post`` and
    ``comb``, and under autocast the bf16 cast of the residual that ``matmul(comb^T, residual)`` saves
    (``c * N * H``; without autocast the residual itself, counted elsewhere). ``fast``: the Triton merge
    (``ops/mhc/streams_triton.py``) keeps the residual itself, so no cast."""
    N, H, c = spec.hc_mult, spec.hidden_size, prec.compute
    cast = c * N * H if (prec.autocast and prec.stream != c and not fast) else 0
    return y_bytes * H + cast + prec.f32 * N + c * N * N


# ---- loss, communication, allocator ------------------------------------------------------------------
def vocab_loss_bytes(N: int, H: int, V: int, chunk_tokens: int, dtype_bytes: int,
                     vocab_chunk: int | None = None, weight_grad: bool = True) -> dict[str, int]:
    """Peak working bytes of the loss's forward + backward, beyond its inputs (hidden, weight, labels)
    (``memory/vocab_loss.py``; ``WEIGHT_GRAD_ROWS`` from ``memory.rules``).

    ``d`` = dtype_bytes, ``a`` = accumulation bytes (4 for half inputs, else d), ``C x Vc`` one strip.

    plain:   the logits and what cross-entropy keeps and makes of them: ``N*V*(2a + 2d)`` for half
             inputs (logits, their fp32 copy, the log-softmax, its gradient; 12 bytes per logit measured
             on an H200 in bf16), ``N*V*3a`` otherwise. Its peak comes before the input gradients exist.
    chunked: the input gradient ``N*H*d``, the per-token lse and loss ``2*N*a``, and in backward one
             strip ``C*Vc*(d + a)`` (recomputed logits, then the fp32 softmax and the input-dtype result)
             with the chunk's fp32 input-gradient accumulator ``C*H*a`` and, for half inputs, the fp32
             addmm output temporary of one block of weight-gradient rows ``min(Vc, WEIGHT_GRAD_ROWS)*H*4``;
             for half inputs the fp32 weight gradient ``V*H*4`` is held throughout and cast to ``V*H*d`` at
             the end (after the strips), otherwise the weight gradient ``V*H*d`` is the accumulator itself.
             Independent of N but for the two per-token terms. A frozen head (``weight_grad`` False) has no
             weight gradient: the strips and the per-token terms only.
    """
    d = dtype_bytes
    half = d < 4
    a = 4 if half else d
    C, Vc = min(chunk_tokens, N), min(vocab_chunk or V, V)
    plain = N * V * (2 * a + 2 * d) if half else N * V * 3 * a
    strip = C * Vc * (d + a) + C * H * a + (min(Vc, WEIGHT_GRAD_ROWS) * H * 4 if half else 0)
    per_token = 2 * N * a + N * H * d
    chunked = per_token + (V * H * 4 + max(strip, V * H * d) if half else V * H * d + strip)
    if not weight_grad:
        chunked = per_token + strip
    return {"plain": plain, "chunked": chunked}


def liger_loss_bytes(N: int, H: int, V: int, d: int, weight_grad: bool = True) -> int:
    """The fast set's loss (``ops/vocab_loss/liger.py``: Liger's fused linear cross-entropy, chunked or not), beyond
    its inputs: the input gradient ``N*H*d`` and the weight gradient ``V*H*d`` it fills during the forward
    (in the head's dtype), one chunk of logits ``rows*V*d`` written over in place by its softmax gradient
    (``rows``: at most ``ops.workspace.LIGER_CHUNK_ROWS``, ``ops.vocab_loss.liger.CHUNK_ROWS``'s default), the
    per-token fp32 loss ``4*N``; for a half head, the weight gradient's fp32 copy ``V*H*4`` at the backward
    (the cast to an fp32 parameter's gradient: counted for a bf16 parameter too, an upper bound). Measured
    at 32K x V 154,880 x H 4096 in bf16 on an H200: 1.73 GiB with Liger's own chunks of 1,024 rows
    (``benchmarks/kernels/glue_gpu.py``), these terms without the cast."""
    rows = min(LIGER_CHUNK_ROWS, N)
    grads = N * H * d + (V * H * d if weight_grad else 0)
    return grads + rows * V * d + 4 * N + (V * H * 4 if weight_grad and d < 4 else 0)


def loss_bytes(spec: ModelSpec, n: int, d: int, chunked: bool, chunk_tokens: int, weight_grad: bool = True,
               fast: bool = False) -> int:
    """The vocabulary projection + cross-entropy working set of ``spec``'s head over ``n`` tokens
    (``vocab_loss_bytes``; with the fast kernels ``liger_loss_bytes``, chunked or not), ``d`` the hidden's
    bytes."""
    if fast:
        return liger_loss_bytes(n, spec.hidden_size, spec.vocab_size, d, weight_grad)
    both = vocab_loss_bytes(n, spec.hidden_size, spec.vocab_size, chunk_tokens or n, d, weight_grad=weight_grad)
    return both["chunked" if chunked else "plain"]


def comm_buffer_bytes(spec: ModelSpec, n: int, kind: str, prec: Precision, mesh: Mesh, mode: str) -> int:
    """Context-parallel staging: send + receive copies of the largest tensor one collective moves.

    Ulysses moves ``[n, heads, d]`` blocks (KDA's g and attention's q after RoPE are fp32 under
    autocast); gather-KV receives the whole sequence's latent + indexer keys (``S * width``)."""
    if mesh.cp == 1:
        return 0
    if kind == "kda":
        return 2 * n * spec.linear_num_heads * spec.linear_head_dim * prec.f32
    if kind == "attention":
        D = spec.head_dim or spec.hidden_size // spec.num_attention_heads
        return 2 * n * spec.num_attention_heads * D * prec.f32
    if kind == "mla":  # dense MLA goes through Ulysses: q and k (fp32 under autocast) are the widest
        return 2 * n * spec.num_attention_heads * spec.qk_head_dim * prec.f32
    if kind == "gdn":  # Ulysses: q/k/v and the gate per value head
        Hv = spec.linear_num_value_heads or spec.linear_num_heads
        return 2 * n * Hv * max(spec.linear_head_dim, spec.linear_value_head_dim or 0) * prec.compute
    if mode == "ulysses":
        return 2 * n * spec.num_attention_heads * spec.qk_head_dim * prec.compute
    width = (spec.kv_lora_rank + spec.qk_rope_head_dim) * prec.f32 + 2 * spec.index_head_dim * prec.compute
    return n * mesh.cp * width + n * width


def allocator_reserve(tensor_bytes: int, cal: Calibration = CAL) -> int:
    """Caching-allocator slack: a fixed 2 GiB plus 5% of the tensors (fragmentation)."""
    return int(cal.allocator_fixed + cal.allocator_fraction * tensor_bytes)
