"""Op ``hc_mix`` (mHC's normalised-streams projection): the fused implementation (``ops/mhc/mix_fused.py``, the RMS
scale applied after the GEMM, its gradient in closed form) against the reference (HF's order of ops).

Pure torch, so it runs on the CPU: float64 to 1e-12 (values, the streams' and ``fn``'s gradients), float32
to rounding, bf16 autocast to bf16 rounding; a whole glm5 model with the fused op against the reference in
float64; a backward without the scale's gradient term fails. The ``gpu`` test is the same at
glm5-flash-1gpu's shapes under CUDA autocast.
"""

from __future__ import annotations

import pytest
import torch

from megaseq.ops import dispatch
from megaseq.ops.mhc import mix_fused as fused
from megaseq.ops.mhc import reference as mhc
from numerics import rel_err

F64, F32, BF16 = torch.float64, torch.float32, torch.bfloat16


def _inputs(dtype, B=2, S=19, N=4, H=40, device="cpu", seed=0):
    gen = torch.Generator().manual_seed(seed)
    h = (torch.randn(B, S, N, H, generator=gen) * 3 + 0.5).to(device, dtype).requires_grad_()
    fn = (torch.randn((2 + N) * N, N * H, generator=gen) * 0.02).to(device, F32 if dtype == BF16 else dtype)
    return h, fn.requires_grad_()


def _run(impl, h, fn, autocast=None, seed=3):
    with torch.autocast(h.device.type, dtype=autocast, enabled=autocast is not None):
        mix = impl(h, fn, 1e-6)
    g = torch.randn(mix.shape, generator=torch.Generator().manual_seed(seed)).to(mix.device, mix.dtype)
    return (mix, *torch.autograd.grad(mix, [h, fn], g))


@pytest.mark.parametrize("dtype,tol", [(F64, 1e-12), (F32, 2e-5)])
def test_fused_matches_reference(dtype, tol):
    h, fn = _inputs(dtype)
    got, want = _run(fused.hc_mix_fused, h, fn), _run(mhc.hc_mix_reference, h, fn)
    for name, a, b in zip(("mix", "grad h", "grad fn"), got, want):
        assert a.dtype == b.dtype, (name, a.dtype, b.dtype)
        assert rel_err(a, b) <= tol, (name, rel_err(a, b))


def test_fused_matches_reference_under_bf16_autocast():
    """bf16 operands of the GEMM: the stream rounded before the scale instead of after (same relative
    rounding); fp32 streams and a bf16 stream."""
    for stream in (F32, BF16):
        h, fn = _inputs(stream, seed=1)
        got, want = _run(fused.hc_mix_fused, h, fn, BF16), _run(mhc.hc_mix_reference, h, fn, BF16)
        for name, a, b in zip(("mix", "grad h", "grad fn"), got, want):
            assert a.dtype == b.dtype, (name, a.dtype, b.dtype)
            assert rel_err(a, b) <= 1.5e-2, (stream, name, rel_err(a, b))  # measured 0.4-0.5%


def test_backward_without_the_scale_term_fails(monkeypatch):
    """The deliberately broken backward (the gradient through the RMS scale left out) is caught."""
    h, fn = _inputs(F64)
    want = _run(mhc.hc_mix_reference, h, fn)
    monkeypatch.setattr(fused.torch, "addcmul", lambda x, a, b: x)
    got = _run(fused.hc_mix_fused, h, fn)
    assert rel_err(got[0], want[0]) <= 1e-12  # the forward is untouched
    assert rel_err(got[1], want[1]) > 1e-3


def test_a_glm5_model_with_the_fused_op_matches_the_reference():
    """Every parameter's gradient of a tiny glm5 (mHC x4) in float64, fused vs reference hc_mix."""
    from megaseq.models.build import build_model
    from megaseq.models.presets import get_preset

    model = build_model(get_preset("glm5-flash-tiny"), dtype=F64)
    ids = torch.randint(0, 16, (1, 48), generator=torch.Generator().manual_seed(0))
    grads = {}
    for name, prefer in (("fused", {"hc_mix": ["torch_fused"]}), ("ref", {})):
        model.zero_grad(set_to_none=True)
        dispatch.reset_records()
        with dispatch.configured(prefer, {}, False):
            model(ids).double().pow(2).mean().backward()
        ran = {r.impl for _, r in dispatch.records() if r.op == "hc_mix"}
        assert ran == {"torch_fused" if name == "fused" else "torch"}, ran
        grads[name] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    assert grads["fused"].keys() == grads["ref"].keys()
    for n in grads["ref"]:
        assert rel_err(grads["fused"][n], grads["ref"][n]) <= 1e-10 or grads["ref"][n].abs().max() == 0, n


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fused_matches_reference_on_the_gpu():
    """glm5-flash-1gpu's shapes (4 streams of 2048, 4K tokens), fp32 stream, bf16 autocast."""
    h, fn = _inputs(F32, B=1, S=4096, N=4, H=2048, device="cuda")
    got, want = _run(fused.hc_mix_fused, h, fn, BF16), _run(mhc.hc_mix_reference, h, fn, BF16)
    for name, a, b in zip(("mix", "grad h", "grad fn"), got, want):
        assert rel_err(a, b) <= 1.5e-2, (name, rel_err(a, b))
