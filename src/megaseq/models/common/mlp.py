"""SwiGLU MLP: ``down(silu(gate(x)) * up(x))``, with GLM's optional clamp.

Shapes: ``x_SH`` any ``[..., H]``; ``I`` the intermediate size. Token-separable, so ``memory.tiling``
may run it over sequence tiles from outside.

With ``swiglu_limit`` set (GLM-5.3-Flash: 10.0) the gate is clamped from above at the limit and the
up projection into ``[-limit, limit]`` before the product, as ``Glm5NextTextMLP`` does; without it the
MLP is Qwen3's plain SwiGLU. Parameter names mirror HF: ``gate_proj``, ``up_proj``, ``down_proj``. Op
``clamped_swiglu`` is gpt-oss's variant, which its routed experts run.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megaseq.ops import (
    dispatch,
    triton_swiglu,  # noqa: F401  (registers the fused kernel, opt-in)
)


@dispatch.register("swiglu", "torch", reference=True)
def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float | None) -> torch.Tensor:
    """``silu(gate) * up`` with GLM's clamp when ``limit`` is set (shared with the routed experts); op
    ``swiglu``'s reference (the fused one: ``megaseq.ops.triton_swiglu``)."""
    if limit is not None:
        gate = gate.clamp(max=limit)
        up = up.clamp(min=-limit, max=limit)
    return F.silu(gate) * up


@dispatch.register("clamped_swiglu", "torch", reference=True)
def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float | None) -> torch.Tensor:
    """gpt-oss's experts (``GptOssExperts._apply_gate``): ``(up + 1) * g * sigmoid(alpha * g)`` with the gate
    clamped from above at ``limit`` and ``up`` into ``[-limit, limit]``."""
    if limit is not None:
        gate = gate.clamp(max=limit)
        up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


class MLP(nn.Module):
    """Bias-free SwiGLU MLP ``H -> I -> H``."""

    def __init__(self, hidden_size: int, intermediate_size: int, swiglu_limit: float | None = None,
                 layer: str = "mlp") -> None:
        super().__init__()
        self.layer = layer  # name in the dispatcher's per-layer record
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.swiglu_limit = swiglu_limit

    def forward(self, x_SH: torch.Tensor) -> torch.Tensor:
        gated = dispatch.call("swiglu", self.gate_proj(x_SH), self.up_proj(x_SH), self.swiglu_limit, layer=self.layer)
        return self.down_proj(gated)
