"""Absorbed sparse MLA: op ``sparse_attention`` over the shared latent, memory O(query block).

Shapes: B batch, Q queries (this rank's), S keys (the whole sequence), Hh heads, Dn = qk_nope_head_dim,
Dv = v_head_dim, R = kv_lora_rank, W selected key slots per query (-1 = empty), Qb queries per block.

The reference (``blocks/mla_dsa.py``, ``torch_masked``) expands the latent ``c [B, S, R]`` into per-head
keys ``k_h = W_uk[h] c`` and values ``v_h = W_uv[h] c`` (``kv_b_proj``) and attends with a mask. Here
the key part of ``kv_b_proj`` is folded into the query and the value part applied after attending::

    q_abs[h] = q[h] @ W_uk[h]              [Qb, Hh, R]    (scores q . k_s = q_abs . c_s)
    c_sel    = c[idx]                      [Qb, W, R]     (gathered once, shared by all heads)
    p        = softmax(scale * q_abs . c_sel^T)  over the valid slots
    o[h]     = (p[h] @ c_sel) @ W_uv[h]^T  [Qb, Hh, Dv]

an exact reassociation (float64 agrees with the reference to ~1e-15). Queries run in blocks of ``Qb``
sized from ``ops.workspace.ABSORBED_BLOCK_BYTES``; the forward saves only ``q``, ``c``, ``kv_b`` weight, ``idx`` and the
per-(query, head) log-sum-exp, and the backward recomputes each block. The gradient of ``c`` is
accumulated with ``index_add_`` in ``promote_types(dtype, float32)``. Beyond the inputs the working set
is one block: ``Qb * W * R`` gathered latents plus their gradient, and ``Qb * Hh * W`` scores.

Contract (the indexer's selection meets it): each row's valid indices are distinct. Slots that are
negative or ``>= S`` are empty. A row without any valid slot gets what the reference's additive
``finfo.min`` mask gives it: uniform weights over all S keys of its batch row, with the reference's
gradient (the mean and covariance of ``c``, see ``_EmptyRows``).

``return_lse``: also the per-head log-sum-exp the forward saves, in base 2 (``lse2 [B, Q, Hh]``, the contract in
``reference.py``; one ``[B, Q, Hh]`` compute-dtype tensor beyond the saved one), ``+inf`` on rows without a valid
slot.

Precision follows the reference: scores and ``p @ c`` in the input dtype (bf16 under autocast), the
softmax in ``promote_types(dtype, float32)``. Indices are int64 after the batch offset (``B * S * R``
passes 2^31 at 1M tokens).
"""

from __future__ import annotations

import torch

from megaseq.ops.amp import compute_dtype
from megaseq.ops.sparse_mla.reference import LOG2E
from megaseq.ops.workspace import absorbed_block_queries

# run on the CPU for these dtypes (float64: exact to the reference, so the float64 parity tests cover it)
CPU_DTYPES: tuple[torch.dtype, ...] = (torch.float64,)


def block_queries(W: int, R: int, Hh: int, dtype: torch.dtype, budget: int | None = None) -> int:
    """Queries per block so that one backward block stays within ``budget`` bytes (``ops.workspace``,
    the planner's formula too)."""
    return absorbed_block_queries(W, R, Hh, dtype.itemsize, compute_dtype(dtype).itemsize, budget)


# ---- one query block ------------------------------------------------------------------------------------
class _Block:
    """The recomputable part of one block of queries of one batch row (forward and backward share it)."""

    def __init__(self, q_QHD, c_SR, w_uk_HDR, idx_QW, scale: float, cd: torch.dtype) -> None:
        S = c_SR.shape[0]
        self.ok_QW = (idx_QW >= 0) & (idx_QW < S)
        self.flat = torch.where(self.ok_QW, idx_QW.long(), 0).reshape(-1)  # empty slots read row 0, weight 0
        self.c_QWR = c_SR.index_select(0, self.flat).view(*idx_QW.shape, -1)
        self.q_abs_QHR = torch.bmm(q_QHD.transpose(0, 1), w_uk_HDR).transpose(0, 1)
        self.empty_Q = ~self.ok_QW.any(-1)
        scores = torch.matmul(self.q_abs_QHR, self.c_QWR.transpose(1, 2)) * scale  # reference's op order
        s = scores.to(cd).masked_fill_(~self.ok_QW[:, None, :], float("-inf"))
        self.s_QHW = s.masked_fill_(self.empty_Q[:, None, None], 0.0)  # keeps empty rows finite

    def probs(self, lse_QH: torch.Tensor) -> torch.Tensor:
        p = torch.exp(self.s_QHW - lse_QH.unsqueeze(-1))
        return p.masked_fill_(self.empty_Q[:, None, None], 0.0)  # empty rows: see _EmptyRows

    def latent_out(self, p_QHW: torch.Tensor, empty: _EmptyRows | None) -> torch.Tensor:
        o = torch.matmul(p_QHW.to(self.c_QWR.dtype), self.c_QWR)
        if empty is not None:
            o = torch.where(self.empty_Q[:, None, None], empty.mean_R.to(o.dtype), o)
        return o


