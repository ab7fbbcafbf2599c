"""One evaluation of a memory setting: each layer's saved set and temporaries, swept over a step's phases.

Pure Python. ``evaluate(Run)`` returns the peak GPU bytes (and at which phase), the component breakdown
at that peak, and the host bytes. The phases (``docs/planner.md``, "Peak model"):

    forward  at layer l   state + saved(layers < l) + layer l's own forward (its saved part + temporaries)
    loss                  state + saved(all layers) + final norm + vocabulary projection
    backward at layer l   state + saved(layers <= l) + layer l's backward temporaries + grads(layers >= l)
    step                  parameters + gradients + optimizer state

Under recompute "saved" is the boundaries kept on the GPU (SCO moves the first layers' to the host; at
most two of those are back on the GPU at once) and layer l's graph is rebuilt in its backward. State is
the parameters, the optimizer state (steady state: after the first step), gradients when accumulated
over micro-batches, and FSDP buffers when parameters are sharded.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from megaseq.config import ExpertDispatchSettings, MemorySettings
from megaseq.models.spec import ModelSpec
from megaseq.plan import components as C
from megaseq.plan import expert, layers, stream
from megaseq.plan import linear_mixers as LM
from megaseq.plan import mlp as MLP
from megaseq.plan import sparse_attention as SA
from megaseq.plan import weights as W
from megaseq.plan.mesh import CAL, Calibration, Mesh, Precision, precision_for
from megaseq.plan.weights import ParamCounts


@dataclass(frozen=True)
class Run:
    """Everything one evaluation depends on; ``memory`` the settings evaluated (a dict of ``MemorySettings``
    fields is read into one)."""

    spec: ModelSpec
    seq_len: int
    batch: int
    mesh: Mesh
    model_dtype: str
    memory: MemorySettings
    counts: ParamCounts
    mla_mode: str = "gather_kv"
    imbalance: float = 4.0
    grad_accum: int = 1
    sparse_impl: str = "absorbed"  # ops/sparse_mla/absorbed.py on the GPU; "torch_masked" is the CPU reference
    packed_documents: bool = False  # data with document boundaries (text): no segmented KDA
    loss_in_compute_dtype: bool = True  # the trainer casts hidden + head for the loss (False: in the stream's dtype)
    cal: Calibration = CAL
    ep_dispatch: ExpertDispatchSettings = ExpertDispatchSettings()  # how routed rows travel when mesh.ep > 1
    weights: str = "fp32"  # model.weights: fp32 (+ autocast) or bf16 (fp32 master in the optimizer)
    reduce_dtype: str = "fp32"  # parallel.reduce_dtype: the FSDP reduce-scatter's dtype
    # ops whose fast kernel (``model.kernels fast``) the plan counts instead of the reference's working set:
    # "rms_norm", "swiglu", "indexer_topk", "indexer_target", "sparse_attention", "hc_merge" (Triton), "hc_mix"
    # (fused torch), "linear_cross_entropy" (Liger); every other op keeps the base set's
    # (for the fast kernels an upper bound). ``ops.kernels.planned_fast_ops`` picks them for a config.
    fast_ops: frozenset[str] = frozenset()
    indexer_objective: bool = False  # model.train_indexer: each full-indexer layer adds its KL objective

    def __post_init__(self) -> None:
        if isinstance(self.memory, dict):
            object.__setattr__(self, "memory", MemorySettings.from_dict(self.memory))

    @property
    def prec(self) -> Precision:
        """Dtypes of ``model.dtype`` and ``model.weights`` (``components.precision_for``); a frozen bf16 base
        with its embedding makes the residual stream bf16, with its norms their outputs bf16."""
        tr = self.counts.trained
        frozen = tr is not None
        return precision_for(self.model_dtype, self.weights, frozen and tr.embed == 0, frozen and not tr.norms)

    @property
    def reduce_bytes(self) -> int:
        """Bytes per element of FSDP's reduce-scatter (fp64 parameters reduce in fp64)."""
        return max(self.prec.param, 4 if self.reduce_dtype == "fp32" else 2)

    @property
    def accumulates(self) -> bool:
        """Several backward passes per step (micro-batches, sequence segments): gradients accumulate."""
        return self.grad_accum > 1 or bool(self.segment)

    @property
    def segment(self) -> int:
        """Tokens per sequence segment (``memory.model_segment_tokens``), 0 when the step is not segmented."""
        T = self.memory.model_segment_tokens
        return T if 0 < T < self.seq_len else 0

    @property
    def n(self) -> int:
        """Tokens one GPU runs at once: ``B * S / cp``, or ``B * T`` under sequence segments."""
        return self.batch * (self.segment or self.seq_len) // self.mesh.cp

    @property
    def n_seq(self) -> int:
        """Tokens of the sequence one GPU holds: ``B * S / cp``."""
        return self.batch * self.seq_len // self.mesh.cp


