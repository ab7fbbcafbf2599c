"""Per-layer-kind working sets: what each token mixer and MLP kind saves for backward, and its temporaries.

Pure Python. One function per kind and direction (``kda_saved`` / ``kda_temp``, ``dsa_saved`` /
``dsa_temp``, ``indexer_temp``, ``attention_saved`` / ``attention_temp``, ``mlp_saved``, ``moe_saved``,
``mlp_temp``), in bytes for ``n`` tokens on one GPU, following the megaseq blocks op by op; named
coefficients live in ``components.Calibration``. Notation as in ``components``: c compute bytes, f fp32
bytes, xb bytes of the normed block input, D = KDA heads x head dim. ``docs/planner.md`` has the arithmetic.

``trains``: with a frozen base (LoRA, ``train.trainable``) the layer's projections whose weight gets a
gradient, by name within the layer (``self_attn.q_proj``, ``mlp.experts.gate_up_proj``: an adapter counts,
its ``A`` reads the same input); None: every one. autograd keeps a linear's input only for its weight's
gradient, so a frozen projection's input is not saved (unless another op keeps it).
"""

from __future__ import annotations

from dataclasses import replace

from megaseq.models.spec import ModelSpec
from megaseq.ops.workspace import (  # noqa: F401  (the ops' own formulas)
    absorbed_bytes,
    indexer_kl_bytes,
    indexer_scoring_bytes,
    indexer_topk_bytes,
    kv_repeats,
    sdpa_head_groups,
    sink_attention_dims,
    sliding_key_rows,
    sparse_mla_pool_bytes,
    triton_sparse_mla_bytes,
)
from megaseq.plan.components import linear_inputs, norm_saved
from megaseq.plan.mesh import CAL, Calibration, Mesh, Precision

Trains = frozenset[str] | None


def _inputs(width: int, names: list[str], in_bytes: int, prec: Precision, trains: Trains) -> int:
    """``linear_inputs`` of the linears ``names`` reading one tensor, counting only those that train."""
    k = len(names) if trains is None else sum(n in trains for n in names)
    return linear_inputs(width, k, in_bytes, prec) if k else 0


def _if(name: str, trains: Trains) -> int:
    return 1 if trains is None or name in trains else 0


# ---- token mixers: saved per layer, and temporaries --------------------------------------------------
def kda_saved(spec: ModelSpec, n: int, xb: int, prec: Precision, cal: Calibration = CAL,
              trains: Trains = None, fast_norm: bool = False) -> dict[str, int]:
    """KDA (``blocks/kda.py``) with fla's ``chunk_kda`` on the GPU; ``xb`` bytes of the normed input.

    Per token: the six projections' inputs (q, k, v, f_a, b, g_a); the conv's input ``c * 3D`` (fla's
    conv fuses the SiLU and saves only its input; ``kda_conv_copies``); the forget gate ``2 * f * D``
    (g before the decay product, the sigmoid output; Kimi-Linear's softplus gate without a lower bound
    ``(3 f + 1) * D``); chunk_kda's ``q, k`` (l2-normed), ``v`` in bf16,
    ``g`` and its chunk cumsum in fp32, the intra-chunk ``Aqk, Akk`` ``2 * c * heads * 64`` (fla 0.6
    keeps them in the input dtype); the gated output norm ``4 * f * D`` + o_proj's input ``c * D``
    (``fast_norm``: fla's fused norm keeps its input and gate and an fp32 ``rstd`` per row, ``2 * c * D + f * Hh``,
    unless ``cal.hc_mix_torch``).
    """
    H, Hh, Dk = spec.hidden_size, spec.linear_num_heads, spec.linear_head_dim
    D, c, f = Hh * Dk, prec.compute, prec.f32
    p = "self_attn."
    six = [p + x for x in ("q_proj", "k_proj", "v_proj", "forget_gate.f_a_proj", "b_proj", "g_a_proj")]
    late = _if(p + "o_proj", trains) * c * D + (_if(p + "forget_gate.f_b_proj", trains)
                                                 + _if(p + "g_b_proj", trains)) * c * Dk
    return {
        "kda projections' inputs": n * _inputs(H, six, xb, prec, trains),
        "kda conv": n * cal.kda_conv_copies * c * 3 * D,
        # the safe gate (lower_bound * sigmoid): g and the sigmoid's output; without a lower bound (Kimi-Linear)
        # exp(g), 1 + exp(g), the where's bool mask and its output
        "kda forget gate": n * (2 * f * D if spec.linear_lower_bound is not None else (3 * f + 1) * D),
        "kda chunk state (q,k,v,g,A)": n * (3 * c * D + 2 * f * D + 2 * c * Hh * 64 + 2 * f * Hh),
        "kda output norm + o_proj input": n * ((2 * c * D + f * Hh if fast_norm and not cal.hc_mix_torch
                                                else (3 + _if(p + "o_norm", trains)) * f * D) + late),
    }


