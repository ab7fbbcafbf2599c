"""Ring-DTP: the vocabulary projection and cross-entropy sharded by vocabulary over the cp group.

Shapes: N tokens held by this rank, H hidden, V vocabulary, P ranks in the ring, Vp = ceil(V / P)
rows in a padded shard, Vo rows of shard o (balanced: the first V % P shards have one row more).

Rank o owns rows ``[off_o, off_o + Vo)`` of ``lm_head.weight``. The weight-rotating ring: in round
k rank r holds shard ``o = (r + k) % P`` (received from rank r + 1, passed on to rank r - 1), computes
one ``N x Vo`` strip of logits for its own tokens, folds it into the online log-sum-exp state
``(m, s, t)`` of ``megaseq.ops.vocab_loss.reference`` and frees it. After P rounds each token's
``loss = m + log s - t`` is exact. The next shard travels while the current strip is computed.

Backward runs the ring again: the strip is recomputed, ``dlogits = g * (softmax - onehot)``; the
hidden gradient sums ``dlogits @ W_o`` locally, and a gradient accumulator for shard o travels with
the shard, gathering every rank's ``dlogits^T @ h``. After the last round rank r holds the
accumulator of shard ``(r + P - 1) % P = r - 1``, whose owner is the rank the ring sends to: one
more hop of the accumulator alone brings every shard's gradient home.

Peak memory per rank: one strip ``N x Vo`` plus two padded shards and two accumulators, instead of
``N x V`` logits. ``ring_dtp_bytes`` compares this variant's traffic with the activation-rotating one;
every hop is counted (ops ``ring_weight`` and ``ring_grad_acc``) in ``parallel.ulysses.COMM_BYTES``.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from megaseq.parallel.ulysses import _SCOPE, count_bytes

IGNORE_INDEX = -100


def vocab_shard_bounds(vocab_size: int, num_shards: int) -> list[tuple[int, int]]:
    """``[start, end)`` rows of each shard; sizes differ by at most one (V need not divide by P)."""
    base, extra = divmod(vocab_size, num_shards)
    bounds, start = [], 0
    for i in range(num_shards):
        end = start + base + (1 if i < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


def vocab_shard(weight_VH: torch.Tensor, rank: int, num_shards: int) -> torch.Tensor:
    """This rank's rows of a full (replicated) head weight, as a view: its grad flows to the full weight."""
    start, end = vocab_shard_bounds(weight_VH.shape[0], num_shards)[rank]
    return weight_VH[start:end]


def _ring_peers(group: Any) -> tuple[int, int, int, int]:
    """(rank in group, P, global rank to send to (r - 1), global rank to receive from (r + 1))."""
    r, P = dist.get_rank(group), dist.get_world_size(group)
    return r, P, dist.get_global_rank(group, (r - 1) % P), dist.get_global_rank(group, (r + 1) % P)


def _shift(tensors: list[torch.Tensor], send_to: int, recv_from: int, group: Any,
           count: tuple[str, str, str]) -> tuple[list, list]:
    """Start sending ``tensors`` to ``send_to`` and receiving same-shaped ones from ``recv_from``;
    ``count``: (op, direction, scope) the sent bytes are counted under."""
    op, direction, scope = count
    count_bytes(op, direction, sum(t.numel() * t.element_size() for t in tensors), scope)
    received = [torch.empty_like(t) for t in tensors]
    ops = [dist.P2POp(dist.isend, t, send_to, group) for t in tensors]
    ops += [dist.P2POp(dist.irecv, t, recv_from, group) for t in received]
    return received, dist.batch_isend_irecv(ops)


def _wait(reqs: list) -> None:
    for req in reqs:
        req.wait()


def _padded(w_VoH: torch.Tensor, rows: int) -> torch.Tensor:
    out = w_VoH.new_zeros((rows, w_VoH.shape[1]))
    out[: w_VoH.shape[0]] = w_VoH
    return out


def _strip_grad(h_NH: torch.Tensor, w_VoH: torch.Tensor, labels_N: torch.Tensor, lse_N: torch.Tensor,
                g_N: torch.Tensor, offset: int) -> torch.Tensor:
    """``d loss / d logits`` of one strip: ``g * (softmax - onehot(label))``, ``[N, Vo]``."""
    logits = (h_NH @ w_VoH.t()).to(lse_N.dtype)
    d_NV = torch.exp(logits - lse_N[:, None]) * g_N[:, None]
    local = labels_N - offset
    hit = (local >= 0) & (local < w_VoH.shape[0])
    rows = hit.nonzero(as_tuple=True)[0]
    d_NV[rows, local[rows]] -= g_N[rows]
    return d_NV


