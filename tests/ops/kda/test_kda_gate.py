"""Op ``kda_gate`` (KDA's forget-gate activation): fla's fused kernel (``ops/kda/fla.py: kda_gate_fla``) against the
reference (``ops/kda/reference.py: kda_gate_reference``, HF's order of ops).

On the CPU: the reference is the formula in float64 (the safe gate and the softplus gate, GLM-5's ``[Hh]`` and
Kimi-Linear's ``[1, 1, Hh, 1]`` A_log), the forget gate runs it through the dispatcher under its layer's name, and
fla declines CPU tensors, float64 and mismatched shapes. The ``gpu`` tests compare fla with the reference at
glm5-flash-1gpu's KDA shapes and on an odd one, in bf16 and fp32, both gates: the values and the gradients of
``f``, ``A_log`` and ``dt_bias``; a reference without the ``exp`` of A_log fails the same comparison.
"""

from __future__ import annotations

import pytest
import torch

from devices import GPU
from megaseq.models.common import kda
from megaseq.models.spec import ModelSpec
from megaseq.ops import dispatch, kernels
from megaseq.ops.kda import fla as fla_kda
from megaseq.ops.kda import reference as kda_ref
from numerics import assert_close

F64, F32, BF16 = torch.float64, torch.float32, torch.bfloat16
TOL = {F32: (2e-6, 2e-5), BF16: (2e-6, 1.6e-2)}  # (values, gradients) of the largest reference value


def _inputs(shape, dtype, device="cpu", seed=0, kimi=False):
    gen = torch.Generator().manual_seed(seed)
    Hh, D = shape[-2:]
    f = (torch.randn(*shape, generator=gen) * 3).to(device, dtype).requires_grad_()
    a = torch.randn(Hh, generator=gen).to(device, F32 if dtype != F64 else F64)
    a = (a.view(1, 1, Hh, 1) if kimi else a).requires_grad_()
    bias = torch.randn(Hh * D, generator=gen).to(device, a.dtype).requires_grad_()
    return f, a, bias


@pytest.mark.parametrize("lower_bound", [-5.0, None])
@pytest.mark.parametrize("kimi", [False, True])
def test_the_reference_is_the_formula_in_float64(lower_bound, kimi):
    f, a, bias = _inputs((2, 5, 3, 8), F64, kimi=kimi)
    g = f + bias.view(3, 8)
    rate = a.reshape(3, 1).exp()
    want = lower_bound * torch.sigmoid(rate * g) if lower_bound is not None else -rate * torch.nn.functional.softplus(g)
    assert_close("gate", kda_ref.kda_gate_reference(f, a, bias, lower_bound), want, 1e-14)


def test_the_forget_gate_runs_through_the_dispatcher():
    spec = ModelSpec(family="glm5_next", vocab_size=8, hidden_size=16, num_layers=1, layer_types=("kda",),
                     mlp_types=("dense",), linear_num_heads=2, linear_head_dim=8, linear_lower_bound=-5.0)
    gate = kda.ForgetGate(spec, "layers.0.self_attn.forget_gate").double()
    x = torch.randn(2, 5, 16, dtype=F64)
    dispatch.reset_records()
    with dispatch.configured(kernels.preferred_kernels("cuda", "fast")):  # CPU tensors: fla declines
        g = gate(x)
    (layer, rec), = [(lay, r) for lay, r in dispatch.records() if r.op == "kda_gate"]
    assert layer == "layers.0.self_attn.forget_gate" and rec.impl == "torch" and "fla: dtype" in rec.reason, rec
    f = gate.f_b_proj(gate.f_a_proj(x)).view(2, 5, 2, 8)
    assert_close("gate", g, kda_ref.kda_gate_reference(f, gate.A_log, gate.dt_bias, -5.0), 0.0)


def test_fla_declines_what_it_cannot_run():
    f, a, bias = _inputs((2, 5, 3, 8), F32)
    assert fla_kda.kda_gate_fla_supports(f, a, bias, -5.0).startswith("device cpu")
    assert "float64" in fla_kda.kda_gate_fla_supports(f.double(), a, bias, -5.0)
    assert "A_log" in fla_kda.kda_gate_fla_supports(f, a[:2], bias, -5.0)
    assert "dt_bias" in fla_kda.kda_gate_fla_supports(f, a, bias[:8], None)


def _no_exp_reference(f, a, bias, lower_bound):
    """A broken gate: A_log used as the rate itself."""
    Hh, D = f.shape[-2:]
    g = f.float() + bias.float().view(Hh, D)
    return lower_bound * torch.sigmoid(a.float().view(Hh, 1) * g)


def _compare(reference, shape, dtype, lower_bound, kimi=False):
    f, a, bias = _inputs(shape, dtype, "cuda", kimi=kimi)
    val_tol, grad_tol = TOL[dtype]
    got, want = fla_kda.kda_gate_fla(f, a, bias, lower_bound), reference(f, a, bias, lower_bound)
    assert got.dtype == want.dtype == F32
    assert_close("gate", got, want, val_tol)
    gy = torch.randn(got.shape, generator=torch.Generator().manual_seed(1)).to("cuda")
    for name, x, y in zip(("f", "A_log", "dt_bias"), torch.autograd.grad(got, (f, a, bias), gy),
                          torch.autograd.grad(want, (f, a, bias), gy)):
        assert x.dtype == y.dtype and x.shape == y.shape, name
        assert_close(name, x, y, grad_tol)


@pytest.mark.gpu
@GPU
@pytest.mark.parametrize("dtype", [BF16, F32])
@pytest.mark.parametrize("lower_bound", [-5.0, None])
@pytest.mark.parametrize("shape,kimi", [((1, 32768, 16, 128), False), ((2, 37, 3, 48), True)])
def test_fla_matches_the_reference_on_gpu(dtype, lower_bound, shape, kimi):
    _compare(kda_ref.kda_gate_reference, shape, dtype, lower_bound, kimi)


@pytest.mark.gpu
@GPU
def test_a_gate_without_the_exp_fails_on_gpu():
    with pytest.raises(AssertionError, match="gate"):
        _compare(_no_exp_reference, (2, 37, 3, 48), F32, -5.0)
