"""Op ``indexer_topk``: the Triton scoring + exact re-check selects exactly the reference's pools.

Shapes: Q queries, S tokens, P pools of kp tokens, I indexer heads, D head dim, K pools selected.

CPU: the kernel runs under the Triton interpreter (fp32 inputs, fp16 dot operands: the interpreter's bf16
is broken) on odd shapes with two documents, with many exact ties (scores relu'd to 0), through every
path (few-pool rows, certified rows, fallback rows), and two broken variants that must fail. GPU: bf16
and fp32 inputs at the GLM-5.3-Flash indexer shape (I = 32, D = 128, K = 128, 16-token pools).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")  # on the CPU under the interpreter conftest.py selects

from devices import GPU  # noqa: E402
from megaseq.ops import dispatch, workspace  # noqa: E402
from megaseq.ops.indexer import scoring as indexer_scoring  # noqa: E402
from megaseq.ops.indexer import select as sel_mod  # noqa: E402
from megaseq.ops.indexer import topk as indexer_topk  # noqa: E402
from megaseq.ops.indexer import topk_kernel as kern  # noqa: E402

torch.set_num_threads(1)
CPU = pytest.mark.skipif(torch.cuda.is_available() or not kern.INTERPRET, reason="CPU interpreter test")


def pools_of(doc_S: torch.Tensor, kp: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Complete pools of kp tokens from each document's first token (as the indexer): (end [P], doc [P])."""
    start = torch.ones_like(doc_S, dtype=torch.bool)
    start[1:] = doc_S[1:] != doc_S[:-1]
    first = torch.cummax(torch.where(start, torch.arange(len(doc_S)), 0), 0).values
    pos_S = torch.arange(len(doc_S)) - first
    ends_P = torch.nonzero((pos_S + 1) % kp == 0).squeeze(-1)
    return ends_P, doc_S[ends_P]