class RingDTPLoss(torch.autograd.Function):
    """Per-token cross-entropy ``[N]`` of ``h @ W.T`` with W sharded by vocabulary over ``group``."""

    @staticmethod
    def forward(ctx: Any, h_NH: torch.Tensor, w_VoH: torch.Tensor, labels_N: torch.Tensor, vocab_size: int,
                group: Any, ignore_index: int) -> torch.Tensor:
        from megaseq.ops.vocab_loss.reference import acc_dtype, lse_init, lse_logsumexp, lse_update

        r, P, send_to, recv_from = _ring_peers(group)
        bounds = vocab_shard_bounds(vocab_size, P)
        assert w_VoH.shape[0] == bounds[r][1] - bounds[r][0], "shard rows must match vocab_shard_bounds"
        Vp = math.ceil(vocab_size / P)
        state = lse_init(h_NH.shape[0], h_NH.device, acc_dtype(h_NH.dtype))
        buf = _padded(w_VoH.detach(), Vp)
        for k in range(P):
            o = (r + k) % P
            if k < P - 1:
                nxt, reqs = _shift([buf], send_to, recv_from, group, ("ring_weight", "fwd", _SCOPE[0]))
            start, end = bounds[o]
            if end > start:  # V < P leaves some shards empty
                state = lse_update(state, h_NH @ buf[: end - start].t(), labels_N, start)  # strip freed here
            if k < P - 1:
                _wait(reqs)
                buf = nxt[0]
        lse = lse_logsumexp(state)
        valid = labels_N != ignore_index
        loss = torch.where(valid, lse - state.t, torch.zeros_like(lse))
        ctx.save_for_backward(h_NH, w_VoH, labels_N, lse, valid)
        ctx.vocab_size, ctx.group, ctx.scope = vocab_size, group, _SCOPE[0]
        return loss

    @staticmethod
    def backward(ctx: Any, g_N: torch.Tensor) -> tuple:
        h_NH, w_VoH, labels_N, lse, valid = ctx.saved_tensors
        r, P, send_to, recv_from = _ring_peers(ctx.group)
        bounds = vocab_shard_bounds(ctx.vocab_size, P)
        Vp = math.ceil(ctx.vocab_size / P)
        g_N = torch.where(valid, g_N.to(lse.dtype), torch.zeros_like(lse))
        gdtype = torch.promote_types(w_VoH.dtype, torch.float32)
        grad_h = torch.zeros(h_NH.shape, dtype=gdtype, device=h_NH.device)
        w_buf = _padded(w_VoH.detach(), Vp)
        acc = torch.zeros((Vp, h_NH.shape[1]), dtype=gdtype, device=h_NH.device)
        for k in range(P):
            o = (r + k) % P
            start, end = bounds[o]
            if k < P - 1:  # the weight can travel on while this strip is computed
                nxt_w, reqs_w = _shift([w_buf], send_to, recv_from, ctx.group, ("ring_weight", "bwd", ctx.scope))
            if end > start:
                w_o = w_buf[: end - start]
                d_NV = _strip_grad(h_NH, w_o, labels_N, lse, g_N, start)
                grad_h += d_NV @ w_o.to(gdtype)
                acc[: end - start] += d_NV.t() @ h_NH.to(gdtype)
                del d_NV
            hop = ("ring_grad_acc", "bwd", ctx.scope)
            nxt_acc, reqs_acc = _shift([acc], send_to, recv_from, ctx.group, hop)  # the last hop: to the owner
            _wait(reqs_acc)
            acc = nxt_acc[0]
            if k < P - 1:
                _wait(reqs_w)
                w_buf = nxt_w[0]
        own = bounds[r][1] - bounds[r][0]
        grad_w = acc[:own].to(w_VoH.dtype)
        return grad_h.to(h_NH.dtype), grad_w, None, None, None, None


def ring_dtp_loss(hidden_NH: torch.Tensor, weight_shard_VoH: torch.Tensor, labels_N: torch.Tensor,
                  vocab_size: int, group: Any, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Per-token loss ``[N]`` (0 where the label is ``ignore_index``); exact, never holds ``N x V``.

    ``weight_shard_VoH`` is this rank's rows ``vocab_shard_bounds(V, P)[rank]`` of the head weight
    (``vocab_shard(lm_head.weight, rank, P)`` when the weight is replicated). Its gradient sums the
    contributions of every rank's tokens; the hidden gradient is this rank's tokens' own.
    """
    if dist.get_world_size(group) == 1:
        from megaseq.ops.vocab_loss.reference import plain_linear_cross_entropy

        return plain_linear_cross_entropy(hidden_NH, weight_shard_VoH, labels_N, ignore_index=ignore_index,
                                          reduction="none")
    return RingDTPLoss.apply(hidden_NH, weight_shard_VoH, labels_N, vocab_size, group, ignore_index)


def ring_dtp_bytes(N: int, H: int, V: int, P: int, elem_bytes: int = 2, acc_bytes: int = 4) -> dict[str, Any]:
    """Bytes one rank sends per step (forward + backward) in each Ring-DTP variant; N = tokens per rank.

    weight-rotating: forward P-1 shard hops; backward P-1 shard hops plus P hops of the fp32 shard
    gradient accumulator (the last returns it to its owner).
    activation-rotating: forward P-1 hops of the hidden states and labels (int64) plus P hops of the
    (m, s, t) state; backward P-1 hops of hidden, labels and (lse, g), plus P hops of the fp32 hidden
    gradient accumulator; weight gradients stay with their owner.
    Both scale as rows x H: the weight variant moves ceil(V/P) rows, the activation variant N, so the
    activation variant is cheaper while N < V / P (short sequences, large vocabularies).
    """
    Vp = math.ceil(V / P)
    weight = (P - 1) * Vp * H * elem_bytes * 2 + P * Vp * H * acc_bytes
    act_fwd = (P - 1) * (N * H * elem_bytes + N * 8) + P * 3 * N * acc_bytes
    act_bwd = (P - 1) * (N * H * elem_bytes + N * 8 + 2 * N * acc_bytes) + P * N * H * acc_bytes
    activation = act_fwd + act_bwd
    return {"weight_rotating": weight, "activation_rotating": activation,
            "cheaper": "weight_rotating" if weight <= activation else "activation_rotating"}
