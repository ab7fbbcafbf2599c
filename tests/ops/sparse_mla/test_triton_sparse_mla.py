"""The fused Triton sparse MLA (op ``sparse_attention``, implementation ``triton``) against the reference
``torch_masked`` and against ``absorbed``: outputs and the gradients of q, c and the kv_b weight.

Without a GPU the kernels run under Triton's interpreter in fp32 and fp16 on odd small shapes:
``TRITON_INTERPRET=1`` is set by conftest.py before anything imports triton (its own library functions are
decorated at import), and the ``device`` fixture sets ``CPU_INTERPRETER`` for these tests only, so other
modules' CPU tests never dispatch to the interpreter. With a GPU (``-m gpu``): bf16 and fp32 at the
glm5-flash-1gpu shapes (R = 512, Dn = Dv = 256, W = 2063, causal pool selections) with 16 and 64 heads.
"""

from __future__ import annotations

import textwrap

import pytest
import torch

from devices import GPU  # noqa: E402
from megaseq.ops import dispatch, workspace  # noqa: E402
from megaseq.ops.sparse_mla import absorbed as sparse_mla  # noqa: E402
from megaseq.ops.sparse_mla import fused as tsm  # noqa: E402
from megaseq.ops.sparse_mla.reference import sparse_mla_reference  # noqa: E402
from numerics import rel_err  # noqa: E402
from triton_compile import compile_in_child, interpreter_device  # noqa: E402

triton = pytest.importorskip("triton")
torch.set_num_threads(1)
CUDA = torch.cuda.is_available()
# max |a - b| / max |b| per work dtype, against a float64 reference on the same (rounded) inputs
TOL = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 3e-2}
TOL_GPU = {torch.float32: 1e-4, torch.bfloat16: 3e-2}  # fp32 GEMMs around the kernels may use other orders


@pytest.fixture
def device(monkeypatch) -> str:
    """cuda when present, else the cpu under the interpreter (skipped if triton was imported without it)."""
    return interpreter_device(monkeypatch, tsm)


def where_differ(name: str, a: torch.Tensor, b: torch.Tensor) -> str:
    """Max abs and relative error and the index where ``a`` and ``b`` differ most."""
    err = (a.double() - b.double()).abs()
    i = int(err.argmax())
    at = tuple(int(x) for x in torch.unravel_index(torch.tensor(i), err.shape))
    rel = err.max().item() / max(b.double().abs().max().item(), 1e-300)
    return (f"{name}: max abs {err.max().item():.3e} at {at} (got {a.flatten()[i].item():.6g}, want "
            f"{b.flatten()[i].item():.6g}), rel {rel:.3e}")


def assert_close(name: str, a: torch.Tensor, b: torch.Tensor, tol: float) -> None:
    assert torch.isfinite(a).all(), f"{name}: non-finite values"
    assert rel_err(a, b) < tol, where_differ(name, a, b)


def causal_indices(gen, B: int, Q: int, S: int, W: int) -> torch.Tensor:
    """Queries at the last Q of S positions: distinct valid keys at or before each, -1 slots scattered
    among them, one row whose only valid key is itself (its last slot), one out-of-range slot (>= S)."""
    idx = torch.full((B, Q, W), -1, dtype=torch.int32)
    for b in range(B):
        for i in range(Q):
            pos = S - Q + i
            n = int(torch.randint(1, min(W, pos + 1) + 1, (1,), generator=gen))
            keys = torch.randperm(pos + 1, generator=gen)[:n]
            idx[b, i, torch.randperm(W, generator=gen)[:n]] = keys.to(torch.int32)
    idx[0, 2] = -1
    idx[0, 2, W - 1] = S - Q + 2
    idx[-1, -1, 0] = S + 5
    return idx


def make_inputs(seed: int, B: int, Q: int, S: int, Hh: int, R: int, W: int, D: int = 16, dtype=torch.float32,
                device: str = "cpu"):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Q, Hh, D, generator=gen)
    c = torch.randn(B, S, R, generator=gen)
    w = torch.randn(Hh * 2 * D, R, generator=gen) * R**-0.5
    idx = causal_indices(gen, B, Q, S, W)
    g_out = torch.randn(B, Q, Hh, D, generator=gen)
    leaves = [t.to(device, dtype).requires_grad_() for t in (q, c, w)]
    return leaves, idx.to(device), g_out.to(device)


def run(fn, leaves, idx, g_out, scale: float):
    out = fn(*leaves, idx, scale)
    grads = torch.autograd.grad((out.double() * g_out.double()).sum(), leaves)
    return out, grads


def check_against_reference(leaves, idx, g_out, scale: float, tol: float) -> None:
    out, grads = run(tsm.triton_sparse_mla, leaves, idx, g_out, scale)
    ref_leaves = [t.detach().double().requires_grad_() for t in leaves]
    ref, ref_grads = run(sparse_mla_reference, ref_leaves, idx, g_out, scale)
    assert out.dtype == leaves[0].dtype
    assert_close("out", out, ref, tol)
    for name, a, b in zip(("dq", "dc", "dw"), grads, ref_grads):
        assert_close(name, a, b, tol)


# ---- CPU (interpreter) or GPU, fp32: odd shapes ---------------------------------------------------------
@pytest.mark.parametrize("B,Q,S,Hh,R,W", [
    (2, 37, 53, 5, 32, 21),   # heads padded to a block of 16, a partial slot block
    (1, 19, 40, 17, 48, 9),   # two head blocks (atomics from two programs per query), R padded to 64
    (2, 11, 12, 4, 16, 40),   # more slots than keys: most empty
])
def test_triton_matches_reference_fp32(device, B, Q, S, Hh, R, W):
    leaves, idx, g_out = make_inputs(0, B, Q, S, Hh, R, W, device=device)
    assert tsm.triton_sparse_mla_supports(*leaves, idx, 0.37) is None
    check_against_reference(leaves, idx, g_out, 0.37, TOL[torch.float32])


