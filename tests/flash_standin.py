"""A stand-in for ``F.scaled_dot_product_attention`` on the CPU with the memory of the GPU's flash kernel: the
forward keeps q, k, v, the output and the log-sum-exp (no scores matrix: a block of query rows at a time), the
backward allocates dq, dk and dv (the kernel's outputs) and works a block of rows at a time. For measuring what
the callers of attention allocate (``bench.live``), not the kernel's values beyond a float64 check."""

from __future__ import annotations

import math

import torch

ROWS = 4  # query rows of one stand-in block


def _mask(i0: int, i1: int, L: int, Lq: int, causal: bool, device) -> torch.Tensor | None:
    """Rows ``[i0, i1)`` of the causal mask aligned to the lower right (queries the last ``Lq`` of ``L`` keys)."""
    if not causal:
        return None
    q = torch.arange(i0, i1, device=device)[:, None] + (L - Lq)
    return torch.arange(L, device=device)[None, :] > q


class _FlashLike(torch.autograd.Function):
    """One head and one block of query rows at a time; transients of a block's scores ``[ROWS, L]`` and one
    head's ``[L, D]`` update (as a kernel's registers and tiles, bounded whatever the head count)."""

    @staticmethod
    def forward(ctx, q, k, v, causal: bool, scale: float):
        B, H, Lq, _ = q.shape
        L, rep = k.shape[2], H // k.shape[1]
        out = q.new_empty(B, H, Lq, v.shape[-1])
        lse = torch.empty(B, H, Lq, dtype=torch.float32, device=q.device)
        for b in range(B):
            for h in range(H):
                kh, vh = k[b, h // rep], v[b, h // rep]
                for i in range(0, Lq, ROWS):
                    e = min(i + ROWS, Lq)
                    s = (q[b, h, i:e] @ kh.T).float() * scale
                    m = _mask(i, e, L, Lq, causal, q.device)
                    if m is not None:
                        s = s.masked_fill(m, float("-inf"))
                    lse[b, h, i:e] = torch.logsumexp(s, -1)
                    out[b, h, i:e] = torch.exp(s - lse[b, h, i:e, None]).to(vh.dtype) @ vh
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal, ctx.scale = causal, scale
        return out

    @staticmethod
    def backward(ctx, g):
        q, k, v, out, lse = ctx.saved_tensors
        B, H, Lq, _ = q.shape
        L, rep = k.shape[2], H // k.shape[1]
        dq, dk, dv = torch.empty_like(q), torch.zeros_like(k), torch.zeros_like(v)
        for b in range(B):
            for h in range(H):
                kh, vh = k[b, h // rep], v[b, h // rep]
                for i in range(0, Lq, ROWS):
                    e = min(i + ROWS, Lq)
                    s = (q[b, h, i:e] @ kh.T).float() * ctx.scale
                    m = _mask(i, e, L, Lq, ctx.causal, q.device)
                    if m is not None:
                        s = s.masked_fill(m, float("-inf"))
                    p = torch.exp(s - lse[b, h, i:e, None])
                    gh = g[b, h, i:e]
                    delta = (gh.float() * out[b, h, i:e].float()).sum(-1, keepdim=True)
                    ds = (p * ((gh @ vh.T).float() - delta) * ctx.scale).to(q.dtype)
                    dq[b, h, i:e] = ds @ kh
                    dk[b, h // rep].addmm_(ds.T, q[b, h, i:e])  # in place: no [L, D] temporary
                    dv[b, h // rep].addmm_(p.to(g.dtype).T, gh)
        return dq, dk, dv, None, None


def sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """``F.scaled_dot_product_attention``'s signature: causal (``is_causal``) or a lower-right causal bias."""
    assert dropout_p == 0.0
    causal = is_causal or attn_mask is not None  # torch.nn.attention.bias.causal_lower_right: the only mask used
    return _FlashLike.apply(q, k, v, causal, scale if scale is not None else 1 / math.sqrt(q.shape[-1]))


def install(monkeypatch) -> None:
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", sdpa)
