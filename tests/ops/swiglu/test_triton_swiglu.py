"""Op ``swiglu`` in Triton (``ops/swiglu/fused.py``) against its reference (``ops/swiglu/reference.py``), with
GLM's clamp; and the dispatcher's choice of the glue kernels.

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
from megaseq.ops.swiglu import fused as swi  # noqa: E402
from megaseq.ops.swiglu import reference as blocks_mlp  # noqa: E402
from numerics import assert_close  # noqa: E402

torch.set_num_threads(1)


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
    assert_close("swiglu grad", *(grads(o, [gu])[0] for o in (fo, ro)), TOL[dtype][1])


def test_swiglu_broken_clamp_mask_fails(monkeypatch):
    """A backward that forgets the clamps' zero gradient (HAS_LIMIT off) is caught."""
    K = _triton_util.kernels("swiglu.kernels")
    real = K.swiglu_bwd_kernel

    class NoMask:
        def __getitem__(self, grid):
            return lambda *a, **kw: real[grid](*a, **{**kw, "HAS_LIMIT": False})

    monkeypatch.setattr(K, "swiglu_bwd_kernel", NoMask())
    gu, gate, up = _swiglu_inputs(F32, 1.5)
    with pytest.raises(AssertionError, match="grad"):
        assert_close("swiglu grad", *(grads(f(gate, up, 1.5), [gu])[0]
                                      for f in (swi.swiglu_triton, blocks_mlp.swiglu)), TOL[F32][1])


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
def test_swiglu_on_gpu(dtype):
    S = 32768
    for R, I in ((S, 6144), (S * 8, 1024)):
        gen = torch.Generator().manual_seed(R)
        gu = (torch.randn(R, 2 * I, generator=gen) * 4).to(dtype).cuda().requires_grad_()
        compare("swiglu", swi.swiglu_triton, blocks_mlp.swiglu, (*gu.chunk(2, -1), 10.0), dtype)