def test_triton_matches_absorbed_fp32(device):
    leaves, idx, g_out = make_inputs(1, 2, 29, 41, 3, 32, 17, device=device)
    out, grads = run(tsm.triton_sparse_mla, leaves, idx, g_out, 0.2)
    ref, ref_grads = run(sparse_mla.sparse_mla, leaves, idx, g_out, 0.2)
    assert_close("out", out, ref, TOL[torch.float32])
    for name, a, b in zip(("dq", "dc", "dw"), grads, ref_grads):
        assert_close(name, a, b, TOL[torch.float32])


def test_an_explicit_launch_config_computes_the_same(device):
    """``config=`` (benchmarks/kernels/sparse_mla_configs.py times each one): another slot block and pipeline depth sum
    in another order, nothing else; a config that drops slots fails (checked against the default's result)."""
    from megaseq.ops.sparse_mla import kernels as K

    gen = torch.Generator().manual_seed(3)
    Hh, Q, S, R, W = 5, 13, 20, 32, 37
    q, do = (torch.randn(Hh, Q, R, generator=gen).to(device) for _ in range(2))
    c = torch.randn(1, S, R, generator=gen).to(device)
    idx = causal_indices(gen, 1, Q, S, W).to(device)
    dflt = K.default_config("fwd", Hh, R, torch.float32), K.default_config("bwd", Hh, R, torch.float32)
    o, lse = K.forward(q, c, idx, 0.3, config=dflt[0])
    dq, dc = K.backward(q, do, o, lse, c, idx, 0.3, config=dflt[1])
    other = K.Config(16, 32, 4, 1)
    assert other not in dflt
    o2, lse2 = K.forward(q, c, idx, 0.3, config=other)
    dq2, dc2 = K.backward(q, do, o, lse, c, idx, 0.3, config=other)
    for name, a, b in (("o_lat", o2, o), ("dq_abs", dq2, dq), ("dc", dc2, dc)):
        assert_close(name, a, b, TOL[torch.float32])
    fin = torch.isfinite(lse)
    assert torch.equal(fin, torch.isfinite(lse2)) and rel_err(lse2[fin], lse[fin]) < TOL[torch.float32]
    broken = idx.clone()
    broken[..., 0] = -1  # a launch that skipped the first slot block's first slot would compute this
    o3, _ = K.forward(q, c, broken, 0.3, config=other)
    assert rel_err(o3, o) > TOL[torch.float32]


