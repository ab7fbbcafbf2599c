"""Gradient reduction for replicated parameters over the dp x cp ranks, and the loss normalizer.

One optimizer step on D dp ranks x P cp ranks must equal the one-process step on the whole batch:

    loss_global = sum over all tokens of all ranks of loss_i / T,   T = global count of labelled tokens

Each rank backpropagates ``sum(its tokens' loss) / T`` (T all-reduced *before* the backward, so no
rank needs another's loss), and the gradients are then all-reduced with SUM: the sum over ranks of
each rank's partial derivative is the derivative of the global loss. Dividing by a local count, or
averaging gradients over ranks, is wrong as soon as ranks hold different numbers of labelled
tokens (ignored labels, document ends, uneven shards).

Every parameter is replicated on every rank in this release, so the group is the whole world
(``dp x ep x cp``). After the reduction every rank holds the same gradient, so global-norm
clipping and the optimizer step run locally and identically.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

IGNORE_INDEX = -100
BUCKET_NUMEL = 1 << 24  # elements per flat all-reduce buffer (64 MiB in fp32)


def _initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def global_token_count(labels: torch.Tensor | Iterable[torch.Tensor], group: Any = None,
                       ignore_index: int = IGNORE_INDEX) -> int:
    """Labelled tokens over every rank of ``group`` (default: the world) for this optimizer step."""
    if torch.is_tensor(labels):
        labels = [labels]
    local = sum(int((lab != ignore_index).sum()) for lab in labels)
    return all_reduce_int(local, group)


def all_reduce_int(n: int, group: Any = None) -> int:
    if not _initialized():
        return n
    t = torch.tensor([n], dtype=torch.int64, device=_device(group))
    dist.all_reduce(t, group=group)
    return int(t.item())


def all_reduce_float(x: float, group: Any = None) -> float:
    """Sum of a Python float over ``group`` (in float64, so logged losses match one process)."""
    if not _initialized():
        return x
    t = torch.tensor([x], dtype=torch.float64, device=_device(group))
    dist.all_reduce(t, group=group)
    return float(t.item())


def all_reduce_tensor(t: torch.Tensor, group: Any = None) -> torch.Tensor:
    """Sum of ``t`` over ``group`` (default: the world), as a new tensor on ``t``'s device (the collective
    runs on the backend's device: a CUDA copy under nccl)."""
    if not _initialized() or dist.get_world_size(group) == 1:
        return t.clone()
    buf = t.to(_device(group), copy=True)
    dist.all_reduce(buf, group=group)
    return buf.to(t.device)


def _device(group: Any) -> torch.device:
    backend = dist.get_backend(group)
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")


def reduce_gradients(model: torch.nn.Module | Iterable[torch.nn.Parameter], group: Any = None,
                     bucket_numel: int = BUCKET_NUMEL) -> None:
    """Sum every parameter's gradient over ``group`` (default: the world), in flat buckets.

    A parameter that received no gradient on any rank keeps ``grad = None`` (AdamW then skips it,
    exactly as in one process: e.g. the DSA indexer, which runs under no_grad); one that has a
    gradient on some rank only (an expert no local token was routed to) gets zeros elsewhere so
    every rank reduces the same list of tensors.
    """
    params = model.parameters() if isinstance(model, torch.nn.Module) else model
    params = [p for p in params if p.requires_grad]
    if not _initialized() or dist.get_world_size(group) == 1 or not params:
        return
    device = params[0].device
    has = torch.tensor([p.grad is not None for p in params], dtype=torch.int32, device=device)
    dist.all_reduce(has, group=group)
    live = []
    for p, n in zip(params, has.tolist()):
        if n == 0:
            continue
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        live.append(p)
    for bucket in _buckets(live, bucket_numel):
        flat = torch.cat([p.grad.reshape(-1) for p in bucket])
        dist.all_reduce(flat, group=group)
        for p, g in zip(bucket, flat.split([p.numel() for p in bucket])):
            p.grad.copy_(g.view_as(p.grad))


def _buckets(params: list[torch.nn.Parameter], bucket_numel: int) -> list[list[torch.nn.Parameter]]:
    """Consecutive runs of same-dtype, same-device parameters of at most ``bucket_numel`` elements."""
    out: list[list[torch.nn.Parameter]] = []
    size = 0
    for p in params:
        g = p.grad
        if out and size + g.numel() <= bucket_numel and (g.dtype, g.device) == (out[-1][0].grad.dtype,
                                                                                   out[-1][0].grad.device):
            out[-1].append(p)
            size += g.numel()
        else:
            out.append([p])
            size = g.numel()
    return out


@torch.no_grad()
def broadcast_parameters(model: torch.nn.Module, src: int = 0, group: Any = None) -> None:
    """Make every rank's replica equal to rank ``src``'s (after a random init or a partial load)."""
    if not _initialized():
        return
    for t in list(model.parameters()) + list(model.buffers()):
        dist.broadcast(t.data, src=src, group=group)
