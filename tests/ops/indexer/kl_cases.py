"""Inputs and the written-out formula of op ``indexer_kl`` (``ops/indexer/kl.py``), shared by its reference test
(no Triton needed) and its kernel test. Shapes: c queries, I indexer heads, D head dim, P pooled keys, K slots."""

from __future__ import annotations

import torch


def make_inputs(seed: int, c: int, I: int, D: int, P: int, K: int, dtype=torch.float32, device: str = "cpu"):
    """``(q [c, I, D], w [c, I] fp32, keys [P, D], pools [c, K] int64, target [c, K] fp32, cand [c, K])``: scores of
    a few units, about 20% of the slots not candidates (their pools out of range: never read), row 1 without a
    candidate, row 2 selecting pool 3 at six slots; the target positive on the candidates, summing to 1."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(c, I, D, generator=gen) * 2 * D**-0.25
    w = torch.randn(c, I, generator=gen) * I**-0.5
    keys = torch.randn(P, D, generator=gen) * D**-0.25
    pools = torch.randint(0, P, (c, K), generator=gen)
    pools[2, :6] = 3
    cand = torch.rand(c, K, generator=gen) < 0.8
    cand[1] = False
    cand[2, :6] = True
    pools = torch.where(cand, pools, P + 5)
    t = torch.rand(c, K, generator=gen) * cand
    t = t / t.sum(-1, keepdim=True).clamp_min(1e-30)
    return (q.to(device, dtype), w.to(device), keys.to(device, dtype), pools.to(device), t.to(device),
            cand.to(device))


def grads_of(fn, q, w, keys, pools, t, cand, scale: float, weight=None):
    """``(kl [c], (dq, dw, dkeys))`` of ``fn`` with ``sum(kl)`` (or ``sum(weight * kl)``) as the loss."""
    leaves = [x.detach().clone().requires_grad_(True) for x in (q, w, keys)]
    rows = fn(*leaves, pools, t, cand, scale)
    loss = rows.sum() if weight is None else (rows * weight).sum()
    return rows.detach(), torch.autograd.grad(loss, leaves)


def formula(q, w, keys, pools, t, cand, scale: float) -> torch.Tensor:
    """Row by row, slot by slot: ``s_k = sum_i w_i max(0, scale q_i . key_{pool_k})``, ``logp = s - log sum_cand
    exp(s)``, ``KL = sum_k t_k log t_k - sum_cand t_k logp_k`` (0 without candidates)."""
    rows = []
    for n in range(q.shape[0]):
        ks = [k for k in range(pools.shape[1]) if cand[n, k]]
        s = [sum(w[n, i] * torch.clamp(scale * q[n, i] @ keys[pools[n, k]], min=0) for i in range(q.shape[1]))
             for k in ks]
        lse = torch.logsumexp(torch.stack(s), 0) if ks else 0.0
        ent = sum(t[n, k] * torch.log(t[n, k]) for k in range(pools.shape[1]) if t[n, k] > 0)
        rows.append(ent - sum(t[n, k] * (s[j] - lse) for j, k in enumerate(ks)) + 0.0 * q.sum())
    return torch.stack(rows)
