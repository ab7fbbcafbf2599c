"""Least-loaded expert parallelism (LLEP) and the chunking of PipelinedLLEP, in pure Python.

The runtime (``parallel/expert.py``) plans every dispatch with these functions and the planner counts
its bytes with them, so the two cannot disagree. Notation: ``ep`` GPUs (ranks of the ep group), ``E``
experts, ``Ep = E / ep`` experts native to each GPU (GPU g holds experts ``[g Ep, (g + 1) Ep)``),
``loads[e]`` routed rows of expert e over the whole ep group (one row per token and chosen expert).

LLEP (arXiv 2601.17111; written from its description and the reference ``compute_llep_lpt_plan``):

- used only when the GPUs' native loads are imbalanced: ``max / mean > threshold``; otherwise every
  expert's rows go to its native GPU (plain expert parallelism);
- per-GPU cap ``ceil(alpha * total / ep)``; experts are taken largest first (LPT order, ties by index);
  a GPU's *effective* load is what it was given so far plus its native experts not yet taken, so a GPU
  about to be loaded by its own experts is not chosen as a helper;
- an expert fills what its native GPU has left under the cap and spills the rest to the least-loaded
  other GPUs, each taking what it has room for; a spilled piece is never smaller than ``min_tokens``
  (a small GEMM on another GPU costs more than it saves): what cannot be spilled in such pieces stays
  on the native GPU;
- a GPU that takes a spilled piece receives that expert's weights and sends its weight gradient back.

Properties (``tests/parallel/test_llep.py``): every row is served exactly once; a GPU that receives a spill ends
at or under the cap; every spilled piece has at least ``min_tokens`` rows; with ``min_tokens = 1`` and
``alpha >= 1`` every GPU ends at or under the cap; with ``threshold >= alpha`` the busiest GPU is never
busier than under plain expert parallelism.

PipelinedLLEP dispatches a source's ``N`` tokens in ``K = min(ceil(N / c), K_max)`` chunks of at most
``c_eff = ceil(N / K)`` tokens, token t in chunk ``t mod K`` (strided: every chunk samples the whole
sequence, so each sees about 1/K of every expert's load, not one region's skew). A chunk moves at most
``ep * k * c_eff`` rows into any one GPU whatever the routing (every row of every source), so the
receive buffer of a chunk and its expert output are bounded by ``2 * ep * k * c_eff * H * bytes``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

Piece = tuple[int, int]  # (GPU, rows): a contiguous run of one expert's rows, in the expert's row order


@dataclass(frozen=True)
class ExpertPlan:
    """Where each expert's rows go: ``pieces[e]`` in row order (the native GPU's piece first)."""

    pieces: tuple[tuple[Piece, ...], ...]
    ep: int
    cap: int  # the per-GPU cap LLEP planned with (0 when the plan is the native one)
    balanced: bool  # True when LLEP moved rows (imbalance above the threshold)

    @property
    def experts_per_gpu(self) -> int:
        return len(self.pieces) // self.ep

    def home(self, e: int) -> int:
        return e // self.experts_per_gpu

    def gpu_loads(self) -> list[int]:
        loads = [0] * self.ep
        for pieces in self.pieces:
            for g, rows in pieces:
                loads[g] += rows
        return loads

    def transfers(self) -> list[tuple[int, int, int]]:
        """``(expert, native GPU, helper GPU)`` for every spilled piece: the weights that must travel."""
        return [(e, self.home(e), g) for e, pieces in enumerate(self.pieces) for g, _ in pieces if g != self.home(e)]


def native_loads(loads: Sequence[int], ep: int) -> list[int]:
    """Rows per GPU when every expert serves its own rows."""
    Ep = len(loads) // ep
    return [sum(loads[g * Ep:(g + 1) * Ep]) for g in range(ep)]


def imbalance(loads: Sequence[int], ep: int) -> float:
    """``max / mean`` of the GPUs' native loads (1.0 for no rows)."""
    per_gpu = native_loads(loads, ep)
    total = sum(per_gpu)
    return max(per_gpu) * ep / total if total else 1.0


