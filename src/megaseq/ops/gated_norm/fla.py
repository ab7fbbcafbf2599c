"""Op ``gated_rms_norm``: KDA's gated output norm, ``weight * rmsnorm(x) * sigmoid(gate)`` over the last dim,
with flash-linear-attention's fused kernel (``fla.modules.norm.fused_norm_gate.rms_norm_gated``).

Shapes: ``x`` and ``gate`` ``[..., D]`` (KDA: ``[B, S, Hh, D]``, D the head dim), ``weight`` ``[D]``.

The reference (``ops/gated_norm/reference.py: gated_rms_norm_reference``, HF's ``Glm5NextTextGatedRMSNorm`` order of
ops) widens x and the gate to float32 and runs about ten elementwise kernels forward and fifteen backward over
``[S, Hh * D]``, each saving or reading a float32 copy (a few ms per KDA layer at 32K tokens). fla's kernel is
one pass each way: it computes in float32 and keeps x, the gate and one float32 ``rstd`` per row (the same
kernel fla's own KimiDeltaAttention runs as ``FusedRMSNormGated(activation="sigmoid")``).

Numerics: float32 inside, the output rounded once to x's dtype, as the reference (the products in another
order). The gate's gradient is returned in x's dtype, so the kernel asks x and the gate to share one.
"""

from __future__ import annotations

import torch

from megaseq.ops.kda.fla import _maybe_limit_autotune, fla_available

DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def gated_rms_norm_fla_supports(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> str | None:
    if x.shape != gate.shape or weight.shape != (x.shape[-1],):
        return f"shapes x {tuple(x.shape)}, gate {tuple(gate.shape)}, weight {tuple(weight.shape)}"
    if x.dtype not in DTYPES or weight.dtype not in DTYPES:
        return f"dtypes x {x.dtype}, weight {weight.dtype} (fla runs bf16/fp16/fp32; float64 runs the reference)"
    if gate.dtype != x.dtype:
        return f"gate {gate.dtype} vs x {x.dtype} (fla returns the gate's gradient in x's dtype)"
    for t in (x, gate, weight):
        if t.device.type != "cuda":
            return f"device {t.device.type} (fla's Triton kernels need cuda)"
    return fla_available()


def gated_rms_norm_fla(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Same contract as ``gated_rms_norm_reference``: x's shape and dtype."""
    from fla.modules.norm.fused_norm_gate import rms_norm_gated

    _maybe_limit_autotune()
    with torch.autocast(x.device.type, enabled=False):
        return rms_norm_gated(x, gate, weight, None, activation="sigmoid", eps=float(eps))
