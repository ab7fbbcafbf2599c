"""Fused sparse MLA in Triton: op ``sparse_attention``, implementation ``triton`` (contract of ``absorbed``).

Shapes: B batch, Q queries, N = B * Q, S keys (the whole sequence), Hh heads, Dn = qk_nope_head_dim,
Dv = v_head_dim, R = kv_lora_rank, W selected key slots per query (-1 or >= S = empty).

Same computation as ``absorbed`` (``ops/sparse_mla/absorbed.py``): the key part of ``kv_b_proj`` is folded into the
query, attention runs over the selected latents, the value part is applied after. What moves into the
kernels (``ops/sparse_mla/kernels.py``) is everything that touches the W selected latents::

    torch:  q_abs = q @ W_uk                      [Hh, N, R]   one batched GEMM over all queries
    kernel: o_lat, lse = online softmax over c[idx] (gathered BW rows at a time, never [N, W, R])
    torch:  out = o_lat @ W_uv^T                  [B, Q, Hh, Dv]
    backward: do_lat = dO @ W_uv, dW_uv = dO^T o_lat, q_abs again, then the kernel gives
            dq_abs and dc (fp32 atomics into [B, S, R], in place of absorbed's index_add_),
            dq = dq_abs @ W_uk^T, dW_uk = q^T dq_abs.

The forward saves q, c, the weight, idx, ``o_lat [Hh, N, R]`` (work dtype; for ``delta`` and dW_uv, so
the backward needs no third pass over the slots) and ``lse [Hh, N]`` fp32. ``return_lse`` hands that saved
log-sum-exp out (base 2, ``+inf`` on rows without a valid slot: the contract in ``reference.py``) as a
``[B, Q, Hh]`` view, no copy (where some batch row runs ``absorbed``, the rows' lse concatenated).

Rows with no valid slot: ``absorbed`` gives them the reference's uniform-over-all-keys output and its
covariance gradient; the kernels do not. One host sync per call finds the batch rows that have such a
row and hands those batch rows to ``absorbed`` (in real use every query selects at least itself); the
same sync reads the pool-layout check the backward's latent-gradient pass needs (``checks``).

Precision as ``absorbed``: the work dtype (autocast's, else q's) for the GEMMs and the kernels' dot
operands, fp32 accumulation, softmax and latent gradient. On the CPU the kernels run only under Triton's
interpreter (``TRITON_INTERPRET=1``, the CPU tests); the GPU path has not run in this repository's CI.
"""

from __future__ import annotations

import importlib.util
import os

import torch

from megaseq.ops import workspace
from megaseq.ops.sparse_mla.absorbed import AbsorbedSparseMLA, _split_weight, _work_dtype

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MAX_RANK = 1024  # the kernels hold [BW, R] latents and [BH, R] fp32 accumulators per program
EMPTY_SCAN_ROWS = 1 << 16  # query rows per step of the empty-row scan ([rows, W] bool temporaries)
# cpu tensors are accepted only with TRITON_INTERPRET=1 *and* this flag (the CPU tests set both): the env
# var must be set before triton is imported, so it holds for the whole test process, and alone it would
# send every CPU fp32 ``sparse_attention`` call of other tests to the (slow) interpreter
CPU_INTERPRETER: bool = False


def triton_sparse_mla_bytes(Q: int, S: int, W: int, R: int, Hh: int, Dn: int, Dv: int,
                            dtype: torch.dtype) -> dict[str, int]:
    """GPU bytes of one call beyond its inputs and its output (``ops.workspace.triton_sparse_mla_bytes``, the
    planner's formula, in ``dtype``); W does not appear: nothing per slot is stored."""
    del W
    return workspace.triton_sparse_mla_bytes(Q, S, R, Hh, Dn, Dv, dtype.itemsize)


# ---- the autograd Function ------------------------------------------------------------------------------
def _heads_major(x_BQHD: torch.Tensor) -> torch.Tensor:
    B, Q, Hh, D = x_BQHD.shape
    return x_BQHD.permute(2, 0, 1, 3).reshape(Hh, B * Q, D)