def test_the_pool_pass_sums_the_latent_gradient_as_the_atomics_do(device, monkeypatch):
    """``dc="pool"`` (the default; ``MEGASEQ_MLA_DC``): on the indexer's layout (pools of 16, then the tail) each
    selected pool's latent gradient is summed key-major from the queries that chose it and only the tail goes
    through the atomics; ``dq_abs`` and ``dc`` as the atomic path's. A selection not in pools falls back to the
    atomics; a pool pass that misses one query of a pool fails."""
    from megaseq.ops.sparse_mla import kernels as K

    gen = torch.Generator().manual_seed(5)
    B, Q, S, Hh, R = 2, 40, 100, 5, 32  # S not a multiple of 16: the last 4 keys are in no complete pool
    idx = tsm.causal_pool_selection(B, Q, S, kpool=16, pools=3, generator=gen).to(device)
    W = idx.shape[-1]
    assert W == 3 * 16 + 15 and K.pool_layout(idx, S) == 16
    q, do = (torch.randn(Hh, B * Q, R, generator=gen).to(device) for _ in range(2))
    c = torch.randn(B, S, R, generator=gen).to(device)
    o, lse = K.forward(q, c, idx, 0.3)
    dq, dc = K.backward(q, do, o, lse, c, idx, 0.3, dc="atomic")
    dq2, dc2 = K.backward(q, do, o, lse, c, idx, 0.3, dc="pool")
    assert dc.abs().max() > 0 and rel_err(dq2, dq) < TOL[torch.float32]
    assert_close("dc pool vs atomic", dc2, dc, TOL[torch.float32])
    monkeypatch.delenv("MEGASEQ_MLA_DC", raising=False)
    assert K.dc_mode() == "saved" == workspace.DC_DEFAULT  # the default
    monkeypatch.setenv("MEGASEQ_MLA_DC", "atomic")
    assert K.dc_mode() == "atomic"
    monkeypatch.setenv("MEGASEQ_MLA_DC", "pool")
    assert_close("dc from the environment", K.backward(q, do, o, lse, c, idx, 0.3)[1], dc, TOL[torch.float32])
    scattered = causal_indices(gen, 1, 13, 20, 31).to(device)  # no pool structure: the atomics run
    assert K.pool_layout(scattered, 20) is None
    entries = K.pool_entries
    qn, pool, lo, hi, NP = entries(idx, S, 16, chunk=7)  # several programs a pool: their sums add up
    assert pool.numel() > B * NP and int((hi - lo).sum()) == qn.numel()
    monkeypatch.setattr(K, "POOL_CHUNK", 7)
    assert_close("dc in chunks of 7 queries", K.backward(q, do, o, lse, c, idx, 0.3, dc="pool")[1], dc,
                 TOL[torch.float32])

    # the picked block: 1024 queries at 32K keys (2048 pools, 128 chosen), 8192 for a 32K segment of 256K keys
    assert K.pool_query_block(2048, 128) == 1024 and K.pool_query_block(16384, 128) == 8192
    monkeypatch.setattr(K, "POOL_QUERY_BLOCK", 6)  # programs a block of 6 queries at a time, 7 blocks a row
    qn, pool, lo, hi, NP = K.pool_entries(idx, S, 16)
    real = hi > lo
    assert int(real.sum()) > B * NP and int((hi - lo).sum()) == qn.numel()
    blk = (qn[lo[real]].long() % Q) // 6 + (qn[lo[real]].long() // Q) * 7  # each program's block
    assert (blk.diff() >= 0).all() and ((qn[(hi[real] - 1)].long() % Q) // 6 == blk % 7).all()
    assert_close("dc by blocks of 6 queries", K.backward(q, do, o, lse, c, idx, 0.3, dc="pool")[1], dc,
                 TOL[torch.float32])
    monkeypatch.setattr(K, "POOL_QUERIES", 16)  # queries 0-15, 16-31, 32-39 of each row sorted apart
    assert_close("dc sorted 16 queries at a time", K.backward(q, do, o, lse, c, idx, 0.3, dc="pool")[1], dc,
                 TOL[torch.float32])

    def drop_one(idx_BQW, S, kp, chunk=None, **kw):
        qn, pool, lo, hi, NP = entries(idx_BQW, S, kp, chunk, **kw)
        hi = hi.clone()
        hi[0] -= 1  # the first program loses its last query
        return qn, pool, lo, hi, NP

    monkeypatch.setattr(K, "pool_entries", drop_one)
    assert rel_err(K.backward(q, do, o, lse, c, idx, 0.3, dc="pool")[1], dc) > TOL[torch.float32]
    monkeypatch.setenv("MEGASEQ_MLA_DC", "atomics")
    with pytest.raises(ValueError, match="MEGASEQ_MLA_DC must be one of pool, saved, atomic"):
        K.backward(q, do, o, lse, c, idx, 0.3)


def test_the_saved_pool_pass_sums_the_latent_gradient_as_the_atomics_do(device, monkeypatch):
    """``dc="saved"``: the slot pass leaves each pool slot's ``p`` and ``ds`` in memory and the pool pass sums
    ``p^T do_lat + ds^T q_abs`` from them, ``SAVED_QUERIES`` queries of a batch row at a time; ``dq_abs`` and
    ``dc`` as the atomic path's, in chunks that split the rows too. A pool pass that reads another entry's
    saved block fails; so does a slot pass that leaves no ``p``."""
    from megaseq.ops.sparse_mla import kernels as K

    gen = torch.Generator().manual_seed(7)
    B, Q, S, Hh, R = 2, 40, 100, 5, 32
    idx = tsm.causal_pool_selection(B, Q, S, kpool=16, pools=3, generator=gen).to(device)
    q, do = (torch.randn(Hh, B * Q, R, generator=gen).to(device) for _ in range(2))
    c = torch.randn(B, S, R, generator=gen).to(device)
    o, lse = K.forward(q, c, idx, 0.3)
    dq, dc = K.backward(q, do, o, lse, c, idx, 0.3, dc="atomic")
    dq2, dc2 = K.backward(q, do, o, lse, c, idx, 0.3, dc="saved")
    assert dc.abs().max() > 0
    assert_close("dq_abs saved vs atomic", dq2, dq, TOL[torch.float32])
    assert_close("dc saved vs atomic", dc2, dc, TOL[torch.float32])
    monkeypatch.setenv("MEGASEQ_MLA_DC", "saved")
    assert_close("dc saved from the environment", K.backward(q, do, o, lse, c, idx, 0.3)[1], dc, TOL[torch.float32])
    monkeypatch.setattr(K, "SAVED_QUERIES", 7)  # queries 0-6, 7-13, .. 35-39 of each row: 6 chunks a row
    monkeypatch.setattr(K, "POOL_QUERY_BLOCK", 3)
    dq3, dc3 = K.backward(q, do, o, lse, c, idx, 0.3, dc="saved")
    assert_close("dq_abs saved in chunks of 7", dq3, dq, TOL[torch.float32])
    assert_close("dc saved in chunks of 7", dc3, dc, TOL[torch.float32])
    scattered = causal_indices(gen, B, Q, S, idx.shape[-1]).to(device)  # no pools: the atomics alone
    dq4, dc4 = K.backward(q, do, o, lse, c, scattered, 0.3, dc="atomic")
    assert_close("dc saved, no pools", K.backward(q, do, o, lse, c, scattered, 0.3, dc="saved")[1], dc4,
                 TOL[torch.float32])

    entries = K.pool_entries

    def shifted(*a, **kw):  # every entry reads the next entry's saved block
        out = entries(*a, **kw)
        return out[:5] + (out[5].roll(1),)

    monkeypatch.setattr(K, "pool_entries", shifted)
    assert rel_err(K.backward(q, do, o, lse, c, idx, 0.3, dc="saved")[1], dc) > TOL[torch.float32]
    monkeypatch.setattr(K, "pool_entries", entries)
    launch = K.sparse_mla_bwd_kernel

    class NoSave:  # the slot pass as if SAVE_PDS were off: p and ds never written (the buffer zeroed)
        def __getitem__(self, grid):
            def go(*a, **kw):
                kw["p_ptr"].zero_(), kw["ds_ptr"].zero_()
                return launch[grid](*a, **{**kw, "SAVE_PDS": False})
            return go

    monkeypatch.setattr(K, "sparse_mla_bwd_kernel", NoSave())
    assert rel_err(K.backward(q, do, o, lse, c, idx, 0.3, dc="saved")[1], dc) > TOL[torch.float32]


def _head_summed64(q_HNR, c_BSR, idx_BQW, scale: float) -> torch.Tensor:
    """``[B, Q, W]``: op ``indexer_target``'s reference in float64 (each head's own softmax over the valid slots,
    summed over the heads) on the kernels' head-major absorbed queries."""
    from megaseq.ops.indexer.target import indexer_target_reference

    B, Q = idx_BQW.shape[:2]
    q = q_HNR.double().view(q_HNR.shape[0], B, Q, -1)
    return torch.stack([indexer_target_reference(q[:, b].transpose(0, 1), c_BSR[b].double(), idx_BQW[b], scale)
                        for b in range(B)])


@pytest.mark.parametrize("dc", ["atomic", "pool", "saved"])
def test_the_backward_leaves_the_head_summed_probabilities(device, monkeypatch, dc):
    """``probs``: the slot pass writes each slot's probability summed over the heads (op ``indexer_target``'s
    result) in every latent-gradient mode, stored with one head block and added with two (17 heads), chunked
    queries included; the op hands it out through ``HeadProbs`` in its backward. A slot pass that does not
    write it fails the check."""
    from megaseq.ops.sparse_mla import kernels as K
    from megaseq.ops.sparse_mla.reference import HeadProbs

    monkeypatch.setattr(K, "SAVED_QUERIES", 7)
    gen = torch.Generator().manual_seed(11)
    for B, Q, S, Hh, R in ((2, 40, 100, 5, 32), (1, 23, 64, 17, 48)):
        idx = tsm.causal_pool_selection(B, Q, S, kpool=16, pools=3, generator=gen).to(device)
        idx[0, 3, 5] = -1  # a pool with an empty slot: not a pool layout, so the pool modes take the atomics
        q, do = (torch.randn(Hh, B * Q, R, generator=gen).to(device) for _ in range(2))
        c = torch.randn(B, S, R, generator=gen).to(device)
        for sel in (idx, tsm.causal_pool_selection(B, Q, S, kpool=16, pools=3, generator=gen).to(device)):
            want = _head_summed64(q, c, sel, 0.3)
            o, lse = K.forward(q, c, sel, 0.3)
            probs = torch.zeros(B * Q, sel.shape[-1], dtype=torch.float32, device=device)
            K.backward(q, do, o, lse, c, sel, 0.3, dc=dc, probs=probs)
            assert_close(f"head-summed probabilities, {Hh} heads, dc={dc}", probs.view(B, Q, -1), want,
                         TOL[torch.float32])

    leaves, idx, g_out = make_inputs(2, 2, 29, 41, 3, 32, 17, device=device)
    holder = HeadProbs()
    out, lse = tsm.triton_sparse_mla(*leaves, idx, 0.2, return_lse=True, head_probs=holder)
    assert holder.m_BQW is None
    (out * g_out).sum().backward()
    w_uk = leaves[2].detach().view(3, -1, 32)[:, :16]
    q_abs = torch.einsum("bqhd,hdr->hbqr", leaves[0].detach(), w_uk).reshape(3, 2 * 29, 32)
    assert_close("the op's HeadProbs", holder.m_BQW, _head_summed64(q_abs, leaves[1].detach(), idx, 0.2),
                 TOL[torch.float32])

    launch = K.sparse_mla_bwd_kernel

    class NoProbs:  # the slot pass as if STORE_PROBS were off: nothing written
        def __getitem__(self, grid):
            return lambda *a, **kw: launch[grid](*a, **{**kw, "STORE_PROBS": False})

    monkeypatch.setattr(K, "sparse_mla_bwd_kernel", NoProbs())
    probs = torch.zeros(B * Q, sel.shape[-1], dtype=torch.float32, device=device)
    K.backward(q, do, o, lse, c, sel, 0.3, dc=dc, probs=probs)
    assert rel_err(probs.view(B, Q, -1), want) > TOL[torch.float32]


def test_the_forward_reads_the_pool_layout_for_the_backward(device, monkeypatch):
    """The op reads its empty-row check and the first pool candidate's layout check in one sync (``checks``) and
    hands the answer to the backward, which then runs no check of its own; a selection not in pools is left for
    the backward to check (and falls back to the atomics); the gradients are the reference's either way. A
    ``checks`` that claims pools for a scattered selection gives a wrong latent gradient."""
    from megaseq.ops.sparse_mla import kernels as K

    gen = torch.Generator().manual_seed(9)
    B, Q, S, Hh, R = 2, 40, 100, 5, 32
    pooled = tsm.causal_pool_selection(B, Q, S, kpool=16, pools=3, generator=gen).to(device)
    scattered = causal_indices(gen, B, Q, S, pooled.shape[-1]).to(device)
    assert tsm.checks(pooled, S) == ([False, False], 16)
    assert tsm.checks(scattered, S) == ([False, False], "check")
    monkeypatch.setenv("MEGASEQ_MLA_DC", "atomic")
    assert tsm.checks(pooled, S) == ([False, False], "check")  # no pool pass: not checked
    monkeypatch.setenv("MEGASEQ_MLA_DC", "pool")
    leaves = [x.requires_grad_() for x in (torch.randn(B, Q, Hh, 16, generator=gen).to(device),
                                           torch.randn(B, S, R, generator=gen).to(device),
                                           (torch.randn(Hh * 32, R, generator=gen) * R**-0.5).to(device))]
    g_out = torch.randn(B, Q, Hh, 16, generator=gen).to(device)
    calls = []
    layout = K.pool_layout
    monkeypatch.setattr(K, "pool_layout", lambda *a: calls.append(1) or layout(*a))
    for idx, checked in ((pooled, 0), (scattered, 1)):
        calls.clear()
        check_against_reference(leaves, idx, g_out, 0.3, TOL[torch.float32])
        assert len(calls) == checked
    monkeypatch.setattr(tsm, "checks", lambda idx, S: ([False] * idx.shape[0], 16))  # broken: pools claimed
    with pytest.raises(AssertionError):
        check_against_reference(leaves, scattered, g_out, 0.3, TOL[torch.float32])


def test_empty_rows_take_absorbed(device):
    """A batch row with a query that selects nothing goes to ``absorbed`` (the reference's uniform
    fallback); the other row still runs the kernels, which alone give such a query 0 and no gradient."""
    leaves, idx, g_out = make_inputs(2, 2, 13, 20, 3, 16, 8, device=device)
    idx[0, 5] = -1
    check_against_reference(leaves, idx, g_out, 0.5, TOL[torch.float32])
    assert tsm.empty_batch_rows(idx, 20) == [True, False]
    q, c, w = (t.detach().requires_grad_() for t in leaves)
    out = tsm.TritonSparseMLA.apply(q, c, w, idx, 0.5)
    assert out[0, 5].abs().max() == 0
    grads = torch.autograd.grad((out * g_out).sum(), (q, c, w))
    assert all(torch.isfinite(g).all() for g in grads) and grads[0][0, 5].abs().max() == 0


def test_autocast_fp16_runs_in_fp16(device):
    leaves, idx, g_out = make_inputs(3, 1, 23, 30, 4, 32, 12, device=device)
    with torch.autocast(device, dtype=torch.float16):
        assert tsm.triton_sparse_mla_supports(*leaves, idx, 0.3) is None
        out = tsm.triton_sparse_mla(*leaves, idx, 0.3)
    assert out.dtype == torch.float16
    grads = torch.autograd.grad((out.double() * g_out.double()).sum(), leaves)
    assert all(g.dtype == torch.float32 for g in grads)  # through the casts to the fp32 leaves
    half = [t.detach().half().double().requires_grad_() for t in leaves]
    ref, ref_grads = run(sparse_mla_reference, half, idx, g_out, 0.3)
    assert_close("out", out, ref, TOL[torch.float16])
    for name, a, b in zip(("dq", "dc", "dw"), grads, ref_grads):
        assert_close(name, a, b, TOL[torch.float16])


def test_dispatcher_runs_triton_when_preferred(device):
    leaves, idx, _ = make_inputs(4, 1, 9, 12, 2, 16, 5, device=device)
    dispatch.reset_records()
    dispatch.configure(preferred={"sparse_attention": ["triton"]}, planned={"sparse_attention": "triton"},
                       strict=True)
    try:
        out = dispatch.call("sparse_attention", *leaves, idx, 0.4, layer="layers.3.self_attn")
    finally:
        dispatch.configure()
    assert [r.impl for _, r in dispatch.records()] == ["triton"]
    assert rel_err(out, sparse_mla_reference(*[t.double() for t in leaves], idx, 0.4)) < TOL[torch.float32]


# ---- the pool-layout check: the Triton pass against the torch reference ----------------------------------
def random_pool_block(gen, idx: torch.Tensor, kp: int, K: int, b: int | None = None) -> tuple[int, int, int]:
    """(b, q, k) of a random block of the pooled slots that holds a pool (in batch row ``b`` if given)."""
    at = (idx[..., :K * kp:kp] >= 0).nonzero()
    if b is not None:
        at = at[at[:, 0] == b]
    return tuple(int(x) for x in at[int(torch.randint(len(at), (1,), generator=gen))])


def plant(kind: str, idx: torch.Tensor, S: int, gen, kp: int = 16) -> tuple[torch.Tensor, int]:
    """A copy of the pool selection ``idx`` with one violation of the layout at one random block, and its query."""
    K = (idx.shape[-1] + 1) // kp - 1
    idx = idx.clone()
    b, q, k = random_pool_block(gen, idx, kp, K, b=1 if kind == "second_row" else None)
    block = idx[b, q, k * kp:(k + 1) * kp]
    i = int(torch.randint(kp, (1,), generator=gen))
    ar = torch.arange(kp, dtype=idx.dtype, device=idx.device)
    if kind in ("off_by_one", "second_row"):  # one key one off: no longer kp consecutive keys from the first
        block[i] += 1 if int(torch.randint(2, (1,), generator=gen)) else -1
    elif kind == "partly_empty":  # one slot empty, as -1 or as a key >= S (which counts as empty)
        block[i] = -1 if i % 2 else S + i
    elif kind == "first_empty":  # the first slot empty (-1 or >= S), the others still keys of the pool
        block[0] = -1 if i % 2 else S + i
    elif kind == "misaligned":  # kp consecutive keys in range, but first % kp != 0
        r = 1 + int(torch.randint(kp - 1, (1,), generator=gen))
        block[:] = int(torch.randint((S - kp - r) // kp + 1, (1,), generator=gen)) * kp + r + ar
    elif kind == "past_s":  # aligned and consecutive, but first + kp > S (S % kp != 0: the last keys are no pool)
        assert S % kp
        block[:] = S // kp * kp + ar
    else:
        raise ValueError(kind)
    return idx, q


def check_layout(idx: torch.Tensor, S: int) -> int | None:
    """The Triton pass's answer, asserted equal to the torch reference's."""
    from megaseq.ops.sparse_mla import kernels as K

    got, want = K.pool_layout_triton(idx, S), K.pool_layout_reference(idx, S)
    assert got == want, (got, want)
    return got


@pytest.fixture(params=[None, (128, 8)], ids=["default_block", "small_block"])
def layout_block(request, monkeypatch) -> tuple[int, int] | None:
    """Slots per program of the layout pass and slots of a query per program at most: the defaults (all 64 slots
    of 32 queries a program: 3 programs for 2 x 39 queries), or 16 queries of 8 slots, half a block (5 x 8
    programs); the last programs partial. A violation must be seen from any of them."""
    from megaseq.ops.sparse_mla import kernels as K

    if request.param:
        monkeypatch.setattr(K, "POOL_LAYOUT_BLOCK", request.param[0])
        monkeypatch.setattr(K, "POOL_LAYOUT_SLOTS", request.param[1])
    return request.param


def test_pool_layout_kernel_accepts_the_indexer_selection(device, layout_block):
    """The indexer's pools of 16 (S = 100: the last 4 keys in no pool, early queries with empty blocks), with
    keys >= S as empty slots, all-empty selections, int64 and a non-contiguous query slice."""
    gen = torch.Generator().manual_seed(11)
    S = 100
    idx = tsm.causal_pool_selection(2, 39, S, kpool=16, pools=4, q_offset=20, generator=gen)  # W = 79
    assert (idx[..., :64] < 0).any() and (idx[..., :64] >= 0).any()  # some empty, some selected blocks
    assert check_layout(idx.to(device), S) == 16
    past = idx.clone()
    past[..., :64] = torch.where(past[..., :64] < 0, S + 7, past[..., :64])  # keys >= S: empty slots
    assert check_layout(past.to(device), S) == 16
    assert check_layout(torch.full((1, 5, 63), -1, dtype=torch.int32, device=device), S) == 16
    assert check_layout(idx.long().to(device), S) == 16
    assert check_layout(idx.to(device)[:, 7:31], S) == 16
    assert check_layout(idx[:, :0].to(device), S) == 16  # no queries: nothing violates
    # pools of 32 (W = 63): the blocks of 16 fail (tails of 1..15 keys are partly empty), those of 32 hold
    idx32 = tsm.causal_pool_selection(1, 40, S, kpool=32, pools=1, generator=gen)
    assert check_layout(idx32.to(device), S) == 32


@pytest.mark.parametrize("kind", ["off_by_one", "partly_empty", "first_empty", "misaligned", "past_s",
                                  "second_row"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_pool_layout_kernel_finds_each_violation(device, layout_block, kind, seed):
    """One violation at one random block (``second_row``: an off-by-one key in batch row 1 only) makes the
    layout no pool layout, in the kernel as in the reference."""
    gen = torch.Generator().manual_seed(100 + seed)
    S = 100
    idx = tsm.causal_pool_selection(2, 39, S, kpool=16, pools=4, q_offset=20, generator=gen)  # W = 79
    assert check_layout(idx.to(device), S) == 16
    bad, q = plant(kind, idx, S, gen)
    assert (bad != idx).any() and (kind != "second_row" or torch.equal(bad[0], idx[0]))
    assert check_layout(bad.to(device), S) is None
    assert check_layout(bad.long().to(device), S) is None
    assert check_layout(bad.to(device)[:, q:q + 3], S) is None  # a non-contiguous slice of the queries
    assert check_layout(idx.to(device)[:, q:q + 3], S) == 16


def test_pool_layout_kernel_without_a_candidate(device):
    """W + 1 not a multiple of any pool size, or less than two pools of it: no candidate, None in both."""
    gen = torch.Generator().manual_seed(12)
    idx = tsm.causal_pool_selection(1, 20, 64, kpool=16, pools=3, generator=gen).to(device)  # W = 63
    assert check_layout(idx, 64) == 16
    assert check_layout(idx[..., :50], 64) is None  # W + 1 = 51
    assert check_layout(idx[..., :15], 64) is None  # W + 1 = 16 < 2 * 16
    assert check_layout(torch.full((1, 3, 15), -1, dtype=torch.int32, device=device), 64) is None


def test_pool_layout_runs_the_reference_where_triton_cannot(monkeypatch):
    """On the CPU without the interpreter ``pool_layout`` is the torch reference; with it (or on CUDA), the
    Triton pass."""
    from megaseq.ops.sparse_mla import kernels as K

    idx = tsm.causal_pool_selection(1, 20, 64, kpool=16, pools=3, generator=torch.Generator().manual_seed(13))
    monkeypatch.setattr(K, "pool_layout_triton", lambda idx, S: "triton")
    monkeypatch.setattr(K, "pool_layout_reference", lambda idx, S: "reference")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert K.pool_layout(idx, 64) == "reference"
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert K.pool_layout(idx, 64) == "triton"


# ---- the GPU code compiles for sm_90 (no GPU needed) ------------------------------------------------------
COMPILE_SM90 = textwrap.dedent("""
    import torch
    from megaseq.ops.sparse_mla.kernels import compile_ptx
    for kind, dtype, Hh in [("fwd", torch.bfloat16, 16), ("bwd", torch.bfloat16, 16), ("fwd", torch.bfloat16, 64),
                            ("bwd", torch.float32, 16), ("fwd", torch.float32, 5), ("bwd_tail", torch.bfloat16, 16),
                            ("pool", torch.bfloat16, 16), ("pool", torch.float32, 16), ("layout", torch.int32, 0),
                            ("layout", torch.int64, 0), ("bwd_save", torch.bfloat16, 16),
                            ("pool_saved", torch.bfloat16, 16), ("pool_saved", torch.float32, 16)]:
        ptx, smem = compile_ptx(kind, dtype, Hh, 512, 2063)
        assert smem <= 232448, (kind, dtype, Hh, smem)  # an H200's shared memory per block
        print(kind, dtype, Hh, "v4-atomics" if "atom.global.gpu.relaxed.add.v4.f32" in ptx else "-", flush=True)
    for kind, Hh in [("bwd", 16), ("bwd", 64), ("bwd_save", 64)]:  # STORE_PROBS: stored (one head block), added
        ptx, smem = compile_ptx(kind, torch.bfloat16, Hh, 512, 2063, probs=True)
        assert smem <= 232448, (kind, Hh, smem)
        print("probs", kind, Hh, "atomics" if "atom.global.gpu.relaxed.add" in ptx else "-", flush=True)
""")


def test_kernels_compile_for_sm90():
    """Triton's interpreter accepts code the compiler refuses (it did: a helper returning masks of two
    shapes); compile both kernels for an H200 in a process without TRITON_INTERPRET. The latent gradient's
    atomics must come out 4-wide (``atom...add.v4.f32``): scalar ones would be 4x the atomic operations. The
    pool-layout check too, for int32 and int64 selections, and the slot pass writing the head-summed
    probabilities (``STORE_PROBS``)."""
    lines = compile_in_child(COMPILE_SM90).splitlines()
    assert len(lines) == 16, lines
    assert {"probs bwd 16 atomics", "probs bwd 64 atomics", "probs bwd_save 64 atomics"} <= set(lines)
    assert "layout torch.int32 0 -" in lines and "layout torch.int64 0 -" in lines
    assert "bwd torch.bfloat16 16 v4-atomics" in lines and "bwd torch.float32 16 v4-atomics" in lines
    assert "pool torch.bfloat16 16 v4-atomics" in lines and "bwd_tail torch.bfloat16 16 v4-atomics" in lines
    assert "pool_saved torch.bfloat16 16 v4-atomics" in lines and "bwd_save torch.bfloat16 16 v4-atomics" in lines


# ---- what supports refuses, and the memory formula -----------------------------------------------------
def test_supports_gives_reasons(monkeypatch):
    leaves, idx, _ = make_inputs(5, 1, 6, 8, 2, 16, 4)
    q, c, w = (t.detach() for t in leaves)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert "device cpu" in tsm.triton_sparse_mla_supports(q, c, w, idx, 0.5)  # CPU_INTERPRETER unset
    monkeypatch.setattr(tsm, "CPU_INTERPRETER", True)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert "device cpu" in tsm.triton_sparse_mla_supports(q, c, w, idx, 0.5)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert tsm.triton_sparse_mla_supports(q, c, w, idx, 0.5) is None
    assert "bfloat16" in tsm.triton_sparse_mla_supports(q.bfloat16(), c, w, idx, 0.5)
    assert "float64" in tsm.triton_sparse_mla_supports(q.double(), c, w, idx, 0.5)
    assert "multiple of 16" in tsm.triton_sparse_mla_supports(q, c[..., :12], w[:, :12], idx, 0.5)
    assert "latent" in tsm.triton_sparse_mla_supports(q, c[0], w, idx, 0.5)
    assert "do not match" in tsm.triton_sparse_mla_supports(q, c, w, idx[:, :3], 0.5)
    assert "int32" in tsm.triton_sparse_mla_supports(q, c, w, idx.float(), 0.5)


def test_bytes_count_saved_latent_outputs_and_no_per_slot_state():
    Q, S, W, R, Hh, Dn, Dv = 32768, 32768, 2063, 512, 16, 256, 256
    got = tsm.triton_sparse_mla_bytes(Q, S, W, R, Hh, Dn, Dv, torch.bfloat16)
    assert got["saved"] == S * R * 2 + Q * Hh * R * 2 + Q * Hh * 4
    assert got == tsm.triton_sparse_mla_bytes(Q, S, 4 * W, R, Hh, Dn, Dv, torch.bfloat16)  # nothing per slot
    assert got["forward"] == Q * Hh * (Dn + R + Dv) * 2
    # the backward's largest moment is the kernel's: do_lat, q_abs, dq_abs and the fp32 latent gradient; the
    # head-major q (Dn) is made again after it, not held beside it
    assert got["backward"] == Q * Hh * 3 * R * 2 + S * R * 4 + Hh * (Dn + Dv) * R * 2 * 2
    # the key-major latent gradient's sort and delta in the kernel moment, POOL_QUERIES queries a row at a time
    pool = workspace.sparse_mla_pool_bytes(4 * Q, W, 16, Hh, batch=2, mode="pool")
    assert pool == 4 * Q * Hh * 4 + 2 * workspace.POOL_QUERIES * 128 * workspace.POOL_SORT_BYTES
    # the default, saved: p and ds of SAVED_QUERIES queries of one row at a time, and their sort
    saved = workspace.sparse_mla_pool_bytes(4 * Q, W, 16, Hh, batch=2)
    assert saved == workspace.SAVED_QUERIES * 128 * (workspace.POOL_SORT_BYTES + 2 * Hh * 16 * 2)
    assert workspace.sparse_mla_pool_bytes(4 * Q, W, 16, Hh, batch=2, d=4) - saved == \
        workspace.SAVED_QUERIES * 128 * 2 * Hh * 16 * 2  # fp32 p and ds
    assert workspace.sparse_mla_pool_bytes(1000, W, 16, Hh) == 1000 * 128 * (64 + 2 * Hh * 16 * 2)  # one chunk
    for mode in ("saved", "pool", "atomic"):  # no pools: the atomics alone
        assert workspace.sparse_mla_pool_bytes(Q, W + 1, 16, Hh, mode=mode) == 0
    assert workspace.sparse_mla_pool_bytes(Q, W, 16, Hh, mode="atomic") == 0
    assert workspace.triton_sparse_mla_bytes(Q, S, R, Hh, Dn, Dv, 2, pool)["backward"] == \
        got["backward"] + pool
    # the saved o_lat is the price of a backward without a third pass: more than absorbed saves
    assert got["saved"] - workspace.absorbed_bytes(Q, S, W, R, Hh, Dn, Dv, 2, 4)["saved"] == Q * Hh * R * 2


# ---- GPU: the glm5-flash shapes ------------------------------------------------------------------------
def gpu_inputs(Hh: int, Q: int, S: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    R, D = 512, 256
    q = torch.randn(1, Q, Hh, D, device="cuda", generator=gen)
    c = torch.randn(1, S, R, device="cuda", generator=gen)
    w = torch.randn(Hh * 2 * D, R, device="cuda", generator=gen) * R**-0.5
    idx = tsm.causal_pool_selection(1, Q, S, generator=gen, device="cuda")
    g_out = torch.randn(1, Q, Hh, D, device="cuda", generator=gen)
    return [t.to(dtype).requires_grad_() for t in (q, c, w)], idx, g_out


@pytest.mark.gpu
@GPU
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("Hh", [16, 64])
def test_gpu_matches_reference(dtype, Hh):
    leaves, idx, g_out = gpu_inputs(Hh, 4096, 4096, dtype)
    out, grads = run(tsm.triton_sparse_mla, leaves, idx, g_out, 256**-0.5)
    ref_leaves = [t.detach().float().requires_grad_() for t in leaves]
    ref, ref_grads = run(sparse_mla_reference, ref_leaves, idx, g_out, 256**-0.5)  # fp32: no tf32 by default
    assert_close("out", out, ref, TOL_GPU[dtype])
    for name, a, b in zip(("dq", "dc", "dw"), grads, ref_grads):
        assert_close(name, a, b, TOL_GPU[dtype])


@pytest.mark.gpu
@GPU
def test_gpu_bf16_matches_absorbed_at_32k(monkeypatch):
    """The whole op at 32K in bf16 against ``absorbed``, with each way of the latent gradient that has a pool pass
    (``saved`` holds 8K queries' p and ds at a time: four chunks)."""
    leaves, idx, g_out = gpu_inputs(16, 32768, 32768, torch.bfloat16, seed=1)
    ref, ref_grads = run(sparse_mla.sparse_mla, leaves, idx, g_out, 256**-0.5)
    for mode in ("pool", "saved"):
        monkeypatch.setenv("MEGASEQ_MLA_DC", mode)
        out, grads = run(tsm.triton_sparse_mla, leaves, idx, g_out, 256**-0.5)
        assert_close(f"out ({mode})", out, ref, TOL_GPU[torch.bfloat16])
        for name, a, b in zip(("dq", "dc", "dw"), grads, ref_grads):
            assert_close(f"{name} ({mode})", a, b, TOL_GPU[torch.bfloat16])


@pytest.mark.gpu
@GPU
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("mode", ["pool", "saved"])
def test_gpu_pool_pass_matches_the_atomics(dtype, mode):
    """The key-major latent gradient (``dc="pool"``, and ``"saved"``: from the slot pass's saved p and ds, 8K queries
    at a time) on the indexer's layout at glm5-flash-1gpu's DSA shapes (8K queries and keys, 16 heads, R = 512,
    128 pools of 16 and the tail) against the atomic path."""
    from megaseq.ops.sparse_mla import kernels as K

    gen = torch.Generator(device="cuda").manual_seed(2)
    Q = S = 8192
    q, do = ((torch.randn(16, Q, 512, device="cuda", generator=gen) * 512**-0.25).to(dtype) for _ in range(2))
    c = (torch.randn(1, S, 512, device="cuda", generator=gen) * 512**-0.25).to(dtype)
    idx = tsm.causal_pool_selection(1, Q, S, generator=gen, device="cuda")
    assert K.pool_layout(idx, S) == 16
    o, lse = K.forward(q, c, idx, 256**-0.5)
    dq, dc = K.backward(q, do, o, lse, c, idx, 256**-0.5, dc="atomic")
    dq2, dc2 = K.backward(q, do, o, lse, c, idx, 256**-0.5, dc=mode)
    assert_close("dq_abs", dq2, dq, 1e-6)  # the same kernel, the same sums
    assert_close("dc", dc2, dc, 1e-5)  # fp32 sums of the same operands in another order


@pytest.mark.gpu
@GPU
def test_gpu_pool_sort_stays_within_its_planned_bytes():
    """``ops.workspace.sparse_mla_pool_bytes`` counts ``POOL_SORT_BYTES`` per (query, selected pool) while
    ``pool_entries`` sorts ``POOL_QUERIES`` queries: the measured peak of the sort at glm5-flash-1gpu's DSA
    shapes (32K queries, 128 pools of 16) is within that and not far below it."""
    from megaseq.ops.sparse_mla import kernels as K

    Q = S = K.POOL_QUERIES
    idx = tsm.causal_pool_selection(1, Q, S, generator=torch.Generator(device="cuda").manual_seed(3), device="cuda")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = K.pool_entries(idx, S, 16, slots=True)  # with the saved pass's entry index too
    peak = torch.cuda.max_memory_allocated() - base
    slots = Q * 128
    assert 0.4 * workspace.POOL_SORT_BYTES * slots < peak <= workspace.POOL_SORT_BYTES * slots, peak / slots
    assert out[0].numel() <= slots and out[5].numel() == out[0].numel()
    assert workspace.sparse_mla_pool_bytes(Q, 2063, 16, 16, mode="pool") == \
        Q * 16 * 4 + workspace.POOL_SORT_BYTES * slots


@pytest.mark.gpu
@GPU
def test_gpu_pool_layout_kernel_matches_the_reference_at_32k():
    """The layout check at glm5-flash-1gpu's DSA shapes (32K queries and keys, W = 2063: 128 pools of 16, then
    the tail): the Triton pass answers as the torch reference on the indexer's selection (16) and with one
    violation planted at a random block (None)."""
    from megaseq.ops.sparse_mla import kernels as K

    Q = S = 32768
    idx = tsm.causal_pool_selection(1, Q, S, generator=torch.Generator(device="cuda").manual_seed(4), device="cuda")
    assert idx.shape[-1] == 2063 and K.pool_candidates(2063) == [(16, 128)]
    assert check_layout(idx, S) == 16 and K.pool_layout(idx, S) == 16
    gen = torch.Generator().manual_seed(4)
    for kind in ("off_by_one", "partly_empty", "misaligned"):
        bad, _ = plant(kind, idx, S, gen)
        assert check_layout(bad, S) is None and K.pool_layout(bad, S) is None, kind
        del bad
