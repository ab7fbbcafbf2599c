"""Op ``indexer_target`` given the attention's per-head log-sum-exp (``lse``): the same target as without it, one pass.

Shapes: c queries, Hh heads, C latent width, S keys, W selected slots per query.

The lse comes from op ``sparse_attention`` itself (``return_lse``) over the same queries, latents, selection and scale,
as the objective's layer passes it: ``torch_masked`` and ``absorbed`` in float64 for the reference, ``triton`` (its
saved ``[Hh, N]`` tensor seen as ``[B, Q, Hh]``, a strided view) for the kernel, which runs under Triton's
interpreter in fp32 and fp16 (or on the GPU). Selections in the indexer's layout (pools of 4 and their tails), a
query with no valid slot, a slot past S, more slots than keys. Broken log-sum-exps (the natural base, the heads
permuted) must fail the same comparison, and the one-pass kernel compiles for sm_90.
"""

from __future__ import annotations

import math
import textwrap

import pytest
import torch

from megaseq.models.common.indexer_kl import absorbed_query
from megaseq.ops.indexer import target as tgt
from megaseq.ops.sparse_mla import absorbed, fused
from megaseq.ops.sparse_mla.reference import sparse_mla_reference

torch.set_num_threads(1)
TOL = {torch.float64: 1e-12, torch.float32: 1e-5, torch.float16: 1e-5}  # max |m - m64|, m in [0, Hh]: shared rounding
ATTENTION = {"torch_masked": sparse_mla_reference, "absorbed": absorbed.sparse_mla}


def attention_inputs(seed: int, Q: int, S: int, Hh: int, R: int, kp: int = 4, pools: int = 3, D: int = 16,
                     dtype=torch.float64, device: str = "cpu"):
    """``q [1, Q, Hh, D]``, latents ``[1, S, R]``, the ``kv_b`` weight and ``idx [1, Q, W]`` (the indexer's layout):
    query 1 selects nothing, query 2 has a slot past S."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, Q, Hh, D, generator=gen)
    c = torch.randn(1, S, R, generator=gen)
    w = torch.randn(Hh * 2 * D, R, generator=gen) * R**-0.5
    idx = fused.causal_pool_selection(1, Q, S, kpool=kp, pools=pools, generator=gen)
    idx[0, 1] = -1
    idx[0, 2, 0] = S + 3
    return [t.to(device, dtype) for t in (q, c, w)], idx.to(device)


def target_inputs(q, c, w, idx):
    """What the objective hands the target: ``q_abs [Q, Hh, R]`` (``absorbed_query``), the latents, the selection."""
    Hh, D = q.shape[2:]
    w_uk = w.view(Hh, -1, w.shape[1])[:, :D]
    return absorbed_query(q[0], w_uk, 0), c[0], idx[0]


def attention_lse(impl: str, q, c, w, idx, scale: float) -> torch.Tensor:
    """``[Q, Hh]``: the op's lse; for ``triton`` the fused forward's own (``TritonSparseMLA``: the op would hand a batch
    row with an empty query to ``absorbed``), its saved ``[Hh, N]`` viewed as the op does, +inf on that query."""
    if impl != "triton":
        return ATTENTION[impl](q, c, w, idx, scale, return_lse=True)[1][0]
    _, lse_HN = fused.TritonSparseMLA.apply(q, c, w, idx, scale, "check", True)
    return lse_HN.view(q.shape[2], 1, q.shape[1]).permute(1, 2, 0)[0]


# ---- the reference, float64 --------------------------------------------------------------------------------
@pytest.mark.parametrize("impl", ["torch_masked", "absorbed"])
@pytest.mark.parametrize("Q,S,Hh,R,kp,pools", [(13, 29, 3, 16, 4, 3), (9, 7, 5, 8, 2, 6)])  # the second: W 13 > S 7
def test_reference_with_the_attentions_lse_is_the_target(impl, Q, S, Hh, R, kp, pools):
    args, idx = attention_inputs(0, Q, S, Hh, R, kp, pools)
    lse = attention_lse(impl, *args, idx, 0.37)
    q_abs, lat, sel = target_inputs(*args, idx)
    want = tgt.indexer_target_reference(q_abs, lat, sel, 0.37)
    got = tgt.indexer_target_reference(q_abs, lat, sel, 0.37, lse=lse)
    assert (got[1] == 0).all() and (got[~tgt.selected(sel, S)] == 0).all()
    assert (got - want).abs().max() <= TOL[torch.float64]


BROKEN = {"natural_base": lambda lse: lse / math.log2(math.e), "heads_permuted": lambda lse: lse.roll(1, dims=-1)}


@pytest.mark.parametrize("name", list(BROKEN))
def test_reference_with_a_broken_lse_differs(name):
    args, idx = attention_inputs(1, 13, 29, 3, 16)
    lse = attention_lse("absorbed", *args, idx, 0.37)
    q_abs, lat, sel = target_inputs(*args, idx)
    want = tgt.indexer_target_reference(q_abs, lat, sel, 0.37)
    got = tgt.indexer_target_reference(q_abs, lat, sel, 0.37, lse=BROKEN[name](lse))
    assert (got - want).abs().max() > 1e-2


# ---- the kernel: under the interpreter, or on the GPU -------------------------------------------------------
@pytest.fixture
def device(monkeypatch) -> str:
    pytest.importorskip("triton")
    from triton_compile import interpreter_device

    interpreter_device(monkeypatch, fused)
    return interpreter_device(monkeypatch, tgt)


def check_kernel(args, idx, scale: float, tol: float, config=None, lse_fn=lambda lse: lse) -> torch.Tensor:
    """The kernel with the triton attention's lse against the float64 reference (without one); returns m."""
    from megaseq.ops.indexer import target_kernel as K

    lse = lse_fn(attention_lse("triton", *args, idx, scale))
    q_abs, lat, sel = target_inputs(*args, idx)
    before = lse.clone()
    m, lse_out = K.target(q_abs.contiguous(), lat.contiguous(), sel.contiguous(), scale, config, lse2=lse)
    assert lse_out is lse and torch.equal(lse, before)  # read, not written
    want = tgt.indexer_target_reference(q_abs.double(), lat.double(), sel, scale)
    err = (m.double() - want).abs()
    assert err.max() <= tol, f"max |m - m64| {err.max():.3e} at {divmod(int(err.argmax()), sel.shape[1])}"
    assert (m[~tgt.selected(sel, lat.shape[0])] == 0).all() and (m[1] == 0).all()
    return m