def _batch_major(x_HND: torch.Tensor, B: int, Q: int) -> torch.Tensor:
    Hh, _, D = x_HND.shape
    return x_HND.view(Hh, B, Q, D).permute(1, 2, 0, 3).contiguous()


class TritonSparseMLA(torch.autograd.Function):
    """Inputs already in the work dtype, contiguous, autocast off (``triton_sparse_mla`` sees to it)."""

    @staticmethod
    def forward(ctx, q_BQHD, c_BSR, w_OR, idx_BQW, scale, layout="check", return_lse=False, head_probs=None):
        from megaseq.ops.sparse_mla import kernels

        B, Q, Hh, Dn = q_BQHD.shape
        w_uk, w_uv = _split_weight(w_OR, Hh, Dn)
        q_abs_HNR = torch.bmm(_heads_major(q_BQHD), w_uk)
        o_lat_HNR, lse_HN = kernels.forward(q_abs_HNR, c_BSR, idx_BQW, scale)
        del q_abs_HNR
        out = _batch_major(torch.bmm(o_lat_HNR, w_uv.transpose(1, 2)), B, Q)
        ctx.save_for_backward(q_BQHD, c_BSR, w_OR, idx_BQW, o_lat_HNR, lse_HN)
        ctx.scale, ctx.layout, ctx.head_probs = scale, layout, head_probs
        if not return_lse:
            return out
        ctx.set_materialize_grads(False)  # no zeros for the lse's gradient
        ctx.mark_non_differentiable(lse_HN)
        return out, lse_HN

    @staticmethod
    def backward(ctx, grad_BQHV, *_lse_grad):
        if grad_BQHV is None:  # with return_lse (grads not materialised): the output unused
            return (None,) * 8
        from megaseq.ops.sparse_mla import kernels

        q_BQHD, c_BSR, w_OR, idx_BQW, o_lat_HNR, lse_HN = ctx.saved_tensors
        B, Q, Hh, Dn = q_BQHD.shape
        # op indexer_target's result, written by the slot pass from the probabilities it recomputes (HeadProbs)
        probs = None if ctx.head_probs is None else torch.zeros(B * Q, idx_BQW.shape[-1], dtype=torch.float32,
                                                                 device=q_BQHD.device)
        w_uk, w_uv = _split_weight(w_OR, Hh, Dn)
        # backward may run inside the caller's autocast region: the dtypes here are explicit
        with torch.autocast(q_BQHD.device.type, enabled=False):
            do_HNV = _heads_major(grad_BQHV.to(q_BQHD.dtype))
            do_lat_HNR = torch.bmm(do_HNV, w_uv)
            dw_uv = torch.bmm(do_HNV.transpose(1, 2), o_lat_HNR)
            del do_HNV
            # the head-major q is made twice (a copy of Q * Hh * Dn): it is not held beside the kernel's four
            # [Hh, N, R] tensors, the backward's largest moment (ops.workspace.triton_sparse_mla_bytes)
            q_abs_HNR = torch.bmm(_heads_major(q_BQHD), w_uk)
            dq_abs_HNR, dc_BSR = kernels.backward(q_abs_HNR, do_lat_HNR, o_lat_HNR, lse_HN, c_BSR, idx_BQW,
                                                  ctx.scale, layout=ctx.layout, probs=probs)
            del q_abs_HNR, do_lat_HNR
            dw_uk = torch.bmm(_heads_major(q_BQHD).transpose(1, 2), dq_abs_HNR)
            dq = _batch_major(torch.bmm(dq_abs_HNR, w_uk.transpose(1, 2)), B, Q)
            dw = torch.cat([dw_uk, dw_uv], dim=1).reshape(w_OR.shape)
        if probs is not None:
            ctx.head_probs.m_BQW = probs.view(B, Q, -1)
        return dq, dc_BSR.to(c_BSR.dtype), dw, None, None, None, None, None


# ---- the op ---------------------------------------------------------------------------------------------
def _interpreting() -> bool:
    return CPU_INTERPRETER and os.environ.get("TRITON_INTERPRET", "0") == "1"


