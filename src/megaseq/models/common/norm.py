"""RMSNorm exactly as Hugging Face's ``Glm5NextTextRMSNorm`` / ``Qwen3MoeRMSNorm``.

Shapes: ``x_SH`` is any ``[..., H]`` tensor; the norm is over the last dimension only, so the module is
token-separable (sequence sharding and tiling never change its result).

The variance is computed in float32 whatever the input dtype and the normalised value is cast back
before the weight multiplies it (``weight * x.to(input_dtype)``): the order HF uses, so bf16 outputs
round the same way and float64 parity is bitwise.
"""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """``weight * x / sqrt(mean(x^2) + eps)`` over the last dimension; parameter ``weight [dim]``."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        input_dtype = x.dtype
        # float32 for the statistics (HF does the same; in float64 this is a down-cast, as in HF)
        x32 = x.to(torch.float32)
        variance = x32.pow(2).mean(-1, keepdim=True)
        x32 = x32 * torch.rsqrt(variance + self.eps)
        return self.weight * x32.to(input_dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"