@pytest.mark.parametrize("Q,S,Hh,R,kp,pools,bh", [
    (13, 29, 5, 32, 4, 3, None),   # one head block: the tile and the given lse2 in registers
    (7, 40, 20, 48, 4, 4, 16),     # 20 heads in two blocks of 16: the given lse2 read per block
    (9, 7, 4, 16, 2, 6, None),     # more slots (13) than keys (7)
])
def test_kernel_with_the_attentions_lse_fp32(device, Q, S, Hh, R, kp, pools, bh):
    from megaseq.ops.indexer import target_kernel as K

    args, idx = attention_inputs(2, Q, S, Hh, R, kp, pools, dtype=torch.float32, device=device)
    cfg = None if bh is None else K.Config(bh, 16, 4, 1)
    lse = attention_lse("triton", *args, idx, 0.37)
    assert not lse.is_contiguous()  # the attention's saved [Hh, N], viewed [Q, Hh]
    assert tgt.indexer_target_supports(*target_inputs(*args, idx), 0.37, lse=lse) is None
    check_kernel(args, idx, 0.37, TOL[torch.float32], cfg)


def test_kernel_with_the_attentions_lse_fp16(device):
    args, idx = attention_inputs(3, 11, 30, 6, 32, dtype=torch.float16, device=device)
    check_kernel(args, idx, 0.3, TOL[torch.float16])


@pytest.mark.parametrize("name", list(BROKEN))
@pytest.mark.parametrize("bh", [None, 16])
def test_kernel_with_a_broken_lse_fails(device, name, bh):
    from megaseq.ops.indexer import target_kernel as K

    args, idx = attention_inputs(4, 7, 40, 20, 48, dtype=torch.float32, device=device)
    cfg = None if bh is None else K.Config(bh, 16, 4, 1)
    check_kernel(args, idx, 0.37, TOL[torch.float32], cfg)
    with pytest.raises(AssertionError):
        check_kernel(args, idx, 0.37, TOL[torch.float32], cfg, lse_fn=BROKEN[name])


def test_supports_checks_the_lse(device):
    args, idx = attention_inputs(5, 9, 20, 4, 16, dtype=torch.float32, device=device)
    q_abs, lat, sel = target_inputs(*args, idx)
    lse = torch.zeros(9, 4, device=device)
    assert tgt.indexer_target_supports(q_abs, lat, sel, 0.5, lse=lse) is None
    assert "lse" in tgt.indexer_target_supports(q_abs, lat, sel, 0.5, lse=lse[:, :3])
    assert "lse" in tgt.indexer_target_supports(q_abs, lat, sel, 0.5, lse=lse.double())


