"""The reference of op ``gated_rms_norm``: HF's order of operations in the compute dtype."""

from __future__ import annotations

import torch

from megaseq.ops.amp import compute_dtype


def gated_rms_norm_reference(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * rmsnorm(x) * sigmoid(gate)`` over the last dim in the compute dtype, in x's dtype (HF's order)."""
    cd = compute_dtype(x.dtype)
    h = x.to(cd)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    h = weight.to(cd) * h * torch.sigmoid(gate.to(cd))
    return h.to(x.dtype)
