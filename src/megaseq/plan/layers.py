"""Per-layer-kind working sets: what each token mixer and MLP kind saves for backward, and its temporaries.

Pure Python. One function per kind and direction, in bytes for ``n`` tokens on one GPU, following the
megaseq blocks op by op. This module holds softmax attention (``attention_saved`` / ``attention_temp``,
sinks and sliding windows), MLA (``mla_saved`` / ``mla_temp``), the DSA indexer (``indexer_temp``,
``indexer_objective_bytes``) and the sequence-segment terms; the other kinds sit one module each and are
re-exported here, so ``plan.layers`` names every kind's terms: KDA and GDN in ``linear_mixers``, DSA's
attention in ``sparse_attention``, the MLP, MoE and shared expert in ``mlp``. Named coefficients live in
``mesh.Calibration``. Notation as in ``activations``: c compute bytes, f fp32 bytes, xb bytes of the normed
block input, D = KDA heads x head dim. ``docs/planner.md`` has the arithmetic.

``trains``: with a frozen base (LoRA, ``train.trainable``) the layer's projections whose weight gets a
gradient, by name within the layer (``self_attn.q_proj``, ``mlp.experts.gate_up_proj``: an adapter counts,
its ``A`` reads the same input); None: every one. autograd keeps a linear's input only for its weight's
gradient, so a frozen projection's input is not saved (unless another op keeps it).
"""

from __future__ import annotations

from megaseq.memory.rules import round_up
from megaseq.models.spec import ModelSpec
from megaseq.ops.workspace import (  # noqa: F401  (the ops' own formulas)
    absorbed_bytes,
    indexer_kl_bytes,
    indexer_kl_kept_bytes,
    indexer_recall_bytes,
    indexer_scoring_bytes,
    indexer_topk_bytes,
    kv_repeats,
    mla_segment_group_bytes,
    mla_segment_heads,
    sdpa_head_groups,
    sink_attention_dims,
    sliding_key_rows,
    sparse_mla_pool_bytes,
    triton_sparse_mla_bytes,
)
from megaseq.plan.activations import Trains, if_trained, norm_saved, trained_inputs
from megaseq.plan.linear_mixers import gdn_dims, gdn_saved, gdn_temp, kda_saved, kda_segmented, kda_temp  # noqa: F401
from megaseq.plan.mesh import Mesh, Precision
from megaseq.plan.mlp import (  # noqa: F401  (re-exported: plan.layers names every layer kind's terms)
    mlp_saved,
    mlp_temp,
    moe_router_saved,
    moe_row_saved,
    moe_row_temp,
    moe_rows,
    moe_saved,
    shared_expert_saved,
    swiglu_saved_ci,
)
from megaseq.plan.sparse_attention import (  # noqa: F401  (re-exported)
    absorbed_temp,
    dsa_kv_rows,
    dsa_saved,
    dsa_score_block,
    dsa_selection_bytes,
    dsa_temp,
    dsa_width,
)


def indexer_scoring(spec: ModelSpec, query_chunk: int, seq_len: int, fast: bool = False) -> int:
    """One scoring chunk of ``query_chunk`` queries over a ``seq_len`` sequence: the fp32 reference's
    (``ops.workspace.indexer_scoring_bytes``: head scores ``[c, I, P]``) or, ``fast``, the Triton
    selection's (``ops.indexer.topk.indexer_topk_bytes``: summed scores ``[c, P]`` and its candidates)."""
    kp = max(spec.index_kpool, 1)
    pools, select = seq_len // kp, spec.index_topk // kp
    if fast:
        return indexer_topk_bytes(query_chunk, pools, spec.index_n_heads, select, head_dim=spec.index_head_dim)
    return indexer_scoring_bytes(query_chunk, pools, spec.index_n_heads, select)