def triton_sparse_mla_supports(q_BQHD, c_BSR, kv_b_weight, idx_BQW, scale, return_lse: bool = False,
                               head_probs=None) -> str | None:
    if c_BSR.dim() != 3 or kv_b_weight.dim() != 2 or kv_b_weight.shape[1] != c_BSR.shape[-1]:
        return "needs the latent c [B, S, R] and the kv_b weight [Hh * (Dn + Dv), R]"
    if q_BQHD.dim() != 4 or kv_b_weight.shape[0] % q_BQHD.shape[2]:
        return f"q {tuple(q_BQHD.shape)} is not [B, Q, Hh, Dn] for kv_b {tuple(kv_b_weight.shape)}"
    B, Q = q_BQHD.shape[:2]
    if idx_BQW.dim() != 3 or tuple(idx_BQW.shape[:2]) != (B, Q) or c_BSR.shape[0] != B:
        return f"idx {tuple(idx_BQW.shape)} / c {tuple(c_BSR.shape)} do not match q's [B, Q] = [{B}, {Q}]"
    if idx_BQW.dtype not in (torch.int32, torch.int64) or c_BSR.shape[1] >= 2**31:
        return f"idx must be int32/int64 with S < 2^31 (got {idx_BQW.dtype}, S = {c_BSR.shape[1]})"
    R = c_BSR.shape[-1]
    if R % 16 or R > MAX_RANK:
        return f"kv_lora_rank R = {R}: the kernels need a multiple of 16 up to {MAX_RANK}"
    dtype = _work_dtype(q_BQHD)
    if dtype not in DTYPES:
        return f"dtype {dtype} (the Triton kernels run bf16/fp16/fp32)"
    dev = q_BQHD.device.type
    if dev != "cuda" and not (dev == "cpu" and _interpreting()):
        return f"device {dev} (needs cuda, or the cpu under TRITON_INTERPRET=1 with CPU_INTERPRETER set)"
    if dev == "cpu" and dtype == torch.bfloat16:
        return "bfloat16 on the cpu (Triton's interpreter computes bf16 wrongly)"
    if len({t.device for t in (q_BQHD, c_BSR, kv_b_weight, idx_BQW)}) != 1:
        return "q, c, the weight and idx are on different devices"
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed"
    return None


def empty_batch_rows(idx_BQW: torch.Tensor, S: int) -> list[bool]:
    """Per batch row, whether some query has no valid slot: scanned in row blocks, one host sync."""
    return _empty_rows_flags(idx_BQW, S).tolist()


def _empty_rows_flags(idx_BQW: torch.Tensor, S: int) -> torch.Tensor:
    """``empty_batch_rows`` on the device: bool ``[B]``, not read back."""
    B, Q, _ = idx_BQW.shape
    found_B = torch.zeros(B, dtype=torch.bool, device=idx_BQW.device)
    for a in range(0, Q, EMPTY_SCAN_ROWS):
        x = idx_BQW[:, a:a + EMPTY_SCAN_ROWS]
        found_B |= (~((x >= 0) & (x < S)).any(-1)).any(-1)
    return found_B


def checks(idx_BQW: torch.Tensor, S: int) -> tuple[list[bool], int | None | str]:
    """``empty_batch_rows`` and, where the backward will ask (a ``MEGASEQ_MLA_DC`` with a pool pass, ``saved`` or
    ``pool``, and the layout kernel can run), the first pool candidate's ``pool_layout`` check, read back together:
    one host sync a call where the forward and the backward had one each. The layout is ``"check"`` where not
    known (the backward checks)."""
    from megaseq.ops.sparse_mla import kernels

    found_B = _empty_rows_flags(idx_BQW, S)
    cands = kernels.pool_candidates(idx_BQW.shape[2])
    if kernels.dc_mode() not in kernels.POOL_MODES or not cands or not kernels.layout_kernel_runs(idx_BQW):
        return found_B.tolist(), "check"
    kp, K = cands[0]
    *empty, holds = torch.cat([found_B.int(), kernels.pool_layout_flag(idx_BQW, S, kp, K)]).tolist()
    return [bool(e) for e in empty], kp if holds else "check"


