"""RMSNorm's default implementation (``rms_norm_torch``: the reference's forward, a backward in row chunks)
against the reference's autograd, and its backward's memory on a GPU."""

from __future__ import annotations

import pytest
import torch

import megaseq.ops.rms_norm.reference as norm
import megaseq.ops.workspace as workspace
from conftest import cuda_backward_peak
from megaseq.models.common.norm import RMSNorm
from megaseq.ops import dispatch
from megaseq.ops.rms_norm.reference import rms_norm_reference, rms_norm_torch

torch.set_num_threads(2)

CASES = [(torch.float32, torch.float32), (torch.bfloat16, torch.float32), (torch.bfloat16, torch.bfloat16)]


def _run(fn, x, w, g, w_trains: bool):
    x = x.clone().requires_grad_()
    w = w.clone().requires_grad_(w_trains)
    y = fn(x, w, 1e-6)
    y.backward(g)
    return y, x.grad, w.grad


def _inputs(x_dtype, w_dtype, shape=(2, 37, 3, 16)):
    gen = torch.Generator().manual_seed(0)
    x = (3 * torch.randn(*shape, generator=gen)).to(x_dtype)
    w = (torch.rand(shape[-1], generator=gen) + 0.5).to(w_dtype)
    g = torch.randn(*shape, generator=gen).to(torch.promote_types(x_dtype, w_dtype))
    return x, w, g


def _close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> bool:
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    return torch.allclose(a.double(), b.double(), rtol=tol, atol=tol * b.double().abs().max().item())


@pytest.mark.parametrize("x_dtype, w_dtype", CASES)
@pytest.mark.parametrize("w_trains", [True, False])
def test_chunked_backward_equals_the_reference(x_dtype, w_dtype, w_trains, monkeypatch) -> None:
    """Forward bitwise the reference's; the input's and the weight's gradients the reference autograd's, with
    chunks of 2 rows and a ragged last one (74 rows x 3 heads)."""
    monkeypatch.setattr(workspace, "NORM_BACKWARD_ELEMENTS", 40)  # 2 rows of 16 per chunk
    x, w, g = _inputs(x_dtype, w_dtype)
    y0, gx0, gw0 = _run(rms_norm_reference, x, w, g, w_trains)
    y1, gx1, gw1 = _run(rms_norm_torch, x, w, g, w_trains)
    assert torch.equal(y0, y1)
    assert gx1.dtype == gx0.dtype and _close(gx1, gx0, x_dtype)
    if w_trains:
        assert gw1.dtype == gw0.dtype and _close(gw1, gw0, x_dtype)
    else:
        assert gw1 is None


def test_a_broken_backward_is_caught(monkeypatch) -> None:
    """The comparison above fails a backward without the mean-projection term (the rstd's own gradient)."""
    x, w, g = _inputs(torch.float32, torch.float32)
    _, gx0, _ = _run(rms_norm_reference, x, w, g, False)
    monkeypatch.setattr(norm, "_input_grad", lambda x32, rstd, dxhat: rstd * dxhat)
    _, gx1, _ = _run(rms_norm_torch, x, w, g, False)
    assert not _close(gx1, gx0, torch.float32)


def test_saved_tensors_are_the_references() -> None:
    """The same bytes kept for backward as the reference (the planner's ``norm_saved``): the float32 input, the
    per-row rstd, and the normalised value only where the weight trains."""

    def kept(fn, w_trains: bool) -> int:
        seen: dict[int, int] = {}

        def pack(t):
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        x, w, _ = _inputs(torch.bfloat16, torch.float32)
        x.requires_grad_()
        w.requires_grad_(w_trains)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            fn(x, w, 1e-6)
        return sum(b for p, b in seen.items() if p != w.untyped_storage().data_ptr())

    for w_trains in (True, False):
        assert kept(rms_norm_torch, w_trains) == kept(rms_norm_reference, w_trains)


def test_float64_and_no_grad_run_the_reference() -> None:
    """Float64 (the parity tests) keeps HF's autograd bitwise; no-grad calls have no backward to chunk."""
    x, w, g = _inputs(torch.float64, torch.float64)
    y0, gx0, gw0 = _run(rms_norm_reference, x, w, g, True)
    y1, gx1, gw1 = _run(rms_norm_torch, x, w, g, True)
    assert torch.equal(y0, y1) and torch.equal(gx0, gx1) and torch.equal(gw0, gw1)
    with torch.no_grad():
        assert torch.equal(rms_norm_torch(x, w, 1e-6), rms_norm_reference(x, w, 1e-6))


def test_the_module_runs_the_chunked_norm_by_default() -> None:
    m = RMSNorm(16, layer="test_norm")
    x = torch.randn(4, 16, requires_grad=True)
    dispatch.reset_records()
    m(x).sum().backward()
    ran = {r.impl for layer, r in dispatch.records() if r.op == "rms_norm" and layer == "test_norm"}
    assert ran == {"torch_chunked"}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_backward_memory_is_bounded_on_the_gpu() -> None:
    """bf16 q norm at Qwen3-30B-A3B's heads (32 of 128), 64K tokens: the backward's peak above the saved
    tensors and the incoming gradient is ``ops.workspace.norm_backward_temp`` within 10% (the reference's held
    four to five float32 copies of the input, 9 GiB at 128K on an H200)."""
    S, H, D = 65536, 32, 128
    x = torch.randn(1, S, H, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.ones(D, device="cuda", dtype=torch.bfloat16)
    peaks = {}
    for name, fn in (("chunked", rms_norm_torch), ("reference", rms_norm_reference)):
        y = fn(x, w, 1e-6)
        peaks[name] = cuda_backward_peak(y, torch.randn_like(y))
        x.grad = None
        del y
    planned = workspace.norm_backward_temp(S * H, D, 2)
    assert abs(peaks["chunked"] / planned - 1) < 0.10, (peaks, planned)
    assert peaks["reference"] > 3 * peaks["chunked"]


def test_norm_module_imports_the_workspace_rule() -> None:
    assert norm.norm_backward_rows is workspace.norm_backward_rows


def test_full_precision_norms_keeps_float64_and_changes_nothing_else():
    """HF's float32 statistics by default (a float64 input is down-cast, as in HF); under
    ``full_precision_norms`` a float64 input keeps float64 statistics, in the forward and in the chunked
    backward, and bf16/float32 compute bitwise as before."""
    x, w, g = _inputs(torch.float64, torch.float64)
    with norm.full_precision_norms():
        assert norm._normalise(x, w, 1e-6)[1].dtype == torch.float64
        exact = [_run(fn, x, w, g, True) for fn in (rms_norm_reference, rms_norm_torch)]
    assert norm._normalise(x, w, 1e-6)[1].dtype == torch.float32
    hf = _run(rms_norm_reference, x, w, g, True)
    for a, b in zip(*exact):
        torch.testing.assert_close(a, b, rtol=1e-13, atol=1e-15)
    assert not torch.equal(exact[0][0], hf[0])  # float64 statistics differ from HF's float32 ones
    torch.testing.assert_close(exact[0][0], hf[0], rtol=1e-6, atol=1e-7)
    for x_dtype, w_dtype in CASES:
        xs, ws, gs = _inputs(x_dtype, w_dtype)
        with norm.full_precision_norms():
            inside = _run(rms_norm_torch, xs, ws, gs, True)
        for a, b in zip(inside, _run(rms_norm_torch, xs, ws, gs, True)):
            assert torch.equal(a, b)
