"""The same context-parallel checks over NCCL on 2 GPUs (one process per GPU): every token-mixing
block in float64 against one GPU, and Ring-DTP in bf16 against the plain fp32-accumulated loss."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.tensor  # noqa: F401  assert_close imports it lazily: once here, not in each fork
from test_parallel_dsa import FullThenShared
from test_parallel_ulysses import _attention, _kda, _toy, block_parity

from megaseq.config import ParallelConfig
from megaseq.parallel.launch import spawn_local
from megaseq.parallel.mesh import init_mesh, shutdown
from megaseq.parallel.ring_dtp import ring_dtp_loss, vocab_shard_bounds

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                       reason="needs 2 CUDA GPUs (NCCL)"),
]


@pytest.mark.parametrize("name, make, H", [
    ("toy GQA", _toy(9, 6, 2, 5), 9),
    ("softmax attention", _attention(6, 3), 10),
    ("KDA", _kda(6, 6), 10),
    ("MLA + DSA", FullThenShared, 10),
])
def test_blocks_over_nccl_match_one_gpu(name, make, H):
    S = 24
    spawn_local(block_parity, 2, args=(make, 1, 2, 2, S, H, "cuda"))


def _ring_bf16_worker(rank: int, N: int, H: int, V: int, device: str = "cuda") -> None:
    from megaseq.ops.vocab_loss.reference import plain_linear_cross_entropy

    dev = torch.device(f"cuda:{rank}") if device == "cuda" else torch.device("cpu")
    mesh = init_mesh(ParallelConfig(cp=2, backend="nccl" if device == "cuda" else "gloo"), N, device=dev)
    g = torch.Generator().manual_seed(0)
    h = torch.randn(N, H, generator=g).to(dev, torch.bfloat16)
    w = (torch.randn(V, H, generator=g) * 0.05).to(dev, torch.bfloat16)
    labels = torch.randint(0, V, (N,), generator=g).to(dev)
    h_ref, w_ref = h.clone().requires_grad_(), w.clone().requires_grad_()
    loss_ref = plain_linear_cross_entropy(h_ref, w_ref, labels, reduction="none")
    loss_ref.sum().backward()
    n = N // 2
    sl = slice(rank * n, (rank + 1) * n)
    lo, hi = vocab_shard_bounds(V, 2)[rank]
    h_loc, w_loc = h[sl].clone().requires_grad_(), w[lo:hi].clone().requires_grad_()
    loss = ring_dtp_loss(h_loc, w_loc, labels[sl], V, mesh.cp_group)
    loss.sum().backward()
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, loss_ref[sl].detach(), atol=2e-3, rtol=1e-3)
    torch.testing.assert_close(h_loc.grad.float(), h_ref.grad[sl].float(), atol=2e-3, rtol=2e-2)
    torch.testing.assert_close(w_loc.grad.float(), w_ref.grad[lo:hi].float(), atol=2e-3, rtol=2e-2)
    shutdown(mesh)


def test_ring_dtp_bf16_over_nccl():
    spawn_local(_ring_bf16_worker, 2, args=(4096, 256, 32003))
