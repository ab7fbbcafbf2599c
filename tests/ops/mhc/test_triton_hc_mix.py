"""Op ``hc_mix`` in Triton (``ops/mhc/mix_triton.py``) against the reference (HF's order of ops, float64).

Without a GPU the kernels run under Triton's interpreter (``TRITON_INTERPRET=1``, conftest.py), in fp32 and
fp16 streams (the interpreter's bf16 is broken) with an fp32 ``fn``, on odd shapes: N = 4 (M = 24, padded to
32) and N = 3 (M = 15, padded to 16), H = 37 and 300 (D = 148 and 1200: partial column blocks), 2 x 37 tokens,
and 2,500 tokens (three backward row chunks, the last partial). With a GPU the same tests run on it and the
``gpu`` tests add glm5-flash-1gpu's shapes in bf16.

The kernel computes in float32 whatever the streams' dtype, so its values and gradients are compared with the
reference in float64 on the same (rounded) inputs: fp32 outputs to 2e-5 of the largest value (another order of
summation), fp16 stream gradients to 2e-3 (one fp16 rounding of each element). A backward without the
RMS scale's term fails.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")  # on the CPU under the interpreter conftest.py selects

from devices import BF16, DEV, F16, F32  # noqa: E402
from megaseq.ops import dispatch, kernels  # noqa: E402
from megaseq.ops.mhc import mix_triton as thm  # noqa: E402
from megaseq.ops.mhc import reference as mhc  # noqa: E402
from numerics import assert_close  # noqa: E402

torch.set_num_threads(1)
TOL = {F32: 2e-5, F16: 2e-3, BF16: 1.6e-2}  # of the stream gradient (the kernel rounds it to the stream's dtype)


def _inputs(N: int, H: int, B: int = 2, S: int = 37, dtype=F32, seed: int = 0, device: str = DEV):
    gen = torch.Generator().manual_seed(seed)
    h = (torch.randn(B, S, N, H, generator=gen) * 3 + 0.5).to(device, dtype).requires_grad_()
    fn = (torch.randn((2 + N) * N, N * H, generator=gen) * 0.02).to(device).requires_grad_()
    return h, fn


def _grads(impl, h, fn, seed: int = 3, autocast=None):
    with torch.autocast(h.device.type, dtype=autocast or torch.bfloat16, enabled=autocast is not None):
        mix = impl(h, fn, 1e-6)
    g = torch.randn(mix.shape, generator=torch.Generator().manual_seed(seed)).to(mix.device, mix.dtype)
    want = [t for t in (h, fn) if t.requires_grad]
    return mix, *torch.autograd.grad(mix, want, g), g


def _exact(h, fn, g):
    """The reference in float64 on the same inputs: mix and the gradients of ``sum(mix * g)``."""
    h64 = h.detach().double().requires_grad_(h.requires_grad)
    fn64 = fn.detach().double().requires_grad_(fn.requires_grad)
    mix = mhc.hc_mix_reference(h64, fn64, 1e-6)
    want = [t for t in (h64, fn64) if t.requires_grad]
    return mix, *torch.autograd.grad(mix, want, g.double())


@pytest.mark.parametrize("N,H", [(4, 37), (3, 300)])
@pytest.mark.parametrize("dtype", [F32, F16])
def test_matches_the_reference_in_float64(N, H, dtype):
    h, fn = _inputs(N, H, dtype=dtype)
    if DEV == "cuda":
        assert thm.hc_mix_triton_supports(h, fn, 1e-6) is None
    mix, gh, gfn, g = _grads(thm.hc_mix_triton, h, fn)
    want = _exact(h, fn, g)
    assert mix.dtype == F32 and gh.dtype == dtype and gfn.dtype == F32
    assert_close("mix", mix, want[0], 2e-5)
    assert_close("grad h", gh, want[1], TOL[dtype])
    assert_close("grad fn", gfn, want[2], 2e-5)


def test_several_row_chunks_and_frozen_or_constant_inputs():
    """2,500 tokens: three backward chunks of 1,024 rows, whose fn partial sums add up; an fn that does not
    train (no partials) and streams that need no gradient (no stream gradient written)."""
    h, fn = _inputs(4, 8, B=1, S=2500)
    assert thm.chunk_rows(2500, 128) == 1024
    mix, gh, gfn, g = _grads(thm.hc_mix_triton, h, fn)
    want = _exact(h, fn, g)
    assert_close("grad h", gh, want[1], 2e-5)
    assert_close("grad fn", gfn, want[2], 2e-5)
    frozen = fn.detach()
    _, gh_only, _ = _grads(thm.hc_mix_triton, h, frozen)
    assert_close("grad h, fn frozen", gh_only, want[1], 2e-5)
    _, gfn_only, _ = _grads(thm.hc_mix_triton, h.detach(), fn)
    assert_close("grad fn, h constant", gfn_only, want[2], 2e-5)


def test_bf16_autocast_returns_the_reference_dtype():
    """Under autocast (fp32 weights) the reference's GEMM is bf16: the kernel returns bf16 too, computed in
    fp32, so it is within bf16 rounding of the reference and closer to the exact value."""
    h, fn = _inputs(4, 37)
    mix, gh, gfn, g = _grads(thm.hc_mix_triton, h, fn, autocast=BF16)
    ref = _grads(mhc.hc_mix_reference, h, fn, autocast=BF16)
    exact = _exact(h, fn, g.float())
    assert mix.dtype == ref[0].dtype == BF16 and gh.dtype == F32
    for name, a, b, e in zip(("mix", "grad h", "grad fn"), (mix, gh, gfn), ref[:3], exact):
        assert_close(name, a, b, 1.6e-2)
        if name != "mix":  # fp32 gradients (the interpreter does not round a bf16 store to nearest)
            assert (a.double() - e).abs().max() <= (b.double() - e).abs().max(), name


def test_backward_without_the_scale_term_fails(monkeypatch):
    """The deliberately broken backward (the gradient through the RMS scale left out) is caught."""
    h, fn = _inputs(4, 37)
    monkeypatch.setattr(thm, "scale_grad_coef", lambda g, u, r, D: torch.zeros_like(r))
    mix, gh, gfn, g = _grads(thm.hc_mix_triton, h, fn)
    want = _exact(h, fn, g)
    assert_close("mix", mix, want[0], 2e-5)  # the forward is untouched
    with pytest.raises(AssertionError):
        assert_close("grad h", gh, want[1], 1e-3)


def test_declines_float64_and_cpu_tensors():
    h, fn = _inputs(4, 8, dtype=torch.float64)
    assert "float64 runs the reference" in thm.hc_mix_triton_supports(h, fn.double(), 1e-6)
    h, fn = _inputs(4, 8, device="cpu")
    assert "cuda" in thm.hc_mix_triton_supports(h, fn, 1e-6)


def test_the_fast_set_tries_the_closed_form_op_where_the_kernel_declines():
    """float64 streams: triton declines, torch_fused runs (before the reference)."""
    h, fn = _inputs(4, 8, dtype=torch.float64, device="cpu")
    dispatch.reset_records()
    with dispatch.configured(kernels.preferred_kernels("cuda", "fast")):
        dispatch.call("hc_mix", h, fn.double(), 1e-6, layer="hc")
    (rec,) = [r for _, r in dispatch.records() if r.op == "hc_mix"]
    assert rec.impl == "torch_fused" and rec.reason.startswith("triton: dtypes"), rec


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_the_gpu_at_glm5_flash_1gpu_shapes():
    """4 streams of 2048, 4K tokens: bf16 streams with an fp32 fn (bf16 weights: an fp32 GEMM) against the
    reference in float64 and in fp32 (its own error beside the kernel's); fp32 streams under bf16 autocast."""
    h, fn = _inputs(4, 2048, B=1, S=4096, dtype=BF16, device="cuda")
    mix, gh, gfn, g = _grads(thm.hc_mix_triton, h, fn)
    exact = _exact(h, fn, g)
    ref = _grads(mhc.hc_mix_reference, h, fn)
    assert_close("mix", mix, exact[0], 2e-5)
    assert_close("grad h", gh, exact[1], 1.6e-2)
    assert_close("grad fn", gfn, exact[2], 2e-5)
    # within 8x the reference's own fp32 error (cuBLAS's; a tf32 or bf16 GEMM would be 100x-1000x): the H200
    # measured the kernel's mix at 4.7x (2.7e-5 of 7.1, 3.8e-6 relative), where the CPU interpreter's is 1.0x
    for a, b, e in zip((mix, gh, gfn), ref[:3], exact):
        assert (a.double() - e).abs().max() <= 8 * (b.double() - e).abs().max() + 1e-9
    h32 = h.detach().float().requires_grad_()
    got, want = _grads(thm.hc_mix_triton, h32, fn, autocast=BF16), _grads(mhc.hc_mix_reference, h32, fn, autocast=BF16)
    for name, a, b in zip(("mix", "grad h", "grad fn"), got[:3], want[:3]):
        assert_close(f"autocast {name}", a, b, 1.6e-2)


def test_the_bf16_pieces_of_a_float32_weight_add_up_to_it():
    w = torch.randn(24, 1000, generator=torch.Generator().manual_seed(0)) * 0.02
    parts = thm.split_bf16x3(w)
    assert parts.dtype == BF16 and parts.shape == (3, 24, 1000)
    assert ((parts.double().sum(0) - w.double()).abs() <= 2**-24 * w.double().abs()).all()  # fp32's own rounding
    assert (parts[0].double() - w.double()).abs().max() > 1e-5  # one bf16 piece alone is not enough
