"""Op ``indexer_kl``'s torch reference against the written-out formula in float64: the KL per row and the gradients
of the queries, head weights and pooled keys (no Triton needed: this runs wherever the suite runs). A reference
whose softmax runs over every slot, not the candidates only, fails the same check."""

from __future__ import annotations

import pytest
import torch
from kl_cases import formula, grads_of, make_inputs

from megaseq.ops.indexer import kl


def check_reference(fn) -> None:
    q, w, keys, pools, t, cand = make_inputs(0, 4, 3, 5, 7, 9)
    pools = torch.where(cand, pools, 0)
    args = (q.double(), w.double(), keys.double(), pools, t.double(), cand)
    got, g = grads_of(fn, *args, 0.6)
    want, g_f = grads_of(formula, *args, 0.6)
    assert torch.allclose(got, want, rtol=1e-12, atol=1e-12) and got[1] == 0 and (got[[0, 2, 3]] > 0).all()
    for a, b in zip(g, g_f, strict=True):
        assert torch.allclose(a, b, rtol=1e-10, atol=1e-12)
    assert (g[0][1] == 0).all() and g[2].abs().sum() > 0


def test_reference_matches_the_formula_in_float64():
    check_reference(kl.indexer_kl_reference)


def test_a_reference_with_the_softmax_over_every_slot_fails():
    def every_slot(q, w, keys, pools, t, cand, scale):
        keys_g = keys.index_select(0, pools.flatten().long()).view(*pools.shape, keys.shape[-1])
        return kl.kl_rows(t, kl.index_scores(q, w, keys_g, scale), torch.ones_like(cand))

    with pytest.raises(AssertionError):
        check_reference(every_slot)
