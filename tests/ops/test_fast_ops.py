"""Fast ops against their references: absorbed sparse MLA (float64 on the CPU, exact), the fla KDA and
causal conv ops (GPU only), and the dispatcher's choice of each."""

from __future__ import annotations

import pytest
import torch

from devices import GPU
from megaseq.models.common.context import SeqContext
from megaseq.models.common.mla_dsa import MLASparseAttention
from megaseq.models.presets import get_preset
from megaseq.ops import dispatch, workspace
from megaseq.ops.indexer import scoring as indexer_scoring
from megaseq.ops.kda import fla as fla_kda
from megaseq.ops.kda.reference import causal_conv_reference, kda_reference
from megaseq.ops.sparse_mla import absorbed as sparse_mla
from megaseq.ops.sparse_mla import reference as mla_dsa
from megaseq.ops.sparse_mla.reference import sparse_mla_reference

torch.set_num_threads(1)
F64 = torch.float64


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-300)).item()


def _distinct_indices(gen, B: int, Q: int, S: int, W: int, offset: int = 0) -> torch.Tensor:
    """Causal, distinct valid indices per row, -1 padding scattered among them, and the edge rows."""
    idx = torch.full((B, Q, W), -1, dtype=torch.int32)
    for b in range(B):
        for i in range(Q):
            pos = offset + i
            n = int(torch.randint(0, min(W, pos + 1) + 1, (1,), generator=gen))
            keys = torch.randperm(pos + 1, generator=gen)[:n]
            slots = torch.randperm(W, generator=gen)[:n]
            idx[b, i, slots] = keys.to(torch.int32)
    idx[0, 3] = -1                      # a row without any valid key (all slots empty)
    idx[0, 4] = -1
    idx[0, 4, W - 1] = offset + 4       # a row whose only valid key is its own tail slot
    idx[-1, -1, 0] = S + 5              # out of range: empty, as in the reference
    return idx


def _sparse_inputs(seed: int, B=2, Q=29, S=37, Hh=3, Dn=5, Dv=7, R=11, W=9, offset=8):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Q, Hh, Dn, generator=gen, dtype=F64).requires_grad_()
    c = torch.randn(B, S, R, generator=gen, dtype=F64).requires_grad_()
    w = (torch.randn(Hh * (Dn + Dv), R, generator=gen, dtype=F64) * R**-0.5).requires_grad_()
    return q, c, w, _distinct_indices(gen, B, Q, S, W, offset), gen


@pytest.mark.parametrize("block_bytes", [1 << 40, 1])  # one block / one query per block
def test_absorbed_sparse_mla_equals_reference(block_bytes, monkeypatch):
    monkeypatch.setattr(workspace, "ABSORBED_BLOCK_BYTES", block_bytes)
    q, c, w, idx, gen = _sparse_inputs(0)
    ref = sparse_mla_reference(q, c, w, idx, 0.37)
    out = sparse_mla.sparse_mla(q, c, w, idx, 0.37)
    g_out = torch.randn(*out.shape, generator=gen, dtype=F64)
    grads_ref = torch.autograd.grad((ref * g_out).sum(), (q, c, w))
    grads = torch.autograd.grad((out * g_out).sum(), (q, c, w))
    assert rel_err(out, ref) < 1e-12
    for name, a, b in zip("qcw", grads, grads_ref):
        assert rel_err(a, b) < 1e-12, name
    # the empty row really took the reference's all-keys fallback, and the tail row its one key
    assert rel_err(out[0, 3], ref[0, 3]) < 1e-12 and out[0, 3].abs().max() > 0


def test_block_queries_fits_the_budget():
    W, R, Hh = 2063, 512, 16
    n = sparse_mla.block_queries(W, R, Hh, torch.bfloat16, budget=2 << 30)
    per_query_floor = W * R * (2 + 4)  # gathered latents (bf16) + their fp32 gradient
    assert n * per_query_floor <= 2 << 30 and n >= 100


def test_mla_layer_absorbed_equals_reference_with_documents():
    spec = get_preset("glm5-flash-tiny").replace(index_topk=8, index_kpool=4, kv_lora_rank=13, v_head_dim=7)
    torch.manual_seed(0)
    layer = MLASparseAttention(spec, layer_idx=3).double()
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=F64) * p.shape[-1] ** -0.5)
    x = torch.randn(2, 43, spec.hidden_size, generator=gen, dtype=F64).requires_grad_()
    doc_ids = torch.tensor([[0] * 11 + [1] * 30 + [2] * 2, [0] * 43])
    w = torch.randn(2, 43, spec.hidden_size, generator=gen, dtype=F64)
    runs = {}
    for impl in ("absorbed", "torch_masked"):
        dispatch.reset_records()
        dispatch.configure(preferred={"sparse_attention": [impl]})
        try:
            ctx = SeqContext(doc_ids=doc_ids)
            out = layer(x, ctx)
            grads = torch.autograd.grad((out * w).sum(), [x, *layer.parameters()], allow_unused=True)
            runs[impl] = (out, grads)
            assert [r.impl for _, r in dispatch.records() if r.op == "sparse_attention"] == [impl]
        finally:
            dispatch.configure()
    (out_a, g_a), (out_r, g_r) = runs["absorbed"], runs["torch_masked"]
    assert rel_err(out_a, out_r) < 1e-12
    for a, b in zip(g_a, g_r):
        assert (a is None) == (b is None)
        if a is not None:
            assert rel_err(a, b) < 1e-12


