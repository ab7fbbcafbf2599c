"""The indexer's tie order (``ops/indexer/scoring.py``): with ``row_len`` the reference keeps the pools
``torch.topk`` keeps on transformers' row (every pool of the sequence, invalid ones at the floor), whatever the
query chunk; without it the lowest pools win. Rows cut inside blocks of exact-zero scores (few heads, keys
every head scores negative), so the two rules disagree and each is checked against its own brute force."""

from __future__ import annotations

import pytest
import torch

from megaseq.ops.indexer import scoring as indexer_scoring

F64 = torch.float64


def _inputs(seed: int = 3, Q: int = 41, P: int = 29, I: int = 2, D: int = 5):
    gen = torch.Generator().manual_seed(seed)
    q = -torch.randn(Q, I, D, generator=gen, dtype=F64).abs()
    w = torch.randn(Q, I, generator=gen, dtype=F64)
    keys = torch.randn(P, D, generator=gen, dtype=F64)
    zero = torch.randperm(P, generator=gen)[: P // 2]  # pools every head of every query scores < 0: exactly 0
    keys[zero] = torch.rand(len(zero), D, generator=gen, dtype=F64) + 0.1
    ends = torch.arange(P) * 2 + 1  # pools of 2 tokens, one document
    q_pos = torch.randperm(2 * P, generator=gen)[:Q].sort().values
    zeros = torch.zeros(2 * P, dtype=torch.long)
    return q, w, keys, ends, zeros[ends], q_pos, zeros[q_pos]


def _brute_rows(q, w, keys, ends, q_pos, scale):
    scores = (torch.einsum("qid,pd->qip", q, keys) * scale).relu()
    index = torch.einsum("qi,qip->qp", w, scores)
    valid = ends[None] <= q_pos[:, None]
    return index.masked_fill(~valid, torch.finfo(F64).min), valid


def _sets(sel, ok):
    return [set(s[o].tolist()) for s, o in zip(sel, ok)]


@pytest.mark.parametrize("chunk", [1, 4, None])
def test_row_len_keeps_torch_topks_choice_on_the_whole_row(chunk):
    q, w, keys, ends, pdoc, q_pos, qdoc = _inputs()
    k, scale = 6, 0.7
    sel, ok = indexer_scoring.select_pools(q, w, keys, ends, pdoc, q_pos, qdoc, k, scale, query_chunk=chunk,
                                           row_len=keys.shape[0])
    rows, valid = _brute_rows(q, w, keys, ends, q_pos, scale)
    top = rows.topk(k, dim=-1).indices
    assert _sets(sel, ok) == _sets(top, valid.gather(-1, top))
    lowest, lok = indexer_scoring.select_pools(q, w, keys, ends, pdoc, q_pos, qdoc, k, scale, query_chunk=chunk)
    assert _sets(lowest, lok) != _sets(sel, ok)  # ties at the cut: the lowest-index rule picks other pools


def test_a_padded_row_picks_as_the_longer_row():
    """Columns past the pools (transformers' never-valid pools) change torch.topk's choice among ties."""
    x = torch.tensor([[0.0] * 7 + [1.0]], dtype=F64)
    floor = torch.finfo(F64).min
    got = indexer_scoring.topk_as_transformers(x, 3, 9, floor)
    want = torch.cat([x, x.new_full((1, 1), floor)], 1).topk(3, dim=-1).indices
    assert torch.equal(got, want)
    assert torch.equal(indexer_scoring.topk_as_transformers(x, 8, 9, floor), torch.arange(8)[None])


def test_the_triton_selection_leaves_transformers_order_to_the_reference():
    pytest.importorskip("triton")
    from megaseq.ops.indexer import topk as indexer_topk

    q, w, keys, ends, pdoc, q_pos, qdoc = _inputs()
    why = indexer_topk.indexer_topk_supports(q.float(), w.float(), keys.float(), ends, pdoc, q_pos, qdoc, 6, 0.7,
                                             row_len=keys.shape[0])
    assert why is not None and "row_len" in why
