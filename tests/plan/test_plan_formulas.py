"""Each byte formula the planner and the runtime share (one definition, in ``plan/`` or ``ops/workspace.py``)
against what the runtime actually allocates (``MemTracker``: every storage torch creates, freed when it is)
or keeps for backward (``saved_tensors_hooks``), on the CPU.

These replace the tests that compared the planner's copy of a formula with the runtime's copy: there is
one copy now, so only a measurement can tell whether it is right.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from megaseq.config import MemorySettings
from megaseq.plan import components as C
from megaseq.plan.activations import vocab_loss_bytes
from megaseq.plan.mesh import Mesh

torch.set_num_threads(1)
CPU = torch.device("cpu")


def _peak_bytes(fn) -> int:
    """Peak bytes of every storage created while ``fn()`` runs (inputs made before it not counted)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with tracker:
            fn()
    return tracker.get_tracker_snapshot("peak")[CPU]["Total"]


def _nbytes(*ts: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


# ---- the vocabulary loss (memory/vocab_loss.py; plan.activations.vocab_loss_bytes) ---------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("kind", ["plain", "chunked"])
def test_vocab_loss_formula_is_what_the_loss_allocates(kind, dtype):
    from megaseq.memory.vocab_loss import chunked_linear_cross_entropy
    from megaseq.ops.vocab_loss.reference import plain_linear_cross_entropy

    g = torch.Generator().manual_seed(0)
    N, H, V, chunk = 1500, 48, 2000, 256
    hidden = torch.randn(N, H, generator=g, dtype=dtype).requires_grad_()
    weight = torch.randn(V, H, generator=g, dtype=dtype).requires_grad_()
    labels = torch.randint(0, V, (N,), generator=g)

    def step() -> None:
        if kind == "plain":
            loss = plain_linear_cross_entropy(hidden, weight, labels, reduction="sum")
        else:
            loss = chunked_linear_cross_entropy(hidden, weight, labels, chunk, reduction="sum")
        loss.backward()

    # the inputs are saved for backward, and so seen by the tracker: they are not the loss's working set
    measured = _peak_bytes(step) - _nbytes(hidden, weight, labels)
    predicted = vocab_loss_bytes(N, H, V, chunk, dtype.itemsize)[kind]
    assert abs(measured / predicted - 1) < 0.02, (measured, predicted)


def test_chunked_loss_grows_by_its_per_token_terms_only():
    """The chunked loss never holds N x V: doubling N adds the input gradient and two per-token floats."""
    from megaseq.memory.vocab_loss import chunked_linear_cross_entropy

    H, V, chunk = 32, 3000, 128
    peaks = []
    for N in (1000, 2000):
        g = torch.Generator().manual_seed(1)
        hidden = torch.randn(N, H, generator=g).requires_grad_()
        weight = torch.randn(V, H, generator=g).requires_grad_()
        labels = torch.randint(0, V, (N,), generator=g)
        step = lambda h=hidden, w=weight, y=labels: chunked_linear_cross_entropy(  # noqa: E731
            h, w, y, chunk, reduction="sum").backward()
        peaks.append(_peak_bytes(step) - _nbytes(hidden, weight, labels))
    per_token = (peaks[1] - peaks[0]) / 1000
    assert per_token == pytest.approx(H * 4 + 2 * 4, rel=0.1)  # grad_hidden + lse + loss (+ a label copy)
    formula = vocab_loss_bytes(2000, H, V, chunk, 4)["chunked"] - vocab_loss_bytes(1000, H, V, chunk, 4)["chunked"]
    assert formula / 1000 == H * 4 + 2 * 4


# ---- the indexer's scoring chunk (ops/indexer/scoring.py; ops.workspace.indexer_scoring_bytes) -------
@pytest.mark.parametrize("chunk", [64, 256])
def test_indexer_scoring_formula_is_one_chunks_peak(chunk):
    """32 heads as the real indexer, every pool visible to every query (the last chunk of a sequence)."""
    from megaseq.ops.indexer.scoring import select_pools
    from megaseq.ops.workspace import indexer_scoring_bytes

    g = torch.Generator().manual_seed(2)
    Q, P, I, D, K = 256, 1024, 32, 16, 32
    q, w, keys = torch.randn(Q, I, D, generator=g), torch.randn(Q, I, generator=g), torch.randn(P, D, generator=g)
    pool_end, pool_doc = torch.arange(P) * 4 + 3, torch.zeros(P, dtype=torch.long)
    q_pos, q_doc = torch.arange(Q) + 4 * P, torch.zeros(Q, dtype=torch.long)
    out = {}

    def run() -> None:
        out["sel"], out["ok"] = select_pools(q, w, keys, pool_end, pool_doc, q_pos, q_doc, K, 0.1, query_chunk=chunk)

    measured = _peak_bytes(run)
    measured -= _nbytes(out["sel"], out["ok"]) + P * D * 4  # the results and the transposed keys
    assert abs(measured / indexer_scoring_bytes(chunk, P, I, K) - 1) < 0.06


# ---- the absorbed sparse MLA (ops/sparse_mla/absorbed.py; ops.workspace.absorbed_bytes) ----------------------
def test_absorbed_sparse_mla_saves_its_inputs_and_the_formulas_saved_set():
    from megaseq.ops.sparse_mla.absorbed import sparse_mla
    from megaseq.ops.workspace import absorbed_bytes

    g = torch.Generator().manual_seed(3)
    B, Q, S, Hh, Dn, Dv, R, W = 1, 37, 53, 3, 8, 8, 16, 9
    q = torch.randn(B, Q, Hh, Dn, generator=g, dtype=torch.float64).requires_grad_()
    c = torch.randn(B, S, R, generator=g, dtype=torch.float64).requires_grad_()
    w = torch.randn(Hh * (Dn + Dv), R, generator=g, dtype=torch.float64).requires_grad_()
    idx = torch.stack([torch.randperm(S, generator=g)[:W] for _ in range(Q)]).unsqueeze(0).to(torch.int32)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        sparse_mla(q, c, w, idx, 0.3)
    # the latent is the input itself here (float64: no work-dtype copy), which the formula counts as saved
    formula = absorbed_bytes(Q, S, W, R, Hh, Dn, Dv, 8, 8)["saved"]
    assert _nbytes(*saved) == _nbytes(q, w, idx) + formula


# ---- sequence segments (memory/model_segments.py; plan.segments.segment_store_bytes) --------------------
def test_segment_store_holds_what_the_planner_counts(monkeypatch):
    """The store's fullest moment is the first backward segment's end: the DSA caches and one fp32
    latent-gradient accumulator per DSA layer over the whole sequence, and the KDA state + halo at every
    segment start not yet spent. The planner counts every segment start and, on top, the backward's
    temporary latent gradient: an upper bound by two segments' KDA states and that temporary."""
    from megaseq.memory import model_segments as ms
    from megaseq.memory.vocab_loss import linear_cross_entropy
    from megaseq.models.build import build_model
    from megaseq.models.glm5.spec import glm5_flash_tiny
    from megaseq.plan.run import Run
    from megaseq.plan.segments import segment_store_bytes

    spec = glm5_flash_tiny().replace(index_topk=32)
    model = build_model(spec, dtype=torch.float32, seed=0)
    S, T = 192, 16
    ids = torch.randint(0, spec.vocab_size, (1, S), generator=torch.Generator().manual_seed(4))
    seen = []
    orig = ms.SegmentContext.collect

    def spy(self) -> None:
        seen.append(self.store.nbytes())
        orig(self)
        seen.append(self.store.nbytes())

    monkeypatch.setattr(ms.SegmentContext, "collect", spy)
    loss = lambda h, y: linear_cross_entropy(h, model.lm_head.weight, y, reduction="sum")  # noqa: E731
    ms.segmented_loss_backward(model, ids, ids, loss, 1.0, T)
    run = Run(spec=spec, seq_len=S, batch=1, mesh=Mesh(), model_dtype="fp32",
              memory=MemorySettings(model_segment_tokens=T), counts=C.count_params(spec))
    store = segment_store_bytes(run)
    planned = sum(store.values())
    dsa = spec.layer_types.count("dsa")
    temporary = store["segment latent gradients (fp32)"] // (dsa + 1)
    per_segment = store["segment KDA states"] // -(-S // T)
    assert planned - temporary - 2 * per_segment == max(seen) <= planned
