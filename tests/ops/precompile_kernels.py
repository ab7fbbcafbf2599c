"""Triton kernels at module level, for ``test_precompile``: a manifest names them by module and qualname, so
they must be importable by name. Imports Triton: imported by the tests that have it."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def add_constant(x_ptr, n, C: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=mask) + C, mask=mask)


@triton.autotune(configs=[triton.Config({"BLOCK": 128}), triton.Config({"BLOCK": 256})], key=["n"])
@triton.heuristics({"C": lambda args: 1})
@triton.jit
def tuned_add(x_ptr, n, C: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=mask) + C, mask=mask)


def use_stand_in_driver() -> None:
    """Make Triton's active driver device 0 of an sm_90 GPU, for compiling only (no GPU needed): a process that
    compiles real kernels for ``cuda:90`` without launching them."""
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver

    class StandInDriver:
        def get_current_device(self):
            return 0

        def set_current_device(self, device):
            pass

        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

        def get_current_stream(self, device):
            return 0

    driver.set_active(StandInDriver())