class _EmptyRows:
    """Rows with no valid slot. The reference's ``finfo.min`` mask saturates every score of such a row
    to the same value: uniform weights ``1 / S`` over all keys (output: the mean latent), and the
    softmax gradient ``dS_j = (dP_j - mean dP) / S``. In the latent, per row and head:
    ``dq_abs = scale * Cov(c) @ dO_lat`` and ``dc_j += (scale * A (c_j - mean) + u) / S`` with
    ``A = sum q_abs dO_lat^T`` and ``u = sum dO_lat`` over the empty (row, head) pairs.
    Built only for a batch row that has such rows (``has_empty``)."""

    def __init__(self, c_SR: torch.Tensor, cd: torch.dtype) -> None:
        self.c_SR, self.cd = c_SR, cd
        self.mean_R = c_SR.mean(0, dtype=cd)
        self._cov = None
        self.A_RR = torch.zeros(c_SR.shape[1], c_SR.shape[1], dtype=cd, device=c_SR.device)
        self.u_R = torch.zeros(c_SR.shape[1], dtype=cd, device=c_SR.device)

    @staticmethod
    def has_empty(idx_QW: torch.Tensor, S: int, rows: int = 1 << 16) -> bool:
        """Whether any row has no valid slot; by row blocks (``[Q, W]`` bool temporaries would be 2 GiB
        each at 1M tokens), one host sync."""
        found = torch.zeros((), dtype=torch.bool, device=idx_QW.device)
        for a in range(0, idx_QW.shape[0], rows):
            x = idx_QW[a:a + rows]
            found |= ~((x >= 0) & (x < S)).any(-1).all()
        return bool(found)

    def cov(self) -> torch.Tensor:
        if self._cov is None:
            c = self.c_SR.to(self.cd)
            self._cov = c.T @ c / c.shape[0] - torch.outer(self.mean_R, self.mean_R)
        return self._cov

    def backward(self, blk: _Block, dq_abs_QHR, do_lat_QHR, scale: float) -> torch.Tensor:
        """Adds the empty rows' terms; returns dq_abs with their rows replaced."""
        e = blk.empty_Q[:, None, None]
        dl = torch.where(e, do_lat_QHR, 0).to(self.cd)  # [Qb, Hh, R], zero outside empty rows
        self.A_RR += torch.where(e, blk.q_abs_QHR, 0).to(self.cd).flatten(0, 1).T @ dl.flatten(0, 1)
        self.u_R += dl.sum((0, 1))
        return torch.where(e, (scale * dl @ self.cov()).to(dq_abs_QHR.dtype), dq_abs_QHR)

    def grad_c(self, scale: float) -> torch.Tensor:
        S = self.c_SR.shape[0]
        return ((self.c_SR.to(self.cd) - self.mean_R) @ (scale * self.A_RR.T) + self.u_R) / S


# ---- the autograd Function ------------------------------------------------------------------------------
def _split_weight(w_OR: torch.Tensor, Hh: int, Dn: int) -> tuple[torch.Tensor, torch.Tensor]:
    w = w_OR.view(Hh, -1, w_OR.shape[-1])
    return w[:, :Dn], w[:, Dn:]  # W_uk [Hh, Dn, R], W_uv [Hh, Dv, R]


def _blocks(Q: int, W: int, R: int, Hh: int, dtype: torch.dtype) -> list[tuple[int, int]]:
    n = block_queries(W, R, Hh, dtype)
    return [(s, min(s + n, Q)) for s in range(0, Q, n)]


