"""Working sets of DeepSeek Sparse Attention (DSA) over MLA: the selection, the gathered keys, the scored
blocks, and the absorbed path's temporaries, in bytes for ``n`` tokens on one GPU, following the megaseq
blocks op by op. The indexer's own terms (scoring, objective) are in ``layers``.

Pure Python. Notation and ``trains`` as in ``layers``; ``docs/planner.md`` has the arithmetic.
"""

from __future__ import annotations

from megaseq.models.spec import ModelSpec
from megaseq.ops.workspace import (
    absorbed_bytes,
    sparse_mla_pool_bytes,
    triton_sparse_mla_bytes,
)
from megaseq.plan.activations import Trains, if_trained, norm_saved, trained_inputs
from megaseq.plan.mesh import CAL, Calibration, Mesh, Precision


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
    fast_norm: bool = False,
) -> dict[str, int]:
    """MLA + DSA (``blocks/mla_dsa.py``); K/V rows from ``dsa_kv_rows``.

    ``impl`` is the sparse-attention implementation: ``torch_masked`` (the reference, the CPU path) as
    below, or ``absorbed`` (``ops/sparse_mla/absorbed.py``, the GPU path): no per-head K/V at all; the op saves
    the latent's compute-dtype copy ``c * (kv_lora + rope)`` per K/V row, the per-(query, head)
    log-sum-exp ``f * Hh`` and the selection (every layer that computes one), its blocks being
    recomputed in backward; or ``triton`` (the fast set's fused kernels, ``ops/sparse_mla/fused.py``):
    the same and the latent output ``o_lat`` ``c * Hh * R`` per query (``ops.workspace.triton_sparse_mla_bytes``).

    Per query token: q_a/kv_a inputs; q_a_layernorm and kv_a_layernorm (``(f + c) * rank``; ``fast_norm``: the
    Triton norm's input and rstd, ``activations.norm_saved``); q_b's input;
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
    q_norm, q_out = norm_saved(ql, c, prec, fast=fast_norm)
    kv_norm, kv_out = norm_saved(kl, c, prec, fast=fast_norm)
    p = "self_attn."
    out = {
        "dsa projections' inputs": n * trained_inputs(H, [p + "q_a_proj", p + "kv_a_proj_with_mqa"], xb, prec,
                                                      trains),
        "dsa q/kv norms + q_b input": n * (q_norm + kv_norm
                                           + trained_inputs(ql, [p + "q_b_proj"], q_out, prec, trains)),
        "dsa q": n * c * Hh * qk,
        "dsa K/V (kv_b input, k, kv_b output)": kv_rows
        * (trained_inputs(kl, [p + "kv_b_proj"], kv_out, prec, trains) + c * Hh * qk
           + c * Hh * (spec.qk_nope_head_dim + v)),
        "dsa o_proj input": n * c * Hh * v * if_trained(p + "o_proj", trains),
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
