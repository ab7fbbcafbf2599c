"""Gradient reduction over gloo: sums in buckets of mixed dtypes, keeps ``grad = None`` where no rank
has a gradient, zero-fills where only some ranks do; the global token count."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megaseq.config import build_config
from megaseq.parallel.env import DistributedEnv
from megaseq.parallel.grads import all_reduce_float, global_token_count, reduce_gradients
from megaseq.parallel.launch import spawn_local


def _params() -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(0)
    f64, f32 = torch.float64, torch.float32
    shapes = [((3, 5), f64), ((7,), f32), ((2, 2, 3), f64), ((4,), f64)]
    return [torch.nn.Parameter(torch.randn(s, generator=g, dtype=d)) for s, d in shapes]


def _rank_grad(p: torch.Tensor, rank: int, i: int) -> torch.Tensor:
    return torch.full_like(p, float(10 * (rank + 1) + i)) + torch.arange(p.numel(), dtype=p.dtype).view_as(p)


def _reduce_worker(rank: int, world: int) -> None:
    dist.init_process_group("gloo", rank=rank, world_size=world)
    params = _params()
    for i, p in enumerate(params[:2]):  # every rank has a gradient
        p.grad = _rank_grad(p, rank, i)
    if rank == world - 1:  # only the last rank (an expert routed to by its tokens only)
        params[2].grad = _rank_grad(params[2], rank, 2)
    # params[3]: no rank has a gradient (the DSA indexer under no_grad)
    reduce_gradients(params, bucket_numel=16)  # several buckets; float32 and float64 kept apart
    for i in range(2):
        want = sum(_rank_grad(params[i], r, i) for r in range(world))
        assert params[i].grad.dtype == params[i].dtype
        torch.testing.assert_close(params[i].grad, want, atol=0, rtol=0)
    torch.testing.assert_close(params[2].grad, _rank_grad(params[2], world - 1, 2), atol=0, rtol=0)
    assert params[3].grad is None
    labels = torch.full((2, 5), 1)
    labels[:, : rank + 1] = -100  # rank r ignores r + 1 tokens per row
    assert global_token_count([labels, labels[:1]]) == sum(15 - 3 * (r + 1) for r in range(world))
    assert all_reduce_float(0.5 + rank) == sum(0.5 + r for r in range(world))
    dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 4])
def test_reduce_gradients_sums_and_keeps_none(world):
    spawn_local(_reduce_worker, world, args=(world,))


def test_expert_parallel_needs_its_processes():
    """ep is an axis of the mesh now (tests/test_parallel_expert*.py); one process cannot hold it."""
    cfg = build_config(overrides={"parallel.ep": 2, "train.device": "cpu"})
    with pytest.raises(ValueError, match="not a multiple of parallel.cp \\* parallel.ep = 1 \\* 2"):
        DistributedEnv(cfg)
