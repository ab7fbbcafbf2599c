"""The routing of one MoE call under expert parallelism: chunks, LLEP plans, split sizes and row orders.

Shapes: N tokens of this rank, K experts per token, P ep ranks, E experts, Ep = E / P held per rank,
n tokens of a chunk, M = n * K routed rows of a chunk (token-major: row ``t * K + k``), R rows this rank
receives in a chunk, Kc chunks.

``build_route`` runs once per MoE forward (two small all-gathers: every rank's token count, then every
rank's per-chunk expert counts ``[Kc, E]``); every rank then computes the same plans
(``parallel.llep.plan_experts`` per chunk) and from them, for itself, what it sends and receives. The chunk
steps (and their replays in backward) read the route and communicate only rows.

Row order, the contract between sender and receiver: expert e's rows in a chunk are ordered by source
rank, then by row index within the source; the chunk's plan cuts that order into pieces, one per GPU.
A source sends its rows sorted by (destination, expert, row); a destination receives, from each source,
blocks ``(s, e)`` in expert order, and regroups them by (served expert, source) for the grouped GEMM:
the experts it holds first (in id order), then the experts spilled to it (in id order).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from megaseq.config import ExpertDispatchSettings
from megaseq.memory.replay import Chunk
from megaseq.parallel.llep import ExpertPlan, chunk_sizes, native_plan, num_chunks, plan_experts
from megaseq.parallel.ulysses import count_bytes

_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass
class ChunkRoute:
    """One chunk, seen from this rank: the dense tables its rows are routed with."""

    offset_E: torch.Tensor  # [E] where this rank's rows of expert e start in the chunk's row order
    start_EP: torch.Tensor  # [E, P] first row (in expert e's order) that GPU g serves ...
    end_EP: torch.Tensor  # [E, P] ... and one past its last (start == end: none)
    send: list[int]  # rows this rank sends to each rank
    recv: list[int]  # rows this rank receives from each rank
    recv_PE: torch.Tensor  # [P, E] rows received from source s for expert e
    plan: ExpertPlan


@dataclass
class Route:
    """Everything a call's chunk steps need; the same object serves the backward's replays."""

    chunks: list[Chunk]  # contiguous ranges of the strided token order
    order_N: torch.Tensor  # [N] token of each position in the strided order
    parts: list[ChunkRoute]
    served_E: torch.Tensor  # [E] position of expert e among the experts this rank serves (-1: not served)
    num_held: int
    held_start: int  # the first expert this rank holds
    foreign: list[int]  # experts spilled to this rank (their weights received), ascending
    weight_send: list[tuple[int, int]] = field(default_factory=list)  # (held expert, rank), by rank
    weight_send_splits: list[int] = field(default_factory=list)
    weight_recv_splits: list[int] = field(default_factory=list)
    moves_weights: bool = False  # some expert's weights travel this call (the same answer on every rank)

    def stats(self) -> dict[str, Any]:
        return {"chunks": len(self.chunks), "c_eff": max(c.end - c.start for c in self.chunks),
                "max_rows_in": max(sum(p.recv) for p in self.parts),
                "balanced_chunks": sum(p.plan.balanced for p in self.parts),
                "foreign_experts": len(self.foreign)}


def strided_order(N: int, Kc: int, device: torch.device) -> tuple[torch.Tensor, list[Chunk]]:
    """Tokens ``j, j + Kc, j + 2 Kc, ...`` form chunk j: the permutation and the chunks over it."""
    order = torch.cat([torch.arange(j, N, Kc, device=device) for j in range(Kc)]) if N else \
        torch.zeros(0, dtype=torch.long, device=device)
    chunks, start = [], 0
    for size in chunk_sizes(N, Kc):
        chunks.append(Chunk(start, start + size))
        start += size
    return order, chunks


def gather_ints(x: torch.Tensor, group: Any, P: int, scope: str) -> torch.Tensor:
    """``[P, *x.shape]``: every rank's int64 ``x`` (the identity with one rank)."""
    x = x.to(torch.int64).contiguous()
    if P == 1:
        return x.unsqueeze(0)
    count_bytes("ep_counts", "fwd", x.numel() * 8 * (P - 1), scope)
    out = torch.empty((P * x.numel(),), dtype=torch.int64, device=x.device)
    _all_gather(out, x.reshape(-1), group=group)
    return out.view(P, *x.shape)


