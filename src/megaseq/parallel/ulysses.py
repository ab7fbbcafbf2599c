"""Ulysses context parallelism: the SeqContext hooks as collectives over the cp group.

Shapes: B batch, S full sequence, S_loc = S / P tokens per rank, P = cp ranks, Hh heads,
h = Hh / P heads per rank, D head dim (any trailing dims ``*R`` ride along).

Two ways a token-mixing block goes context-parallel (docs/context_parallel.md has the bytes):

- Ulysses (KDA, softmax attention, optionally MLA): ``seq_to_heads`` is an all-to-all that turns
  ``[B, S_loc, Hh, *R]`` (all heads, part of the sequence) into ``[B, S, h, *R]`` (all of the
  sequence, part of the heads); the block runs its full-sequence kernel (attention, or KDA's conv and
  recurrence) on its heads; ``heads_to_seq`` is the inverse all-to-all. The backward of each is the
  other: an all-to-all is a permutation of blocks, so its adjoint is the inverse permutation.
  GQA: when P exceeds the KV heads (and is a multiple of them) each KV head is replicated P / Hkv
  times before the all-to-all, so rank r receives KV head r // (P / Hkv), the one its query heads
  ``head_slice`` use; the backward sums the replicas' gradients.
- gather-KV (MLA/DSA): queries stay local; ``gather_seq`` all-gathers the compact latent KV (and
  the indexer keys) of the whole sequence; its backward reduce-scatters the gradient, because every
  rank's queries contributed to every shard's gradient. With this mode each rank scores only its own
  queries in the DSA indexer, so scoring is split across the group rather than repeated.

Every collective's cost is independent of which rank calls it; all ranks of a cp group must call
the same hooks in the same order (the blocks do: the layer sequence is the same on every rank).

Traffic counter: every collective here (and Ring-DTP's hops) adds the payload bytes that *leave this
rank* to ``COMM_BYTES[(scope, op, direction)]`` -- an all-to-all ``(P - 1) / P`` of its buffer (the
block addressed to itself stays), an all-gather its shard ``P - 1`` times, a reduce-scatter the
``P - 1`` blocks of other ranks, a point-to-point send the whole tensor: the definition
``megaseq.plan.flops.comm_volume`` uses. ``scope`` is a label set with ``comm_scope`` (e.g. the layer
kind; the backward keeps the forward's label), ``direction`` is ``fwd`` or ``bwd``. One dict add per
call; ``tests/parallel/test_parallel_comm_volume.py`` checks the planner's formulas against it.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from megaseq.models.common.context import SeqContext
from megaseq.parallel.mesh import check_heads

_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


# ---- traffic counter --------------------------------------------------------------------------
COMM_BYTES: defaultdict[tuple[str, str, str], int] = defaultdict(int)  # (scope, op, direction) -> bytes
_SCOPE = [""]  # the label new collectives are counted under (a list: mutable without ``global``)


def count_bytes(op: str, direction: str, nbytes: int, scope: str | None = None) -> None:
    COMM_BYTES[(_SCOPE[0] if scope is None else scope, op, direction)] += nbytes


def comm_bytes() -> dict[tuple[str, str, str], int]:
    """A copy of the counter: bytes this rank sent, by (scope, op, direction)."""
    return dict(COMM_BYTES)


def reset_comm_bytes() -> None:
    COMM_BYTES.clear()


@contextmanager
def comm_scope(label: str) -> Iterator[None]:
    """Count the collectives started inside (and their backward) under ``label``."""
    prev, _SCOPE[0] = _SCOPE[0], label
    try:
        yield
    finally:
        _SCOPE[0] = prev


def _nbytes(x: torch.Tensor) -> int:
    return x.numel() * x.element_size()


# ---- raw collectives (no autograd) ----------------------------------------------------------
def _all_to_all(x_P: torch.Tensor, group: Any, direction: str = "fwd", scope: str | None = None) -> torch.Tensor:
    """Block p of the leading dim goes to rank p; block p of the result came from rank p."""
    x_P = x_P.contiguous()
    P = x_P.shape[0]
    count_bytes("all_to_all", direction, _nbytes(x_P) * (P - 1) // P, scope)  # own block stays
    out = torch.empty_like(x_P)
    dist.all_to_all_single(out, x_P, group=group)
    return out


def _seq_to_heads(x: torch.Tensor, group: Any, P: int, direction: str = "fwd",
                  scope: str | None = None) -> torch.Tensor:
    """``[B, S_loc, Hh, *R] -> [B, S, Hh / P, *R]`` (Hh divisible by P); ``direction``, ``scope``: the
    counter's labels (a backward passes the forward's scope)."""
    B, S_loc, Hh, *R = x.shape
    h = Hh // P
    x_PBshR = x.reshape(B, S_loc, P, h, *R).movedim(2, 0)  # head group p -> rank p
    y_PBshR = _all_to_all(x_PBshR, group, direction, scope)  # block p: rank p's sequence shard of my heads
    return y_PBshR.movedim(0, 1).reshape(B, P * S_loc, h, *R)


def _heads_to_seq(y: torch.Tensor, group: Any, P: int, direction: str = "fwd",
                  scope: str | None = None) -> torch.Tensor:
    """``[B, S, h, *R] -> [B, S_loc, h * P, *R]``: the inverse of ``_seq_to_heads``."""
    B, S, h, *R = y.shape
    S_loc = S // P
    y_PBshR = y.reshape(B, P, S_loc, h, *R).movedim(1, 0)  # sequence shard p -> rank p
    x_PBshR = _all_to_all(y_PBshR, group, direction, scope)  # block p: head group p of my shard
    return x_PBshR.movedim(0, 2).reshape(B, S_loc, P * h, *R)


def _gather_seq(x: torch.Tensor, group: Any, P: int, scope: str | None = None) -> torch.Tensor:
    """``[B, S_loc, *R] -> [B, S, *R]`` (always a forward: its backward is ``_reduce_scatter_seq``)."""
    B, S_loc, *R = x.shape
    count_bytes("all_gather", "fwd", _nbytes(x) * (P - 1), scope)  # the shard, to each other rank
    out_PBsR = torch.empty((P * B, S_loc, *R), dtype=x.dtype, device=x.device)  # gloo wants dim 0 stacked
    _all_gather(out_PBsR, x.contiguous(), group=group)
    return out_PBsR.view(P, B, S_loc, *R).movedim(0, 1).reshape(B, P * S_loc, *R)


def _reduce_scatter_seq(g: torch.Tensor, group: Any, P: int, scope: str | None = None) -> torch.Tensor:
    """``[B, S, *R] -> [B, S_loc, *R]``: sum over ranks, keep this rank's shard (a backward)."""
    B, S, *R = g.shape
    count_bytes("reduce_scatter", "bwd", _nbytes(g) * (P - 1) // P, scope)  # the other ranks' blocks
    g_PBsR = g.reshape(B, P, S // P, *R).movedim(1, 0).reshape(P * B, S // P, *R)
    out = torch.empty((B, S // P, *R), dtype=g.dtype, device=g.device)
    _reduce_scatter(out, g_PBsR, group=group)
    return out


# ---- autograd Functions -------------------------------------------------------------------
class SeqToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, P: int) -> torch.Tensor:
        ctx.group, ctx.P, ctx.scope = group, P, _SCOPE[0]
        return _seq_to_heads(x, group, P)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _heads_to_seq(g, ctx.group, ctx.P, "bwd", ctx.scope), None, None


class HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, y: torch.Tensor, group: Any, P: int) -> torch.Tensor:
        ctx.group, ctx.P, ctx.scope = group, P, _SCOPE[0]
        return _heads_to_seq(y, group, P)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _seq_to_heads(g, ctx.group, ctx.P, "bwd", ctx.scope), None, None


class GatherSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, P: int) -> torch.Tensor:
        ctx.group, ctx.P, ctx.scope = group, P, _SCOPE[0]
        return _gather_seq(x, group, P)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _reduce_scatter_seq(g, ctx.group, ctx.P, ctx.scope), None, None


# ---- the context ----------------------------------------------------------------------------
@dataclass
class UlyssesContext(SeqContext):
    """SeqContext for one rank of a cp group of ``cp_size`` ranks; ``group`` is that cp group."""

    group: Any = None
    mla_mode: str = "gather_kv"  # how MLA/DSA layers go parallel: "gather_kv" or "ulysses"
    _full_doc_ids: torch.Tensor | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        assert self.cp_size > 1 and self.group is not None, "UlyssesContext needs a cp group of 2+ ranks"
        assert dist.get_rank(self.group) == self.cp_rank, "cp group rank order must follow the sequence"

    def full_doc_ids(self) -> torch.Tensor | None:
        if self.doc_ids is None:
            return None
        if self._full_doc_ids is None:  # the same for every layer: gather once per step
            self._full_doc_ids = _gather_seq(self.doc_ids, self.group, self.cp_size, scope="doc_ids")
        return self._full_doc_ids

    def seq_offset(self) -> int:
        return self.cp_rank * self.local_len()

    def local_len(self) -> int:
        assert self.doc_ids is not None or self.position_ids is not None, "the shard's length is unknown"
        ref = self.doc_ids if self.doc_ids is not None else self.position_ids
        return ref.shape[1]

    def seq_to_heads(self, x: torch.Tensor) -> torch.Tensor:
        P, heads = self.cp_size, x.shape[2]
        if heads % P:
            check_heads(heads, P, "heads given to seq_to_heads", replicable=True)
            x = x.repeat_interleave(P // heads, dim=2)  # GQA: KV head j serves ranks j*P/Hkv ...
        return SeqToHeads.apply(x, self.group, P)

    def heads_to_seq(self, x: torch.Tensor) -> torch.Tensor:
        return HeadsToSeq.apply(x, self.group, self.cp_size)

    def head_slice(self, num_heads: int) -> slice:
        P, r = self.cp_size, self.cp_rank
        if num_heads % P == 0:
            h = num_heads // P
            return slice(r * h, (r + 1) * h)
        check_heads(num_heads, P, "heads given to head_slice", replicable=True)
        j = r // (P // num_heads)  # replicated (GQA KV) heads: one per rank
        return slice(j, j + 1)

    def gather_seq(self, x: torch.Tensor, key: str | None = None) -> torch.Tensor:
        return GatherSeq.apply(x, self.group, self.cp_size)


def make_context(mesh: Any, shard: dict[str, torch.Tensor], mla_mode: str = "gather_kv") -> SeqContext:
    """The context a model forward needs for this rank's shard (the plain one when cp = 1)."""
    doc, pos = shard.get("doc_ids"), shard.get("position_ids")
    if mesh.cp == 1:
        return SeqContext(doc_ids=doc, position_ids=pos)
    if pos is None:  # no documents: positions are the global token index
        S_loc = shard["input_ids"].shape[1]
        pos = torch.arange(mesh.cp_rank * S_loc, (mesh.cp_rank + 1) * S_loc, device=shard["input_ids"].device)
        pos = pos.expand(shard["input_ids"].shape[0], S_loc)
    return UlyssesContext(doc_ids=doc, position_ids=pos, cp_size=mesh.cp, cp_rank=mesh.cp_rank,
                          group=mesh.cp_group, mla_mode=mla_mode)
