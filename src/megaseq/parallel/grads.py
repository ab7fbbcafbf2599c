"""Gradient reduction for replicated parameters over the dp x cp ranks, and the loss normalizer.

One optimizer step on D dp ranks x P cp ranks must equal the one-process step on the whole batch:

    loss_global = sum over all tokens of all ranks of loss_i / T,   T = global count of labelled tokens

Each rank backpropagates ``sum(its tokens' loss) / T`` (T all-reduced *before* the backward, so no
rank needs another's loss), and the gradients are then all-reduced with SUM: the sum over ranks of
each rank's partial derivative is the derivative of the global loss. Dividing by a local count, or
averaging gradients over ranks, is wrong as soon as ranks hold different numbers of labelled
tokens (ignored labels, document ends, uneven shards).

Every parameter but the routed experts is replicated on every rank, so its group is the whole world
(``dp x ep x cp``). Under expert parallelism each rank holds E / ep experts, replicated over the dp x cp
ranks with the same ep coordinate (``mesh.expert_group``), whose gradients are summed there. After the
reduction every rank holds the same gradient of each parameter it holds; the global norm adds the
experts' squares over the ep group (``clip_grad_norm``), so clipping and the step agree everywhere.
Parameters sharded by FSDP (``parallel.fsdp``) are reduce-scattered by FSDP in the backward; global-norm
clipping then sums each shard's squares over its mesh (``memory.master_adam.grad_norm``).
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
                     bucket_numel: int = BUCKET_NUMEL, dtensors: bool = False) -> None:
    """Sum every whole (replicated) parameter's gradient over ``group`` (default: the world), in flat buckets.

    A parameter that received no gradient on any rank keeps ``grad = None`` (AdamW then skips it,
    exactly as in one process: e.g. the DSA indexer, which runs under no_grad); one that has a
    gradient on some rank only (an expert no local token was routed to) gets zeros elsewhere so
    every rank reduces the same list of tensors. FSDP's shards (DTensor parameters) are skipped: their
    gradients were reduce-scattered in the backward (``parallel.fsdp``). ``dtensors``: DTensor parameters
    are reduced too, their local tensors summed over ``group`` (the expert-parallel experts, each a slice
    replicated over the ranks of ``group``).
    """
    params = model.parameters() if isinstance(model, torch.nn.Module) else model
    params = [p for p in params if p.requires_grad and (dtensors or not _is_dtensor(p))]
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
    all_reduce_tensors([_local(p.grad) for p in live], group, bucket_numel)


def _is_dtensor(t: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local tensor (a view: writing it writes the DTensor), else ``t``."""
    return t.to_local() if _is_dtensor(t) else t


@torch.no_grad()
def all_reduce_tensors(tensors: list[torch.Tensor], group: Any = None, bucket_numel: int = BUCKET_NUMEL) -> None:
    """Sum each tensor over ``group`` in place, in flat buckets of same-dtype, same-device tensors."""
    if not _initialized() or dist.get_world_size(group) == 1:
        return
    for bucket in _buckets(tensors, bucket_numel):
        flat = torch.cat([t.reshape(-1) for t in bucket])
        dist.all_reduce(flat, group=group)
        for t, g in zip(bucket, flat.split([t.numel() for t in bucket])):
            t.copy_(g.view_as(t))


def _buckets(tensors: list[torch.Tensor], bucket_numel: int) -> list[list[torch.Tensor]]:
    """Consecutive runs of same-dtype, same-device tensors of at most ``bucket_numel`` elements."""
    out: list[list[torch.Tensor]] = []
    size = 0
    for t in tensors:
        if out and size + t.numel() <= bucket_numel and (t.dtype, t.device) == (out[-1][0].dtype,
                                                                                  out[-1][0].device):
            out[-1].append(t)
            size += t.numel()
        else:
            out.append([t])
            size = t.numel()
    return out


@torch.no_grad()
def broadcast_parameters(model: torch.nn.Module, src: int = 0, group: Any = None) -> None:
    """Make every rank's replica equal to rank ``src``'s (after a random init or a partial load)."""
    if not _initialized():
        return
    for t in list(model.parameters()) + list(model.buffers()):
        dist.broadcast(t.data, src=src, group=group)


def clip_grad_norm(params: Iterable[torch.nn.Parameter], max_norm: float, sharded: Iterable[torch.nn.Parameter] = (),
                   group: Any = None) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` over parameters of which ``sharded`` are split over ``group`` (each
    rank holds different ones, the others are replicated): the norm of every gradient of the model, the
    same on every rank. ``max_norm`` 0: the norm only."""
    params = [p for p in params if p.grad is not None]
    shard_ids = {id(p) for p in sharded}
    norms = [torch.linalg.vector_norm(_local(p.grad)) for p in params]  # a DTensor's: its local slice's
    rep = [n for p, n in zip(params, norms) if id(p) not in shard_ids]
    own = [n for p, n in zip(params, norms) if id(p) in shard_ids]
    dtype = norms[0].dtype if norms else torch.float32
    sq = torch.zeros((), dtype=dtype, device=params[0].grad.device if params else None)
    sq_own = sum((n * n for n in own), sq.clone())
    if _initialized() and group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(sq_own, group=group)
    total = torch.sqrt(sum((n * n for n in rep), sq) + sq_own)
    if max_norm > 0:
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for p in params:
            _local(p.grad).mul_(coef.to(p.grad.dtype))
    return total
