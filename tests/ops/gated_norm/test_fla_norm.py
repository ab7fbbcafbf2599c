"""Op ``gated_rms_norm`` (KDA's gated output norm): fla's fused kernel (``ops/gated_norm/fla.py``) against the reference
(``models/common/kda.py``, HF's order of ops).

On the CPU: the KDA block's norm runs through the dispatcher, the reference equals the formula in float64, and
the fla kernel declines CPU tensors, float64 and mixed dtypes (the fast set then runs the reference). The
``gpu`` tests compare fla with the reference at glm5-flash-1gpu's KDA shapes and on an odd shape, values and
the gradients of x, the gate and the weight, in bf16 and fp32; a swish gate in place of the sigmoid fails.
"""

from __future__ import annotations

import pytest
import torch

from megaseq.models.common import kda
from megaseq.ops import dispatch, kernels
from megaseq.ops.gated_norm import fla as fla_norm
from megaseq.ops.gated_norm import reference as gated_norm_ref
from numerics import assert_close

F64, F32, BF16 = torch.float64, torch.float32, torch.bfloat16
TOL = {F32: (2e-5, 2e-5), BF16: (1.6e-2, 3e-2)}  # (output, gradients) of the largest reference value


def _inputs(shape, dtype, device="cpu", seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(*shape, generator=gen) * 2).to(device, dtype).requires_grad_()
    gate = torch.randn(*shape, generator=gen).to(device, dtype).requires_grad_()
    w = (1 + 0.1 * torch.randn(shape[-1], generator=gen)).to(device, dtype).requires_grad_()
    return x, gate, w


def test_the_reference_is_the_formula_in_float64():
    x, gate, w = _inputs((2, 5, 3, 16), F64)
    want = w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * torch.sigmoid(gate)
    assert_close("gated norm", gated_norm_ref.gated_rms_norm_reference(x, gate, w, 1e-6), want, 1e-14)


def test_the_kda_norm_runs_through_the_dispatcher():
    norm = kda.GatedRMSNorm(16, 1e-6, "layers.0.self_attn.o_norm").double()
    x, gate, _ = _inputs((2, 5, 3, 16), F64)
    dispatch.reset_records()
    with dispatch.configured(kernels.preferred_kernels("cuda", "fast")):  # CPU tensors: fla declines
        y = norm(x, gate)
    (layer, rec), = [(lay, r) for lay, r in dispatch.records() if r.op == "gated_rms_norm"]
    assert layer == "layers.0.self_attn.o_norm" and rec.impl == "torch" and "fla: dtypes" in rec.reason, rec
    assert_close("norm", y, gated_norm_ref.gated_rms_norm_reference(x, gate, norm.weight, 1e-6), 0.0)


def test_fla_declines_what_it_cannot_run():
    x, gate, w = _inputs((2, 5, 16), F32)
    assert fla_norm.gated_rms_norm_fla_supports(x, gate, w, 1e-6).startswith("device cpu")
    assert "float64" in fla_norm.gated_rms_norm_fla_supports(x.double(), gate.double(), w.double(), 1e-6)
    assert "gate torch.bfloat16" in fla_norm.gated_rms_norm_fla_supports(x, gate.bfloat16(), w, 1e-6)
    assert "shapes" in fla_norm.gated_rms_norm_fla_supports(x, gate[..., :8], w, 1e-6)


def _compare(fast, shape, dtype):
    x, gate, w = _inputs(shape, dtype, "cuda")
    out_tol, grad_tol = TOL[dtype]
    got, want = fast(x, gate, w, 1e-6), gated_norm_ref.gated_rms_norm_reference(x, gate, w, 1e-6)
    assert got.dtype == want.dtype == dtype
    assert_close("out", got, want, out_tol)
    g = torch.randn(shape, generator=torch.Generator(device="cuda").manual_seed(5), device="cuda").to(dtype)
    for name, a, b in zip(("x", "gate", "weight"), torch.autograd.grad(got, (x, gate, w), g),
                          torch.autograd.grad(want, (x, gate, w), g)):
        assert a.dtype == b.dtype, name
        assert_close(f"grad {name}", a, b, grad_tol)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("shape", [(1, 4096, 16, 128), (2, 37, 3, 100)])
@pytest.mark.parametrize("dtype", [BF16, F32])
def test_fla_matches_the_reference_on_the_gpu(shape, dtype):
    pytest.importorskip("fla")
    assert fla_norm.gated_rms_norm_fla_supports(*_inputs(shape, dtype, "cuda"), 1e-6) is None
    _compare(fla_norm.gated_rms_norm_fla, shape, dtype)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_swish_gate_fails_the_comparison():
    pytest.importorskip("fla")
    from fla.modules.norm.fused_norm_gate import rms_norm_gated

    def swish(x, gate, w, eps):
        return rms_norm_gated(x, gate, w, None, activation="swish", eps=eps)

    with pytest.raises(AssertionError):
        _compare(swish, (1, 4096, 16, 128), F32)