@dataclass
class LayerTerms:
    """One layer: saved bytes by name (attention half, MLP half) and its temporaries."""

    attn: dict[str, int]
    ffn: dict[str, int]
    mixer_fwd: int
    mixer_bwd: int
    mlp_fwd: int
    mlp_bwd: int
    merge_fwd: int  # the mHC merge's forward temporaries (after either half)
    wgrad: int  # one weight's gradient temporary (the largest tensor of the layer)
    boundary_term: int  # the part of ``attn`` that is the layer input itself
    tiled: bool = False  # the MLP runs tiled: its weights are not held by the layer's graph

    @property
    def saved(self) -> int:
        return sum(self.attn.values()) + sum(self.ffn.values())

    @property
    def before_mixer_output(self) -> int:
        """The attention half's saved bytes while the mixer's working set peaks: before its output
        stage (o_proj's input, the merge) and, for DSA, before the selection exists."""
        late = ("o_proj input", "merge", "selection")
        return sum(v for k, v in self.attn.items() if not any(w in k for w in late))


@dataclass
class Evaluation:
    peak_tensors: int
    peak_gpu: int  # + allocator reserve + CUDA context
    phase: str
    breakdown: dict[str, int]
    notes: dict[str, str]
    phases: dict[str, int]
    host_per_gpu: dict[str, int]
    peak_host: int  # per host
    saved_terms: dict[str, int] = field(default_factory=dict)
    # the first step's tensor peak: the optimizer's state is created by its first update, so the forward,
    # loss and backward of the first step run without it (what a one-step measurement reads)
    first_step_tensors: int = 0


# ---- per layer --------------------------------------------------------------------------------------
def _trains(run: Run, i: int) -> frozenset[str] | None:
    """Layer i's projections whose weight gets a gradient (``plan.layers``' ``trains``; None: all)."""
    tr = run.counts.trained
    return None if tr is None else tr.projections[i]


def _mixer(run: Run, i: int, xb: int) -> tuple[dict[str, int], int, int]:
    spec, n, prec, mesh = run.spec, run.n, run.prec, run.mesh
    trains = _trains(run, i)
    kind = spec.layer_types[i]
    comm = C.comm_buffer_bytes(spec, n, kind, prec, mesh, run.mla_mode)
    T = run.memory.kda_segment_tokens
    fast_norm = "gated_rms_norm" in run.fast_ops
    if kind == "kda" and 0 < T < n:
        return LM.kda_segmented(spec, n, run.batch, T, xb, prec, run.cal, trains, fast_norm)
    if kind == "kda":
        return (
            LM.kda_saved(spec, n, xb, prec, run.cal, trains, fast_norm),
            LM.kda_temp(spec, n, prec, False, run.cal) + comm,
            LM.kda_temp(spec, n, prec, True, run.cal) + comm,
        )
    keys = run.batch * run.seq_len if run.segment else 0  # sequence segments: the last segment's keys
    if kind == "attention":
        window, S = (spec.sliding_window if i in spec.sliding_layers else 0), run.seq_len
        return (
            layers.attention_saved(spec, n, xb, prec, mesh, trains, window, S),
            layers.attention_temp(spec, n, prec, False, mesh, window, S) + comm + layers.attention_segment_temp(
                spec, keys, prec, mesh, False),
            layers.attention_temp(spec, n, prec, True, mesh, window, S) + comm + layers.attention_segment_temp(
                spec, keys, prec, mesh, True),
        )
    if kind == "mla":
        saved = layers.mla_saved(spec, n, xb, prec, trains)
        if run.segment:  # absorbed over the carried latent (no expanded SDPA q, k, v, o)
            saved["mla q,k,v,o (SDPA, v padded) + lse"] = layers.mla_segment_saved(spec, n, prec)
        return (
            saved,
            layers.mla_temp(spec, n, prec, False) + comm + layers.mla_segment_temp(spec, keys, prec, False),
            layers.mla_temp(spec, n, prec, True) + comm + layers.mla_segment_temp(spec, keys, prec, True),
        )
    if kind == "gdn":
        return (
            LM.gdn_saved(spec, n, xb, prec, run.cal, trains),
            LM.gdn_temp(spec, n, prec, False, run.cal) + comm,
            LM.gdn_temp(spec, n, prec, True, run.cal) + comm,
        )
    if kind != "dsa":
        raise ValueError(
            f"the memory planner has no terms for layer kind {kind!r} (layer {i} of {spec.family}): it plans "
            "attention, mla, gdn, kda and dsa layers")
    full = spec.indexer_types[i] == "full"
    B, S, mode = run.batch, run.seq_len, run.mla_mode
    impl = "triton" if "sparse_attention" in run.fast_ops else run.sparse_impl
    saved = SA.dsa_saved(spec, n, B, S, xb, prec, mesh, mode, full, run.cal, impl, trains)
    fwd = SA.dsa_temp(spec, n, B, S, prec, mesh, mode, False, run.cal, impl)
    if full:
        fwd = max(fwd, layers.indexer_temp(spec, n, B, S, run.memory.indexer_query_chunk, prec,
                                           fast="indexer_topk" in run.fast_ops))
    if full and run.indexer_objective:  # the KL's chunk in the forward; its summed gradients until the backward
        kept, chunk = layers.indexer_objective_bytes(spec, n, B, S, prec,
                                                     fused_target="indexer_target" in run.fast_ops)
        saved = {**saved, "dsa indexer objective (gradients, pooled keys)": kept}
        fwd = max(fwd, chunk)
    return saved, fwd + comm, SA.dsa_temp(spec, n, B, S, prec, mesh, mode, True, run.cal, impl) + comm


