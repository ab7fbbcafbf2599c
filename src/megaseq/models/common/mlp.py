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
from torch import nn

from megaseq.ops import dispatch


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