def build_route(experts_NK: torch.Tensor, num_experts: int, group: Any, P: int, rank: int,
                settings: ExpertDispatchSettings, scope: str, order_fn: Any = strided_order) -> Route:
    """The route of one call (collectives: two all-gathers of integers over the ep group)."""
    N, K = experts_NK.shape
    E, device = num_experts, experts_NK.device
    N_max = int(gather_ints(torch.tensor([N], device=device), group, P, scope).max())
    Kc = num_chunks(N_max, settings.chunk_tokens, settings.max_chunks) if settings.pipelined else 1
    order_N, chunks = order_fn(N, Kc, device)
    chunk_of = torch.repeat_interleave(torch.arange(Kc, device=device),
                                       torch.tensor([c.end - c.start for c in chunks], device=device))
    key = chunk_of.unsqueeze(1) * E + experts_NK[order_N]
    counts = torch.bincount(key.reshape(-1), minlength=Kc * E).view(Kc, E)
    C_PKE = gather_ints(counts, group, P, scope).cpu()
    parts = [_chunk_route(C_PKE[:, j], rank, settings) for j in range(Kc)]
    return _finish(Route(chunks=chunks, order_N=order_N, parts=parts, served_E=torch.empty(0), num_held=E // P,
                         held_start=rank * (E // P), foreign=[]), E, P, rank, device)


def _chunk_route(C_PE: torch.Tensor, rank: int, settings: ExpertDispatchSettings) -> ChunkRoute:
    P, E = C_PE.shape
    loads = C_PE.sum(0).tolist()
    if settings.balances:
        plan = plan_experts(loads, P, settings.alpha, settings.threshold, settings.min_tokens)
    else:
        plan = native_plan(loads, P)
    start, end = torch.zeros(E, P, dtype=torch.int64), torch.zeros(E, P, dtype=torch.int64)
    for e, pieces in enumerate(plan.pieces):
        at = 0
        for g, n in pieces:
            start[e, g], end[e, g] = at, at + n
            at += n
    offset = torch.cumsum(C_PE, 0) - C_PE  # [P, E]: each source's first row in expert e's order
    lo, hi = offset.unsqueeze(2), (offset + C_PE).unsqueeze(2)
    A_PEG = (torch.minimum(hi, end.unsqueeze(0)) - torch.maximum(lo, start.unsqueeze(0))).clamp(min=0)
    return ChunkRoute(offset_E=offset[rank], start_EP=start, end_EP=end, send=A_PEG[rank].sum(0).tolist(),
                      recv=A_PEG[:, :, rank].sum(1).tolist(), recv_PE=A_PEG[:, :, rank], plan=plan)


def _finish(route: Route, E: int, P: int, rank: int, device: torch.device) -> Route:
    """The experts this rank serves and the weights that travel (the union over the chunks' plans)."""
    moves = sorted({t for part in route.parts for t in part.plan.transfers()})  # (expert, home, helper)
    route.foreign = sorted({e for e, _, g in moves if g == rank})
    Ep = E // P
    served = torch.full((E,), -1, dtype=torch.int64)
    served[rank * Ep:(rank + 1) * Ep] = torch.arange(Ep)
    for i, e in enumerate(route.foreign):
        served[e] = Ep + i
    mine = sorted(((g, e) for e, home, g in moves if home == rank))
    route.weight_send = [(e, g) for g, e in mine]
    route.weight_send_splits = [sum(1 for g, _ in mine if g == r) for r in range(P)]
    route.weight_recv_splits = [sum(1 for e, home, g in moves if g == rank and home == r) for r in range(P)]
    route.moves_weights = bool(moves)
    for part in route.parts:  # the tables live where the rows are
        part.offset_E, part.start_EP, part.end_EP = (t.to(device) for t in (part.offset_E, part.start_EP,
                                                                            part.end_EP))
    route.served_E = served.to(device)
    return route


# ---- row orders inside a chunk ---------------------------------------------------------------------
def destinations(experts_nK: torch.Tensor, part: ChunkRoute, P: int) -> torch.Tensor:
    """``[M]`` the rank each routed row of this chunk goes to (row ``t * K + k``)."""
    e_M = experts_nK.reshape(-1)
    M = e_M.numel()
    order = torch.argsort(e_M, stable=True)
    counts = torch.bincount(e_M, minlength=part.offset_E.numel())
    first = torch.cumsum(counts, 0) - counts
    rank_in_e = torch.empty_like(e_M)
    rank_in_e[order] = torch.arange(M, device=e_M.device) - first[e_M[order]]
    row = (part.offset_E[e_M] + rank_in_e).unsqueeze(1)  # position in the expert's chunk row order
    inside = (part.start_EP[e_M] <= row) & (row < part.end_EP[e_M])
    assert bool(inside.any(1).all()) if M else True, "a routed row no GPU serves: the plan lost rows"
    return inside.to(torch.int8).argmax(1)


def group_by_served(part: ChunkRoute, served_E: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Received rows (blocks ``(source, expert)``) -> (the order grouping them by served expert then source,
    rows per served expert)."""
    P, E = part.recv_PE.shape
    blocks = part.recv_PE.reshape(-1).to(served_E.device)
    e_of = torch.arange(E, device=served_E.device).repeat(P)
    s_of = torch.arange(P, device=served_E.device).repeat_interleave(E)
    key = torch.repeat_interleave(served_E[e_of] * P + s_of, blocks)
    num_served = int(served_E.max()) + 1
    per_served = torch.zeros(num_served, dtype=torch.int64, device=served_E.device)
    per_served.index_add_(0, served_E[e_of].clamp(min=0), blocks * (served_E[e_of] >= 0))
    return torch.argsort(key, stable=True), per_served
