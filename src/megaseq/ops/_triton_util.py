"""What every Triton glue op shares: whether a kernel can run on a tensor, and a small launch-config table.

Triton kernels run on CUDA tensors, or on CPU tensors under Triton's interpreter (``TRITON_INTERPRET=1``
set before Triton is imported: the CPU tests). The kernel modules themselves (``_*_kernels.py``) import
Triton at their top and are imported lazily by the ops, so megaseq imports without Triton.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from types import ModuleType

import torch


def interpreting() -> bool:
    """Triton's CPU interpreter is on (the CPU tests set it before importing Triton)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def triton_supports(*tensors: torch.Tensor) -> str | None:
    """None when Triton kernels can run on these tensors (CUDA, or any device under the interpreter)."""
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed"
    for x in tensors:
        if x.device.type != "cuda" and not interpreting():
            return f"device {x.device.type} (Triton kernels need cuda, or TRITON_INTERPRET=1)"
        if interpreting() and x.dtype == torch.bfloat16:
            return "bfloat16 under Triton's interpreter (its numpy bf16 is broken)"
    devices = {x.device for x in tensors}
    if len(devices) > 1:
        return f"tensors on several devices {sorted(map(str, devices))}"
    return None


def kernels(name: str) -> ModuleType:
    """The kernel module ``megaseq.ops.<name>`` (imported on first use: it imports Triton)."""
    return importlib.import_module(f"megaseq.ops.{name}")


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())