def kda_temp(spec: ModelSpec, n: int, prec: Precision, backward: bool, cal: Calibration = CAL) -> int:
    """KDA temporaries above the saved set: forward ``7 c D`` + the chunk states
    ``heads * Dk * Dv * c / 64`` per token; backward fp32 grads ``8 f D`` + recomputed ``4 c D`` + the
    states, their fp32 grads and the recomputed states ``heads * Dk * Dv * (2c + f) / 64``."""
    Hh, Dk, c, f = spec.linear_num_heads, spec.linear_head_dim, prec.compute, prec.f32
    D, states = Hh * Dk, Hh * Dk * Dk / 64
    if not backward:
        return int(n * (cal.kda_fwd_temp_cd * c * D + c * states))
    return int(n * (cal.kda_bwd_temp_fd * f * D + cal.kda_bwd_temp_cd * c * D + (2 * c + f) * states))


def kda_segmented(
    spec: ModelSpec, n: int, batch: int, T: int, xb: int, prec: Precision, cal: Calibration = CAL,
    trains: Trains = None,
    fast_norm: bool = False,
) -> tuple[dict[str, int], int, int]:
    """KDA in segments of ``T`` tokens (``memory/kda_segments.py``): (saved, forward temp, backward temp).

    Saved: the layer's input ``xb * H`` per token (the tensor itself) and one recurrent state
    ``f * Hh * Dk * Dk`` per segment and row (``segmented_saved_bytes``). Forward: one segment's
    no-grad forward (``kda_temp`` over ``T + K - 1`` tokens plus ``nograd_fraction`` of its saved set)
    and the output ``c * H`` per token being filled. Backward: one segment's saved set and backward
    temporaries over ``T + K - 1`` tokens, and the input's gradient ``f * H`` per token."""
    H, Hh, Dk, c, f = spec.hidden_size, spec.linear_num_heads, spec.linear_head_dim, prec.compute, prec.f32
    m = min(T + spec.linear_conv_kernel - 1, n)
    segments = -(-n // (batch * T)) if batch else 0
    seg_saved = sum(kda_saved(spec, m * batch, xb, prec, cal, trains, fast_norm).values())
    saved = {"kda segmented: input": n * xb * H, "kda segmented: states": segments * batch * f * Hh * Dk * Dk}
    fwd = kda_temp(spec, m * batch, prec, False, cal) + int(cal.nograd_fraction * seg_saved) + n * c * H
    seg_cal = replace(cal, kda_bwd_temp_fd=cal.kda_segment_bwd_temp_fd)
    bwd = seg_saved + kda_temp(spec, m * batch, prec, True, seg_cal) + n * f * H
    return saved, fwd, bwd


def dsa_width(spec: ModelSpec) -> int:
    """Key slots a DSA query attends to: W = topk + kpool - 1 (the incomplete tail pool)."""
    return spec.index_topk + (spec.index_kpool - 1 if spec.index_kpool_always_select_tail else 0)


def dsa_selection_bytes(spec: ModelSpec, n: int) -> int:
    """The DSA selection ``[n, W]`` int32 (``dsa_width``)."""
    return 4 * n * dsa_width(spec)


def dsa_kv_rows(n: int, batch: int, seq_len: int, mesh: Mesh, mode: str) -> int:
    """Rows of expanded K/V (all heads) per GPU: the whole sequence ``B * S`` under gather-KV (every rank
    expands the gathered latent for all heads) and under sequence segments (``n`` the segment's queries,
    the keys all tokens so far), ``n`` under Ulysses (S rows x heads / cp)."""
    return batch * seq_len if mode == "gather_kv" else n


def dsa_score_block(
    spec: ModelSpec, n: int, batch: int, seq_len: int, mesh: Mesh, mode: str, cal: Calibration = CAL
) -> tuple[int, bool]:
    """(score elements of one query block, whether the whole layer is one block) of the reference
    sparse attention: blocks of ``ATTENTION_BLOCK_ELEMS // (B * heads * S)`` queries."""
    heads = spec.num_attention_heads // (mesh.cp if mode == "ulysses" else 1)
    queries = n // batch if mode == "gather_kv" or mesh.cp == 1 else seq_len
    per_query = batch * heads * seq_len
    block = max(1, cal.attn_block_elems // max(1, per_query))
    return min(block, queries) * per_query, block >= queries


def dsa_saved(
    spec: ModelSpec,
    n: int,
    batch: int,
    seq_len: int,
    xb: int,
    prec: Precision,
    mesh: Mesh,
    mode: str,
    full_indexer: bool,
    cal: Calibration = CAL,
    impl: str = "torch_masked",
    trains: Trains = None,
) -> dict[str, int]:
    """MLA + DSA (``blocks/mla_dsa.py``); K/V rows from ``dsa_kv_rows``.

    ``impl`` is the sparse-attention implementation: ``torch_masked`` (the reference, the CPU path) as
    below, or ``absorbed`` (``ops/sparse_mla/absorbed.py``, the GPU path): no per-head K/V at all; the op saves
    the latent's compute-dtype copy ``c * (kv_lora + rope)`` per K/V row, the per-(query, head)
    log-sum-exp ``f * Hh`` and the selection (every layer that computes one), its blocks being
    recomputed in backward; or ``triton`` (the fast set's fused kernels, ``ops/sparse_mla/fused.py``):
    the same and the latent output ``o_lat`` ``c * Hh * R`` per query (``ops.workspace.triton_sparse_mla_bytes``).

    Per query token: q_a/kv_a inputs; q_a_layernorm and kv_a_layernorm (``(f + c) * rank``); q_b's input;
    q ``c * Hh * qk``; o_proj's input ``c * Hh * v``; the selection ``4 * W`` (full-indexer layers, kept by
    the checkpointed query blocks; a shared layer reuses it). Per K/V row: kv_b's input ``c * kv_lora``,
    the keys ``c * Hh * qk`` (a concatenation) and kv_b's output ``c * Hh * (nope + v)`` (v is a view of
    it). The reference sparse attention runs in query blocks recomputed in backward; a single block
    (short sequences) saves its scores: the fp32 softmax and the bf16 probabilities, ``(f + c)`` per
    score element.
    """
    H, Hh, c, f = spec.hidden_size, spec.num_attention_heads, prec.compute, prec.f32
    ql, kl, qk, v = spec.q_lora_rank, spec.kv_lora_rank, spec.qk_head_dim, spec.v_head_dim
    kv_rows = dsa_kv_rows(n, batch, seq_len, mesh, mode)
    q_norm, q_out = norm_saved(ql, c, prec)
    kv_norm, kv_out = norm_saved(kl, c, prec)
    p = "self_attn."
    out = {
        "dsa projections' inputs": n * _inputs(H, [p + "q_a_proj", p + "kv_a_proj_with_mqa"], xb, prec, trains),
        "dsa q/kv norms + q_b input": n * (q_norm + kv_norm + _inputs(ql, [p + "q_b_proj"], q_out, prec, trains)),
        "dsa q": n * c * Hh * qk,
        "dsa K/V (kv_b input, k, kv_b output)": kv_rows
        * (_inputs(kl, [p + "kv_b_proj"], kv_out, prec, trains) + c * Hh * qk + c * Hh * (spec.qk_nope_head_dim + v)),
        "dsa o_proj input": n * c * Hh * v * _if(p + "o_proj", trains),
    }
    if impl in ("absorbed", "triton"):
        del out["dsa K/V (kv_b input, k, kv_b output)"]
        R = kl + spec.qk_rope_head_dim
        if impl == "triton":  # the fused kernels also keep o_lat [Q, Hh, R] for their backward
            out["dsa latent copy + o_lat + log-sum-exp"] = triton_sparse_mla_bytes(
                n, kv_rows, R, Hh, spec.qk_head_dim, v, c)["saved"]
        else:
            out["dsa latent copy + log-sum-exp"] = kv_rows * c * R + n * f * Hh
        if full_indexer:
            out["dsa selection (int32)"] = dsa_selection_bytes(spec, n)
        return out
    block, single = dsa_score_block(spec, n, batch, seq_len, mesh, mode, cal)
    if single:  # the softmax output (compute dtype promoted to fp32) and its cast, if any, for p @ v
        out["dsa attention scores (one block)"] = (f + (c if c != f else 0)) * block
    elif full_indexer:  # checkpointed query blocks save their slice of the selection
        out["dsa selection (int32)"] = dsa_selection_bytes(spec, n)
    return out


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
                            fused_target: bool = False) -> tuple[int, int]:
    """The indexer objective of one full-indexer layer in the sparse stage (``models.common.indexer_kl``):
    ``(kept until the backward, one chunk's working set)`` from ``ops.workspace.indexer_kl_bytes`` (fp32: the
    objective computes in ``promote(dtype, fp32)``): kept are the gradients the forward summed (pooled keys
    ``[P, Di]`` and head weights ``[Q, I]``) and the pooled keys' graph. ``fused_target``: the target comes from
    op ``indexer_target``'s Triton kernel (no gathered latents or head scores in the chunk, so more rows a chunk)."""
    kp = max(spec.index_kpool, 1)
    P, K = seq_len // kp, spec.index_topk // kp
    W = dsa_width(spec)
    R = spec.kv_lora_rank + spec.qk_rope_head_dim
    Q = max(1, n // batch)
    total = indexer_kl_bytes(Q, seq_len, spec.num_attention_heads, spec.index_n_heads, spec.index_head_dim, P, K,
                             W, R, dense=False, itemsize=prec.f32, gathered_itemsize=prec.compute,
                             fused_target=fused_target, query_width=spec.q_lora_rank)
    kept = batch * (prec.f32 * (P * spec.index_head_dim + Q * spec.index_n_heads)
                    + prec.f32 * (2 * seq_len * spec.index_head_dim + P * spec.index_head_dim))
    return kept, batch * total - kept


def dsa_temp(
    spec: ModelSpec,
    n: int,
    batch: int,
    seq_len: int,
    prec: Precision,
    mesh: Mesh,
    mode: str,
    backward: bool,
    cal: Calibration = CAL,
    impl: str = "torch_masked",
) -> int:
    """Sparse attention temporaries (``impl="absorbed"``: see ``absorbed_temp``; ``"triton"``: the fused
    kernels' or absorbed's, the larger, ``ops.workspace.triton_sparse_mla_bytes``): one query block's
    scores (forward: scores, masked scores, fp32 softmax, bf16 probabilities ``3c + f`` per element;
    backward: the recomputed block and its grads ``5c + 3f``), the gathered fp32 latent ``f * kv_lora``
    per K/V row, and in backward the K/V gradients ``c * Hh * (qk + v)`` and the latent's fp32 gradient
    per K/V row, and dq."""
    if impl == "absorbed":
        return absorbed_temp(spec, n, batch, seq_len, prec, mesh, mode, backward)
    if impl == "triton":  # or absorbed, which the op runs for batch rows that have a query with no valid slot
        kv_rows = dsa_kv_rows(n, batch, seq_len, mesh, mode)
        R = spec.kv_lora_rank + spec.qk_rope_head_dim
        pool = sparse_mla_pool_bytes(n, dsa_width(spec), spec.index_kpool, spec.num_attention_heads, batch,
                                     prec.compute)
        b = triton_sparse_mla_bytes(n, kv_rows, R, spec.num_attention_heads, spec.qk_head_dim, spec.v_head_dim,
                                    prec.compute, pool)
        fused = b["backward"] if backward else b["forward"] + kv_rows * prec.compute * R  # + the latent's copy
        return max(fused, absorbed_temp(spec, n, batch, seq_len, prec, mesh, mode, backward))
    Hh, c, f = spec.num_attention_heads, prec.compute, prec.f32
    kv_rows = dsa_kv_rows(n, batch, seq_len, mesh, mode)
    block, _ = dsa_score_block(spec, n, batch, seq_len, mesh, mode, cal)
    latent = kv_rows * f * (spec.kv_lora_rank + spec.qk_rope_head_dim)
    if not backward:
        return block * (3 * c + f) + latent
    grads = kv_rows * (c * Hh * (spec.qk_head_dim + spec.v_head_dim) + f * spec.kv_lora_rank)
    return block * (5 * c + 3 * f) + latent + grads + n * c * Hh * spec.qk_head_dim


def absorbed_temp(spec: ModelSpec, n: int, batch: int, seq_len: int, prec: Precision, mesh: Mesh, mode: str,
                  backward: bool) -> int:
    """The absorbed sparse MLA's temporaries (``ops.workspace.absorbed_bytes``, the op's own block sizing):
    one query block within ``ABSORBED_BLOCK_BYTES``, the latent copy being made ``c * R`` per K/V row; in
    backward also the latent's fp32 gradient and its cast ``(f + c) * R`` per K/V row and dq ``c * Hh * qk``
    per query."""
    Hh, c, f = spec.num_attention_heads, prec.compute, prec.f32
    R = spec.kv_lora_rank + spec.qk_rope_head_dim
    W = dsa_width(spec)
    block = absorbed_bytes(n, seq_len, W, R, Hh, spec.qk_nope_head_dim, spec.v_head_dim, c, f)["block"]
    kv_rows = dsa_kv_rows(n, batch, seq_len, mesh, mode)
    if not backward:
        return block + kv_rows * c * R
    return block + kv_rows * (f + c) * R + n * c * Hh * spec.qk_head_dim


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
        "attention projections' inputs": n * _inputs(H, qkv, xb, prec, trains),
        "attention q/k norms + rope": n * (norms + 2 * q_bytes * rot),
        "attention q,k,v,o + lse": n * sdpa,
        "attention o_proj input": n * c * Hq * D * _if("self_attn.o_proj", trains),
    }
    if spec.attn_output_gate:  # one call: o is a view of SDPA's output (kept above); the product is o_proj's input
        out["attention output gate (sigmoid)"] = n * c * Hq * D
        if sdpa_groups(spec, mesh)[0] > 1:  # o is the calls' concatenation: a copy, kept by the gate
            out["attention heads' concatenation"] = n * c * Hq * D
    return out


def attention_sink_saved(spec: ModelSpec, prec: Precision, kv: int, window: int, seq_len: int) -> float:
    """Per token, what the sink attention's SDPA call keeps: q and o ``Dp`` wide (``Dp =
    sink_attention_dims(D)``), the log-sum-exp, and k, v: ``kv`` heads (full layers) or, in a sliding layer,
    ``Hkv`` heads of ``sliding_key_rows`` keys per token (the blocks' copies)."""
    Hq, Hkv, c, f = spec.num_attention_heads, spec.num_key_value_heads, prec.compute, prec.f32
    Dp = sink_attention_dims(spec.head_dim or spec.hidden_size // Hq)
    keys = 2 * Hkv * sliding_key_rows(window, seq_len) if window else 2 * kv
    return c * (2 * Hq + keys) * Dp + f * Hq


def mla_saved(spec: ModelSpec, n: int, xb: int, prec: Precision, trains: Trains = None) -> dict[str, int]:
    """Dense MLA (``models/common/mla.py``: DeepSeek-V3, Kimi-Linear's MLA layers) through SDPA, per query
    token (``n`` this rank's tokens; under Ulysses each rank holds all tokens of ``Hh / cp`` heads: the
    same bytes). Hh heads, R kv_lora_rank, Dn/Dr/Dv the nope/rope/value head dims, Dq = Dn + Dr.

    The projections' inputs (``q_a_proj`` or ``q_proj``, and ``kv_a_proj_with_mqa``); the q_a / kv_a
    RMSNorms ``(f + c) * rank`` and q_b's input; RoPE's cos/sin ``2 * xb * Dr`` (rotating layers only);
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
    q_norm, q_out = norm_saved(ql, c, prec) if ql else (0, c)
    kv_norm, kv_out = norm_saved(R, c, prec)
    # without autocast kv_b reads a view of the latent [c | k_rot] and kv_a_layernorm a view of kv_a's output:
    # both keep the whole R + Dr wide storage
    latent = R + (0 if prec.autocast else Dr)
    kv_norm += 0 if prec.autocast else f * Dr
    rotate = spec.mla_rotate and Dr > 0
    return {
        "mla projections' inputs": n * _inputs(H, first, xb, prec, trains),
        "mla q/kv norms + q_b input": n * (q_norm + kv_norm
                                          + (_inputs(ql, [p + "q_b_proj"], q_out, prec, trains) if ql else 0)),
        "mla rope cos/sin": n * 2 * xb * Dr if rotate else 0,
        "mla kv_b input": n * (_inputs(latent, [p + "kv_b_proj"], kv_out, prec, trains)),
        "mla q,k,v,o (SDPA, v padded) + lse": n * (c * 4 * Hh * max(Dq, Dv) + f * Hh),
        "mla o_proj input": n * c * Hh * Dv * _if(p + "o_proj", trains),
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


def gdn_dims(spec: ModelSpec) -> tuple[int, int, int, int]:
    """(Hk, Dk, Hv, Dv): gated DeltaNet key / value heads and head dims."""
    Hk, Dk = spec.linear_num_heads, spec.linear_head_dim
    return Hk, Dk, spec.linear_num_value_heads or Hk, spec.linear_value_head_dim or Dk


def gdn_saved(spec: ModelSpec, n: int, xb: int, prec: Precision, cal: Calibration = CAL,
              trains: Trains = None) -> dict[str, int]:
    """Gated DeltaNet (``models/common/gdn.py``) with fla's ``chunk_gated_delta_rule`` on the GPU, per token.

    Hk/Dk key heads and dim, Hv/Dv value heads and dim, C = 2 Hk Dk + Hv Dv conv channels. The two
    projections' inputs (in_proj_qkvz, in_proj_ba); the gates: beta = sigmoid(b) ``c * Hv`` and the decay's
    softplus input and output ``2 f * Hv``; the conv's input ``c * C`` (``[q | k | v]`` concatenated;
    fla's conv saves only its input, the torch reference its output too: ``kda_conv_copies``); the chunk
    kernel's q and k (repeated to the Hv value heads when Hv > Hk: ``repeat_interleave`` copies), v, beta,
    the per-head fp32 decay cumsum and q/k rstd ``3 f * Hv`` and the intra-chunk ``A`` ``c * Hv * 64``;
    the gated norm ``(4 f + c) * Hv * Dv`` (fp32 input, its bf16 cast for the weight, the gate's fp32 copy,
    the weighted value and silu's output; without a cast and with Hv = Hk the gate is a view that keeps
    in_proj_qkvz's whole output)
    and out_proj's input ``c * Hv * Dv``."""
    H, c, f = spec.hidden_size, prec.compute, prec.f32
    Hk, Dk, Hv, Dv = gdn_dims(spec)
    C = 2 * Hk * Dk + Hv * Dv
    p = "linear_attn."
    # silu(z.to(fp32)) keeps z's fp32 copy; without a cast z itself: its reshape's copy when value heads are
    # grouped (Hv > Hk), else a view that keeps in_proj_qkvz's whole output
    gate = f * Hv * Dv if (c != f or Hv != Hk) else c * (2 * Hk * Dk + 2 * Hv * Dv)
    return {
        "gdn projections' inputs": n * _inputs(H, [p + "in_proj_qkvz", p + "in_proj_ba"], xb, prec, trains),
        "gdn gates (beta, decay)": n * (c * Hv + 2 * f * Hv),
        "gdn conv": n * cal.kda_conv_copies * c * C,
        "gdn chunk state (q,k,v,beta,g,A)": n * (c * Hv * (2 * Dk + Dv + 1 + 64) + 3 * f * Hv),
        "gdn gated norm + o_proj input": n * ((3 * f + c) * Hv * Dv + gate
                                              + c * Hv * Dv * _if(p + "out_proj", trains)),
    }


def gdn_temp(spec: ModelSpec, n: int, prec: Precision, backward: bool, cal: Calibration = CAL) -> int:
    """Gated DeltaNet temporaries above the saved set, KDA's coefficients (``kda_temp``: fla's chunk kernels
    of both share their structure; not fitted to GDN on a GPU) with ``D = Hv * max(Dk, Dv)`` and the chunk
    states ``Hv * Dk * Dv / 64`` per token; forward also the q and k copies before the concatenation,
    ``2 c * Hk * Dk``."""
    c, f = prec.compute, prec.f32
    Hk, Dk, Hv, Dv = gdn_dims(spec)
    D, states = Hv * max(Dk, Dv), Hv * Dk * Dv / 64
    if not backward:
        return int(n * (cal.kda_fwd_temp_cd * c * D + c * states + 2 * c * Hk * Dk))
    return int(n * (cal.kda_bwd_temp_fd * f * D + cal.kda_bwd_temp_cd * c * D + (2 * c + f) * states))


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
    """Dense MLA under sequence segments runs absorbed (``MultiLatentAttention._attend_carried``): per query token
    the absorbed query ``[q_nope W_uk | q_rot]`` ``c * Hh * (R + Dr)`` (the checkpoint's input) and the latent
    output ``c * Hh * R`` (``W_uv``'s einsum input), with each head call's log-sum-exp ``f * Hh``; in place of
    the expanded SDPA's q, k, v, o."""
    Hh, R, Dr = spec.num_attention_heads, spec.kv_lora_rank, spec.qk_rope_head_dim
    return n * (prec.compute * Hh * (2 * R + Dr) + prec.f32 * Hh)


def mla_segment_temp(spec: ModelSpec, rows: int, prec: Precision, backward: bool) -> int:
    """Dense MLA under sequence segments, per key row (``rows = B * e``, gathered: every rank holds all keys),
    latent width ``C = R + Dr``: forward the values ``[c | 0]`` (a copy, when Dr > 0) ``c * C``; backward the
    checkpointed attention rebuilt: the joined latent, the values, one head call's dk and dv and the joined
    latent's gradient, taken as ``6 c * C``."""
    C = spec.kv_lora_rank + spec.qk_rope_head_dim
    values = prec.compute * C if spec.qk_rope_head_dim else 0
    return rows * (6 * prec.compute * C if backward else values)


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


# ---- MLP and MoE -------------------------------------------------------------------------------------
def swiglu_saved_ci(spec: ModelSpec, fast: bool = False) -> int:
    """SwiGLU (``blocks/mlp.py: swiglu``) per row, in units of ``c * I``: the gate/up outputs (kept by
    the clamps or the SiLU and product), the clamped gate, SiLU output, clamped up and the product
    (down_proj's input): 6 with GLM's clamp, 4 without. ``fast``: the fast set's fused kernel
    (``ops/swiglu/fused.py``) keeps gate and up only (views of their producer) and recomputes the rest:
    with the product, 3 either way."""
    if fast:
        return 3
    return 6 if spec.swiglu_limit is not None else 4


def mlp_saved(spec: ModelSpec, n: int, intermediate: int, xb: int, prec: Precision, trains: Trains = None,
              prefix: str = "mlp.", fast: bool = False) -> int:
    """Dense SwiGLU: gate/up inputs + ``swiglu * c * I`` per token (its last, the product, is down_proj's
    input: kept only when down_proj trains; ``fast``: the fused kernel's set, ``swiglu_saved_ci``)."""
    gate_up = [prefix + "gate_proj", prefix + "up_proj"]
    swiglu = swiglu_saved_ci(spec, fast) - 1 + _if(prefix + "down_proj", trains)
    return n * (_inputs(spec.hidden_size, gate_up, xb, prec, trains) + swiglu * prec.compute * intermediate)


def moe_rows(spec: ModelSpec, tokens: int, mesh: Mesh, imbalance: float) -> int:
    """Routed rows one GPU computes for ``tokens`` tokens: ``tokens * K``. With expert parallelism a GPU
    receives rows from its ep group: ``imbalance`` (max/mean load) times the mean, and never more than
    every token of the group routed to its ``E/ep`` experts (under tiling: every token of a tile)."""
    K = spec.num_experts_per_tok
    if mesh.ep == 1:
        return tokens * K
    local = max(1, spec.num_experts // mesh.ep)
    return int(min(tokens * K * imbalance, tokens * mesh.ep * min(K, local)))


def moe_row_saved(spec: ModelSpec, xb: int, prec: Precision, trains: Trains = None, fast: bool = False) -> int:
    """Per routed row: the expert input (a cast copy; kept only when ``gate_up_proj`` trains), the SwiGLU set
    (its product, ``down_proj``'s input, only when ``down_proj`` trains) and the expert output ``c * H`` kept
    by the weighting."""
    H, I, c = spec.hidden_size, spec.moe_intermediate_size, prec.compute
    swiglu = swiglu_saved_ci(spec, fast) - 1 + _if("mlp.experts.down_proj", trains)
    return _inputs(H, ["mlp.experts.gate_up_proj"], xb, prec, trains) + swiglu * c * I + c * H


def moe_row_temp(spec: ModelSpec, xb: int, prec: Precision, backward: bool, cal: Calibration = CAL) -> float:
    """Per routed row: the temporaries above the saved set (forward, or backward)."""
    coef = cal.moe_bwd_temp_rows if backward else cal.moe_fwd_temp_rows
    extra = cal.mlp_bwd_temp_ci if backward else cal.mlp_fwd_temp_ci
    return coef * xb * spec.hidden_size + extra * prec.compute * spec.moe_intermediate_size + 24


def moe_router_saved(spec: ModelSpec, n: int, prec: Precision, trains: Trains = None) -> int:
    """The router's cast input (kept only when the router trains) and its scores ``2 * c * E``, the group
    mask, the top-k indices (int64)."""
    router_in = _inputs(spec.hidden_size, ["mlp.gate"], prec.f32, prec, trains)  # the router casts x to fp32 first
    logits = prec.compute if prec.autocast else prec.f32  # autocast runs the fp32 router linear in bf16
    E, K = spec.num_experts, spec.num_experts_per_tok
    return n * (router_in + logits * E + E + 8 * (K + 3))


def moe_saved(
    spec: ModelSpec, n: int, xb: int, prec: Precision, mesh: Mesh, imbalance: float, trains: Trains = None,
    fast: bool = False,
) -> dict[str, int]:
    """MoE (``blocks/moe.py``): the router (``moe_router_saved``), per routed row ``moe_row_saved``, and the
    shared expert as a dense SwiGLU (``fast``: the fused SwiGLU's saved set)."""
    rows = moe_rows(spec, n, mesh, imbalance)
    out = {
        "moe router": moe_router_saved(spec, n, prec, trains),
        "moe routed rows (x, SwiGLU, y)": rows * moe_row_saved(spec, xb, prec, trains, fast),
    }
    if spec.num_shared_experts:
        out["moe shared expert"] = shared_expert_saved(spec, n, xb, prec, trains, fast)
    return out


def shared_expert_saved(spec: ModelSpec, n: int, xb: int, prec: Precision, trains: Trains = None,
                        fast: bool = False) -> int:
    """The shared expert as a dense SwiGLU of ``shared_expert_intermediate_size`` (or ``moe_intermediate_size``
    x shared experts); Qwen3-Next's gated one (``mlp.shared_expert``) also keeps its gate linear's input, the
    sigmoid's output and the expert's output for ``sigmoid(gate) * expert``, ``c * H`` each (+ the gate)."""
    H, c = spec.hidden_size, prec.compute
    I = spec.shared_expert_intermediate_size or spec.moe_intermediate_size * spec.num_shared_experts
    prefix = "mlp.shared_expert." if spec.shared_expert_gate else "mlp.shared_experts."
    out = mlp_saved(spec, n, I, xb, prec, trains, prefix, fast)
    gate = [prefix[:-1] + "_gate"] if spec.shared_expert_gate else []
    names = [prefix + "gate_proj", prefix + "up_proj"] + gate
    uncast = not (prec.autocast and xb != c)  # the linears keep the MoE input itself, not casts of their own
    if uncast and _inputs(H, ["mlp.gate"], prec.f32, prec, trains):  # ... which the router's input already is
        out -= n * _inputs(H, names[:2], xb, prec, trains)
    elif gate:
        out += n * (_inputs(H, names, xb, prec, trains) - _inputs(H, names[:2], xb, prec, trains))
    return out + (n * c * (H + 1) if gate else 0)  # sigmoid(gate) * expert: the expert's output and the sigmoid


def mlp_temp(
    spec: ModelSpec,
    n: int,
    kind: str,
    xb: int,
    prec: Precision,
    mesh: Mesh,
    imbalance: float,
    backward: bool,
    cal: Calibration = CAL,
) -> int:
    """MLP/MoE temporaries above the saved set, per token (dense) or per routed row (MoE)."""
    c = prec.compute
    if kind == "dense":
        coef = cal.mlp_bwd_temp_ci if backward else cal.mlp_fwd_temp_ci
        return int(n * coef * c * spec.intermediate_size)
    rows = moe_rows(spec, n, mesh, imbalance)
    dispatch = 2 * rows * c * spec.hidden_size if mesh.ep > 1 else 0  # all-to-all send + receive
    return int(rows * moe_row_temp(spec, xb, prec, backward, cal) + dispatch)
