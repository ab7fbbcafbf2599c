"""Autocast state capture for recomputation.

A backward runs outside the forward's ``torch.autocast`` region, so every scheme that recomputes a
forward in backward (tiling, full-layer recompute, token-tiled layers) must re-enter the autocast
state the forward saw, as ``torch.utils.checkpoint`` does; otherwise a bf16 run recomputes in fp32:
gradients of a different forward, more memory, and fast kernels that refuse fp32 inputs.
"""

from __future__ import annotations

import contextlib

import torch

AutocastState = tuple[tuple[str, bool, torch.dtype], ...]


def autocast_state() -> AutocastState:
    """Whether autocast is on, and at which dtype, for the CPU and CUDA."""
    return tuple((d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in ("cpu", "cuda"))


def autocast_as(state: AutocastState) -> contextlib.ExitStack:
    """A context that restores ``state`` (enter it around the recomputation)."""
    stack = contextlib.ExitStack()
    for dev, enabled, dtype in state:
        stack.enter_context(torch.autocast(dev, dtype=dtype, enabled=enabled))
    return stack


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype HF computes "in float32" in: float32 for bf16/fp16/fp32 inputs, float64 for float64 ones
    (so the float64 parity tests stay exact)."""
    return torch.promote_types(dtype, torch.float32)


def lowered(t: torch.Tensor) -> torch.dtype:
    """The dtype an autocast-eligible matmul or attention would read ``t`` in: the autocast dtype where autocast
    is on for ``t``'s device and ``t`` is a wider float, else ``t``'s own dtype."""
    dev = t.device.type
    if t.is_floating_point() and torch.is_autocast_enabled(dev):
        low = torch.get_autocast_dtype(dev)
        if t.dtype.itemsize > low.itemsize:
            return low
    return t.dtype
