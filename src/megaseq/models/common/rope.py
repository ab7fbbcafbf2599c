"""Rotary position embeddings as Hugging Face computes them: default, linear and YaRN frequencies, partial
rotation, half-split or interleaved pairs.

Shapes: B batch, S tokens, D the rotated dims (``rotary_dim``, ``head_dim * partial_rotary_factor``), Dh a
head's dims; ``x [..., Dh]`` with the rotated part first (``x[..., :D]``) and the rest passed through.

``inv_freq`` and ``attention_factor`` follow ``transformers.modeling_rope_utils`` op for op
(``_compute_default_rope_parameters``, ``_compute_linear_scaling_rope_parameters``,
``_compute_yarn_parameters``): float32 frequencies, ``cos, sin = cos(p * f), sin(p * f)`` in float32 times
``attention_factor`` (YaRN's ``mscale``), then cast to the activations' dtype. They are computed on the fly
from the positions (D/2 frequencies) rather than kept as buffers, so a model-wide ``.to(dtype)`` cannot
round them. Position-wise: rotating a shard at its own ``position_ids`` is exact under context parallelism
and packed documents.

Rotation layouts: ``half`` (``rotate_half``: pairs ``(i, i + D/2)``, Llama / Qwen / GLM) and ``interleave``
(pairs ``(2i, 2i + 1)``, DeepSeek's MLA with ``rope_interleave``, returned de-interleaved as HF's
``apply_rotary_pos_emb_interleave`` does: ``[x0', x2', ... | x1', x3', ...]``).

``rope_scaling`` is the HF ``rope_parameters`` dict without ``rope_theta`` (``ModelSpec.rope_scaling``;
``models.spec.check_rope_scaling`` refuses types and keys not implemented here).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from megaseq.ops.rope.reference import rotate


def rotary_dim(head_dim: int, partial_rotary_factor: float = 1.0) -> int:
    """Rotated dims of a head (HF: ``int(head_dim * partial_rotary_factor)``)."""
    return int(head_dim * partial_rotary_factor)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def inv_freq(dim: int, theta: float, scaling: dict[str, Any] | None = None, max_position_embeddings: int = 0,
             device: torch.device | None = None) -> tuple[torch.Tensor, float]:
    """``(inv_freq [dim / 2] float32, attention_factor)`` for RoPE of ``dim`` rotated dims."""
    scaling = scaling or {}
    kind = scaling.get("rope_type", "default")
    base = theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim)
    if kind == "default":
        return 1.0 / base, 1.0
    if kind == "linear":
        return (1.0 / base) / scaling["factor"], 1.0
    assert kind == "yarn", f"rope_type {kind!r} (models.spec.check_rope_scaling refuses it)"
    return _yarn(dim, theta, scaling, max_position_embeddings, base)


def _yarn(dim: int, theta: float, p: dict[str, Any], max_positions: int,
          pos_freqs: torch.Tensor) -> tuple[torch.Tensor, float]:
    """HF ``_compute_yarn_parameters``: interpolated frequencies below the correction range, extrapolated
    above it, a linear ramp between; ``attention_factor`` from ``factor`` (and ``mscale`` /
    ``mscale_all_dim`` when both are set) unless given."""
    original = p["original_max_position_embeddings"]
    factor = p.get("factor")
    if factor is None:
        factor = max_positions / original
    attention_factor = p.get("attention_factor")
    mscale, mscale_all_dim = p.get("mscale"), p.get("mscale_all_dim")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = float(_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim))
        else:
            attention_factor = _yarn_mscale(factor)
    beta_fast, beta_slow = p.get("beta_fast") or 32, p.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # HF's guard against a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32, device=pos_freqs.device) - low) / (high - low),
                       0, 1)
    extrapolation = 1 - ramp
    freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return freq, attention_factor


def yarn_softmax_scale(scaling: dict[str, Any] | None, scale: float) -> float:
    """DeepSeek's attention scale under YaRN (HF ``yarn_apply_mscale``): ``scale * mscale^2`` with
    ``mscale = yarn_mscale(factor, mscale_all_dim)`` when the scaling sets ``mscale_all_dim``."""
    scaling = scaling or {}
    if scaling.get("rope_type", "default") != "default" and scaling.get("mscale_all_dim", 0):
        m = _yarn_mscale(scaling["factor"], scaling["mscale_all_dim"])
        scale = scale * m * m
    return scale


def cos_sin(position_ids_BS: torch.Tensor, freq_F: torch.Tensor, attention_factor: float,
            dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos, sin [B, S, 2F]`` (``cat(freqs, freqs)``), in float32 times ``attention_factor``, then cast."""
    freqs = position_ids_BS[..., None].float() * freq_F.to(position_ids_BS.device)
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * attention_factor).to(dtype), (emb.sin() * attention_factor).to(dtype)


def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool = False) -> torch.Tensor:
    """Rotate the first ``cos.shape[-1]`` dims of ``x`` (broadcast ``cos``/``sin`` to x's leading dims)."""
    D = cos.shape[-1]
    if interleave:
        c, s = cos[..., : D // 2], sin[..., : D // 2]
        x1, x2 = x[..., 0:D:2], x[..., 1:D:2]
        rot = torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)
        return rot if D == x.shape[-1] else torch.cat([rot, x[..., D:]], dim=-1)
    return rotate(x, cos, sin)
