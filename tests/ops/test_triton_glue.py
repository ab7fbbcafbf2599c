"""Fused glue ops (mHC weights, collapse, merge, clamped SwiGLU, RMSNorm) against their torch references.

Without a GPU the Triton kernels run under Triton's interpreter (``TRITON_INTERPRET=1``, set by conftest.py
before anything imports Triton), in fp32 and fp16 (the interpreter's bf16 is broken), on odd shapes: B=2, S=37,
N=4 (and N=3: padded to 4), H=24 and 300 (two column blocks). With a GPU the same tests run on it, and
the ``gpu`` tests add bf16/fp32 at the glm5-flash-1gpu shapes.

Tolerances are relative to the largest reference value. fp32: the kernels sum in another order than torch
(and the exp and rsqrt round differently); the Sinkhorn's 39 divisions are contractive and end within
~3e-7 of the reference (measured), tested at 2e-5. fp16/bf16: outputs round like the reference (often
bit for bit); gradients accumulate in fp32 where autograd rounds each product, a few half ulps apart.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")  # on the CPU under the interpreter conftest.py selects

from devices import BF16, DEV, F16, F32, GPU  # noqa: E402
from megaseq.models.common import mhc as blocks_mhc  # noqa: E402  (the references live in the blocks)
from megaseq.models.common import mlp as blocks_mlp  # noqa: E402
from megaseq.models.common import norm as blocks_norm  # noqa: E402
from megaseq.ops import _triton_util, dispatch  # noqa: E402
from megaseq.ops.mhc import weights_triton as mhc  # noqa: E402
from megaseq.ops.mhc import streams_triton as streams  # noqa: E402
from megaseq.ops.rms_norm import fused as rms  # noqa: E402
from megaseq.ops.swiglu import fused as swi  # noqa: E402
from numerics import assert_close  # noqa: E402

torch.set_num_threads(1)
# (output, gradients) relative tolerance per input dtype
TOL = {F32: (2e-5, 2e-5), F16: (2e-3, 4e-3), BF16: (1.6e-2, 3e-2)}


def assert_supported(why: str | None) -> None:
    """The kernel's ``supports`` accepts the arguments; on the CPU only the device stops the dispatcher."""
    assert why is None if DEV == "cuda" else why.startswith("device cpu"), why


def _grads(out, inputs, seed: int = 7):
    """Gradients of ``sum(out * w)`` for fixed random ``w`` per output (a tuple of outputs or one)."""
    outs = out if isinstance(out, tuple) else (out,)
    gen = torch.Generator(device=outs[0].device).manual_seed(seed)
    loss = sum((o.float() * torch.randn(o.shape, generator=gen, device=o.device)).sum() for o in outs)
    return torch.autograd.grad(loss, inputs)


def _compare(name, fast, ref, inputs, dtype):
    out_tol, grad_tol = TOL[dtype]
    fo, ro = fast(*inputs), ref(*inputs)
    fo, ro = (fo if isinstance(fo, tuple) else (fo,)), (ro if isinstance(ro, tuple) else (ro,))
    for i, (a, b) in enumerate(zip(fo, ro)):
        assert a.dtype == b.dtype, f"{name} output {i}: dtype {a.dtype} vs {b.dtype}"
        assert_close(f"{name} output {i}", a, b, out_tol)
    diff = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
    for i, (a, b) in enumerate(zip(_grads(fo, diff), _grads(ro, diff))):
        assert_close(f"{name} grad {i}", a, b, grad_tol)


# ---- hc_weights -----------------------------------------------------------------------------------------
def _hc_inputs(N: int, B: int = 2, S: int = 37, seed: int = 0, device: str = DEV):
    gen = torch.Generator().manual_seed(seed)
    M = 2 * N + N * N
    mix = torch.randn(B, S, M, generator=gen) * 2
    base = torch.randn(M, generator=gen) * 0.5
    scale = 1 + 0.3 * torch.randn(3, generator=gen)
    return [t.to(device).requires_grad_() for t in (mix, base, scale)]