def native_plan(loads: Sequence[int], ep: int) -> ExpertPlan:
    Ep = len(loads) // ep
    pieces = tuple(((e // Ep, n),) if n else () for e, n in enumerate(loads))
    return ExpertPlan(pieces=pieces, ep=ep, cap=0, balanced=False)


def plan_experts(loads: Sequence[int], ep: int, alpha: float, threshold: float, min_tokens: int) -> ExpertPlan:
    """LLEP when ``imbalance(loads) > threshold``, else the native plan."""
    if ep == 1 or imbalance(loads, ep) <= threshold:
        return native_plan(loads, ep)
    return llep_plan(loads, ep, alpha, min_tokens)


def llep_plan(loads: Sequence[int], ep: int, alpha: float, min_tokens: int) -> ExpertPlan:
    """The LLEP assignment of ``loads`` (see the module docstring), whatever the imbalance."""
    E = len(loads)
    assert E % ep == 0 and min_tokens >= 1, (E, ep, min_tokens)
    Ep = E // ep
    cap = max(1, math.ceil(alpha * sum(loads) / ep))
    pending = native_loads(loads, ep)  # native rows not yet assigned, per GPU
    given = [0] * ep  # rows assigned so far, per GPU
    pieces: list[tuple[Piece, ...]] = [()] * E
    for e in sorted(range(E), key=lambda i: (-loads[i], i)):
        rows, home = loads[e], e // Ep
        if rows == 0:
            continue
        pending[home] -= rows
        room = cap - given[home] - pending[home]
        keep = min(rows, max(room, 0))
        if rows - keep < min_tokens:
            keep = rows
        spilled = _spill(rows - keep, home, cap, given, pending, min_tokens)
        keep = rows - sum(n for _, n in spilled)  # what no helper could take stays home
        given[home] += keep
        pieces[e] = (((home, keep),) if keep else ()) + tuple(spilled)
    return ExpertPlan(pieces=tuple(pieces), ep=ep, cap=cap, balanced=True)


def _spill(rest: int, home: int, cap: int, given: list[int], pending: list[int], min_tokens: int) -> list[Piece]:
    """Give ``rest`` rows to the least-loaded other GPUs (effective load, ties by index), each what it has
    room for, never a piece under ``min_tokens``; updates ``given``."""
    out: list[Piece] = []
    if rest == 0:
        return out
    helpers = sorted((g for g in range(len(given)) if g != home), key=lambda g: (given[g] + pending[g], g))
    for g in helpers:
        take = min(rest, cap - given[g] - pending[g])
        if take < min_tokens:
            continue
        out.append((g, take))
        given[g] += take
        rest -= take
        if rest < min_tokens:
            break
    return out


# ---- rows of each source ---------------------------------------------------------------------------
def source_pieces(counts: Sequence[Sequence[int]], plan: ExpertPlan) -> list[list[list[Piece]]]:
    """``out[s][e]``: where source s's rows of expert e go. Expert e's rows are ordered by source, then in
    each source's own order; ``counts[s][e]`` is how many source s has; the plan's pieces cut that order."""
    P, E = len(counts), len(plan.pieces)
    out = [[[] for _ in range(E)] for _ in range(P)]
    for e in range(E):
        bounds, start = [], 0
        for g, n in plan.pieces[e]:
            bounds.append((g, start, start + n))
            start += n
        offset = 0
        for s in range(P):
            lo, hi = offset, offset + counts[s][e]
            offset = hi
            for g, a, b in bounds:
                n = min(hi, b) - max(lo, a)
                if n > 0:
                    out[s][e].append((g, n))
    return out


# ---- PipelinedLLEP chunking --------------------------------------------------------------------------
def num_chunks(tokens: int, chunk_tokens: int, max_chunks: int) -> int:
    """``K = min(ceil(N / c), K_max)`` (at least 1)."""
    return max(1, min(-(-tokens // chunk_tokens), max_chunks))


def chunk_capacity(tokens: int, chunk_tokens: int, max_chunks: int) -> int:
    """``c_eff = ceil(N / K)``: the most tokens a source sends in one chunk."""
    return -(-tokens // num_chunks(tokens, chunk_tokens, max_chunks)) if tokens else 0


def chunk_sizes(tokens: int, num: int) -> list[int]:
    """Tokens in each strided chunk (token t in chunk ``t mod num``)."""
    return [len(range(j, tokens, num)) for j in range(num)]


def max_rows_in(ep: int, top_k: int, c_eff: int) -> int:
    """The most rows one GPU receives in one chunk, whatever the routing: every row of every source."""
    return ep * top_k * c_eff


def dispatch_buffer_bound(ep: int, top_k: int, c_eff: int, hidden: int, row_bytes: int) -> int:
    """``2 * ep * k * c_eff * H * bytes``: one chunk's received rows and their expert output."""
    return 2 * max_rows_in(ep, top_k, c_eff) * hidden * row_bytes
