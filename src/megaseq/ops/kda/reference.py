"""The references of ops ``causal_conv``, ``kda`` and ``kda_gate`` (``models.common.kda`` describes the layer).

The ``kda`` reference is HF's ``chunk_kimi_delta_attention`` (its row-by-row substitution loop done as one
triangular solve); its working set is O(S * chunk * Dk) per head: a reference for tests and short CPU runs.
Where HF casts to float32 it computes in ``promote_types(dtype, float32)`` (float64 stays float64)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from megaseq.ops.amp import compute_dtype


def _segments(S: int, cu_seqlens: torch.Tensor | None) -> list[tuple[int, int]]:
    if cu_seqlens is None:
        return [(0, S)]
    bounds = cu_seqlens.tolist()
    return list(zip(bounds[:-1], bounds[1:]))


def causal_conv_reference(x_BSC: torch.Tensor, weight_CK: torch.Tensor, activation: str | None = "silu",
                          cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
    """``out[t, c] = act(sum_j w[c, j] * x[t - K + 1 + j, c])`` with zeros before each segment start.

    With ``cu_seqlens`` (``[N + 1]`` offsets) the batch must be 1 and each segment is convolved alone.
    """
    assert cu_seqlens is None or x_BSC.shape[0] == 1, "cu_seqlens needs the batch flattened to one row"
    C, K = weight_CK.shape
    outs = []
    for start, end in _segments(x_BSC.shape[1], cu_seqlens):
        seg = x_BSC[:, start:end].transpose(1, 2).to(weight_CK.dtype)
        y = F.conv1d(seg, weight_CK.unsqueeze(1), padding=K - 1, groups=C)[..., : end - start]
        if activation == "silu":
            y = F.silu(y)
        else:
            assert activation is None, f"unsupported conv activation {activation!r}"
        outs.append(y.transpose(1, 2).to(x_BSC.dtype))
    return torch.cat(outs, dim=1) if len(outs) > 1 else outs[0]


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """fla's l2norm: ``x / sqrt(sum x^2 + eps)`` (eps added, not clamped)."""
    return x / torch.sqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _kda_chunked(q, k, v, g, beta, chunk_size: int, initial_state: torch.Tensor | None = None,
                 return_state: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """One segment; inputs ``[B, H, L, D]`` (beta ``[B, H, L]``) in compute dtype.

    A port of HF ``chunk_kimi_delta_attention``: within a chunk the delta rule's unit lower-triangular
    system is solved at once, across chunks the state ``[B, H, Dk, Dv]`` is carried. It starts at
    ``initial_state`` (None: zero); with ``return_state`` the state after the last token comes back too,
    ``(out, state)``. The zero padding of the last chunk leaves the state unchanged (k, v and beta pad
    to zero, g to zero log decay), so the returned state is the one after token L - 1.
    """
    B, Hn, L, Dk = k.shape
    Dv = v.shape[-1]
    C = chunk_size
    pad = (C - L % C) % C
    q = F.pad(q, (0, 0, 0, pad)) * (1 / math.sqrt(Dk))
    k, v, g = (F.pad(t, (0, 0, 0, pad)) for t in (k, v, g))
    beta = F.pad(beta, (0, pad))
    v_beta, k_beta = v * beta.unsqueeze(-1), k * beta.unsqueeze(-1)
    q, k, v, g, k_beta, v_beta = (t.reshape(B, Hn, -1, C, t.shape[-1]) for t in (q, k, v, g, k_beta, v_beta))
    g = g.cumsum(dim=-2)
    dev = q.device
    incl = torch.triu(torch.ones(C, C, dtype=torch.bool, device=dev), diagonal=0)
    strict = torch.triu(torch.ones(C, C, dtype=torch.bool, device=dev), diagonal=1)
    decay = (g.unsqueeze(-2) - g.unsqueeze(-3)).masked_fill(strict[..., None], float("-inf"))
    decay = decay.exp().to(q.dtype)
    # N: the strictly lower intra-chunk interactions; HF's row-by-row substitution loop computes
    # (I - N)^{-1}, here one batched unit-triangular solve (same result, one op instead of C - 1)
    N = (k_beta.unsqueeze(-2) * k.unsqueeze(-3) * decay).sum(dim=-1).masked_fill(incl, 0)
    eye = torch.eye(C, dtype=N.dtype, device=dev)
    attn = torch.linalg.solve_triangular(eye + N, eye.expand_as(N), upper=False, unitriangular=True)
    u = attn @ v_beta
    w = attn @ (k_beta * g.exp())
    # everything that does not depend on the carried state is computed for all chunks at once; the
    # loop over chunks then unbinds (one backward op) instead of indexing (one full-size zero-fill
    # per chunk in backward, which made the loop quadratic in the number of chunks)
    intra = (q.unsqueeze(-2) * k.unsqueeze(-3) * decay).sum(dim=-1).masked_fill(strict, 0)
    q_decayed = q * g.exp()
    k_decayed = (k * (g[..., -1:, :] - g).exp()).transpose(-1, -2)
    chunk_decay = g[..., -1, :].exp().unsqueeze(-1)
    if initial_state is None:
        state = torch.zeros(B, Hn, Dk, Dv, dtype=u.dtype, device=dev)
    else:
        assert initial_state.shape == (B, Hn, Dk, Dv), f"initial_state {tuple(initial_state.shape)}"
        state = initial_state.to(u.dtype)
    outs = []
    for qd_i, intra_i, u_i, w_i, kd_i, cd_i in zip(*(t.unbind(2) for t in (q_decayed, intra, u, w, k_decayed,
                                                                         chunk_decay))):
        v_new = u_i - w_i @ state
        outs.append(qd_i @ state + intra_i @ v_new)
        state = state * cd_i + kd_i @ v_new
    out = torch.stack(outs, dim=2).reshape(B, Hn, -1, Dv)[:, :, :L]
    return (out, state) if return_state else out


def kda_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                  cu_seqlens: torch.Tensor | None = None, chunk_size: int = 16,
                  initial_state: torch.Tensor | None = None,
                  return_state: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """KDA over ``[B, S, H, D]`` inputs (``g`` log-decay ``[B, S, H, Dk]``, ``beta [B, S, H]``).

    q and k are l2-normalised here (HF's ``use_qk_l2norm_in_kernel=True``). The state starts at
    ``initial_state`` ``[N, H, Dk, Dv]`` (None: zero) at every segment of ``cu_seqlens`` (batch 1,
    N segments) or at every row (N = B). Returns ``[B, S, H, Dv]`` in q's dtype; with ``return_state``
    ``(out, final_state [N, H, Dk, Dv])``, the state in compute dtype (fla's kernel returns float32).
    """
    assert cu_seqlens is None or q.shape[0] == 1, "cu_seqlens needs the batch flattened to one row"
    cd = compute_dtype(q.dtype)
    segments = _segments(q.shape[1], cu_seqlens)
    if initial_state is not None:
        n = len(segments) if cu_seqlens is not None else q.shape[0]
        assert initial_state.shape == (n, q.shape[2], k.shape[-1], v.shape[-1]), (
            f"initial_state {tuple(initial_state.shape)}, expected [{n}, H, Dk, Dv]")
    outs, states = [], []
    for i, (start, end) in enumerate(segments):
        qs, ks, vs, bs, gs = (t[:, start:end].transpose(1, 2).contiguous().to(cd) for t in (q, k, v, beta, g))
        h0 = initial_state if initial_state is None or cu_seqlens is None else initial_state[i:i + 1]
        res = _kda_chunked(l2norm(qs), l2norm(ks), vs, gs, bs, chunk_size, h0, return_state)
        if return_state:
            res, state = res
            states.append(state)
        outs.append(res.transpose(1, 2))
    out = torch.cat(outs, dim=1) if len(outs) > 1 else outs[0]
    out = out.contiguous().to(q.dtype)
    if return_state:
        return out, torch.cat(states) if len(states) > 1 else states[0]
    return out


def kda_gate_reference(f_BSHD: torch.Tensor, A_log_H: torch.Tensor, dt_bias_C: torch.Tensor,
                       lower_bound: float | None) -> torch.Tensor:
    """The log decay from the gate projection's output ``f [B, S, Hh, D]``, in the compute dtype (HF's order):
    ``g = f + dt_bias``, then ``lower_bound * sigmoid(exp(A_log) * g)`` (the "safe gate", in (lower_bound, 0))
    or, without a lower bound, ``-exp(A_log) * softplus(g)`` (softplus linear above 20)."""
    cd = compute_dtype(f_BSHD.dtype)
    Hh, D = f_BSHD.shape[-2:]
    g = f_BSHD.to(cd) + dt_bias_C.to(cd).view(Hh, D)
    decay_rate = torch.exp(A_log_H.to(cd).view(Hh, 1))
    if lower_bound is not None:
        return lower_bound * torch.sigmoid(decay_rate * g)
    return -decay_rate * torch.where(g > 20.0, g, torch.log(1.0 + torch.exp(g)))