def triton_sparse_mla(q_BQHD: torch.Tensor, c_BSR: torch.Tensor, kv_b_weight: torch.Tensor,
                      idx_BQW: torch.Tensor, scale: float, return_lse: bool = False,
                      head_probs=None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Fused sparse MLA, ``[B, Q, Hh, Dv]`` in the work dtype (``return_lse``: and ``lse2 [B, Q, Hh]`` fp32); same
    arguments and result as ``absorbed`` (``head_probs``: filled by the backward where no batch row has a query
    without a valid slot, ``reference.HeadProbs``)."""
    dt = _work_dtype(q_BQHD)
    q, c, w = (t.to(dt).contiguous() for t in (q_BQHD, c_BSR, kv_b_weight))
    idx = idx_BQW.contiguous()
    B, Q, Hh = q.shape[:3]
    with torch.autocast(q_BQHD.device.type, enabled=False):
        empty, layout = checks(idx, c.shape[1])
        if not any(empty):
            res = TritonSparseMLA.apply(q, c, w, idx, float(scale), layout, return_lse, head_probs)
            if not return_lse:
                return res
            out, lse_HN = res
            return out, lse_HN.view(Hh, B, Q).permute(1, 2, 0)  # the saved tensor, viewed [B, Q, Hh]
        parts = []
        for b, has_empty in enumerate(empty):  # absorbed for the batch rows with an empty query
            args = (q[b:b + 1], c[b:b + 1], w, idx[b:b + 1], float(scale))
            if has_empty:
                part = AbsorbedSparseMLA.apply(*args, return_lse)
            else:
                part = TritonSparseMLA.apply(*args, "check", return_lse)
                if return_lse:
                    part = (part[0], part[1].view(Hh, 1, Q).permute(1, 2, 0))
            parts.append(part)
        if not return_lse:
            return torch.cat(parts, dim=0)
        return torch.cat([o for o, _ in parts], dim=0), torch.cat([lse.float() for _, lse in parts], dim=0)


# ---- synthetic selections (tests and benchmarks) ---------------------------------------------------------
def causal_pool_selection(B: int, Q: int, S: int, kpool: int = 16, pools: int = 128, q_offset: int | None = None,
                          generator: torch.Generator | None = None, device: torch.device | str | None = None,
                          chunk: int = 1024) -> torch.Tensor:
    """``[B, Q, pools * kpool + kpool - 1]`` int32 shaped like the indexer's selection for queries at
    positions ``q_offset + i`` (default: the last Q of S keys): ``pools`` distinct complete pools of
    ``kpool`` tokens whose last token is visible, drawn uniformly (no locality: the worst case for the
    cache), ascending, -1 where fewer exist; then the query's own incomplete pool (``_select_row``)."""
    q_offset = S - Q if q_offset is None else q_offset
    P, K = S // kpool, min(pools, S // kpool)
    out = torch.full((B, Q, pools * kpool + kpool - 1), -1, dtype=torch.int32, device=device)
    offs = torch.arange(kpool, device=device)
    for b in range(B):
        for a in range(0, Q, chunk):
            pos = q_offset + torch.arange(a, min(a + chunk, Q), device=device)
            score = torch.rand(pos.numel(), P, generator=generator, device=device)
            score.masked_fill_(torch.arange(P, device=device)[None] >= ((pos + 1) // kpool)[:, None], -1.0)
            top, sel = score.topk(K, dim=-1)
            sel = torch.where(top >= 0, sel, P).sort(-1).values
            tok = (sel[..., None] * kpool + offs).flatten(1)
            out[b, a:a + pos.numel(), :K * kpool] = torch.where(tok < P * kpool, tok, -1).to(torch.int32)
            tail_count = (pos + 1) % kpool
            tail = (pos - tail_count + 1)[:, None] + offs[:kpool - 1]
            tail = tail.masked_fill(offs[None, :kpool - 1] >= tail_count[:, None], -1)
            out[b, a:a + pos.numel(), pools * kpool:] = tail.to(torch.int32)
    return out
