"""The planner's expert-parallel terms: one MoE layer's dispatch memory on a GPU, and its bytes on the wire.

Pure Python. Notation: ``n`` tokens this GPU holds (``B * S / cp``), ``ep`` GPUs of the ep group, ``E``
experts, ``Ep = E / ep``, ``k`` experts per token, ``c_eff`` tokens per chunk, ``H`` hidden, ``I`` expert
intermediate size; ``xb`` bytes of the MoE input rows, ``c`` compute bytes (the experts' output rows).

Memory (``dispatch_terms``), by dispatch mode (``config.ExpertDispatchSettings``):

- ``plain``: one all-to-all; the busiest GPU holds ``imbalance x`` the mean ``n * k`` rows (the measured
  max/mean load, capped by every token of the group to its experts) with their graph until backward;
- ``llep``: the same, the rows capped near ``alpha x`` the mean once the imbalance exceeds the threshold;
- ``pipelined_llep``: ``K = min(ceil(n / c), K_max)`` chunks; a chunk's rows into one GPU are at most
  ``ep * k * c_eff`` whatever the routing (``llep.max_rows_in``), and only one chunk's are alive (no graph
  in forward, each chunk replayed in backward): the planned rows are that bound; the graph saved until
  backward is the inputs ``n * (xb * H + k * (f + 8))``. The dispatch buffer proper (received rows and
  their expert output) is ``llep.dispatch_buffer_bound``.

The per-row costs are the MoE's (``MLP.moe_row_saved`` / ``moe_row_temp``: an upper bound of the CPU
reference path, ``tests/parallel/test_parallel_expert_memory.py``), plus the all-to-all's send and receive copies.

Traffic (``layer_bytes``): exactly what ``parallel/expert.py`` sends for given routing counts (checked to
the byte by ``tests/parallel/test_parallel_expert_comm.py``); ``expected_step_bytes``: the same for routing spread
evenly over the experts, per GPU per training step (all MoE layers).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from megaseq.config import ExpertDispatchSettings
from megaseq.models.spec import ModelSpec
from megaseq.parallel.llep import (
    chunk_capacity,
    dispatch_buffer_bound,
    max_rows_in,
    native_plan,
    num_chunks,
    plan_experts,
    source_pieces,
)
from megaseq.plan import mlp as MLP
from megaseq.plan.mesh import CAL, Calibration, Mesh, Precision


@dataclass(frozen=True)
class DispatchTerms:
    """One MoE layer's routed path on the busiest GPU of the ep group."""

    mode: str
    chunks: int
    c_eff: int  # tokens per chunk (n with one chunk)
    rows_in: int  # rows the GPU holds at once, as planned
    rows_in_bound: int  # ... at most, whatever the routing
    rows_in_expected: int  # ... at the measured imbalance
    buffer_bound: int  # received rows + their expert output at the bound (the paper's dispatch buffer)
    saved: dict[str, int] = field(default_factory=dict)  # kept until backward
    fwd_temp: int = 0
    bwd_temp: int = 0


def expected_rows(spec: ModelSpec, tokens: int, mesh: Mesh, imbalance: float, d: ExpertDispatchSettings) -> int:
    """Rows the busiest GPU receives for ``tokens`` tokens per GPU at the measured ``imbalance`` (LLEP caps
    it near ``alpha`` once it exceeds the threshold)."""
    if d.balances and imbalance > d.threshold:
        imbalance = d.alpha
    return MLP.moe_rows(spec, tokens, mesh, imbalance)


