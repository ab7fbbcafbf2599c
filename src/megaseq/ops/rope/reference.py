"""Op ``rope``, the reference: the half-split rotation as Hugging Face's ``apply_rotary_pos_emb`` computes it.

Shapes: B batch, S tokens, Hq / Hk query / key heads, Dh a head's dims, D the rotated dims (``D <= Dh``, even;
the rest of each head passes through). ``cos, sin [B, S, D]`` hold ``cat(f, f)`` (each frequency twice, as
``models.common.rope.cos_sin`` builds them), already scaled and cast to the activations' dtype.

Contract (every implementation): ``rope(q [B, S, Hq, Dh], k [B, S, Hk, Dh], cos, sin) -> (q', k')``, new tensors
of the inputs' shapes and dtype, ``x'[..., :D] = x[..., :D] * cos + rotate_half(x[..., :D]) * sin``.
"""

from __future__ import annotations

import torch


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``[x1, x2] -> [-x2, x1]`` over the last dim's halves."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first ``cos.shape[-1]`` dims of ``x`` (``cos``/``sin`` broadcast to x's leading dims)."""
    D = cos.shape[-1]
    rot = x[..., :D] * cos + rotate_half(x[..., :D]) * sin
    return rot if D == x.shape[-1] else torch.cat([rot, x[..., D:]], dim=-1)


def rope_reference(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                   sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
    return rotate(q, cos, sin), rotate(k, cos, sin)