def test_dispatcher_choices_on_cpu():
    q, c, w, idx, _ = _sparse_inputs(3)
    assert sparse_mla.sparse_mla_supports(q, c, w, idx, 0.5) is None  # float64: exact, so allowed
    assert "cpu" in sparse_mla.sparse_mla_supports(q.float(), c.float(), w.float(), idx, 0.5)
    assert "latent" in sparse_mla.sparse_mla_supports(q, c[0], w, idx, 0.5)
    x = torch.randn(1, 8, 4, 3, dtype=F64)
    why = fla_kda.kda_fla_supports(x, x, x, x, x[..., 0])
    assert why is not None and "cuda" in why
    assert fla_kda.conv_fla_supports(x.flatten(2), torch.randn(12, 4, dtype=F64)) is not None


# ---- GPU: fla kernels against the references -----------------------------------------------------------
def _kda_inputs(device, dtype, B=2, S=300, H=3, D=64, seed=0):
    gen = torch.Generator(device="cpu").manual_seed(seed)
    q, k, v = (torch.randn(B, S, H, D, generator=gen) for _ in range(3))
    g = -5.0 * torch.sigmoid(torch.randn(B, S, H, D, generator=gen))
    beta = torch.sigmoid(torch.randn(B, S, H, generator=gen))
    return [t.to(device, dtype if t is not g else torch.float32).requires_grad_() for t in (q, k, v, g, beta)]


@pytest.mark.gpu
@GPU
@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("docs", [False, True])
def test_fla_kda_matches_reference(dtype, tol, docs):
    """fla's chunk KDA in bf16 (the dtype it runs in megaseq: bf16 tensors or fp32 under bf16 autocast)."""
    inputs = _kda_inputs("cuda", dtype)
    cu = None
    if docs:
        inputs = [t.detach().reshape(1, -1, *t.shape[2:]).requires_grad_() for t in inputs]
        cu = torch.tensor([0, 77, 301, 600], device="cuda")
    assert fla_kda.kda_fla_supports(*inputs, cu) is None
    ref = kda_reference(*[t.double() for t in inputs], cu)
    out = fla_kda.kda_fla(*inputs, cu)
    w = torch.randn_like(ref)
    g_ref = torch.autograd.grad((ref * w).sum(), inputs)
    g_out = torch.autograd.grad((out.double() * w).sum(), inputs)
    assert rel_err(out.double(), ref) < tol
    for a, b in zip(g_out, g_ref):
        assert rel_err(a.double(), b.double()) < tol


@pytest.mark.gpu
@GPU
@pytest.mark.parametrize("docs", [False, True])
def test_fla_kda_refuses_float32_and_the_dispatcher_runs_the_reference(docs):
    """fla's fp32 chunk KDA asks more shared memory than an H200 has (a Triton OutOfResources at launch), so
    its check refuses fp32 with the reason and the dispatcher runs the reference instead; the same tensors
    under bf16 autocast are accepted."""
    inputs = _kda_inputs("cuda", torch.float32, S=40)
    cu = None
    if docs:
        inputs = [t.detach().reshape(1, -1, *t.shape[2:]).requires_grad_() for t in inputs]
        cu = torch.tensor([0, 17, 80], device="cuda")
    why = fla_kda.kda_fla_supports(*inputs, cu)
    assert why is not None and "float32" in why and "bf16" in why
    with dispatch.configured(preferred={"kda": ["fla_chunk"]}):
        chosen = dispatch.select("kda", "test.kda", *inputs, cu)
    assert chosen.name != "fla_chunk" and dispatch.implementations("kda")[chosen.name].reference
    with torch.autocast("cuda", dtype=torch.bfloat16):
        assert fla_kda.kda_fla_supports(*inputs, cu) is None