COMPILE_SM90 = textwrap.dedent("""
    import torch
    from megaseq.ops.indexer.target_kernel import compile_ptx
    for dtype, Hh, C, W in [(torch.bfloat16, 16, 512, 2063), (torch.bfloat16, 64, 512, 2063),
                            (torch.float32, 16, 512, 2063)]:
        ptx, smem = compile_ptx(dtype, Hh, C, W, has_lse=True)
        assert smem <= 232448, (dtype, Hh, C, smem)
        print(dtype, Hh, "ok", flush=True)
""")


def test_one_pass_kernel_compiles_for_sm90():
    """The kernel reading a given lse compiles for an H200 (one head block and several; fp32)."""
    pytest.importorskip("triton")
    from triton_compile import compile_in_child

    lines = compile_in_child(COMPILE_SM90).splitlines()
    assert len(lines) == 3 and all(line.endswith(" ok") for line in lines), lines


def layer_objective(device: str, preferred: dict[str, list[str]], keep_probs: bool = True):
    """A glm5-shaped DSA layer (pools of 4, 64 tokens, chunks of 16 queries) in fp32 with its sparse-stage objective:
    ``(KL, the indexer's gradients, the lse each chunk's target got)``. ``keep_probs`` False: the attention leaves
    no head-summed probabilities, so the target op runs from its lse."""
    from megaseq.models.common.context import SeqContext
    from megaseq.models.common.mla_dsa import MLASparseAttention
    from megaseq.models.glm5.spec import glm5_flash_tiny
    from megaseq.ops import dispatch

    torch.manual_seed(0)
    m = MLASparseAttention(glm5_flash_tiny().replace(index_kpool=4, index_topk=32, index_n_heads=4), 0).to(device)
    with torch.no_grad():
        for p in m.indexer.parameters():
            p.add_(0.3 * torch.randn_like(p))
    m.indexer.kl_coef, m.indexer.query_chunk = 1.0, 16
    x = torch.randn(1, 64, m.q_a_proj.in_features, device=device)
    seen = []
    impl = (preferred.get("indexer_target") or ["torch_gather"])[0]

    def target(q_abs, c_SC, idx_cW, scale, lse=None):
        seen.append(lse)
        return original(q_abs, c_SC, idx_cW, scale, lse=lse)

    attention = (preferred.get("sparse_attention") or ["absorbed"])[0]
    state = {}

    def attend(*args, head_probs=None, **kw):
        return state["attend"](*args, head_probs=head_probs if keep_probs else None, **kw)

    with dispatch.configured(preferred=preferred), dispatch.override("indexer_target", impl, target) as original, \
            dispatch.override("sparse_attention", attention, attend) as state["attend"]:
        m(x, SeqContext()).sum().backward()
    grads = {n: p.grad.clone() for n, p in m.indexer.named_parameters() if p.grad is not None}
    return m.indexer.stats.read().kl_sum, grads, seen


def test_the_layer_hands_the_triton_attentions_lse_to_the_kernel(device):
    """Where the fused sparse MLA leaves no head-summed probabilities, its lse (a strided view of its saved tensor)
    reaches the one-pass kernel through the layer, chunk by chunk; where it leaves them (the default), the target
    op does not run. Either way the KL and the indexer's gradients equal the reference path's (``torch_masked``
    attention and ``torch_gather`` target, given the reference's lse)."""
    kl_ref, g_ref, seen_ref = layer_objective(device, {"sparse_attention": ["torch_masked"]})
    assert len(seen_ref) == 4 and all(lse is not None for lse in seen_ref)
    fused = {"sparse_attention": ["triton"], "indexer_target": ["triton"]}
    for keep in (False, True):
        kl, g, seen = layer_objective(device, fused, keep_probs=keep)
        if keep:
            assert seen == []  # the target read from the attention's backward
        else:
            assert len(seen) == 4 and all(lse is not None for lse in seen)
            assert seen[0].stride() == (1, 64)  # rows of the saved [Hh, N] lse, N = 64 queries
        assert abs(kl - kl_ref) <= 1e-5 * abs(kl_ref), (keep, kl, kl_ref)
        assert g.keys() == g_ref.keys() and len(g) > 2
        for n in g:
            assert (g[n] - g_ref[n]).abs().max() <= 1e-4 * g_ref[n].abs().max(), (keep, n)