def _mlp(run: Run, i: int, xb: int, tokens: int) -> tuple[dict[str, int], int, int]:
    """(saved, forward temp, backward temp) of layer i's MLP over ``tokens`` tokens."""
    spec, prec, mesh = run.spec, run.prec, run.mesh
    kind = spec.mlp_types[i]
    if kind == "moe" and mesh.ep > 1:
        return _moe_ep(run, xb, tokens)
    fast = "swiglu" in run.fast_ops
    if kind == "dense":
        saved = {"mlp (dense SwiGLU)": MLP.mlp_saved(spec, tokens, spec.intermediate_size, xb, prec,
                                                        _trains(run, i), fast=fast)}
    else:
        saved = MLP.moe_saved(spec, tokens, xb, prec, mesh, run.imbalance, _trains(run, i), fast=fast)
    fwd = MLP.mlp_temp(spec, tokens, kind, xb, prec, mesh, run.imbalance, False, run.cal)
    bwd = MLP.mlp_temp(spec, tokens, kind, xb, prec, mesh, run.imbalance, True, run.cal)
    return saved, fwd, bwd


def _moe_ep(run: Run, xb: int, tokens: int) -> tuple[dict[str, int], int, int]:
    """An MoE layer under expert parallelism: the router and the shared expert here, the routed path as the
    dispatch mode runs it (``plan.expert.dispatch_terms``: PipelinedLLEP at its bound)."""
    spec, prec = run.spec, run.prec
    t = expert.dispatch_terms(spec, tokens, run.mesh, run.ep_dispatch, xb, prec, run.imbalance, run.cal)
    saved = {"moe router": MLP.moe_router_saved(spec, tokens, prec), **t.saved}
    if spec.num_shared_experts:
        saved["moe shared expert"] = MLP.shared_expert_saved(spec, tokens, xb, prec,
                                                                fast="swiglu" in run.fast_ops)
    return saved, t.fwd_temp, t.bwd_temp