class AbsorbedSparseMLA(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q_BQHD, c_BSR, w_OR, idx_BQW, scale, return_lse=False, head_probs=None):
        B, Q, Hh, Dn = q_BQHD.shape
        S, R, W, cd = c_BSR.shape[1], c_BSR.shape[-1], idx_BQW.shape[-1], compute_dtype(q_BQHD.dtype)
        w_uk, w_uv = _split_weight(w_OR, Hh, Dn)
        out = q_BQHD.new_empty(B, Q, Hh, w_uv.shape[1])
        lse = torch.empty(B, Q, Hh, dtype=cd, device=q_BQHD.device)
        for b in range(B):
            empty = _EmptyRows(c_BSR[b], cd) if _EmptyRows.has_empty(idx_BQW[b], S) else None
            for s, e in _blocks(Q, W, R, Hh, q_BQHD.dtype):
                blk = _Block(q_BQHD[b, s:e], c_BSR[b], w_uk, idx_BQW[b, s:e], scale, cd)
                # +inf on empty rows (their probabilities are 0 either way: _Block.probs)
                lse[b, s:e] = torch.logsumexp(blk.s_QHW, dim=-1).masked_fill_(blk.empty_Q[:, None], float("inf"))
                o_lat = blk.latent_out(blk.probs(lse[b, s:e]), empty)
                out[b, s:e] = torch.bmm(o_lat.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)
                del blk, o_lat
        ctx.save_for_backward(q_BQHD, c_BSR, w_OR, idx_BQW, lse)
        ctx.scale, ctx.head_probs = scale, head_probs
        if not return_lse:
            return out
        lse2 = lse * LOG2E
        ctx.set_materialize_grads(False)  # no zeros for the lse's gradient
        ctx.mark_non_differentiable(lse2)
        return out, lse2

    @staticmethod
    def backward(ctx, grad_BQHV, *_lse_grad):
        if grad_BQHV is None:  # with return_lse (grads not materialised): the output unused
            return (None,) * 7
        q_BQHD, c_BSR, w_OR, idx_BQW, lse = ctx.saved_tensors
        B, Q, Hh, Dn = q_BQHD.shape
        S, R, W, cd = c_BSR.shape[1], c_BSR.shape[-1], idx_BQW.shape[-1], compute_dtype(q_BQHD.dtype)
        w_uk, w_uv = _split_weight(w_OR, Hh, Dn)
        grads = (torch.empty_like(q_BQHD), torch.zeros(B, S, R, dtype=cd, device=c_BSR.device),
                 torch.zeros(w_uk.shape, dtype=cd, device=w_OR.device),
                 torch.zeros(w_uv.shape, dtype=cd, device=w_OR.device))
        # op indexer_target's result, from the probabilities each block recomputes (reference.HeadProbs)
        probs = None if ctx.head_probs is None else torch.empty(B, Q, W, dtype=cd, device=q_BQHD.device)
        # backward may run inside the caller's autocast region: the dtypes here are explicit
        with torch.autocast(q_BQHD.device.type, enabled=False):
            for b in range(B):
                empty = _EmptyRows(c_BSR[b], cd) if _EmptyRows.has_empty(idx_BQW[b], S) else None
                for s, e in _blocks(Q, W, R, Hh, q_BQHD.dtype):
                    blk = _Block(q_BQHD[b, s:e], c_BSR[b], w_uk, idx_BQW[b, s:e], ctx.scale, cd)
                    _block_backward(blk, b, s, e, q_BQHD, grad_BQHV, lse, w_uk, w_uv, empty, ctx.scale, grads,
                                    None if probs is None else probs[b, s:e])
                    del blk
                if empty is not None:
                    grads[1][b] += empty.grad_c(ctx.scale)
        dq, dc, dw_uk, dw_uv = grads
        dw = torch.cat([dw_uk, dw_uv], dim=1).reshape(w_OR.shape).to(w_OR.dtype)
        if probs is not None:
            ctx.head_probs.m_BQW = probs
        return dq, dc.to(c_BSR.dtype), dw, None, None, None, None


