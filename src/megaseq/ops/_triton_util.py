"""What every Triton glue op shares: whether a kernel can run on a tensor, and a small launch-config table.

Triton kernels run on CUDA tensors, or on CPU tensors under Triton's interpreter (``TRITON_INTERPRET=1``
set before Triton is imported: the CPU tests, which call the kernels directly). The kernel modules
themselves (``<op>/*kernels.py``) import Triton at their top and are imported lazily by the ops, so megaseq
imports without Triton.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from collections.abc import Sequence
from types import ModuleType

import torch


def interpreting() -> bool:
    """Triton's CPU interpreter is on (the CPU tests set it before importing Triton)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def triton_supports(*tensors: torch.Tensor) -> str | None:
    """None when Triton kernels can run on these tensors: CUDA only.

    The dispatcher never picks a Triton kernel for CPU tensors, even under ``TRITON_INTERPRET=1`` (which a
    test module sets for the whole pytest process): the CPU tests call the kernels directly instead, so no
    other test silently runs a model through the slow interpreter.
    """
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed"
    for x in tensors:
        if x.device.type != "cuda":
            return f"device {x.device.type} (Triton kernels need cuda)"
    devices = {x.device for x in tensors}
    if len(devices) > 1:
        return f"tensors on several devices {sorted(map(str, devices))}"
    return None


def interpreted_run_problem(tensors: Sequence[torch.Tensor], names: str, cpu_interpreter: bool) -> str | None:
    """None where a Triton kernel that its tests also run under the interpreter can run on ``tensors``: on cuda,
    or on the cpu under ``TRITON_INTERPRET=1`` for an op whose module-level ``CPU_INTERPRETER`` flag a test set
    (``cpu_interpreter``; never bf16 there: the interpreter computes it wrongly), all on one device, Triton
    installed; else the reason. ``names``: what the tensors are, for that reason."""
    dev = tensors[0].device.type
    if not (dev == "cuda" or (dev == "cpu" and cpu_interpreter and interpreting())):
        return f"device {dev} (needs cuda, or the cpu under TRITON_INTERPRET=1 with CPU_INTERPRETER set)"
    if dev == "cpu" and any(t.dtype == torch.bfloat16 for t in tensors):
        return "bfloat16 on the cpu (Triton's interpreter computes bf16 wrongly)"
    if len({t.device for t in tensors}) != 1:
        return f"{names} are on different devices"
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed"
    return None


def kernels(name: str) -> ModuleType:
    """The kernel module ``megaseq.ops.<name>`` (imported on first use: it imports Triton), with Triton's
    autotuner reading megaseq's tuned tables and the cache directory set (``triton_autotune.install``)."""
    if interpreting():
        _fix_interpreter_index()
    from megaseq.ops.triton_autotune import install

    install()
    return importlib.import_module(f"megaseq.ops.{name}")


def _fix_interpreter_index() -> None:
    """Let the interpreter ``range`` over a scalar tensor (a loop bound computed in the kernel).

    Triton 3.6's interpreter turns a scalar into an int with ``int(ndarray of shape [1])``, which numpy >= 2.3
    refuses ("only 0-dimensional arrays can be converted to Python scalars"); compiled kernels are unaffected.
    """
    import numpy as np
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor
    if getattr(original, "megaseq_fixed", False):
        return

    def patched(tensor, scope) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))

    patched.megaseq_fixed = True
    interpreter._patch_lang_tensor = patched


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())
