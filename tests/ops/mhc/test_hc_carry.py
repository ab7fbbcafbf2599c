"""The streams' gradient carried through the fast hyper-connection kernels (``HyperConnection.carrying``).

A layer uses its streams three times: ``hc_mix`` (the mixing weights), ``hc_collapse`` (the block input) and
``hc_merge`` (the residual). With the Triton kernels, ``carrying`` hands the streams on through ``hc_mix`` and
``hc_collapse`` as views whose gradients those kernels' backwards add into the streams' gradient as they write
it (``ops/mhc/mix_triton.py``, ``ops/mhc/streams_triton.py``), instead of autograd adding three gradients.

Checked here against the plain computation in float64 (the references, ``forward`` with the streams as the
residual): the loss and every gradient (streams, ``fn``, ``base``, ``scale``, the block's weight), on odd
shapes (N = 4, H = 37; N = 3, H = 300), fp32 and fp16 streams, under Triton's interpreter on the CPU (on the
GPU when there is one). A backward that drops the carried gradient, in either kernel, fails.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")  # on the CPU under the interpreter conftest.py selects

from devices import DEV, F16, F32  # noqa: E402
from megaseq.models.common import mhc  # noqa: E402
from megaseq.models.spec import ModelSpec  # noqa: E402
from megaseq.ops import dispatch  # noqa: E402
from megaseq.ops.mhc import mix_triton as thm  # noqa: E402
from megaseq.ops.mhc import streams_triton as tms  # noqa: E402
from numerics import assert_close  # noqa: E402

torch.set_num_threads(1)
FAST = {op: ["triton"] for op in ("hc_mix", "hc_weights", "hc_collapse", "hc_merge")}
TOL = {F32: 5e-5, F16: 4e-3}  # of each gradient's largest value (fp16: the kernels round the streams' gradient)


@pytest.fixture(autouse=True)
def _triton_on_the_cpu(monkeypatch):
    """The dispatcher never picks a Triton kernel for CPU tensors (``ops._triton_util.triton_supports``); here,
    under the interpreter, it must: their supports checks see CUDA-less tensors as supported."""
    if DEV == "cpu":
        for op in FAST:
            impl = dispatch.implementations(op)["triton"]
            monkeypatch.setattr(impl, "supports", lambda *a, **k: None)


def _spec(N: int, H: int) -> ModelSpec:
    return ModelSpec(family="glm5_next", vocab_size=8, hidden_size=H, num_layers=1, layer_types=("kda",),
                     mlp_types=("dense",), hc_mult=N, hc_sinkhorn_iters=3, hc_eps=1e-6, rms_norm_eps=1e-6)


def _setup(N: int, H: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    hc = mhc.HyperConnection(_spec(N, H), layer="hc")
    with torch.no_grad():
        hc.fn.copy_(torch.randn(hc.fn.shape, generator=gen) * 0.05)
        hc.base.copy_(torch.randn(hc.base.shape, generator=gen) * 0.3)
        hc.scale.copy_(1 + torch.rand(3, generator=gen))
    h = (torch.randn(2, 37, N, H, generator=gen) * 2 + 0.3).to(dtype)
    w = torch.randn(H, H, generator=gen) / H**0.5
    g = torch.randn(2, 37, N, H, generator=gen)
    return hc, h, w, g


def _run(hc, h, w, g, carry: bool, use_x: bool = True):
    """sum(out * g) for ``out = merge(post, comb, tanh(x @ w), residual)``, and its gradients."""
    h = h.detach().requires_grad_()
    w = w.detach().to(h.dtype).requires_grad_()
    if carry:
        post, comb, x, res = hc.carrying(h)
    else:
        (post, comb, x), res = hc(h), h
    y = torch.tanh(x @ w) if use_x else torch.tanh(w).sum(0).expand_as(x)
    out = hc.merge(post, comb, y.to(h.dtype), res)
    loss = (out.double() * g.to(out.device, torch.float64)).sum()
    params = [h, hc.fn, hc.base, hc.scale, w]
    return loss, res, torch.autograd.grad(loss, params)


def _exact(hc, h, w, g, use_x: bool = True):
    hc64 = mhc.HyperConnection(_spec(hc.hc_mult, h.shape[-1]), layer="hc64").double()
    hc64.load_state_dict({k: v.double() for k, v in hc.state_dict().items()})
    return _run(hc64, h.cpu().double(), w.cpu().double(), g, carry=False, use_x=use_x)


def _check(hc, h, w, g, dtype, use_x: bool = True, carry: bool = True):
    loss64, _, grads64 = _exact(hc, h, w, g, use_x)
    hc = hc.to(DEV)
    with dispatch.configured(preferred=FAST):
        dispatch.reset_records()
        loss, res, grads = _run(hc, h.to(DEV), w.to(DEV), g, carry=carry, use_x=use_x)
        ran = {(r.op, r.impl) for _, r in dispatch.records()}
    assert {("hc_mix", "triton"), ("hc_collapse", "triton"), ("hc_merge", "triton")} <= ran, ran
    if carry:
        assert res.grad_fn is not None and "Collapse" in type(res.grad_fn).__name__  # the carried view, not h
    assert_close("loss", loss.detach().cpu(), loss64.detach(), TOL[dtype])
    for name, got, want in zip(("h", "fn", "base", "scale", "w"), grads, grads64):
        assert_close(name, got.cpu(), want, TOL[dtype])


# on the GPU two of the four cases: each new shape and dtype compiles and autotunes every kernel's configurations
# (minutes for all four on an H200 without a Triton cache)
CASES = [(4, 37, F32), (3, 300, F16)] + ([] if DEV == "cuda" else [(4, 37, F16), (3, 300, F32)])


@pytest.mark.parametrize("N,H,dtype", CASES)
def test_carrying_matches_the_plain_computation_in_float64(N, H, dtype):
    _check(*_setup(N, H, dtype), dtype)


def test_carrying_with_the_block_input_unused():
    """The collapse's output unused (its gradient None): the carried gradient alone goes on."""
    _check(*_setup(4, 37, F32), F32, use_x=False)


def test_forward_leaves_the_carried_views_unused():
    """``forward`` (the tiled layer's path) is ``carrying`` with the views dropped: the merge's residual is h itself,
    autograd adds its gradient, the kernels get none carried."""
    _check(*_setup(4, 37, F32), F32, carry=False)


def test_carrying_off_the_fast_kernels_is_the_plain_computation():
    """The references have no carry variant: ``carrying`` returns the streams themselves."""
    hc, h, w, g = _setup(4, 37, torch.float64)
    _, res, grads = _run(hc.double(), h, w.double(), g, carry=True)
    _, _, plain = _run(hc, h, w.double(), g, carry=False)
    assert res.grad_fn is None  # h itself
    for got, want in zip(grads, plain):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("fn", [tms._Collapse, thm._HcMixTriton], ids=["collapse", "mix"])
def test_dropping_the_carried_gradient_fails(monkeypatch, fn):
    backward = fn.backward

    def dropped(ctx, g_out, g_carried=None):
        return backward(ctx, g_out, None)

    monkeypatch.setattr(fn, "backward", staticmethod(dropped))
    with pytest.raises(AssertionError, match="h: "):
        _check(*_setup(4, 37, F32), F32)