@pytest.mark.parametrize("iters", [20, 3, 1])
@pytest.mark.parametrize("N", [4, 3])
def test_hc_weights_matches_reference(N, iters):
    mix, base, scale = _hc_inputs(N)
    assert_supported(mhc.hc_weights_triton_supports(mix, base, scale, N, iters, 1e-6))
    _compare("hc_weights", mhc.hc_weights_triton, blocks_mhc.hc_weights_reference, (mix, base, scale, N, iters, 1e-6),
             F32)


@pytest.mark.parametrize("used", [(2,), (0,), (0, 1)])
def test_hc_weights_some_outputs_unused(used):
    """Outputs without a gradient (None in the backward) contribute nothing, as in autograd."""
    mix, base, scale = _hc_inputs(4, seed=1)
    args = (mix, base, scale, 4, 20, 1e-6)
    fo = [mhc.hc_weights_triton(*args)[i] for i in used]
    ro = [blocks_mhc.hc_weights_reference(*args)[i] for i in used]
    for i, (a, b) in enumerate(zip(_grads(tuple(fo), [mix, base, scale]), _grads(tuple(ro), [mix, base, scale]))):
        assert_close(f"grad {i}", a, b, TOL[F32][1])


def test_hc_weights_backward_one_iteration_short_fails(monkeypatch):
    """The deliberately broken backward (one Sinkhorn pair fewer than the forward) is caught."""
    K = _triton_util.kernels("_mhc_weights_kernels")
    real = K.hc_weights_bwd_kernel

    class OneShort:
        def __getitem__(self, grid):
            return lambda *a, **kw: real[grid](*a, **{**kw, "ITERS": kw["ITERS"] - 1})

    monkeypatch.setattr(K, "hc_weights_bwd_kernel", OneShort())
    mix, base, scale = _hc_inputs(4)
    with pytest.raises(AssertionError, match="grad"):
        _compare("hc_weights", mhc.hc_weights_triton, blocks_mhc.hc_weights_reference,
                 (mix, base, scale, 4, 20, 1e-6), F32)


def test_hc_weights_declines_float64():
    mix, base, scale = (t.detach().double() for t in _hc_inputs(4))
    assert "float64" in mhc.hc_weights_triton_supports(mix, base, scale, 4, 20, 1e-6)
    impl = dispatch.select("hc_weights", "test", mix, base, scale, 4, 20, 1e-6)
    assert impl.name == "torch"


# ---- hc_collapse, hc_merge ------------------------------------------------------------------------------
def _stream_inputs(N: int, H: int, dtype, B: int = 2, S: int = 37, seed: int = 3, device: str = DEV):
    gen = torch.Generator().manual_seed(seed)
    pre = torch.rand(B, S, N, generator=gen) + 1e-6
    post = 2 * torch.rand(B, S, N, generator=gen)
    comb = torch.softmax(torch.randn(B, S, N, N, generator=gen), -1)
    h = torch.randn(B, S, N, H, generator=gen).to(dtype)
    y = torch.randn(B, S, H, generator=gen).to(dtype)
    return [t.to(device).requires_grad_() for t in (pre, post, comb, h, y)]


@pytest.mark.parametrize("dtype", [F32, F16])
@pytest.mark.parametrize("N,H", [(4, 24), (3, 300)])
def test_hc_collapse_matches_reference(N, H, dtype):
    pre, _, _, h, _ = _stream_inputs(N, H, dtype)
    assert_supported(streams.hc_collapse_triton_supports(pre, h))
    _compare("hc_collapse", streams.hc_collapse_triton, blocks_mhc.hc_collapse_reference, (pre, h), dtype)