def indexer_temp(spec: ModelSpec, n: int, batch: int, seq_len: int, query_chunk: int, prec: Precision,
                 fast: bool = False) -> int:
    """The indexer's forward (no grad): its queries ``c * I * Di`` and head weights ``f * I`` per query,
    the gathered keys + gates and pooling temporaries ``(3c + 2f) * Di`` and positions/documents
    ``16`` per sequence token, and the larger of one scoring chunk (``indexer_scoring``; ``fast``: the
    Triton selection's) and the selection in int64 then int32 ``12 * W`` (built after the scoring)."""
    I, Di, c, f = spec.index_n_heads, spec.index_head_dim, prec.compute, prec.f32
    chunk = min(query_chunk, n // batch)
    per_query = c * I * Di + f * I + c * 2 * Di
    per_key = (3 * c + 2 * f) * Di + 16
    scoring = indexer_scoring(spec, chunk, seq_len, fast)
    # the int64 selection and its int32 copy are built after the last scoring chunk is freed
    return n * per_query + batch * seq_len * per_key + max(scoring, 3 * dsa_selection_bytes(spec, n))


def indexer_objective_bytes(spec: ModelSpec, n: int, batch: int, seq_len: int, prec: Precision,
                            fused_target: bool = False, given_lse: bool = False,
                            lse_copy: bool = False, fused_kl: bool = False) -> tuple[int, int]:
    """The indexer objective of one full-indexer layer in the sparse stage (``models.common.indexer_objective``'s
    ``SparseObjective``, which runs in the backward right after the layer's attention): ``(kept from the forward
    to it, its working set there)`` from ``ops.workspace.indexer_kl_bytes`` (fp32: the objective computes in
    ``promote(dtype, fp32)``). Kept are the pooled keys' graph and, with ``lse_copy``, the attention's log-sum-exp
    ``[Q, Hh]`` fp32, a tensor of its own under ``sparse_attention``'s ``absorbed`` and ``torch_masked`` (the
    Triton op's is a view of the tensor it saves); the working set is one chunk and the gradients it sums (pooled
    keys ``[P, Di]`` and head weights ``[Q, I]``). ``fused_target``: the target comes from op ``indexer_target``'s
    Triton kernel or from the attention's head-summed probabilities (no gathered latents or head scores in the
    chunk, so more rows a chunk). ``given_lse``: the target reads the attention's per-head log-sum-exp (what the
    layer does). ``fused_kl``: the indexer side in op ``indexer_kl``'s kernel. The working set also holds, after the
    chunks, one group of the sampled recall (``indexer_recall_bytes``, over every key). The head-summed
    probabilities themselves are ``head_probs_bytes``."""
    kp = max(spec.index_kpool, 1)
    P, K = seq_len // kp, spec.index_topk // kp
    W = dsa_width(spec)
    R = spec.kv_lora_rank + spec.qk_rope_head_dim
    Q = max(1, n // batch)
    total = indexer_kl_bytes(Q, seq_len, spec.num_attention_heads, spec.index_n_heads, spec.index_head_dim, P, K,
                             W, R, dense=False, itemsize=prec.f32, gathered_itemsize=prec.compute,
                             fused_target=fused_target, query_width=spec.q_lora_rank, given_lse=given_lse,
                             lse_copy=lse_copy, fused_kl=fused_kl, keys_itemsize=prec.compute,
                             recall=indexer_recall_bytes(spec.num_attention_heads, seq_len))
    kept = batch * indexer_kl_kept_bytes(Q, seq_len, spec.num_attention_heads, spec.index_head_dim, P, False,
                                         prec.f32, given_lse, lse_copy)
    return kept, batch * total - kept


def head_probs_bytes(spec: ModelSpec, n: int, impl: str) -> int:
    """The head-summed probabilities ``[n, W]`` fp32 (``ops.sparse_mla.reference.HeadProbs``) that
    ``sparse_attention``'s backward leaves for the sparse stage's objective under ``triton`` and ``absorbed``
    (none under ``torch_masked``): made as the attention's backward starts, freed when the objective is done."""
    return 4 * n * dsa_width(spec) if impl in ("triton", "absorbed") else 0


def attention_saved(spec: ModelSpec, n: int, xb: int, prec: Precision, mesh: Mesh,
                    trains: Trains = None, window: int = 0, seq_len: int = 0) -> dict[str, int]:
    """GQA softmax attention (``blocks/attention.py``) with SDPA: q/k/v inputs, q/k RMSNorm per head
    ``(f + c) * (Hq + Hkv) * D`` (zero-centered norms, Qwen3-Next: ``2 f``, their fp32 input and normalised
    value), RoPE's cos/sin ``2 * q_bytes * rotated dims``, SDPA's q, k, v, o (bf16 casts) and log-sum-exp,
    and o_proj's input. KV heads repeated for Ulysses when cp does not divide them. Qwen3-Next's output
    gate (``attn_output_gate``): ``o * sigmoid(gate)`` keeps the sigmoid's output ``c * Hq * D`` (o itself
    is a view of SDPA's kept output in one call; in several, their concatenation, a copy it also keeps).
    With attention sinks (gpt-oss, ``models.common.sink_attention``'s SDPA path) q, k, v and o are
    ``sink_attention_dims(D)`` wide, and a sliding layer (``window``) keeps its blocks' keys and values,
    ``sliding_key_rows`` per token, and its reshaped q (``attention_sink_saved``)."""
    H, Hq, Hkv = spec.hidden_size, spec.num_attention_heads, spec.num_key_value_heads
    D, c, f = spec.head_dim or H // Hq, prec.compute, prec.f32
    kv = sdpa_kv_heads(spec, prec, mesh)
    kept = f if spec.norm_zero_centered else (0 if prec.frozen_norms else c)
    norms = (f + kept) * (Hq + Hkv) * D if spec.qk_norm else 0
    if spec.qk_norm and spec.attn_output_gate and c == f:  # no cast: q_norm keeps a view of q_proj's [q | gate]
        norms += f * Hq * D
    # RoPE's cos/sin over the rotated dims, in q's dtype after its norm: the fp32 weight promotes a plain
    # RMSNorm's output, a zero-centered one casts back (type_as)
    q_bytes = f if (spec.qk_norm and not spec.norm_zero_centered) else c
    rot = int(D * spec.partial_rotary_factor)
    qkv = [f"self_attn.{x}" for x in ("q_proj", "k_proj", "v_proj")]
    sdpa = (attention_sink_saved(spec, prec, kv, window, seq_len) if spec.attention_sinks
            else c * (2 * Hq + 2 * kv) * D + f * Hq)
    out = {
        "attention projections' inputs": n * trained_inputs(H, qkv, xb, prec, trains),
        "attention q/k norms + rope": n * (norms + 2 * q_bytes * rot),
        "attention q,k,v,o + lse": n * sdpa,
        "attention o_proj input": n * c * Hq * D * if_trained("self_attn.o_proj", trains),
    }
    if spec.attn_output_gate:  # one call: o is a view of SDPA's output (kept above); the product is o_proj's input
        out["attention output gate (sigmoid)"] = n * c * Hq * D
        if sdpa_groups(spec, mesh)[0] > 1:  # o is the calls' concatenation: a copy, kept by the gate
            out["attention heads' concatenation"] = n * c * Hq * D
    return out


def kept_attention_bytes(spec: ModelSpec, kind: str, n: int, prec: Precision) -> int:
    """What a layer keeping attention's output for its rerun (``memory.keep_attention_layers``,
    ``ops.kept_attention``) holds from its forward to its backward, for ``n`` query tokens: SDPA's output in the
    compute dtype and its log-sum-exp in fp32 per head. Softmax attention: ``Hq`` heads of ``D`` (with sinks
    ``sink_attention_dims(D)``); dense MLA: ``Hh`` heads of ``max(Dq, Dv)`` (the values padded to q's width).
    Under Ulysses each rank holds all tokens of ``1 / cp`` of the heads: the same bytes. 0 for the layers whose
    attention is not SDPA (KDA, GDN, DSA's sparse kernels)."""
    c, f = prec.compute, prec.f32
    if kind == "attention":
        Hq = spec.num_attention_heads
        D = spec.head_dim or spec.hidden_size // Hq
        return n * (c * Hq * (sink_attention_dims(D) if spec.attention_sinks else D) + f * Hq)
    if kind == "mla":
        Hh = spec.num_attention_heads
        return n * (c * Hh * max(spec.qk_head_dim, spec.v_head_dim) + f * Hh)
    return 0


def kept_attention_host_bytes(spec: ModelSpec, kind: str, n: int, prec: Precision, mesh: Mesh) -> int:
    """The pinned host bytes of a layer keeping attention's output in host memory
    (``memory.keep_attention_host_layers``, ``memory.offload.KeptHostStore``): ``kept_attention_bytes``' tensors,
    each at a ``SLOT_ALIGN``-aligned offset of the pool: per SDPA call of the layer (softmax attention:
    ``sdpa_groups``; MLA: one) its output and its log-sum-exp, each rounded up. Calls per document of packed
    rows add at most ``2 x SLOT_ALIGN`` bytes each (not counted)."""
    total = kept_attention_bytes(spec, kind, n, prec)
    if not total:
        return 0
    calls = sdpa_groups(spec, mesh)[0] if kind == "attention" else 1
    lse = n * prec.f32 * spec.num_attention_heads
    return calls * (round_up((total - lse) // calls) + round_up(lse // calls))


def attention_sink_saved(spec: ModelSpec, prec: Precision, kv: int, window: int, seq_len: int) -> float:
    """Per token, what the sink attention's SDPA call keeps: q and o ``Dp`` wide (``Dp =
    sink_attention_dims(D)``), the log-sum-exp, and k, v: ``kv`` heads (full layers) or, in a sliding layer,
    ``Hkv`` heads of ``sliding_key_rows`` keys per token (the blocks' copies)."""
    Hq, Hkv, c, f = spec.num_attention_heads, spec.num_key_value_heads, prec.compute, prec.f32
    Dp = sink_attention_dims(spec.head_dim or spec.hidden_size // Hq)
    keys = 2 * Hkv * sliding_key_rows(window, seq_len) if window else 2 * kv
    return c * (2 * Hq + keys) * Dp + f * Hq


def mla_saved(spec: ModelSpec, n: int, xb: int, prec: Precision, trains: Trains = None,
              fast_norm: bool = False) -> dict[str, int]:
    """Dense MLA (``models/common/mla.py``: DeepSeek-V3, Kimi-Linear's MLA layers) through SDPA, per query
    token (``n`` this rank's tokens; under Ulysses each rank holds all tokens of ``Hh / cp`` heads: the
    same bytes). Hh heads, R kv_lora_rank, Dn/Dr/Dv the nope/rope/value head dims, Dq = Dn + Dr.

    The projections' inputs (``q_a_proj`` or ``q_proj``, and ``kv_a_proj_with_mqa``); the q_a / kv_a
    RMSNorms ``(f + c) * rank`` (``fast_norm``: the Triton norm's input and rstd, ``activations.norm_saved``) and
    q_b's input; RoPE's cos/sin ``2 * xb * Dr`` (rotating layers only);
    kv_b's input, the normed latent ``c * R`` (its bf16 cast; without autocast the latent itself,
    ``R + Dr`` wide); SDPA's q, k, v and output, each ``Hh * Dq`` wide (the op zero-pads v to q's head dim
    when ``Dv < Dq``, ``ops`` ``attention_sdpa``, so v and o are ``Dq`` wide) in the compute dtype, and
    its log-sum-exp ``f * Hh``; o_proj's input ``c * Hh * Dv`` (the sliced output, copied by the reshape).
    kv_b's output itself is not kept (k and v are new tensors: a concatenation and a pad)."""
    H, Hh, c, f = spec.hidden_size, spec.num_attention_heads, prec.compute, prec.f32
    ql, R, Dr, Dv = spec.q_lora_rank, spec.kv_lora_rank, spec.qk_rope_head_dim, spec.v_head_dim
    Dq = spec.qk_head_dim
    p = "self_attn."
    first = [p + ("q_a_proj" if ql else "q_proj"), p + "kv_a_proj_with_mqa"]
    q_norm, q_out = norm_saved(ql, c, prec, fast=fast_norm) if ql else (0, c)
    kv_norm, kv_out = norm_saved(R, c, prec, fast=fast_norm)
    # without autocast kv_b reads a view of the latent [c | k_rot] and the torch kv_a_layernorm a view of kv_a's
    # output: both keep the whole R + Dr wide storage (the Triton norm keeps its own R wide input)
    latent = R + (0 if prec.autocast else Dr)
    kv_norm += 0 if (prec.autocast or fast_norm) else f * Dr
    rotate = spec.mla_rotate and Dr > 0
    return {
        "mla projections' inputs": n * trained_inputs(H, first, xb, prec, trains),
        "mla q/kv norms + q_b input": n * (q_norm + kv_norm
                                          + (trained_inputs(ql, [p + "q_b_proj"], q_out, prec, trains) if ql else 0)),
        "mla rope cos/sin": n * 2 * xb * Dr if rotate else 0,
        "mla kv_b input": n * (trained_inputs(latent, [p + "kv_b_proj"], kv_out, prec, trains)),
        "mla q,k,v,o (SDPA, v padded) + lse": n * (c * 4 * Hh * max(Dq, Dv) + f * Hh),
        "mla o_proj input": n * c * Hh * Dv * if_trained(p + "o_proj", trains),
    }


def mla_temp(spec: ModelSpec, n: int, prec: Precision, backward: bool) -> int:
    """Dense MLA temporaries above the saved set. Forward: kv_b's output ``c * Hh * (Dn + Dv)`` (alive until
    k and v are built) and, under autocast, the fp32 q and k (RoPE's fp32 cos/sin and the fp32 latent promote
    the concatenations) before SDPA's bf16 casts, ``2 f * Hh * Dq``. Backward: SDPA's dq, dk, dv ``3 c * Hh *
    Dq`` and its fp32 dq accumulator, then (autocast) dq and dk cast back to fp32 and kv_b's output gradient,
    taken as ``f * Hh * Dq`` more."""
    Hh, c, f = spec.num_attention_heads, prec.compute, prec.f32
    Dq, Dn, Dv = max(spec.qk_head_dim, spec.v_head_dim), spec.qk_nope_head_dim, spec.v_head_dim
    promoted = 2 * f * Hh * spec.qk_head_dim if prec.autocast else 0
    if not backward:
        return n * (c * Hh * (Dn + Dv) + promoted)
    return n * (3 * c * Hh * Dq + f * Hh * Dq + (f * Hh * Dq if prec.autocast else 0))


# ---- sequence segments: the keys of every token so far (memory/model_segments.py) -------------------------
def attention_segment_temp(spec: ModelSpec, rows: int, prec: Precision, mesh: Mesh, backward: bool) -> int:
    """Softmax attention under sequence segments, above its per-query terms: ``rows`` keys (``B * e``: every
    token up to the segment's end; the last segment's ``B * S``) of this rank's KV heads ``kv / cp``. Forward
    (no graph): SDPA reads views of the K/V caches, nothing more (float32 with GQA: the repeated heads,
    ``kv_for_sdpa``). Backward: the checkpointed attention is rebuilt one layer at a time: the joined k and v
    and their gradients ``4 c kv D`` per key, and with more query heads than KV heads in an SDPA call the
    kernel's per-query-head dk and dv ``2 c (Hq / calls) D`` (``attention_temp``'s ``dk_expanded``)."""
    Hq, D, c = spec.num_attention_heads // mesh.cp, spec.head_dim or spec.hidden_size // spec.num_attention_heads, \
        prec.compute
    kv = max(1, kv_heads(spec, mesh) // mesh.cp)
    calls, gqa = sdpa_groups(spec, mesh)
    repeated = 2 * c * Hq * D if prec.compute == 4 and gqa else 0
    if not backward:
        return rows * repeated
    return rows * (4 * c * kv * D + (2 * c * (Hq // calls) * D if gqa else 0) + repeated)


def mla_segment_saved(spec: ModelSpec, n: int, prec: Precision) -> int:
    """Dense MLA under sequence segments (``MultiLatentAttention._attend_carried``) keeps, per query token, the
    queries ``c * Hh * Dq`` (the segment attention's saved input: its keys are rebuilt from the carried latent
    in the backward), in place of the one-pass SDPA's q, k, v, o and log-sum-exp."""
    return n * prec.compute * spec.num_attention_heads * spec.qk_head_dim


def mla_segment_temp(spec: ModelSpec, rows: int, prec: Precision, mesh: Mesh, backward: bool) -> int:
    """Dense MLA under sequence segments, per key row (``rows = B * e``, gathered: every rank holds all keys),
    latent width ``C = R + Dr``: each SDPA call expands the latent to its head group's keys and values
    (``ops.workspace.mla_segment_heads`` heads of this rank's ``Hh / cp``; ``D = max(Dq, Dv)``, v padded to it).
    Forward the group's keys and zero-padded values ``(Dq + D) c`` per head (the values made padded:
    ``MultiLatentAttention._keys_values``). Backward
    (``MultiLatentAttention._attend_groups_vjp``) the joined latent ``c C`` and its gradient, formed in place in
    float32 ``f C``, beside one group's keys, padded values and their gradients
    (``ops.workspace.mla_segment_group_bytes``, ``4 D c`` per head)."""
    C, c = spec.kv_lora_rank + spec.qk_rope_head_dim, prec.compute
    D, heads = max(spec.qk_head_dim, spec.v_head_dim), spec.num_attention_heads // mesh.cp
    if not backward:
        return rows * mla_segment_heads(heads, rows, D, c) * (spec.qk_head_dim + D) * c
    return rows * (c + prec.f32) * C + mla_segment_group_bytes(heads, rows, D, c)


def kv_heads(spec: ModelSpec, mesh: Mesh) -> int:
    """The attention's KV heads, summed over the cp ranks: the model's, repeated for Ulysses when cp does
    not divide them (``kv_repeats``, as the block repeats them)."""
    Hq, Hkv = spec.num_attention_heads, spec.num_key_value_heads
    return Hkv * (kv_repeats(Hq, Hkv, mesh.cp) if mesh.cp > 1 and Hkv % mesh.cp else 1)


def sdpa_groups(spec: ModelSpec, mesh: Mesh) -> tuple[int, bool]:
    """``(calls, gqa)``: SDPA calls per attention layer on one rank (``attention.sdpa_head_groups`` of its
    heads) and whether a call's query heads outnumber its KV heads (flash then expands dk/dv per query head;
    float32 repeats the KV heads, ``kv_for_sdpa``)."""
    Hq, kv = spec.num_attention_heads // mesh.cp, max(1, kv_heads(spec, mesh) // mesh.cp)
    calls = sdpa_head_groups(Hq, kv)
    return calls, Hq // calls > (1 if calls > 1 else kv)


def sdpa_kv_heads(spec: ModelSpec, prec: Precision, mesh: Mesh) -> int:
    """KV heads of the k and v SDPA keeps, summed over the cp ranks: ``kv_heads``, or in float32 with GQA
    within a call the query heads (``kv_for_sdpa``: on CUDA float32 GQA has only the math kernel, so the KV
    heads are repeated)."""
    return spec.num_attention_heads if prec.compute == 4 and sdpa_groups(spec, mesh)[1] else kv_heads(spec, mesh)


def attention_temp(spec: ModelSpec, n: int, prec: Precision, backward: bool, mesh: Mesh | None = None,
                   window: int = 0, seq_len: int = 0) -> int:
    """Flash/cuDNN SDPA temporaries: forward the fp32 q/k after RoPE before their bf16 casts; backward
    dq, dk, dv, the fp32 dq accumulator and, with fewer KV heads than query heads in a call, the per-query-head
    dk and dv summed into dk, dv (flash's ``dk_expanded``, ``dv_expanded``; in float32 the repeated heads'
    gradients). SDPA runs in G calls (``attention.sdpa_head_groups``) one after another: each call's backward
    holds its share (``(f + 2c) Hq D / G``, and a contiguous copy of its output gradient, a slice of the
    concatenation's: ``c Hq D / G``) beside the gradients of q, k, v finished so far, then the query gradient
    is concatenated (``2 c (Hq + Hkv) D``). With cuDNN each call allocates its dq, dk, dv and two float32
    buffers of its q (``2 f Hq D / G``): in bf16 the same bytes as the share above (``docs/planner.md``).
    With attention sinks every head is ``Dp = sink_attention_dims(D)`` wide in SDPA (and a sliding layer's
    keys ``sliding_key_rows`` per token): the terms above scaled so, plus, forward, the padded q's second
    copy and, backward, the gradients sliced back to D dims (an upper bound: not measured on a GPU)."""
    if spec.attention_sinks:
        return _sink_attention_temp(spec, n, prec, backward, mesh, window, seq_len)
    H, Hq, Hkv = spec.hidden_size, spec.num_attention_heads, spec.num_key_value_heads
    D, c, f = spec.head_dim or H // Hq, prec.compute, prec.f32
    if not backward:
        return n * f * (Hq + Hkv) * D
    mesh = mesh or Mesh()
    kv = kv_heads(spec, mesh)
    calls, gqa = sdpa_groups(spec, mesh)
    grads = c * (Hq + 2 * kv) * D  # dq, dk, dv
    per_call = (f + (2 * c if gqa else 0)) * Hq * D // calls  # the dq accumulator, dk and dv per query head
    if calls == 1:
        return n * (grads + per_call)
    # a call's output gradient is a slice of the concatenation's: flash's backward makes it contiguous
    per_call += c * Hq * D // calls
    return n * max(grads + per_call, 2 * c * (Hq + kv) * D)


def _sink_attention_temp(spec: ModelSpec, n: int, prec: Precision, backward: bool, mesh: Mesh | None,
                         window: int, seq_len: int) -> int:
    """``attention_temp`` of the sink attention's SDPA path (its docstring)."""
    Hq, Hkv, c = spec.num_attention_heads, spec.num_key_value_heads, prec.compute
    D = spec.head_dim or spec.hidden_size // Hq
    Dp = sink_attention_dims(D)
    rows = sliding_key_rows(window, seq_len) if window else 1.0
    base = attention_temp(spec.replace(attention_sinks=False), n, prec, backward, mesh)
    if not backward:
        return int(base * Dp / D) + n * c * Hq * Dp
    return int(base * rows * Dp / D) + n * c * (Hq + 2 * Hkv) * D