def _gdn_inputs(device, dtype, B=2, S=300, Hk=2, Hv=4, D=64, seed=0):
    """q, k ``[B, S, Hk, D]``, v ``[B, S, Hv, D]`` (two value heads per key head, as Qwen3-Next), g (log decay,
    float32) and beta ``[B, S, Hv]``."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    q, k = (torch.randn(B, S, Hk, D, generator=gen) for _ in range(2))
    v = torch.randn(B, S, Hv, D, generator=gen)
    g = -torch.nn.functional.softplus(torch.randn(B, S, Hv, generator=gen))
    beta = torch.sigmoid(torch.randn(B, S, Hv, generator=gen))
    return [t.to(device, dtype if t is not g else torch.float32).requires_grad_() for t in (q, k, v, g, beta)]


@pytest.mark.gpu
@GPU
@pytest.mark.parametrize("docs", [False, True])
def test_fla_gdn_matches_reference_or_declines_where_fla_refuses(docs):
    """fla's chunked gated delta rule in bf16 (grouped value heads, documents as ``cu_seqlens``, a carried initial
    state and the final state returned) against the reference in float64: outputs, final states and every
    gradient. Where fla refuses the gated backward (Hopper with Triton 3.4-3.7.0 and no TileLang backend) the
    check declines with that reason before the forward and the dispatcher runs the reference."""
    from megaseq.ops.gdn import fla as fla_gdn
    from megaseq.ops.gdn.reference import gdn_reference

    inputs = _gdn_inputs("cuda", torch.bfloat16)
    cu = None
    if docs:
        inputs = [t.detach().reshape(1, -1, *t.shape[2:]).requires_grad_() for t in inputs]
        cu = torch.tensor([0, 77, 301, 600], device="cuda")
    N = 3 if docs else 2
    h0 = torch.randn(N, 4, 64, 64, device="cuda", generator=torch.Generator("cuda").manual_seed(1)) * 0.1
    refused = fla_gdn.hopper_backward_refused()
    if refused is not None:
        assert fla_gdn.gdn_fla_supports(*inputs, cu, h0, True) == refused and "3.7.1" in refused
        with dispatch.configured(preferred={"gdn": ["fla_chunk"]}):
            chosen = dispatch.select("gdn", "test.gdn", *inputs, cu, h0, True)
        assert dispatch.implementations("gdn")[chosen.name].reference
        pytest.skip(refused)
    assert fla_gdn.gdn_fla_supports(*inputs, cu, h0, True) is None
    h0 = h0.requires_grad_()
    ref, ref_h = gdn_reference(*[t.double() for t in inputs], cu, h0.double(), True)
    out, out_h = fla_gdn.gdn_fla(*inputs, cu, h0, True)
    w, wh = torch.randn_like(ref), torch.randn_like(ref_h)
    leaves = (*inputs, h0)
    g_ref = torch.autograd.grad((ref * w).sum() + (ref_h * wh).sum(), leaves)
    g_out = torch.autograd.grad((out.double() * w).sum() + (out_h.double() * wh).sum(), leaves)
    assert rel_err(out.double(), ref) < 3e-2 and rel_err(out_h.double(), ref_h) < 3e-2
    for a, b in zip(g_out, g_ref):
        assert rel_err(a.double(), b.double()) < 3e-2


@pytest.mark.gpu
@GPU
def test_fla_conv_matches_reference():
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(1, 300, 48, generator=gen).cuda().requires_grad_()
    wt = torch.randn(48, 4, generator=gen).cuda().requires_grad_()
    cu = torch.tensor([0, 100, 300], device="cuda")
    assert fla_kda.conv_fla_supports(x, wt, "silu", cu) is None
    ref = causal_conv_reference(x, wt, "silu", cu)
    out = fla_kda.conv_fla(x, wt, "silu", cu)
    assert rel_err(out, ref) < 1e-4
    g = torch.randn_like(ref)
    grads = torch.autograd.grad((ref * g).sum(), (x, wt))
    for a, b in zip(torch.autograd.grad((out * g).sum(), (x, wt)), grads):
        assert rel_err(a, b) < 1e-4


@pytest.mark.gpu
@GPU
def test_absorbed_sparse_mla_on_gpu_bf16():
    q, c, w, idx, _ = _sparse_inputs(4, B=1, Q=200, S=200, Hh=4, Dn=32, Dv=32, R=64, W=40, offset=0)
    q, c, w = (t.detach().cuda().requires_grad_() for t in (q, c, w))
    idx = idx.cuda()
    ref = sparse_mla_reference(q, c, w, idx, 0.2)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = sparse_mla.sparse_mla(q.float(), c.float(), w, idx, 0.2)
    assert out.dtype == torch.bfloat16 and rel_err(out.double(), ref) < 3e-2
    assert mla_dsa.ATTENTION_BLOCK_ELEMS > 0


# ---- indexer scoring at long context -------------------------------------------------------------------
def _valid_sets(sel: torch.Tensor, ok: torch.Tensor) -> list[set[int]]:
    return [set(s[o].tolist()) for s, o in zip(sel, ok)]


def test_select_pools_causal_prefix_equals_all_pools():
    """Scoring each chunk against the causal prefix of pools only picks the same valid pools as scoring
    every pool (ties included: many scores are relu'd to exactly 0), in ascending order."""
    gen = torch.Generator().manual_seed(9)
    Q, P, I, D, kp = 53, 23, 3, 4, 3
    q = torch.randn(Q, I, D, generator=gen, dtype=F64)
    w = torch.randn(Q, I, generator=gen, dtype=F64)
    keys = torch.randn(P, D, generator=gen, dtype=F64)
    pool_end = torch.arange(P) * kp + kp - 1
    doc = (torch.arange(Q + 20) >= 30).long()  # two documents
    q_pos = torch.arange(Q) + 7
    sel, ok = indexer_scoring.select_pools(q, w, keys, pool_end, doc[pool_end], q_pos, doc[q_pos], 5, 0.3,
                                           query_chunk=4)
    # brute force: every pool scored, the same tie rule
    scores = (torch.einsum("qid,pd->qip", q, keys) * 0.3).relu()
    index = torch.einsum("qi,qip->qp", w, scores)
    valid = (pool_end[None] <= q_pos[:, None]) & (doc[pool_end][None] == doc[q_pos][:, None])
    top = indexer_scoring.topk_lowest_index_ties(index.masked_fill(~valid, torch.finfo(F64).min), 5)
    assert _valid_sets(sel, ok) == _valid_sets(top, valid.gather(-1, top))
    assert (sel.diff(dim=-1) > 0).all()
    assert ok.any() and not ok.all()  # both kinds of rows are exercised


def test_indexer_query_chunk_attribute_bounds_scoring(monkeypatch):
    spec = get_preset("glm5-flash-tiny").replace(index_topk=8, index_kpool=4)
    torch.manual_seed(1)
    layer = MLASparseAttention(spec, layer_idx=3).double()
    x = torch.randn(1, 61, spec.hidden_size, dtype=F64)
    q_resid = torch.randn(1, 61, spec.q_lora_rank, dtype=F64)
    whole = layer.indexer(x, q_resid, SeqContext())
    sizes = []
    real = indexer_scoring.select_pools
    layer.indexer.query_chunk = 9  # what the family's parallelize sets from the plan
    with dispatch.override("indexer_topk", "torch_fp32", lambda q, *a, **k: sizes.append(len(q)) or real(q, *a, **k)):
        assert torch.equal(layer.indexer(x, q_resid, SeqContext()), whole)
    assert max(sizes) == 9 and sum(sizes) == 61


@pytest.mark.parametrize("docs", [False, True])
def test_indexer_hands_the_op_a_count_of_visible_pools(docs):
    """The count the indexer hands op ``indexer_topk`` (``visible``, so a chunk reads nothing back) is at least
    the pools ending at or before each chunk's last query, and exactly that for one document."""
    spec = get_preset("glm5-flash-tiny").replace(index_topk=8, index_kpool=4)
    torch.manual_seed(1)
    layer = MLASparseAttention(spec, layer_idx=3).double()
    x = torch.randn(1, 61, spec.hidden_size, dtype=F64)
    q_resid = torch.randn(1, 61, spec.q_lora_rank, dtype=F64)
    ctx = SeqContext(doc_ids=(torch.arange(61) >= 23).long()[None]) if docs else SeqContext()
    calls = []
    real = indexer_scoring.select_pools

    def counting(q, w, keys, ends, pdoc, q_pos, *a, visible=None, **k):
        calls.append((visible, int((ends <= q_pos.max()).sum())))
        return real(q, w, keys, ends, pdoc, q_pos, *a, visible=visible, **k)

    layer.indexer.query_chunk = 9
    with dispatch.override("indexer_topk", "torch_fp32", counting):
        layer.indexer(x, q_resid, ctx)
    assert len(calls) == 7
    assert all(v >= n for v, n in calls) and (docs or all(v == n for v, n in calls)), calls
    assert not docs or any(v > n for v, n in calls)  # a document's partial pool: more than the exact count


def test_default_scoring_chunk_is_bounded(monkeypatch):
    P, I, K = (1 << 20) // 16, 32, 128  # 1M tokens, 16-token pools
    chunk = indexer_scoring.resolve_query_chunk(None, P, I, K)
    assert 1 <= chunk and indexer_scoring.indexer_scoring_bytes(chunk, P, I, K) <= indexer_scoring.SCORING_BUDGET_BYTES
    assert indexer_scoring.resolve_query_chunk(7, P, I, K) == 7  # an explicit chunk wins
