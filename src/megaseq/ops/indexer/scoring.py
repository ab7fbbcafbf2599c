"""Op ``indexer_topk``: the DSA lightning indexer's scoring, the top pools per query, a block of queries at a time.

Shapes: Q queries (this rank's), P pooled keys (complete k-pools of the whole sequence), I indexer
heads, D indexer head dim, K pools selected per query, c = query_chunk.

The indexer scores every query against every pool: ``relu(q . k_pool * scale)`` per head, weighted
by a per-query head weight and summed over heads. Done at once that is a ``[Q, I, P]`` tensor: at 1M
tokens with 16-token pools and 32 heads, 2e12 elements. Each query's top-K depends only on its own
row, so scoring ``query_chunk`` rows at a time and keeping only their top-K gives identical indices
with the working set of one chunk (``indexer_scoring_bytes``). The reference system kept this under
2 GiB by scoring a few hundred queries at a time.

Only pools whose last token is at or before the chunk's last query can be selected, so each chunk is
scored against that causal prefix of the pools only (at least ``K`` of them): the same selection at
about half the work over a sequence. The selected pools of each query are returned in ascending
order, so the selection does not depend on how queries are chunked or sharded.

The chunk is the ``query_chunk`` argument (the DSA indexer passes its ``query_chunk``, which the family's
``parallelize`` sets from the memory plan), else as many rows as fit ``SCORING_BUDGET_BYTES`` by
``indexer_scoring_bytes``: the scoring is bounded even when no plan was applied. Its reference
implementation is ``torch_fp32`` (below); fast ones (``ops.table``) keep the same contract.
"""

from __future__ import annotations

import torch

from megaseq.ops.workspace import SCORING_BUDGET_BYTES as SCORING_BUDGET_BYTES  # re-exported: the chunk's budget
from megaseq.ops.workspace import indexer_scoring_bytes as indexer_scoring_bytes  # re-exported: its memory formula
from megaseq.ops.workspace import resolve_query_chunk


@torch.no_grad()
@torch.autocast("cuda", enabled=False)
@torch.autocast("cpu", enabled=False)
def select_pools(q_QID: torch.Tensor, weights_QI: torch.Tensor, keys_PD: torch.Tensor,
                 pool_end_P: torch.Tensor, pool_doc_P: torch.Tensor, q_pos_Q: torch.Tensor,
                 q_doc_Q: torch.Tensor, num_select: int, scale: float,
                 query_chunk: int | None = None, row_len: int | None = None,
                 visible: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Top pools per query: ``(pool index [Q, K'] int64 ascending, selected-and-valid [Q, K'] bool)``.

    A pool is a candidate for a query when its last token is at or before the query
    (``pool_end <= q_pos``) and in the same document; ``pool_end_P`` must be ascending (pools in
    sequence order). ``K' = min(num_select, P)``: as in the reference, when a query has fewer
    candidates than K' the remaining picks are invalid pools, flagged False. Scores are computed in
    ``promote_types(q.dtype, float32)`` (HF: float32), with autocast off so a bf16 run scores in fp32
    too (the selection is discrete: scores must not change with the compute dtype of the matmuls).

    Ties (pools scoring exactly equal at the cut, common with few heads: all of a pool's head scores relu'd
    to 0) go to the lowest pool indices (``topk_lowest_index_ties``), whatever the layout. ``row_len``:
    instead, the choice ``torch.topk`` makes on the row transformers builds for one whole document: every
    pool scored, invalid ones at the floor, ``row_len`` columns (its pool count; columns past ``P`` are
    pools that are never valid). ``torch.topk``'s choice among ties depends on the row's length and contents
    (and the device), so this reproduces transformers' selection only for that layout.
    """
    Q, P = q_QID.shape[0], keys_PD.shape[0]
    k = min(num_select, P)
    sel = torch.zeros(Q, k, dtype=torch.int64, device=q_QID.device)
    ok = torch.zeros(Q, k, dtype=torch.bool, device=q_QID.device)
    if k == 0 or Q == 0:
        return sel, ok
    cd = torch.promote_types(q_QID.dtype, torch.float32)
    keys_DP = keys_PD.transpose(0, 1).to(cd)
    chunk = resolve_query_chunk(query_chunk, P, q_QID.shape[1], k)
    floor = torch.finfo(cd).min
    ends_P = pool_end_P.contiguous()
    for s in range(0, Q, chunk):
        e = min(s + chunk, Q)
        # the causal prefix of pools any query of the chunk can see (at least k columns for top-k);
        # the columns left out are invalid for every query here, so the selection is unchanged
        if row_len is not None:
            n = P
        elif visible is not None and e - s == Q:
            n = max(k, min(visible, P))
        else:
            n = max(k, int(torch.searchsorted(ends_P, q_pos_Q[s:e].max(), right=True)))
        scores_cIP = torch.matmul(q_QID[s:e].to(cd), keys_DP[:, :n]).mul_(scale).relu_()
        index_cP = torch.matmul(weights_QI[s:e].to(cd).unsqueeze(-2), scores_cIP).squeeze(-2)
        del scores_cIP
        valid_cP = (pool_end_P[None, :n] <= q_pos_Q[s:e, None]) & (pool_doc_P[None, :n] == q_doc_Q[s:e, None])
        index_cP.masked_fill_(~valid_cP, floor)
        top = (topk_as_transformers(index_cP, k, row_len, floor) if row_len is not None
               else topk_lowest_index_ties(index_cP, k)).sort(dim=-1).values
        sel[s:e] = top
        ok[s:e] = valid_cP.gather(-1, top)
    return sel, ok


def topk_lowest_index_ties(x_cP: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest entries per row; among equal values at the cut the lowest indices win.

    ``torch.topk`` leaves the choice among ties unspecified (on the CPU it depends on the row's length
    and layout), and exact ties are common here: a pool whose head scores are all relu'd to zero scores
    exactly 0. A fixed rule makes the selection independent of how rows and pools are laid out
    (documents packed or not, queries chunked or sharded). Returns ``[c, k]`` in no particular order.
    """
    cut = x_cP.topk(k, dim=-1).values[:, -1:]
    above = x_cP > cut
    at = x_cP == cut
    room = k - above.sum(-1, keepdim=True, dtype=torch.int32)
    chosen = above | (at & (at.to(torch.int32).cumsum(-1, dtype=torch.int32) <= room))
    # exactly k ones per row, so this topk has no ties to break
    return chosen.to(torch.int8).topk(k, dim=-1).indices


def topk_as_transformers(x_cP: torch.Tensor, k: int, row_len: int, floor: float) -> torch.Tensor:
    """``k`` of the ``P`` columns of ``x_cP`` as ``torch.topk`` picks them from the row padded with ``floor`` to
    ``row_len`` columns (transformers' row: its pools past ``P`` are incomplete, never valid). Where the padded
    row needs more than ``P`` picks every column is picked, as there."""
    c, P = x_cP.shape
    if min(k, row_len) >= P:
        return torch.arange(P, device=x_cP.device).expand(c, P)
    row_cR = torch.cat([x_cP, x_cP.new_full((c, row_len - P), floor)], dim=1) if row_len > P else x_cP
    return row_cR.topk(k, dim=-1).indices