def dispatch_terms(spec: ModelSpec, n: int, mesh: Mesh, d: ExpertDispatchSettings, xb: int, prec: Precision,
                   imbalance: float, cal: Calibration = CAL) -> DispatchTerms:
    """The routed path's memory under ``ep > 1`` (the router and the shared expert are the caller's)."""
    K, H, c, f = spec.num_experts_per_tok, spec.hidden_size, prec.compute, prec.f32
    row_saved = MLP.moe_row_saved(spec, xb, prec)
    fwd_row, bwd_row = (MLP.moe_row_temp(spec, xb, prec, b, cal) for b in (False, True))
    a2a = 2 * c * H  # the all-to-all's send and receive copy of a row
    if not d.pipelined:
        rows = expected_rows(spec, n, mesh, imbalance, d)
        bound = min(n * K * mesh.ep, n * mesh.ep * min(K, spec.num_experts // mesh.ep)) if d.mode == "plain" \
            else n * K * mesh.ep
        return DispatchTerms(mode=d.mode, chunks=1, c_eff=n, rows_in=rows, rows_in_bound=bound, rows_in_expected=rows,
                             buffer_bound=2 * bound * H * c,
                             saved={"moe routed rows (x, SwiGLU, y)": rows * row_saved},
                             fwd_temp=int(rows * (fwd_row + a2a)), bwd_temp=int(rows * (bwd_row + a2a)))
    chunks, c_eff = num_chunks(n, d.chunk_tokens, d.max_chunks), chunk_capacity(n, d.chunk_tokens, d.max_chunks)
    rows = max_rows_in(mesh.ep, K, c_eff)
    sent = K * c_eff  # rows a source sends (and gets back) per chunk
    src_fwd, src_bwd = sent * 4 * c * H, sent * 6 * f * H  # sent rows, outputs back, unsorted, weighted (+ grads)
    return DispatchTerms(
        mode=d.mode, chunks=chunks, c_eff=c_eff, rows_in=rows, rows_in_bound=rows,
        rows_in_expected=expected_rows(spec, c_eff, mesh, imbalance, d),
        buffer_bound=dispatch_buffer_bound(mesh.ep, K, c_eff, H, c),
        saved={"moe dispatch inputs (pipelined: x, weights, ids)": n * (xb * H + K * (f + 8))},
        fwd_temp=int(rows * (cal.nograd_fraction * row_saved + fwd_row + a2a)) + src_fwd,
        bwd_temp=int(rows * (row_saved + bwd_row + a2a)) + src_bwd + n * (xb * H + K * f),
    )


# ---- traffic ------------------------------------------------------------------------------------------
def chunk_counts(routing: list[list[list[int]]], num_experts: int, d: ExpertDispatchSettings) -> list[list[list[int]]]:
    """``counts[s][j][e]``: rows of expert e in chunk j of rank s, from every rank's routing
    ``routing[s][t] = [k expert ids of token t]``: ``K = min(ceil(N_max / c), K_max)`` chunks (one unless
    pipelined), token t in chunk ``t mod K``."""
    N_max = max(len(r) for r in routing)
    Kc = num_chunks(N_max, d.chunk_tokens, d.max_chunks) if d.pipelined else 1
    out = [[[0] * num_experts for _ in range(Kc)] for _ in routing]
    for s, tokens in enumerate(routing):
        for t, chosen in enumerate(tokens):
            for e in chosen:
                out[s][t % Kc][e] += 1
    return out


def layer_bytes(counts_PKE: list[list[list[int]]], rank: int, d: ExpertDispatchSettings, H: int, I: int,
                x_bytes: int, y_bytes: int, w_bytes: int) -> dict[tuple[str, str], int]:
    """Bytes rank ``rank`` sends in one MoE layer's forward + backward, by (collective, direction), given every
    rank's routed rows per chunk and expert ``counts_PKE[s][j][e]`` (``chunk_counts``): the integer
    all-gathers (token counts, then the counts), the rows out (``ep_dispatch``) and back (``ep_combine``),
    the spilled weights (``ep_weights``). Under ``pipelined_llep`` each chunk's forward all-to-alls run
    again in backward; the weights are not sent again (kept from the forward)."""
    P, E = len(counts_PKE), len(counts_PKE[0][0])
    Kc = len(counts_PKE[0])
    out = {("ep_counts", "fwd"): 8 * (P - 1) * (1 + Kc * E)} if P > 1 else {}
    sent = recv = 0
    moves: set[tuple[int, int, int]] = set()
    for j in range(Kc):
        C_PE = [counts_PKE[s][j] for s in range(P)]
        loads = [sum(C_PE[s][e] for s in range(P)) for e in range(E)]
        plan = plan_experts(loads, P, d.alpha, d.threshold, d.min_tokens) if d.balances else native_plan(loads, P)
        pieces = source_pieces(C_PE, plan)
        sent += sum(n for e in range(E) for g, n in pieces[rank][e] if g != rank)
        recv += sum(n for s in range(P) if s != rank for e in range(E) for g, n in pieces[s][e] if g == rank)
        moves |= set(plan.transfers())
    runs = 2 if d.pipelined else 1  # forward, and the replay in backward
    out[("ep_dispatch", "fwd")] = runs * sent * H * x_bytes
    out[("ep_combine", "fwd")] = runs * recv * H * y_bytes
    out[("ep_combine", "bwd")] = sent * H * y_bytes
    out[("ep_dispatch", "bwd")] = recv * H * x_bytes
    if moves:
        expert = 3 * I * H * w_bytes
        out[("ep_weights", "fwd")] = expert * sum(1 for _, home, _ in moves if home == rank)
        out[("ep_weights", "bwd")] = expert * sum(1 for _, _, g in moves if g == rank)
    return {k: v for k, v in out.items() if v}


def expected_step_bytes(spec: ModelSpec, seq_len: int, mesh: Mesh, d: ExpertDispatchSettings, batch: int = 1,
                        prec: Precision | None = None) -> dict[str, Any]:
    """Bytes one GPU sends per training step for expert parallelism, with the routing spread evenly (each
    expert ``n * k / E`` rows from every rank, so no LLEP and no weights move): per MoE layer and in all.
    ``xb`` is the MoE input's bytes (the normed hidden: the stream dtype), ``c`` the experts' outputs'."""
    if mesh.ep == 1:
        return {}
    stream, c = (4, 2) if prec is None else (prec.stream, prec.compute)
    n = batch * seq_len // mesh.cp
    K, H, E, P = spec.num_experts_per_tok, spec.hidden_size, spec.num_experts, mesh.ep
    remote = n * K * (P - 1) // P  # rows to (and from) other GPUs
    Kc = num_chunks(n, d.chunk_tokens, d.max_chunks) if d.pipelined else 1
    runs = 2 if d.pipelined else 1
    per_layer = runs * remote * H * (stream + c) + remote * H * (stream + c) + 8 * (P - 1) * (1 + Kc * E)
    moe_layers = spec.mlp_types.count("moe")
    return {"mode": d.mode, "chunks": Kc, "rows_remote_per_layer": remote, "per_layer": per_layer,
            "moe_layers": moe_layers, "per_step": per_layer * moe_layers}
