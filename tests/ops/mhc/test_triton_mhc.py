"""mHC glue ops in Triton (``ops/mhc/weights_triton.py``, ``ops/mhc/streams_triton.py``: hc_weights, hc_collapse,
hc_merge) against their torch references (``ops/mhc/reference.py``).

Without a GPU the Triton kernels run under Triton's interpreter (``TRITON_INTERPRET=1``, set by conftest.py
before anything imports Triton), in fp32 and fp16 (the interpreter's bf16 is broken), on odd shapes; with a GPU
the same tests run on it, and the ``gpu`` test adds bf16/fp32 at the glm5-flash-1gpu shapes. Tolerances:
``glue_checks``.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")  # on the CPU under the interpreter conftest.py selects

from devices import BF16, DEV, F16, F32, GPU  # noqa: E402
from glue_checks import TOL, assert_supported, compare, grads  # noqa: E402
from megaseq.ops import _triton_util, dispatch  # noqa: E402
from megaseq.ops.mhc import reference as blocks_mhc  # noqa: E402
from megaseq.ops.mhc import streams_triton as streams  # noqa: E402
from megaseq.ops.mhc import weights_triton as mhc  # noqa: E402
from numerics import assert_close  # noqa: E402

torch.set_num_threads(1)


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
    compare("hc_weights", mhc.hc_weights_triton, blocks_mhc.hc_weights_reference, (mix, base, scale, N, iters, 1e-6),
             F32)


@pytest.mark.parametrize("used", [(2,), (0,), (0, 1)])
def test_hc_weights_some_outputs_unused(used):
    """Outputs without a gradient (None in the backward) contribute nothing, as in autograd."""
    mix, base, scale = _hc_inputs(4, seed=1)
    args = (mix, base, scale, 4, 20, 1e-6)
    fo = [mhc.hc_weights_triton(*args)[i] for i in used]
    ro = [blocks_mhc.hc_weights_reference(*args)[i] for i in used]
    for i, (a, b) in enumerate(zip(grads(tuple(fo), [mix, base, scale]), grads(tuple(ro), [mix, base, scale]))):
        assert_close(f"grad {i}", a, b, TOL[F32][1])


def test_hc_weights_backward_one_iteration_short_fails(monkeypatch):
    """The deliberately broken backward (one Sinkhorn pair fewer than the forward) is caught."""
    K = _triton_util.kernels("mhc.weights_kernels")
    real = K.hc_weights_bwd_kernel

    class OneShort:
        def __getitem__(self, grid):
            return lambda *a, **kw: real[grid](*a, **{**kw, "ITERS": kw["ITERS"] - 1})

    monkeypatch.setattr(K, "hc_weights_bwd_kernel", OneShort())
    mix, base, scale = _hc_inputs(4)
    with pytest.raises(AssertionError, match="grad"):
        compare("hc_weights", mhc.hc_weights_triton, blocks_mhc.hc_weights_reference,
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
    compare("hc_collapse", streams.hc_collapse_triton, blocks_mhc.hc_collapse_reference, (pre, h), dtype)


@pytest.mark.parametrize("dtype", [F32, F16])
@pytest.mark.parametrize("N,H", [(4, 24), (3, 300)])
def test_hc_merge_matches_reference(N, H, dtype):
    _, post, comb, h, y = _stream_inputs(N, H, dtype)
    assert_supported(streams.hc_merge_triton_supports(post, comb, y, h))
    compare("hc_merge", streams.hc_merge_triton, blocks_mhc.hc_merge_reference, (post, comb, y, h), dtype)


@pytest.mark.parametrize("N,H", [(4, 24), (3, 300)])
def test_hc_merge_block_output_narrower_than_streams(N, H):
    """fp32 weights under autocast: the block's output y is half precision beside fp32 streams. The kernel takes
    it and matches the reference: fp32 output, y's gradient in y's dtype."""
    _, post, comb, h, _ = _stream_inputs(N, H, F32)
    y = torch.randn(h.shape[:-2] + (H,), generator=torch.Generator().manual_seed(9)).to(F16).to(DEV).requires_grad_()
    assert_supported(streams.hc_merge_triton_supports(post, comb, y, h))
    compare("hc_merge", streams.hc_merge_triton, blocks_mhc.hc_merge_reference, (post, comb, y, h), F16)
    gy = torch.autograd.grad(streams.hc_merge_triton(post, comb, y, h).sum(), y)[0]
    assert gy.dtype == F16
    # the other way round the reference's output would be fp32 while the kernel writes the streams' dtype
    why = streams.hc_merge_triton_supports(post, comb, y.detach().float(), h.detach().half())
    assert why is not None and "wider" in why, why


# ---- GPU: bf16 and fp32 at the glm5-flash-1gpu shapes ---------------------------------------------------
@pytest.mark.gpu
@GPU
@pytest.mark.parametrize("dtype", [BF16, F32])
def test_mhc_glue_ops_on_gpu(dtype):
    S, N, H = 32768, 4, 2048
    mix, base, scale = _hc_inputs(N, B=1, S=S, device="cuda")
    compare("hc_weights", mhc.hc_weights_triton, blocks_mhc.hc_weights_reference, (mix, base, scale, N, 20, 1e-6), F32)
    pre, post, comb, h, y = _stream_inputs(N, H, dtype, B=1, S=S, device="cuda")
    compare("hc_collapse", streams.hc_collapse_triton, blocks_mhc.hc_collapse_reference, (pre, h), dtype)
    compare("hc_merge", streams.hc_merge_triton, blocks_mhc.hc_merge_reference, (post, comb, y, h), dtype)
    if dtype == F32:  # a bf16 block output beside fp32 streams (fp32 weights under autocast)
        y16 = y.detach().to(BF16).requires_grad_()
        compare("hc_merge", streams.hc_merge_triton, blocks_mhc.hc_merge_reference, (post, comb, y16, h), BF16)