@pytest.mark.parametrize("dtype", [F32, F16])
@pytest.mark.parametrize("N,H", [(4, 24), (3, 300)])
def test_hc_merge_matches_reference(N, H, dtype):
    _, post, comb, h, y = _stream_inputs(N, H, dtype)
    assert_supported(streams.hc_merge_triton_supports(post, comb, y, h))
    _compare("hc_merge", streams.hc_merge_triton, blocks_mhc.hc_merge_reference, (post, comb, y, h), dtype)


@pytest.mark.parametrize("N,H", [(4, 24), (3, 300)])
def test_hc_merge_block_output_narrower_than_streams(N, H):
    """fp32 weights under autocast: the block's output y is half precision beside fp32 streams. The kernel takes
    it (session 10's fast profile ran the reference's batched GEMM for 9 of 16 merges for want of this) and
    matches the reference: fp32 output, y's gradient in y's dtype."""
    _, post, comb, h, _ = _stream_inputs(N, H, F32)
    y = torch.randn(h.shape[:-2] + (H,), generator=torch.Generator().manual_seed(9)).to(F16).to(DEV).requires_grad_()
    assert_supported(streams.hc_merge_triton_supports(post, comb, y, h))
    _compare("hc_merge", streams.hc_merge_triton, blocks_mhc.hc_merge_reference, (post, comb, y, h), F16)
    gy = torch.autograd.grad(streams.hc_merge_triton(post, comb, y, h).sum(), y)[0]
    assert gy.dtype == F16
    # the other way round the reference's output would be fp32 while the kernel writes the streams' dtype
    why = streams.hc_merge_triton_supports(post, comb, y.detach().float(), h.detach().half())
    assert why is not None and "wider" in why, why


# ---- swiglu -----------------------------------------------------------------------------------------------
def _swiglu_inputs(dtype, limit, R: int = 37, I: int = 77, seed: int = 5, device: str = DEV):
    """Gate and up as the two strided halves of one [R, 2I] tensor (the routed experts' layout), with
    values exactly at the clamp bounds (the gradient passes there)."""
    gen = torch.Generator().manual_seed(seed)
    gu = torch.randn(R, 2 * I, generator=gen) * 3
    if limit is not None:
        gu[0, :5], gu[1, I:I + 3], gu[2, I:I + 3] = limit, -limit, limit
    gu = gu.to(dtype).to(device).requires_grad_()
    return gu, *gu.chunk(2, dim=-1)


@pytest.mark.parametrize("dtype", [F32, F16])
@pytest.mark.parametrize("limit", [None, 1.5, 10.0])
def test_swiglu_matches_reference(dtype, limit):
    gu, gate, up = _swiglu_inputs(dtype, limit)
    assert gate.stride(0) == 2 * gate.shape[1]
    assert_supported(swi.swiglu_triton_supports(gate, up, limit))
    fo, ro = swi.swiglu_triton(gate, up, limit), blocks_mlp.swiglu(gate, up, limit)
    assert fo.dtype == ro.dtype == dtype
    assert_close("swiglu", fo, ro, TOL[dtype][0])
    assert_close("swiglu grad", *(_grads(o, [gu])[0] for o in (fo, ro)), TOL[dtype][1])


def test_swiglu_broken_clamp_mask_fails(monkeypatch):
    """A backward that forgets the clamps' zero gradient (HAS_LIMIT off) is caught."""
    K = _triton_util.kernels("_swiglu_kernels")
    real = K.swiglu_bwd_kernel

    class NoMask:
        def __getitem__(self, grid):
            return lambda *a, **kw: real[grid](*a, **{**kw, "HAS_LIMIT": False})

    monkeypatch.setattr(K, "swiglu_bwd_kernel", NoMask())
    gu, gate, up = _swiglu_inputs(F32, 1.5)
    with pytest.raises(AssertionError, match="grad"):
        assert_close("swiglu grad", *(_grads(f(gate, up, 1.5), [gu])[0]
                                      for f in (swi.swiglu_triton, blocks_mlp.swiglu)), TOL[F32][1])