def _largest_weight(spec: ModelSpec, i: int) -> int:
    """Elements of the layer's largest non-expert weight (its gradient's temporary in backward; the
    experts' per-expert gradients accumulate without a full-size temporary, as measured on an H200)."""
    H = spec.hidden_size
    if spec.mlp_types[i] == "moe":
        mlp = max(H * spec.moe_intermediate_size * max(spec.num_shared_experts, 1), spec.num_experts * H)
    else:
        mlp = H * spec.intermediate_size
    kind = spec.layer_types[i]
    if kind == "kda":
        mix = H * spec.linear_num_heads * spec.linear_head_dim
    elif kind in ("dsa", "mla"):
        Hh = spec.num_attention_heads
        mix = max(
            (spec.q_lora_rank or H) * Hh * spec.qk_head_dim,  # q_b_proj, or q_proj without a q LoRA rank
            Hh * spec.v_head_dim * H,
            spec.kv_lora_rank * Hh * (spec.qk_nope_head_dim + spec.v_head_dim),
        )
    elif kind == "gdn":
        Hk, Dk, Hv, Dv = LM.gdn_dims(spec)
        mix = H * (2 * Hk * Dk + 2 * Hv * Dv)  # in_proj_qkvz
    else:
        gate = 2 if spec.attn_output_gate else 1  # Qwen3-Next's q_proj carries the output gate
        mix = gate * H * spec.num_attention_heads * (spec.head_dim or H // spec.num_attention_heads)
    return max(mlp, mix)


def layer_terms(run: Run, i: int) -> LayerTerms:
    spec, n, prec = run.spec, run.n, run.prec
    N, H, s, c, f = spec.hc_mult, spec.hidden_size, prec.stream, prec.compute, prec.f32
    norm, xb = C.norm_saved(H, s, prec, fast="rms_norm" in run.fast_ops)
    mixer, mixer_fwd, mixer_bwd = _mixer(run, i, xb)
    # with a plain residual (N = 1) an fp32 stream is the norms' own fp32 input: count it once
    resid = N * H * s if (N > 1 or s == f) else 0
    attn = {"layer input (boundary)": n * resid}
    ffn = {"mid-layer residual": n * resid}
    if N > 1:
        trains = _trains(run, i)
        attn["mHC"], ffn["mHC"] = (n * C.hc_saved(spec, prec, run.cal, trains is None or f"{hc}.fn" in trains,
                                                  fast="hc_mix" in run.fast_ops)
                                   for hc in ("attn_hc", "ffn_hc"))
    attn["input norm"] = ffn["post-attention norm"] = n * norm - (n * resid if N == 1 else 0)
    attn.update(mixer)
    tr = run.counts.trained
    if tr is not None and (tr.lora_rows_attn[i] or tr.merged[i]):  # models.common.lora: B's saved input
        attn["LoRA intermediates"] = n * tr.lora_rows_attn[i] * c + tr.merged[i] * c
    tiled = run.memory.tiled_mlp
    tile = min(run.memory.mlp_tile_tokens, n) if tiled else n
    mlp, mlp_fwd, mlp_bwd = _mlp(run, i, xb, tile)
    if tr is not None and tr.lora_rows_mlp[i]:
        mlp["LoRA intermediates (mlp)"] = tile * tr.lora_rows_mlp[i] * c
    # backward: the gradient of the sublayer's input (in its dtype, xb: the norm's output; a tiled MLP's
    # replay fills one such buffer) and of its output where that is a tensor of its own: a cast of the
    # stream's gradient (a bf16 output added to an fp32 stream) or mHC's merge backward (N > 1); with a
    # plain residual in the output's dtype it is the stream's gradient itself, counted in ``agrad`` (counting an fp32
    # input gradient and the output's again would count that gradient twice).
    y_mlp = c if spec.mlp_types[i] == "dense" else xb
    grad_attn = n * H * (xb + (c if (c != s or N > 1) else 0))
    grad_mlp = n * H * (xb + (y_mlp if (y_mlp != s or N > 1) else 0))
    if tiled:  # the tiles run without a graph: their weights' bf16 copies live only inside backward
        tile_saved = sum(mlp.values())
        mlp_params = sum(W.mlp_params(spec, spec.mlp_types[i])) if tr is None else tr.mlp[i]
        mlp_fwd = int(run.cal.nograd_fraction * tile_saved) + mlp_fwd
        mlp_bwd = tile_saved + mlp_bwd + 2 * W.grad_bytes(mlp_params, W.state_mesh(run.counts, run.mesh), prec)
        mlp_bwd += W.weight_copy_bytes(mlp_params, prec, run.mesh)
        mlp = {"mlp (tiled: input only)": n * xb * H}
    if N > 1:
        fast_merge = "hc_merge" in run.fast_ops
        attn["mHC merge"] = n * C.merge_saved(spec, c, prec, fast_merge)
        y_mlp = c if spec.mlp_types[i] == "dense" else xb
        ffn["mHC merge (mlp)"] = n * C.merge_saved(spec, y_mlp, prec, fast_merge)
    if tiled and N > 1:
        # Glm5DecoderLayer.token_tile: the mHC maps, norms, merges and the MLP run tile by tile with
        # recompute; the layer keeps its input (the boundary), the first half's mHC weights post/comb,
        # the mixer's own saved set and the mixer output y (the second tiled half's input). The tiles'
        # full per-token sets become one tile's temporaries in backward.
        per_token = sum(v for k, v in {**attn, **ffn}.items()
                        if k not in mixer and k != "layer input (boundary)") // max(n, 1) - xb * H
        tile_part = tile * per_token
        mlp_fwd += int(run.cal.nograd_fraction * tile_part)
        mlp_bwd += tile_part
        attn = {"layer input (boundary)": n * resid, "mHC maps (post, comb)": n * f * (N + N * N), **mixer}
        ffn = {"mixer output (tiled input)": n * H * c}
    else:
        ffn.update(mlp)
    wgrad = prec.grad * (_largest_weight(spec, i) if tr is None else tr.largest[i])
    merge = (tile if tiled else n) * C.merge_temp(spec, prec) if N > 1 else 0
    return LayerTerms(
        attn=attn,
        ffn=ffn,
        mixer_fwd=mixer_fwd,
        mixer_bwd=mixer_bwd + grad_attn,
        mlp_fwd=mlp_fwd,
        mlp_bwd=mlp_bwd + grad_mlp,
        merge_fwd=merge,
        wgrad=wgrad,
        boundary_term=attn["layer input (boundary)"],
        tiled=tiled,
    )


def all_layer_terms(run: Run) -> list[LayerTerms]:
    """Per layer, computing each distinct (mixer, MLP, indexer) combination once."""
    cache: dict[tuple, LayerTerms] = {}
    out = []
    spec = run.spec
    for i in range(spec.num_layers):
        key = (spec.layer_types[i], spec.mlp_types[i], spec.indexer_types[i] if spec.indexer_types else "")
        tr = run.counts.trained
        if tr is not None:  # adapters may differ per layer (lora.targets naming layers)
            key += (tr.lora_rows_attn[i], tr.lora_rows_mlp[i], tr.merged[i], tr.mlp[i], tr.largest[i],
                    tr.projections[i])
        if key not in cache:
            cache[key] = layer_terms(run, i)
        out.append(cache[key])
    return out


# ---- the sweep ---------------------------------------------------------------------------------------
def _readers(spec: ModelSpec) -> list[bool]:
    """Per layer: a full-indexer DSA layer whose selection a later shared layer reads."""
    out = [False] * spec.num_layers
    last = None
    for i, kind in enumerate(spec.layer_types):
        if kind != "dsa":
            continue
        if spec.indexer_types[i] == "full":
            last = i
        elif last is not None:
            out[last] = True
    return out


def _state(run: Run) -> tuple[dict[str, int], list[int], int, int]:
    """(persistent state, per-layer gradients, head gradient, embedding gradient)."""
    counts, mesh, prec, m = run.counts, run.mesh, run.prec, run.memory
    state = {
        "parameters": W.param_bytes(counts, mesh, prec),
        "optimizer state": W.optimizer_gpu_bytes(counts, mesh, prec, m.optimizer_offload, m.optimizer_bucket_params),
    }
    if run.segment:
        state.update(segment_store_bytes(run))
    state.update(stream.gpu_terms(run, state["parameters"]))  # a frozen base streamed from the host
    acc = run.accumulates
    kept = counts.fp32_kept if prec.master else [0] * len(counts.layers)
    tr = counts.trained
    if tr is not None:  # a frozen base: only what trains has a gradient (the kept fp32 tensors taken as frozen),
        kept = [0] * len(counts.layers)  # whole on every rank under FSDP (W.state_mesh)
        mesh = W.state_mesh(counts, mesh)
    whole = [counts.layer_trained(i)[1] if mesh.ep > 1 else 0 for i in range(len(kept))]  # the experts under ep
    g_layers = [W.grad_bytes(sum(counts.layer_trained(i)), mesh, prec, k, acc, w)
                for i, (k, w) in enumerate(zip(kept, whole))]
    tied = run.spec.tie_word_embeddings
    head, embed, norm = (counts.head, counts.embed, counts.final_norm) if tr is None else (tr.head, tr.embed,
                                                                                            tr.final_norm)
    g_head = W.grad_bytes(norm + (embed if tied else head), mesh, prec, 0, acc)
    g_embed = 0 if tied else W.grad_bytes(embed, mesh, prec, 0, acc)
    return state, g_layers, g_head, g_embed


def fsdp_per_layer(run: Run) -> tuple[list[int], int, int]:
    """(parameters FSDP gathers for each layer, for the embedding (0 when tied: it is the root's head), the
    root's head + final norm)."""
    counts, mesh, prec = run.counts, run.mesh, run.prec
    layers = [W.gathered_params(counts, i, mesh, prec) for i in range(len(counts.layers))]
    tied = run.spec.tie_word_embeddings
    tr = counts.trained
    if tr is not None:  # a frozen base: its frozen part only (what trains is whole on every rank)
        return layers, 0 if tied else tr.frozen_embed, tr.frozen_final_norm + (tr.frozen_embed if tied
                                                                                 else tr.frozen_head)
    head = counts.final_norm + (counts.embed if tied else counts.head)
    return layers, 0 if tied else counts.embed, head


def segment_store_bytes(run: Run) -> dict[str, int]:
    """What sequence segments keep over the whole sequence (``memory/model_segments.py``): per DSA layer
    the latent ``c * R`` and the indexer's keys + gates ``f * 2 Di`` per token (fp32: LayerNorm under
    autocast) and the latent's fp32 gradient accumulator; during a DSA layer's backward one more fp32
    ``[s, R]`` (the earlier latents' gradient) and the latents gathered for its graph ``c * R`` (in
    ``dsa_saved``); per KDA layer the fp32 state ``[Hh, D, D]`` and the ``K - 1`` halo inputs at every
    segment start (this rank's cp share of the heads: the halo is carried after the q/k/v projections,
    ``3 * Hh / cp * D`` wide); with ``segment_keep_selection`` every full-indexer DSA layer's selection ``4 W``
    per token (all kept when the backward begins); with the indexer objective the fp32 gradient of every full
    indexer's keys + gates ``f * 2 Di`` per token."""
    spec, prec, B, S, T = run.spec, run.prec, run.batch, run.seq_len, run.segment
    c, f = prec.compute, prec.f32
    R = spec.kv_lora_rank + spec.qk_rope_head_dim
    dsa = spec.layer_types.count("dsa")
    kda = spec.layer_types.count("kda")
    segs = -(-S // T)
    # per rank: its cp share of the KDA heads' state [Hh/cp, D, D] (fp32) and halo [K - 1, 3 * Hh/cp * D]
    Hl, D = spec.linear_num_heads // run.mesh.cp, spec.linear_head_dim
    state = Hl * D * D * f + (spec.linear_conv_kernel - 1) * 3 * Hl * D * c
    full = sum(1 for i, k in enumerate(spec.layer_types) if k == "dsa" and spec.indexer_types[i] == "full")
    kept = full * SA.dsa_selection_bytes(spec, B * S) if run.memory.segment_keep_selection else 0
    out = {
        "segment DSA selections (kept)": kept,
        "segment caches (DSA latents, indexer keys)": dsa * B * S * (R * c + 2 * spec.index_head_dim * f),
        "segment latent gradients (fp32)": (dsa + (1 if dsa else 0)) * B * S * R * f,
        "segment KDA states": kda * segs * B * state,
        # model.train_indexer: the indexer keys' gradient from later segments, fp32 [B, S, 2 Di] per full indexer
        "segment indexer key gradients (fp32)": (full * B * S * 2 * spec.index_head_dim * f
                                                 if run.indexer_objective else 0),
    }
    out.update(_segment_mixer_store(run, segs))
    return out


def _segment_mixer_store(run: Run, segs: int) -> dict[str, int]:
    """Sequence segments' store of softmax attention, dense MLA and gated DeltaNet layers (the rest of
    ``segment_store_bytes``): per attention layer the K and V caches of every token, this rank's KV heads
    (``kv / cp``, after ``seq_to_heads``), and their fp32 gradient accumulators, ``2 (c + f) kv D`` per token;
    per MLA layer the latent ``[c | k_rot]`` (gathered: all tokens on every rank) and its fp32 accumulator,
    ``(c + f) (R + Dr)``; per GDN layer the fp32 state ``[Hv / cp, Dk, Dv]`` and the ``K - 1`` conv inputs
    ``C / cp`` wide at every segment start but the first."""
    spec, prec, B, S, cp = run.spec, run.prec, run.batch, run.seq_len, run.mesh.cp
    c, f = prec.compute, prec.f32
    kinds = spec.layer_types
    Hk, Dk, Hv, Dv = LM.gdn_dims(spec)
    gdn_state = Hv // cp * Dk * Dv * f + (spec.linear_conv_kernel - 1) * (2 * Hk * Dk + Hv * Dv) // cp * c
    out = {}
    rows = segment_kv_rows(run)
    if run.memory.segment_kv_host and rows:  # the store in host memory (segment_kv_host_bytes), two layers here
        out["segment K/V in flight (host-kept store)"] = B * S * max(rows) * (3 * c + 2 * f)
    elif "attention" in kinds:  # (only softmax attention's heads constrain cp: ask only then)
        D = spec.head_dim or spec.hidden_size // spec.num_attention_heads
        kv = max(1, layers.kv_heads(spec, run.mesh) // cp)
        out["segment K/V caches + fp32 gradients"] = kinds.count("attention") * B * S * 2 * (c + f) * kv * D
    if "mla" in kinds and not run.memory.segment_kv_host:
        out["segment MLA latents + fp32 gradients"] = (kinds.count("mla") * B * S * (c + f)
                                                       * (spec.kv_lora_rank + spec.qk_rope_head_dim))
    if "gdn" in kinds:
        out["segment GDN states"] = kinds.count("gdn") * max(segs - 1, 0) * B * gdn_state  # none into the first
    return out


def segment_kv_rows(run: Run) -> list[int]:
    """Elements per token of each softmax-attention layer's K and V (this rank's KV heads) and each dense MLA
    layer's latent ``[c | k_rot]``: the rows sequence segments keep for every token (``attend_seq``)."""
    spec, out = run.spec, []
    for kind in spec.layer_types:
        if kind == "attention":
            D = spec.head_dim or spec.hidden_size // spec.num_attention_heads
            out.append(2 * max(1, layers.kv_heads(spec, run.mesh) // run.mesh.cp) * D)
        elif kind == "mla":
            out.append(spec.kv_lora_rank + spec.qk_rope_head_dim)
    return out


def segment_kv_host_bytes(run: Run) -> int:
    """``memory.segment_kv_host``: the host memory of the K/V (or latent) rows of every token and layer with their
    fp32 gradient accumulators, ``(c + f) * rows`` per token and layer (``memory/segment_host.py``); 0 when off.
    The device holds about two layers' worth instead (``_segment_mixer_store``): the rows and the accumulator
    of the layer in its backward, their gradient, and the next layer's rows and accumulator fetched ahead."""
    if not (run.segment and run.memory.segment_kv_host):
        return 0
    return run.batch * run.seq_len * sum(segment_kv_rows(run)) * (run.prec.compute + run.prec.f32)


def _copies(run: Run, i: int, cached_only: bool) -> int:
    """bf16 weight copies of layer i (autocast). ``cached_only``: the autocast cache of a no-grad forward
    keeps the leaf weights' casts, not the experts' (cast per expert from a view). A tiled MLP runs its
    tiles without a graph, so the layer's graph holds no copies of the MLP's weights."""
    dense, experts, _ = run.counts.layers[i]
    if run.counts.trained is not None:  # a frozen base is stored in the compute dtype: nothing to cast
        dense, experts = run.counts.layer_trained(i)
        return W.weight_copy_bytes(dense + (0 if cached_only else experts), run.prec, run.mesh)
    if cached_only:
        experts = 0
    elif run.memory.tiled_mlp:
        dense -= W.mlp_params(run.spec, run.spec.mlp_types[i])[0]
        experts = 0
    return W.weight_copy_bytes(dense + experts, run.prec, run.mesh)


def _sco_offloaded(run: Run, bnd: int) -> int:
    m = run.memory
    if not (m.recompute and m.checkpoint_offload) or bnd == 0:
        return 0
    return C.sco_plan(run.spec.num_layers, bnd, m.offload_host_budget).num_offloaded


def _phases(run: Run, terms: list[LayerTerms]) -> list[tuple[str, dict[str, int], str]]:
    spec, prec, mesh, n = run.spec, run.prec, run.mesh, run.n
    L, H, s = spec.num_layers, spec.hidden_size, prec.stream
    rec = run.memory.recompute
    state, g_layers, g_head, g_embed = _state(run)
    # gradients accumulate over micro-batches, and over sequence segments (a segment's forward runs with
    # the later segments' gradients held)
    acc = run.grad_accum > 1 or bool(run.segment)
    g_all = sum(g_layers) + g_head + g_embed
    gathered, embed_block, head = fsdp_per_layer(run)
    frozen = run.counts.trained is not None  # a frozen base: FSDP gathers it in its storage dtype, no gradient
    blocks = ([embed_block] if embed_block else []) + gathered  # FSDP units in forward order (root apart)
    first = 1 if embed_block else 0

    def fsdp(i: int, backward: bool) -> int:  # layer i running, its neighbour's all-gather prefetched
        j = first + i
        other = blocks[j - 1] if backward and j > 0 else (blocks[j + 1] if not backward and j + 1 < len(blocks)
                                                          else 0)
        return W.fsdp_buffers(blocks[j], other, head, mesh, prec, run.reduce_bytes, backward, frozen)
    bnd = C.boundary_bytes(spec, n, prec)
    final = n * (C.norm_saved(H, s, prec, fast="rms_norm" in run.fast_ops)[0] + s * H)
    # under autocast the trainer casts the hidden states and the head to the compute dtype for the loss
    cast = prec.autocast and run.loss_in_compute_dtype
    d_loss = prec.compute if cast else s
    head_trains = run.counts.head_trained()  # a frozen head: no weight gradient, already in the compute dtype
    loss = C.loss_bytes(
        spec, n, d_loss, run.memory.chunked_loss, run.memory.loss_chunk_tokens, weight_grad=head_trains,
        fast="linear_cross_entropy" in run.fast_ops,
    ) + ((n + (spec.vocab_size if head_trains else 0)) * H * d_loss if cast else 0)
    sel = SA.dsa_selection_bytes(spec, n) if "dsa" in spec.layer_types else 0
    readers = _readers(spec)
    k = _sco_offloaded(run, bnd)
    fwd_state = dict(state, **{"gradients": g_all if acc else 0})
    # each layer's weight copies and DSA selection once, with running sums (the phases read prefixes of them)
    copies_cached = [_copies(run, i, cached_only=True) for i in range(L)]
    copies_full = [_copies(run, i, cached_only=False) for i in range(L)]
    copies_upto = list(itertools.accumulate(copies_full, initial=0))  # [i]: layers 0 .. i - 1
    sel_upto = list(itertools.accumulate((sel if readers[j] else 0 for j in range(L)), initial=0))
    out: list[tuple[str, dict[str, int], str]] = []
    saved_before, copies_before, carry = 0, 0, 0
    for i, t in enumerate(terms):  # forward
        A, F = sum(t.attn.values()), t.saved - sum(t.attn.values())
        kind = f"layer {i} ({spec.layer_types[i]} + {spec.mlp_types[i]})"
        carry += sel if (rec and readers[i]) else 0
        if rec:
            copies_before += copies_cached[i]
            kept = max(0, i + 1 - k) + (1 if i < k else 0)
            work = int(run.cal.nograd_fraction * (t.saved - t.boundary_term))
            work += max(t.mixer_fwd, t.mlp_fwd, t.merge_fwd)
            comps = {"checkpoint boundaries": kept * bnd, "layer working set": work}
        else:
            copies_before += copies_full[i]
            part, work = max(
                (t.before_mixer_output, t.mixer_fwd), (A + F, t.mlp_fwd), (A + F, t.merge_fwd), key=sum
            )
            comps = {"saved activations": saved_before + part, "layer working set": work}
            saved_before += t.saved
        out.append(
            (
                f"forward, {kind}",
                dict(
                    fwd_state,
                    **comps,
                    **{"weight copies (bf16)": copies_before, "DSA selections (carry)": carry,
                       "FSDP buffers": fsdp(i, False)},
                ),
                kind,
            )
        )
    loss_comps = {
        "vocabulary projection (loss)": loss,
        "final norm + hidden": final,
        "DSA selections (carry)": carry,
    }
    if rec:
        loss_comps["checkpoint boundaries"] = (L - k) * bnd
    else:
        loss_comps.update({"saved activations": saved_before, "weight copies (bf16)": copies_before})
    loss_comps["FSDP buffers"] = W.fsdp_buffers(0, 0, head, mesh, prec, run.reduce_bytes, False, frozen)
    out.append(("loss", dict(fwd_state, **loss_comps), "loss"))
    grads = g_head + (g_embed if acc else 0) + (sum(g_layers) if acc else 0)
    for i in range(L - 1, -1, -1):  # backward
        t = terms[i]
        A, F = sum(t.attn.values()), t.saved - sum(t.attn.values())
        grads += 0 if acc else g_layers[i]
        kind = f"layer {i} ({spec.layer_types[i]} + {spec.mlp_types[i]})"
        common = dict(state, **{"gradients": grads, "FSDP buffers": fsdp(i, True)})
        # layer i's own peak, as (saved part, temporaries, activation gradients) at each moment: its
        # backward (the MLP half first, then the mixer with the MLP half freed); under recompute first its
        # rerun forward, when only the incoming gradient exists, and in its backward the rerun's output,
        # which memory/offload.py keeps alive while autograd.grad runs
        out_alive = bnd if rec else 0
        agrad = 2 * bnd + t.wgrad + out_alive
        branches = [(A + F, t.mlp_bwd, agrad), (A, t.mixer_bwd, agrad)]
        if rec:
            pre = t.before_mixer_output
            branches += [(pre, t.mixer_fwd, bnd), (A + F, t.mlp_fwd, bnd), (A + F, t.merge_fwd, bnd)]
        part, work, agrad = max(branches, key=sum)
        if rec:
            kept = max(0, i + 1 - k) + min(2, min(i + 1, k))
            live = sel_upto[i + 1]
            comps = {
                "checkpoint boundaries": kept * bnd,
                "recomputed layer": part - t.boundary_term,
                "layer working set": work,
                "activation gradients": agrad,
                "weight copies (bf16)": copies_full[i],
                "DSA selections (carry)": live,
            }
        else:
            saved_before -= t.saved
            copies = copies_upto[i + 1]
            comps = {
                "saved activations": saved_before + part,
                "layer working set": work,
                "activation gradients": agrad,
                "weight copies (bf16)": copies,
            }
        out.append((f"backward, {kind}", dict(common, **comps), kind))
    out.append(("optimizer step", dict(state, gradients=g_all), "step"))
    return out


def evaluate(run: Run) -> Evaluation:
    """The peak over the phases of one step, its breakdown, and the host memory."""
    terms = all_layer_terms(run)
    phases = _phases(run, terms)
    name, comps, where = max(phases, key=lambda p: sum(p[1].values()))
    tensors = sum(comps.values())
    reserve = C.allocator_reserve(tensors, run.cal)
    breakdown = {k: v for k, v in comps.items() if v} | {
        "allocator reserve": reserve,
        "CUDA context": run.cal.cuda_context_bytes,
    }
    summary: dict[str, int] = {}
    for label, _, _ in (("forward", 0, 0), ("loss", 0, 0), ("backward", 0, 0), ("optimizer step", 0, 0)):
        summary[label] = max(sum(c.values()) for p, c, _ in phases if p.startswith(label))
    saved_terms: dict[str, int] = {}
    for t in terms:
        for k, v in list(t.attn.items()) + list(t.ffn.items()):
            saved_terms[k] = saved_terms.get(k, 0) + v
    bnd = C.boundary_bytes(run.spec, run.n, run.prec)
    k = _sco_offloaded(run, bnd)
    host = {
        "process (Python, torch, CUDA host state)": run.cal.process_host_bytes,
        "SCO pinned boundaries": k * C.round_up(bnd),
        "segment K/V + fp32 gradients (memory.segment_kv_host)": segment_kv_host_bytes(run),
        "optimizer state (OffloadStreamAdamW)": W.optimizer_host_bytes(
            run.counts, run.mesh, run.memory.optimizer_offload, run.prec
        ),
        **stream.host_terms(run),
    }
    notes = {"layer working set": where, "recomputed layer": where, "saved activations": name}
    # torch's AdamW makes its moments in the first update; MasterAdamW (bf16 weights) makes its state with
    # the optimizer, so the first step has it too
    eager = bool(run.prec.master) and not run.memory.optimizer_offload
    first = max(sum(v for k, v in c.items() if k != "optimizer state" or p == "optimizer step" or eager)
                for p, c, _ in phases)
    return Evaluation(
        first_step_tensors=first,
        peak_tensors=tensors,
        peak_gpu=tensors + reserve + run.cal.cuda_context_bytes,
        phase=name,
        breakdown=breakdown,
        notes=notes,
        phases=summary,
        host_per_gpu=host,
        peak_host=sum(host.values()) * run.mesh.gpus_on_host,
        saved_terms=saved_terms,
    )
