"""RMSNorm exactly as Hugging Face's ``Glm5NextTextRMSNorm`` / ``Qwen3MoeRMSNorm``.

Shapes: ``x_SH`` is any ``[..., H]`` tensor; the norm is over the last dimension only, so the module is
token-separable (sequence sharding and tiling never change its result).

The variance is computed in float32 whatever the input dtype and the normalised value is cast back
before the weight multiplies it (``weight * x.to(input_dtype)``): the order HF uses, so bf16 outputs
round the same way and float64 parity is bitwise.

That float32 is a down-cast in a float64 model: a change of 1e-17 upstream (a scheme that reorders a sum,
such as ``memory.kda_segment_tokens``'s chunk boundaries) can cross a float32 rounding boundary and move
a statistic by one float32 ulp, a gradient by ~1e-8. Exactness tests of such schemes run under
``full_precision_norms()``, where the statistics are in ``promote_types(x.dtype, float32)``: float64
stays float64, bf16 and float32 compute exactly as before.
"""

from __future__ import annotations

import torch
from torch import nn

from megaseq.ops import dispatch


class RMSNorm(nn.Module):
    """``weight * x / sqrt(mean(x^2) + eps)`` over the last dimension; parameter ``weight [dim]``."""

    def __init__(self, dim: int, eps: float = 1e-6, layer: str = "rms_norm") -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.layer = layer  # name in the dispatcher's per-layer record

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dispatch.call("rms_norm", x, self.weight, self.eps, layer=self.layer)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"


class ZeroCenteredRMSNorm(nn.Module):
    """Qwen3-Next's RMSNorm: ``rmsnorm(x) * (1 + weight)``, cast back after (weight stored as ``w - 1``,
    initialised to 0); HF's ``Qwen3NextRMSNorm`` op for op, in ``promote_types(dtype, float32)`` where HF
    casts to float32. Unlike ``RMSNorm`` its weight multiplies in that dtype, so in a float64 model a literal
    float32 would reduce the weight's gradient in float32, in an order that depends on how tokens are split
    (docs/architecture.md, "Precision in float64"); bf16/fp32 numerics are HF's."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    @torch.no_grad()
    def init_weights(self, std: float) -> None:
        self.weight.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cd = torch.promote_types(x.dtype, torch.float32)
        h = x.to(cd)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.to(cd))).type_as(x)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}, zero-centered"


def make_norm(dim: int, eps: float, zero_centered: bool = False) -> nn.Module:
    """The family's RMSNorm over ``dim`` (``ModelSpec.norm_zero_centered``)."""
    return ZeroCenteredRMSNorm(dim, eps) if zero_centered else RMSNorm(dim, eps)