# ---- rms_norm -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype,wdtype", [(F32, F32), (F16, F16), (F16, F32)])
@pytest.mark.parametrize("H", [24, 300])
def test_rms_norm_matches_reference(H, dtype, wdtype):
    gen = torch.Generator().manual_seed(11)
    x = (torch.randn(2, 37, H, generator=gen) * 2).to(dtype).to(DEV).requires_grad_()
    w = (1 + 0.1 * torch.randn(H, generator=gen)).to(wdtype).to(DEV).requires_grad_()
    assert_supported(rms.rms_norm_triton_supports(x, w, 1e-6))
    _compare("rms_norm", rms.rms_norm_triton, blocks_norm.rms_norm_reference, (x, w, 1e-6), dtype)


def test_dispatch_prefers_triton_on_cuda_only():
    """Preferred (``model.kernels fast``), the dispatcher picks the kernels on CUDA, the references elsewhere
    and for float64 (with the reason); by default the references (the kernels are opt-in)."""
    gate = torch.randn(5, 8, device=DEV)
    assert dispatch.select("swiglu", "test", gate, gate, 10.0).name == "torch"
    dispatch.reset_records()
    with dispatch.configured(preferred={"swiglu": ["triton"], "rms_norm": ["triton"]}):
        assert dispatch.select("swiglu", "test", gate, gate, 10.0).name == ("triton" if DEV == "cuda" else "torch")
        # float64 falls back to the default (torch_chunked, which runs the reference itself in float64)
        assert dispatch.select("rms_norm", "test", gate.double(), torch.ones(8, device=DEV, dtype=torch.float64),
                               1e-6).name == "torch_chunked"
    reasons = {rec.op: rec.reason for _, rec in dispatch.records()}
    assert "float64" in reasons["rms_norm"]
    assert DEV == "cuda" or "device cpu" in reasons["swiglu"]


# ---- GPU: bf16 and fp32 at the glm5-flash-1gpu shapes ---------------------------------------------------
@pytest.mark.gpu
@GPU
@pytest.mark.parametrize("dtype", [BF16, F32])
def test_glue_ops_on_gpu(dtype):
    S, N, H = 32768, 4, 2048
    mix, base, scale = _hc_inputs(N, B=1, S=S, device="cuda")
    _compare("hc_weights", mhc.hc_weights_triton, blocks_mhc.hc_weights_reference, (mix, base, scale, N, 20, 1e-6), F32)
    pre, post, comb, h, y = _stream_inputs(N, H, dtype, B=1, S=S, device="cuda")
    _compare("hc_collapse", streams.hc_collapse_triton, blocks_mhc.hc_collapse_reference, (pre, h), dtype)
    _compare("hc_merge", streams.hc_merge_triton, blocks_mhc.hc_merge_reference, (post, comb, y, h), dtype)
    if dtype == F32:  # a bf16 block output beside fp32 streams (fp32 weights under autocast)
        y16 = y.detach().to(BF16).requires_grad_()
        _compare("hc_merge", streams.hc_merge_triton, blocks_mhc.hc_merge_reference, (post, comb, y16, h), BF16)
    for R, I in ((S, 6144), (S * 8, 1024)):
        gen = torch.Generator().manual_seed(R)
        gu = (torch.randn(R, 2 * I, generator=gen) * 4).to(dtype).cuda().requires_grad_()
        _compare("swiglu", swi.swiglu_triton, blocks_mlp.swiglu, (*gu.chunk(2, -1), 10.0), dtype)
    for R in (S, 4 * S):
        x = torch.randn(R, H, device="cuda", dtype=dtype, requires_grad=True)
        w = (1 + 0.1 * torch.randn(H, device="cuda")).to(dtype).requires_grad_()
        _compare("rms_norm", rms.rms_norm_triton, blocks_norm.rms_norm_reference, (x, w, 1e-6), dtype)
