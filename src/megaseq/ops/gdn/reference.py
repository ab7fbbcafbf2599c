"""The reference of op ``gdn``: HF's ``torch_chunk_gated_delta_rule`` op for op (``models.common.gdn``
describes the layer). Its memory is O(S * 64 * D) per head: tests and short runs."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megaseq.ops.amp import compute_dtype

CHUNK = 64  # the reference's chunk (HF's)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """HF's (and fla's) l2norm for the gated delta rule: ``x * rsqrt(sum x^2 + eps)``."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _gdn_chunked(q, k, v, g, beta, state, chunk: int):
    """One segment, ``[B, H, L, D]`` (g, beta ``[B, H, L]``) in compute dtype, q already scaled; returns
    ``(out [B, H, L, Dv], final state [B, H, Dk, Dv])``."""
    B, Hn, L, Dk = k.shape
    pad = (chunk - L % chunk) % chunk
    q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
    beta, g = F.pad(beta, (0, pad)), F.pad(g, (0, pad))
    v_beta, k_beta = v * beta.unsqueeze(-1), k * beta.unsqueeze(-1)
    q, k, k_beta, v_beta = (t.reshape(B, Hn, -1, chunk, t.shape[-1]) for t in (q, k, k_beta, v_beta))
    g = g.reshape(B, Hn, -1, chunk).cumsum(dim=3)
    upper = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    decay = (g.unsqueeze(4) - g.unsqueeze(3)).masked_fill(upper, float("-inf")).exp()
    system = (k_beta @ k.transpose(-1, -2)) * decay
    intra = (q @ k.transpose(-1, -2)) * decay
    new_v = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    k_cum = torch.linalg.solve_triangular(system, k_beta * g.exp().unsqueeze(-1), upper=False, unitriangular=True)
    q = q * g.exp().unsqueeze(-1)
    k = k * (g[..., -1:] - g).exp().unsqueeze(-1)
    chunk_decay = g[..., -1].exp()[..., None, None]
    if state is None:
        state = q.new_zeros(B, Hn, Dk, v.shape[-1])
    outs = []
    for i in range(q.shape[2]):
        v_i = new_v[:, :, i] - k_cum[:, :, i] @ state
        outs.append(q[:, :, i] @ state + intra[:, :, i] @ v_i)
        state = state * chunk_decay[:, :, i] + k[:, :, i].transpose(-1, -2) @ v_i
    return torch.cat(outs, dim=2)[:, :, :L], state


def gdn_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                  cu_seqlens: torch.Tensor | None = None, initial_state: torch.Tensor | None = None,
                  return_state: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule over ``q, k [B, S, Hk, Dk]``, ``v [B, S, Hv, Dv]``, ``g, beta [B, S, Hv]``.

    Each key head serves ``Hv / Hk`` consecutive value heads. The state ``[N, Hv, Dk, Dv]`` starts at
    ``initial_state`` (None: zero) per row or per ``cu_seqlens`` segment (batch 1). Returns ``[B, S, Hv, Dv]``
    in q's dtype; with ``return_state`` ``(out, final_state)`` in compute dtype.
    """
    assert cu_seqlens is None or q.shape[0] == 1, "cu_seqlens needs the batch flattened to one row"
    cd = compute_dtype(q.dtype)
    rep = v.shape[2] // k.shape[2]
    bounds = [(0, q.shape[1])] if cu_seqlens is None else list(zip(cu_seqlens.tolist()[:-1], cu_seqlens.tolist()[1:]))
    outs, states = [], []
    for i, (s, e) in enumerate(bounds):
        qs, ks = (l2norm(t[:, s:e].to(cd)).repeat_interleave(rep, dim=2).transpose(1, 2) for t in (q, k))
        vs, gs, bs = (t[:, s:e].to(cd).transpose(1, 2) for t in (v, g, beta))
        h0 = None if initial_state is None else (initial_state if cu_seqlens is None else initial_state[i:i + 1])
        o, h = _gdn_chunked(qs * qs.shape[-1] ** -0.5, ks, vs, gs, bs, None if h0 is None else h0.to(cd), CHUNK)
        outs.append(o.transpose(1, 2))
        states.append(h)
    out = (torch.cat(outs, dim=1) if len(outs) > 1 else outs[0]).contiguous().to(q.dtype)
    return (out, torch.cat(states)) if return_state else out