def _block_backward(blk: _Block, b: int, s: int, e: int, q_BQHD, grad_BQHV, lse, w_uk, w_uv,
                    empty: _EmptyRows | None, scale: float, grads, probs_QW: torch.Tensor | None = None) -> None:
    """One block's contribution to (dq, dc, dW_uk, dW_uv), written into / accumulated in ``grads`` (and its rows of
    the head-summed probabilities into ``probs_QW``)."""
    dq, dc, dw_uk, dw_uv = grads
    dt = q_BQHD.dtype
    p = blk.probs(lse[b, s:e])
    if probs_QW is not None:
        probs_QW.copy_(p.sum(1))
    do_HQV = grad_BQHV[b, s:e].transpose(0, 1).to(dt)
    dw_uv += torch.bmm(do_HQV.transpose(1, 2), blk.latent_out(p, empty).transpose(0, 1))
    do_lat = torch.bmm(do_HQV, w_uv).transpose(0, 1)  # [Qb, Hh, R]
    dp = torch.matmul(do_lat, blk.c_QWR.transpose(1, 2)).to(p.dtype)
    ds = p * (dp - (p * dp).sum(-1, keepdim=True))
    del dp
    ds_dt = ds.to(dt) * scale  # the reference's gradient of (q k^T) * scale
    del ds
    dq_abs = torch.matmul(ds_dt, blk.c_QWR)
    if empty is not None:
        dq_abs = empty.backward(blk, dq_abs, do_lat, scale)
    dq[b, s:e] = torch.bmm(dq_abs.transpose(0, 1), w_uk.transpose(1, 2)).transpose(0, 1)
    dw_uk += torch.bmm(q_BQHD[b, s:e].permute(1, 2, 0), dq_abs.transpose(0, 1))
    # d c_sel = dS^T q_abs + p^T dO_lat: one matmul over the stacked heads, in the compute dtype
    lhs = torch.cat([ds_dt, p.to(dt)], dim=1).to(p.dtype).transpose(1, 2)
    rhs = torch.cat([blk.q_abs_QHR, do_lat], dim=1).to(p.dtype)
    dc[b].index_add_(0, blk.flat, torch.matmul(lhs, rhs).flatten(0, 1))


# ---- the op ---------------------------------------------------------------------------------------------
def _work_dtype(q: torch.Tensor) -> torch.dtype:
    """The dtype the reference's matmuls run in: autocast's when it is on, else q's."""
    dev = q.device.type
    if dev in ("cuda", "cpu") and torch.is_autocast_enabled(dev):
        return torch.get_autocast_dtype(dev)
    return q.dtype


def sparse_mla_supports(q_BQHD, c_BSR, kv_b_weight, idx_BQW, scale, return_lse: bool = False,
                        head_probs=None) -> str | None:
    if c_BSR.dim() != 3 or kv_b_weight.dim() != 2 or kv_b_weight.shape[1] != c_BSR.shape[-1]:
        return "needs the latent c [B, S, R] and the kv_b weight [Hh * (Dn + Dv), R]"
    if q_BQHD.dim() != 4 or kv_b_weight.shape[0] % q_BQHD.shape[2]:
        return f"q {tuple(q_BQHD.shape)} is not [B, Q, Hh, Dn] for kv_b {tuple(kv_b_weight.shape)}"
    dtype = _work_dtype(q_BQHD)
    if dtype not in (torch.bfloat16, torch.float16, torch.float32, torch.float64):
        return f"dtype {dtype}"
    if q_BQHD.device.type == "cpu" and dtype not in CPU_DTYPES:
        return f"cpu {dtype}: torch_masked is the CPU path (absorbed runs on the CPU for {CPU_DTYPES})"
    return None


def sparse_mla(q_BQHD: torch.Tensor, c_BSR: torch.Tensor, kv_b_weight: torch.Tensor, idx_BQW: torch.Tensor,
               scale: float, return_lse: bool = False,
               head_probs=None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Absorbed sparse MLA, ``[B, Q, Hh, Dv]`` (``return_lse``: and ``lse2 [B, Q, Hh]``); same arguments and result
    as the reference op (``head_probs``: filled by the backward, ``reference.HeadProbs``)."""
    dt = _work_dtype(q_BQHD)
    args = (q_BQHD.to(dt), c_BSR.to(dt), kv_b_weight.to(dt), idx_BQW, float(scale), return_lse, head_probs)
    with torch.autocast(q_BQHD.device.type, enabled=False):
        return AbsorbedSparseMLA.apply(*args)
