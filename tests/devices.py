"""Where the kernel tests run: the GPU when there is one, else the CPU, where Triton kernels run under the
interpreter that ``conftest.py`` selects before any test module imports Triton."""

from __future__ import annotations

import pytest
import torch

DEV = "cuda" if torch.cuda.is_available() else "cpu"
F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
