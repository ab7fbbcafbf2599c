"""Ring-DTP over gloo: the vocabulary-sharded loss equals the one-process cross-entropy (float64) in
loss, hidden gradient and weight gradient, for vocabularies the ring does not divide; and the bytes
it sends are the ones ``ring_dtp_bytes`` predicts."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.tensor  # noqa: F401  assert_close imports it lazily: once here, not in each fork
import torch.nn.functional as F

from megaseq.config import ParallelConfig
from megaseq.parallel import ring_dtp
from megaseq.parallel.grads import global_token_count, reduce_gradients
from megaseq.parallel.launch import spawn_local
from megaseq.parallel.mesh import init_mesh, shutdown
from megaseq.parallel.ring_dtp import ring_dtp_bytes, ring_dtp_loss, vocab_shard, vocab_shard_bounds

TOL = dict(atol=1e-11, rtol=1e-10)


def _data(N: int, H: int, V: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    h = torch.randn(N, H, generator=g, dtype=torch.float64)
    w = torch.randn(V, H, generator=g, dtype=torch.float64) * 0.7
    labels = torch.randint(0, V, (N,), generator=g)
    labels[torch.randperm(N, generator=g)[: N // 5]] = -100  # ignored tokens
    return h, w, labels


def _reference(h: torch.Tensor, w: torch.Tensor, labels: torch.Tensor):
    h, w = h.clone().requires_grad_(), w.clone().requires_grad_()
    loss_N = F.cross_entropy(h @ w.T, labels, reduction="none")  # 0 at ignored tokens
    (loss_N.sum() / (labels != -100).sum()).backward()
    return loss_N.detach(), h.grad, w.grad


def _ring_worker(rank: int, dp: int, cp: int, N: int, H: int, V: int) -> None:
    mesh = init_mesh(ParallelConfig(dp=dp, cp=cp, backend="gloo"), N)
    sent = []
    real_shift = ring_dtp._shift

    def counting_shift(tensors, *args):
        sent.append(sum(t.numel() * t.element_size() for t in tensors))
        return real_shift(tensors, *args)

    ring_dtp._shift = counting_shift
    h, w, labels = _data(N, H, V)
    loss_ref, gh_ref, gw_ref = _reference(h, w, labels)
    n = N // cp
    sl = slice(mesh.cp_rank * n, (mesh.cp_rank + 1) * n)
    lo, hi = vocab_shard_bounds(V, cp)[mesh.cp_rank]
    # 1) a weight shard held as its own tensor: its gradient gathers every rank's tokens
    h_loc = h[sl].clone().requires_grad_()
    w_shard = w[lo:hi].clone().requires_grad_()
    total = global_token_count(labels[sl], group=mesh.cp_group)
    assert total == int((labels != -100).sum())
    loss = ring_dtp_loss(h_loc, w_shard, labels[sl], V, mesh.cp_group)
    (loss.sum() / total).backward()
    torch.testing.assert_close(loss.detach(), loss_ref[sl], **TOL)
    torch.testing.assert_close(h_loc.grad, gh_ref[sl], **TOL)
    torch.testing.assert_close(w_shard.grad, gw_ref[lo:hi], **TOL)
    P, Vp = cp, -(-V // cp)
    expect = ring_dtp_bytes(n, H, V, P, elem_bytes=8, acc_bytes=8)["weight_rotating"]
    assert sum(sent) == expect, (sum(sent), expect)
    # 2) a replicated head weight: each rank's view of its rows; the world all-reduce completes it
    w_full = torch.nn.Parameter(w.clone())
    h_loc2 = h[sl].clone().requires_grad_()
    loss2 = ring_dtp_loss(h_loc2, vocab_shard(w_full, mesh.cp_rank, cp), labels[sl], V, mesh.cp_group)
    (loss2.sum() / total).backward()
    reduce_gradients([w_full], group=mesh.cp_group)
    torch.testing.assert_close(w_full.grad, gw_ref, **TOL)
    assert Vp * P >= V
    shutdown(mesh)


@pytest.mark.parametrize("dp, cp, N, H, V", [
    (1, 2, 10, 7, 23),  # V odd: shards of 12 and 11 rows
    (1, 4, 12, 5, 31),  # shards 8, 8, 8, 7
    (2, 2, 6, 3, 9),    # two rings side by side
    (1, 4, 8, 4, 3),    # V < P: one shard is empty
])
def test_ring_dtp_matches_one_process(dp, cp, N, H, V):
    spawn_local(_ring_worker, dp * cp, args=(dp, cp, N, H, V))


def test_vocab_shards_cover_the_vocabulary_once():
    for V, P in [(23, 2), (31, 4), (3, 4), (154880, 64)]:
        b = vocab_shard_bounds(V, P)
        assert b[0][0] == 0 and b[-1][1] == V and all(b[i][1] == b[i + 1][0] for i in range(P - 1))
        assert max(e - s for s, e in b) - min(e - s for s, e in b) <= 1


def test_ring_dtp_bytes_picks_the_variant_that_moves_fewer_rows():
    V, H, P = 154880, 4096, 8  # glm5-flash; V / P = 19360 rows per shard
    short = ring_dtp_bytes(4096, H, V, P)   # 32K tokens over 8 ranks: 4K per rank < 19360
    long = ring_dtp_bytes(131072, H, V, P)  # 1M tokens over 8 ranks
    assert short["cheaper"] == "activation_rotating" and long["cheaper"] == "weight_rotating"
    assert short["weight_rotating"] == long["weight_rotating"]  # independent of the sequence
    assert long["activation_rotating"] > 6 * long["weight_rotating"]
