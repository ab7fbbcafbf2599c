"""Op ``rms_norm`` in Triton (``ops/rms_norm/fused.py``) against its reference (``ops/rms_norm/reference.py``).

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
from glue_checks import assert_supported, compare  # noqa: E402
from megaseq.ops.rms_norm import fused as rms  # noqa: E402
from megaseq.ops.rms_norm import reference as blocks_norm  # noqa: E402

torch.set_num_threads(1)


# ---- rms_norm -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype,wdtype", [(F32, F32), (F16, F16), (F16, F32)])
@pytest.mark.parametrize("H", [24, 300])
def test_rms_norm_matches_reference(H, dtype, wdtype):
    gen = torch.Generator().manual_seed(11)
    x = (torch.randn(2, 37, H, generator=gen) * 2).to(dtype).to(DEV).requires_grad_()
    w = (1 + 0.1 * torch.randn(H, generator=gen)).to(wdtype).to(DEV).requires_grad_()
    assert_supported(rms.rms_norm_triton_supports(x, w, 1e-6))
    compare("rms_norm", rms.rms_norm_triton, blocks_norm.rms_norm_reference, (x, w, 1e-6), dtype)


# ---- GPU: bf16 and fp32 at the glm5-flash-1gpu shapes ---------------------------------------------------
@pytest.mark.gpu
@GPU
@pytest.mark.parametrize("dtype", [BF16, F32])
def test_rms_norm_on_gpu(dtype):
    S, H = 32768, 2048
    for R in (S, 4 * S):
        x = torch.randn(R, H, device="cuda", dtype=dtype, requires_grad=True)
        w = (1 + 0.1 * torch.randn(H, device="cuda")).to(dtype).requires_grad_()
        compare("rms_norm", rms.rms_norm_triton, blocks_norm.rms_norm_reference, (x, w, 1e-6), dtype)
