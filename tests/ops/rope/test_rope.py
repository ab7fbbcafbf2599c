"""Op ``rope``: the reference against transformers' ``apply_rotary_pos_emb`` (float64), and Liger's fused kernel
(``ops/rope/liger.py``) against the reference.

Without a GPU Liger's kernel runs under Triton's interpreter (``TRITON_INTERPRET=1``, set by conftest.py) in
fp32 where liger-kernel is installed; with a GPU the same tests run on it, and the ``gpu`` test adds bf16 at
Qwen3-30B-A3B's heads (32 query, 4 key heads of 128) and a partial rotation. Tolerances: ``glue_checks``.
"""

from __future__ import annotations

import pytest
import torch

from devices import BF16, DEV, F32, GPU
from glue_checks import TOL, grads
from megaseq.models.common import rope as model_rope
from megaseq.ops import dispatch
from megaseq.ops.rope import reference
from numerics import assert_close


def _inputs(dtype, B=2, S=13, Hq=6, Hk=2, Dh=16, D=16, cos_batch=None, device=DEV, seed=3):
    """q, k ``[B, S, H, Dh]`` (q a strided view, as a gated query is) and cos/sin at packed-document positions."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, S, Hq, 2 * Dh, generator=gen)[..., :Dh].to(dtype).to(device).requires_grad_()
    k = torch.randn(B, S, Hk, Dh, generator=gen).to(dtype).to(device).requires_grad_()
    pos = torch.cat([torch.arange(5), torch.arange(S - 5)]).expand(cos_batch or B, S).to(device)
    freq, factor = model_rope.inv_freq(D, 10000.0, {}, 4096, device)
    cos, sin = model_rope.cos_sin(pos, freq, factor, dtype)
    return q, k, cos, sin


def test_reference_matches_transformers():
    llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    q, k, cos, sin = _inputs(torch.float64, device="cpu")
    hq, hk = llama.apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
    rq, rk = reference.rope_reference(q, k, cos, sin)
    assert torch.equal(rq, hq.transpose(1, 2)) and torch.equal(rk, hk.transpose(1, 2))


def test_partial_rotation_passes_the_rest_through():
    q, k, cos, sin = _inputs(torch.float64, Dh=16, D=8, device="cpu")
    rq, rk = reference.rope_reference(q, k, cos, sin)
    assert torch.equal(rq[..., 8:], q[..., 8:]) and not torch.equal(rq[..., :8], q[..., :8])
    assert torch.equal(rq, model_rope.apply(q, cos.unsqueeze(2), sin.unsqueeze(2)))


def test_dispatch_runs_the_reference_on_the_cpu():
    q, k, cos, sin = _inputs(F32, device="cpu")
    from megaseq.ops.rope import liger

    why = liger.liger_rope_supports(q, k, cos, sin)
    assert why is not None and ("cuda" in why or "not installed" in why)
    assert dispatch.select("rope", "test", q, k, cos, sin).name == "torch"


# ---- Liger's kernel -----------------------------------------------------------------------------------------
pytest.importorskip("triton")


def _liger():
    pytest.importorskip("liger_kernel")
    from megaseq.ops.rope import liger

    return liger


def _check(liger, dtype, **shape):
    q, k, cos, sin = _inputs(dtype, **shape)
    q0, k0 = q.detach().clone(), k.detach().clone()
    fq, fk = liger.rope_liger(q, k, cos, sin)
    rq, rk = reference.rope_reference(q, k, cos, sin)
    out_tol, grad_tol = TOL[dtype]
    assert_close("rope q", fq, rq, out_tol)
    assert_close("rope k", fk, rk, out_tol)
    assert torch.equal(q, q0) and torch.equal(k, k0), "the inputs were written"
    for name, a, b in zip(("dq", "dk"), grads((fq, fk), [q, k]), grads((rq, rk), [q, k])):
        assert_close(f"rope {name}", a, b, grad_tol)


@pytest.mark.parametrize("shape", [{}, {"D": 8}, {"cos_batch": 1}, {"Hq": 5, "Hk": 5, "Dh": 24, "D": 12}])
def test_liger_matches_reference(shape):
    _check(_liger(), F32, **shape)


def test_liger_broken_backward_fails(monkeypatch):
    """A backward that rotates the gradient forward (the sine's sign not flipped) is caught."""
    liger = _liger()
    import liger_kernel.ops.rope as lk

    monkeypatch.setattr(lk, "rope_backward", lambda dq, dk, cos, sin: lk.rope_forward(dq, dk, cos, sin)[:2])
    with pytest.raises(AssertionError, match="rope dq"):
        _check(liger, F32)


def test_liger_leaves_the_incoming_gradient_alone():
    liger = _liger()
    q, k, cos, sin = _inputs(F32)
    fq, fk = liger.rope_liger(q, k, cos, sin)
    gq, gk = torch.randn_like(fq), torch.randn_like(fk)
    gq0 = gq.clone()
    torch.autograd.backward((fq, fk), (gq, gk))
    assert torch.equal(gq, gq0)


@pytest.mark.gpu
@GPU
@pytest.mark.parametrize("dtype", [BF16, F32])
@pytest.mark.parametrize("D", [128, 64])
def test_liger_on_gpu(dtype, D):
    liger = _liger()
    _check(liger, dtype, B=1, S=1031, Hq=32, Hk=4, Dh=128, D=D)
    q, k, cos, sin = _inputs(dtype, B=1, S=64, Hq=32, Hk=4, Dh=128, D=D)
    assert liger.liger_rope_supports(q, k, cos, sin) is None
    assert dispatch.select("rope", "test", q, k, cos, sin).name == "torch"  # opt-in: the fast set prefers it
    with dispatch.configured(preferred={"rope": ["liger"]}):
        assert dispatch.select("rope", "test", q, k, cos, sin).name == "liger"