def make_inputs(seed: int, Q=37, S=200, kp=4, I=3, D=16, doc_split=120, ties=False, dtype=torch.float32,
                device="cpu"):
    """Queries at sorted random positions inside S tokens (two documents), LayerNorm'd pool keys.

    ``ties``: a third of the pools get keys that every query's heads score negative (index exactly 0),
    and head weights of both signs, so rows cut inside a block of exact-zero ties.
    """
    gen = torch.Generator().manual_seed(seed)
    doc_S = (torch.arange(S) >= doc_split).long()
    ends_P, pdoc_P = pools_of(doc_S, kp)
    P = len(ends_P)
    keys_PD = torch.nn.functional.layer_norm(torch.randn(P, D, generator=gen) + 0.3, (D,))
    q_QID = torch.randn(Q, I, D, generator=gen)
    w_QI = torch.randn(Q, I, generator=gen) * I**-0.5
    if ties:
        neg = torch.randperm(P, generator=gen)[: P // 3]
        keys_PD[neg] = torch.rand(len(neg), D, generator=gen) + 0.5
        q_QID = -q_QID.abs() * (torch.rand(Q, I, 1, generator=gen) < 0.7) + q_QID * 0.1
    q_pos_Q = torch.randperm(S, generator=gen)[:Q].sort().values
    t = [x.to(device) for x in (q_QID.to(dtype), w_QI, keys_PD.to(dtype), ends_P, pdoc_P, q_pos_Q, doc_S[q_pos_Q])]
    return t, D**-0.5


def assert_same(got, ref, what=""):
    """(sel, ok) equal; on failure name the first differing rows and their pools."""
    sel, ok = got
    sel_r, ok_r = ref
    rows = torch.nonzero((sel != sel_r).any(-1) | (ok != ok_r).any(-1)).squeeze(-1)
    assert sel.dtype == torch.int64 and ok.dtype == torch.bool and sel.shape == sel_r.shape
    detail = [(int(r), sel[r].tolist(), sel_r[r].tolist()) for r in rows[:3]]
    assert rows.numel() == 0, f"{what}: {rows.numel()} rows differ, first (row, fast, ref): {detail}"


def run_both(args, scale, K, **kw):
    ref = indexer_scoring.select_pools(*args, K, scale)
    indexer_topk.STATS.reset()
    got = indexer_topk.indexer_topk_triton(*args, K, scale, **kw)
    return got, ref


# ---- CPU, Triton interpreter ------------------------------------------------------------------------------
@CPU
@pytest.mark.parametrize("I", [3, 5])
@pytest.mark.parametrize("split", [True, False])
def test_equals_reference_two_documents(I, split):
    args, scale = make_inputs(1 + I, I=I)
    for chunk in (None, 10):
        got, ref = run_both(args, scale, 7, query_chunk=chunk, split=split, margin=4)
        assert_same(got, ref, f"I={I} split={split} chunk={chunk}")
        assert (got[0].diff(dim=-1) > 0).all()
    st = indexer_topk.STATS
    assert st.few_pool_rows > 0 and st.rows == 37  # the early rows of both documents
    assert ref[1].any() and not ref[1].all()


@CPU
@pytest.mark.parametrize("split", [True, False])
@pytest.mark.parametrize("q_exact", [False, True])
def test_kernel_error_within_bound(split, q_exact):
    """The kernel's scores are within ``score_error_bound`` of float64 on every visible pair (the bound is
    what the certificate trusts), and masked pairs score exactly the dtype's min."""
    args, scale = make_inputs(17, Q=37, S=400, I=5, doc_split=90)
    q, w, keys, ends, pdoc, pos, qdoc = args
    if q_exact:  # exact in the low dtype: no split, no rounding of q
        q = q.to(kern.low_dtype()).float()
    floor = torch.finfo(torch.float32).min
    L = kern.index_scores(q, w, keys, ends, pdoc, pos, qdoc, len(ends), scale, floor, split)
    exact = torch.einsum("qid,pd->qip", q.double(), keys.double()).mul(scale).relu()
    exact = torch.einsum("qi,qip->qp", w.double(), exact)
    vis = (ends[None] <= pos[:, None]) & (pdoc[None] == qdoc[:, None])
    kmax = float(torch.linalg.vector_norm(keys, dim=-1).max())
    e = indexer_topk.score_error_bound(q.to(kern.low_dtype()) if q_exact else q, w, keys.dtype, kmax, scale, split)
    ratio = ((L.double() - exact).abs() * vis / e[:, None]).max()
    assert 0 < ratio < 1, ratio
    assert (L[~vis] == floor).all()


@CPU
@pytest.mark.parametrize("margin", [0, 3, 200])
def test_many_exact_ties(margin):
    args, scale = make_inputs(7, I=5, ties=True)
    got, ref = run_both(args, scale, 7, margin=margin)
    assert_same(got, ref, f"margin={margin}")
    index = (torch.einsum("qid,pd->qip", args[0], args[2]) * scale).relu()
    index = torch.einsum("qi,qip->qp", args[1], index)
    assert (index == 0).sum() > 100  # the ties are there


@CPU
def test_certified_rows_need_no_fallback():
    """Without ties and with a margin, the certificate holds for (almost) every row: the fast path runs."""
    args, scale = make_inputs(3, Q=37, S=400, I=5, doc_split=90)
    got, ref = run_both(args, scale, 7, margin=8)
    assert_same(got, ref)
    st = indexer_topk.STATS
    assert st.fallback_rows <= 2 and st.rows - st.few_pool_rows > 20, st


@CPU
@pytest.mark.parametrize("band", [2, 32])
@pytest.mark.parametrize("ties", [False, True])
def test_exact_band_recheck(band, ties, monkeypatch):
    """Without the split the bound is wide: most rows re-check their band (narrow, or all M candidates)."""
    monkeypatch.setattr(sel_mod, "BAND", band)
    args, scale = make_inputs(13, S=400, I=5, doc_split=90, ties=ties)
    got, ref = run_both(args, scale, 7, margin=12, split=False)
    assert_same(got, ref, f"band={band} ties={ties}")
    st = indexer_topk.STATS
    assert st.exact_rows >= 3 and st.band_max > band or band > 2, st


@CPU
def test_unsorted_queries_and_bf16_like_inputs():
    """Query rows in any order; inputs exact in the low dtype take the single-dot path."""
    args, scale = make_inputs(11, I=3)
    perm = torch.randperm(37, generator=torch.Generator().manual_seed(0))
    args = [args[0][perm].half().float(), args[1][perm], args[2].half().float(), args[3], args[4],
            args[5][perm], args[6][perm]]
    got, ref = run_both(args, scale, 7, margin=4)
    assert_same(got, ref)


@CPU
def test_the_caller_s_visible_count_replaces_the_read_back(monkeypatch):
    """``visible`` (the exact count of pools ending at or before the last query, or more) gives the reference's
    selection without reading the pools' ends back; too few (pools the late queries see left unscored) changes
    it."""
    args, scale = make_inputs(5, Q=29, S=300, I=3, doc_split=300)  # one document
    ends_P, q_pos_Q = args[3], args[5]
    exact = int((ends_P <= q_pos_Q.max()).sum())
    assert exact < len(ends_P)  # pools past the last query exist: the count matters
    ref = indexer_scoring.select_pools(*args, 7, scale)
    scored = []
    real = sel_mod.Run.chunk
    monkeypatch.setattr(sel_mod.Run, "chunk", lambda self, s, e, n, m: scored.append(n) or real(self, s, e, n, m))
    for visible in (exact, exact + 9, 10**6):
        got = indexer_topk.indexer_topk_triton(*args, 7, scale, visible=visible, margin=4)
        assert_same(got, ref, f"visible={visible}")
        assert_same(indexer_scoring.select_pools(*args, 7, scale, visible=visible), ref, f"reference {visible}")
        assert scored.pop() == min(visible, len(ends_P))  # the caller's count, not one read back
    got = indexer_topk.indexer_topk_triton(*args, 7, scale, visible=exact // 2, margin=4)
    with pytest.raises(AssertionError, match="rows differ"):
        assert_same(got, ref)
    with pytest.raises(AssertionError, match="rows differ"):
        assert_same(indexer_scoring.select_pools(*args, 7, scale, visible=exact // 2), ref)


def _near_tie():
    """Two pools whose exact scores differ by 0.1 ulp of the low dtype, in the order its rounding flips."""
    u = 2.0**-10  # fp16 spacing at 1
    D = 16
    keys_PD = torch.zeros(4, D)
    keys_PD[0, :2] = torch.tensor([1 + 0.45 * u, 1 + 0.45 * u])  # exact 2 + 0.9u, fp16 2
    keys_PD[1, :2] = torch.tensor([1 + 0.8 * u, 1.0])  # exact 2 + 0.8u, fp16 2 + u
    keys_PD[2, :2] = torch.tensor([0.5, 0.5])
    keys_PD[3, :2] = torch.tensor([0.25, 0.5])
    q_QID = torch.zeros(2, 1, D)
    q_QID[:, 0, :2] = 1.0
    w_QI = torch.ones(2, 1)
    ends_P = torch.tensor([3, 7, 11, 15])
    return [q_QID, w_QI, keys_PD, ends_P, torch.zeros(4, dtype=torch.long), torch.tensor([20, 21]),
            torch.zeros(2, dtype=torch.long)]


@CPU
def test_near_tie_is_caught_by_the_certificate():
    args = _near_tie()
    got, ref = run_both(args, 1.0, 1, margin=0, split=False)
    assert ref[0][:, 0].tolist() == [0, 0]
    assert_same(got, ref)
    assert indexer_topk.STATS.fallback_rows == 2


@CPU
def test_broken_variants_fail(monkeypatch):
    """Dropping the certificate (margin 0, near-tie), the band's exact re-check or the causal mask (kernel)
    must change the result."""
    args = _near_tie()
    with monkeypatch.context() as m:
        m.setattr(sel_mod, "score_error_bound", lambda q, *a: torch.full((len(q),), -float("inf")))
        got, ref = run_both(args, 1.0, 1, margin=0, split=False)
        assert got[0][:, 0].tolist() == [1, 1] != ref[0][:, 0].tolist()
    with monkeypatch.context() as m:  # trust the kernel's order inside the band: the near tie flips
        m.setattr(sel_mod.Run, "_band_selection", lambda self, rows, cand, *a: cand[:, :self.k].sort(-1).values)
        got, ref = run_both(args, 1.0, 1, margin=3, split=False)
        assert got[0][:, 0].tolist() == [1, 1] != ref[0][:, 0].tolist()
    real = kern.index_scores
    with monkeypatch.context() as m:
        m.setattr(kern, "index_scores", lambda q, w, k, end, *a: real(q, w, k, torch.zeros_like(end), *a))
        args, scale = make_inputs(2, I=3)
        got, ref = run_both(args, scale, 7, margin=4)
        with pytest.raises(AssertionError, match="rows differ"):
            assert_same(got, ref)


@CPU
def test_dispatch_and_supports():
    args, scale = make_inputs(5, I=3)
    assert indexer_topk.indexer_topk_supports(*args, 7, scale) is None
    assert "multiple of 16" in indexer_topk.indexer_topk_supports(args[0][..., :8], args[1], args[2][:, :8],
                                                                  *args[3:], 7, scale)
    assert "dtypes" in indexer_topk.indexer_topk_supports(args[0].double(), *args[1:], 7, scale)
    assert "scale" in indexer_topk.indexer_topk_supports(*args, 7, -1.0)
    with dispatch.configured(preferred={"indexer_topk": ["triton"]}):  # opt-in: model.kernels fast
        impl = dispatch.select("indexer_topk", "test.indexer", *args, 7, scale)
    assert impl.name == "triton"
    assert dispatch.select("indexer_topk", "test.indexer", *args, 7, scale).name == "torch_fp32"  # by default
    ref = dispatch.implementations("indexer_topk")["torch_fp32"].fn(*args, 7, scale)
    with dispatch.configured(preferred={"indexer_topk": ["triton"]}):
        assert_same(dispatch.call("indexer_topk", *args, 7, scale, layer="test.indexer"), ref)


def test_bytes_and_chunk():
    P, I, K = (1 << 20) // 16, 32, 128
    one = indexer_topk.indexer_topk_bytes(1, P, I, K) - indexer_topk.indexer_topk_bytes(0, P, I, K)
    assert one >= 4 * P
    chunk = workspace.resolve_query_chunk(None, P, I, K, "triton")
    assert indexer_topk.indexer_topk_bytes(chunk, P, I, K) <= workspace.SCORING_BUDGET_BYTES
    assert workspace.resolve_query_chunk(7, P, I, K, "triton") == 7
    # the fused kernel holds no [c, I, P] tensor: ~I times more rows than the reference in the same memory
    if getattr(indexer_scoring, "QUERY_CHUNK", None) is None:
        assert chunk > 20 * indexer_scoring.resolve_query_chunk(None, P, I, K)


# ---- GPU ----------------------------------------------------------------------------------------------------
@GPU
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("Q", [8192, 32768])
def test_gpu_glm5_shape(dtype, Q):
    """Q queries at the end of S = Q tokens (two documents), P = S / 16 pools, I = 32 x 128, K = 128."""
    args, scale = make_inputs(0, Q=Q, S=Q, kp=16, I=32, D=128, doc_split=Q // 3, dtype=dtype, device="cuda")
    args[5] = torch.arange(Q, device="cuda")
    args[6] = (args[5] >= Q // 3).long()
    got, ref = run_both(args, scale, 128)
    st = indexer_topk.STATS
    tied = assert_same_but_fp32_ties(got, ref, args, scale, f"Q={Q} {dtype}")
    print(f"Q={Q} {dtype}: fallback rows {st.fallback_rows}, few-pool rows {st.few_pool_rows}, "
          f"exact rows {st.exact_rows}, rows differing at fp32-level ties {tied}")
    assert tied <= max(1, Q // 4096)
    assert st.fallback_rows <= Q // 100


def assert_same_but_fp32_ties(got, ref, args, scale, what="") -> int:
    """(sel, ok) equal but in rows where the swapped pools tie at the top-k boundary within fp32's rounding:
    the reference's scores are fp32 matmuls whose summation order is cuBLAS's, the re-check's another
    shape's (the issue's "identical to fp32 scoring except at exact near-ties"). A row passes when every
    pool in either selection but not both scores (in float64) within ``tol`` of the row's K-th best score,
    ``tol`` twice the forward error bound of an fp32 evaluation in any order: ``(D + I + 3) 2^-24`` of
    ``scale sum_h |w_h| sum_d |q_hd k_pd|``. Returns the number of such rows."""
    sel, ok = got
    sel_r, ok_r = ref
    assert sel.dtype == torch.int64 and ok.dtype == torch.bool and sel.shape == sel_r.shape
    rows = torch.nonzero((sel != sel_r).any(-1) | (ok != ok_r).any(-1)).squeeze(-1).tolist()
    q, w, keys, ends, pdoc, pos, qdoc = args
    I, D = q.shape[1:]
    K = sel.shape[1]
    for r in rows:
        q_ID, w_I = q[r].double(), w[r].double()
        exact_P = w_I @ (q_ID @ keys.double().T * scale).relu()
        bound_P = (D + I + 3) * 2.0**-24 * scale * (w_I.abs() @ (q_ID.abs() @ keys.double().abs().T))
        vis_P = (ends <= pos[r]) & (pdoc == qdoc[r])
        exact_P = exact_P.masked_fill(~vis_P, -float("inf"))
        kth = exact_P.topk(K).values[-1]
        a, b = set(sel[r].tolist()), set(sel_r[r].tolist())
        swapped = torch.tensor(sorted(a ^ b), device=sel.device)
        gap = (exact_P[swapped] - kth).abs()
        tol = 2 * bound_P[swapped].max()
        assert bool(vis_P[swapped].all()) and bool((gap <= tol).all()), (
            f"{what}: row {r} differs beyond an fp32 tie: pools fast-only {sorted(a - b)}, ref-only "
            f"{sorted(b - a)}, |score - K-th| {gap.tolist()} > {float(tol):.3g}")
        assert (ok[r] == ((ends[sel[r]] <= pos[r]) & (pdoc[sel[r]] == qdoc[r]))).all()
    return len(rows)
