"""The references of ops ``swiglu`` (Qwen3's SwiGLU with GLM's optional clamp) and ``clamped_swiglu``
(gpt-oss's experts)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float | None) -> torch.Tensor:
    """``silu(gate) * up`` with GLM's clamp when ``limit`` is set (shared with the routed experts); op
    ``swiglu``'s reference (the fused one: ``megaseq.ops.swiglu.fused``)."""
    if limit is not None:
        gate = gate.clamp(max=limit)
        up = up.clamp(min=-limit, max=limit)
    return F.silu(gate) * up


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float | None) -> torch.Tensor:
    """gpt-oss's experts (``GptOssExperts._apply_gate``): ``(up + 1) * g * sigmoid(alpha * g)`` with the gate
    clamped from above at ``limit`` and ``up`` into ``[-limit, limit]``."""
    if limit is not None:
        gate = gate.clamp(max=limit)
        up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))
