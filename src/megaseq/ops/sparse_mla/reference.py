"""The reference of op ``sparse_attention``, ``torch_masked``: the keys and values expanded from the latent for
every head and each selected key attended with a mask (HF's computation, O(block * S) scores).

Every implementation of the op takes ``return_lse`` (default False); with True it returns ``(out, lse2)``,
``lse2 [B, Q, Hh]`` the base-2 log-sum-exp of each head's logits over the query's valid slots,
``log2(sum_w 2^(LOG2E * scale * q . k_w))``, in the compute dtype (fp32, or float64 for float64 inputs), without
a gradient, ``+inf`` for a query with no valid slot. The indexer objective's sparse-stage target reads it
(``ops.indexer.target``): ``p_hw = 2^(LOG2E * scale * q_h . k_w - lse2_h)``, 0 on every slot of such a query.

Every implementation also takes ``head_probs`` (a ``HeadProbs``, default None). One whose backward recomputes
the probabilities (``absorbed``, ``triton``) leaves there ``m [B, Q, W]``, each slot's probability summed over
the heads: op ``indexer_target``'s result over the same queries, latents and selection, which the sparse stage's
objective then need not compute (``models.common.indexer_objective``). This reference leaves it None, as does
any implementation for a call whose output gets no gradient.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from megaseq.ops.amp import compute_dtype

ATTENTION_BLOCK_ELEMS: int = 1 << 26
LOG2E: float = math.log2(math.e)  # natural logits to base 2 (the fused kernels' exp2 softmax)


class HeadProbs:
    """Where a ``sparse_attention`` backward leaves ``m_BQW [B, Q, W]`` fp32 (float64 for float64 inputs): each
    slot's softmax probability summed over the heads, 0 on empty slots and on every slot of a query without a
    valid one (the module docstring's). None until such a backward has run."""

    __slots__ = ("m_BQW",)

    def __init__(self) -> None:
        self.m_BQW: torch.Tensor | None = None


def _attend_block(q_BHqD: torch.Tensor, k_BHKD: torch.Tensor, v_BHKD: torch.Tensor, idx_BqW: torch.Tensor,
                  scale: float, return_lse: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    Sk = k_BHKD.shape[2]
    ok = (idx_BqW >= 0) & (idx_BqW < Sk)
    slot = torch.where(ok, idx_BqW.long(), Sk)  # empty slots land in a dropped extra column
    mask = torch.zeros(*idx_BqW.shape[:2], Sk + 1, dtype=torch.bool, device=idx_BqW.device)
    mask.scatter_(-1, slot, True)
    mask = mask[..., :Sk].unsqueeze(1)
    scores = torch.matmul(q_BHqD, k_BHKD.transpose(2, 3)) * scale
    # additive mask with the dtype's min, as HF's eager path does
    zero = torch.zeros((), dtype=scores.dtype, device=scores.device)
    scores = scores + torch.where(mask, zero, torch.finfo(scores.dtype).min)
    cd = compute_dtype(q_BHqD.dtype)
    probs = F.softmax(scores, dim=-1, dtype=cd).to(q_BHqD.dtype)
    out = torch.matmul(probs, v_BHKD).transpose(1, 2)
    if not return_lse:
        return out
    with torch.no_grad():  # the masked keys' exp(finfo.min - max) is 0: the log-sum-exp of the valid slots
        lse = torch.logsumexp(scores.to(cd), dim=-1).masked_fill_(~mask.any(-1), float("inf"))
    return out, (lse * LOG2E).transpose(1, 2)


def sparse_attention_reference(q_BHQD: torch.Tensor, k_BHSD: torch.Tensor, v_BHSD: torch.Tensor,
                               idx_BQW: torch.Tensor, scale: float,
                               return_lse: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of each query over the keys listed in ``idx`` (-1 = none): ``[B, Q, Hh, Dv]``
    (``return_lse``: and ``lse2 [B, Q, Hh]``, the module docstring's).

    Queries are processed in blocks of about ``ATTENTION_BLOCK_ELEMS`` score elements; with several
    blocks and autograd on, each block is recomputed in backward so the saved state stays bounded.
    """
    B, Hh, Q, _ = q_BHQD.shape
    S = k_BHSD.shape[2]
    block = max(1, ATTENTION_BLOCK_ELEMS // max(1, B * Hh * S))
    if block >= Q:
        return _attend_block(q_BHQD, k_BHSD, v_BHSD, idx_BQW, scale, return_lse)
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q_BHQD, k_BHSD, v_BHSD))
    parts = []
    for s in range(0, Q, block):
        args = (q_BHQD[:, :, s:s + block], k_BHSD, v_BHSD, idx_BQW[:, s:s + block], scale, return_lse)
        parts.append(checkpoint(_attend_block, *args, use_reentrant=False) if grad else _attend_block(*args))
    if not return_lse:
        return torch.cat(parts, dim=1)
    return torch.cat([o for o, _ in parts], dim=1), torch.cat([lse for _, lse in parts], dim=1)


def expand_latent(c_BSR: torch.Tensor, kv_b_weight: torch.Tensor, num_heads: int,
                  nope_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Latent ``[B, S, R]`` -> keys ``[B, Hh, S, Dn]`` (contiguous), values ``[B, Hh, S, Dv]`` (kv_b_proj)."""
    B, S, _ = c_BSR.shape
    kv = F.linear(c_BSR, kv_b_weight).view(B, S, num_heads, -1).transpose(1, 2)
    k_nope, v = kv.split([nope_dim, kv.shape[-1] - nope_dim], dim=-1)
    # one contiguous copy of the keys: each query block's matmul would otherwise copy the strided view
    return k_nope.contiguous(), v


def sparse_mla_reference(q_BQHD: torch.Tensor, c_BSR: torch.Tensor, kv_b_weight: torch.Tensor,
                         idx_BQW: torch.Tensor, scale: float, return_lse: bool = False,
                         head_probs: HeadProbs | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """MLA over the selected keys: ``[B, Q, Hh, Dv]``, the HF computation (``return_lse``: and ``lse2 [B, Q, Hh]``,
    the module docstring's; ``head_probs`` is left as it is).

    ``q [B, Q, Hh, Dn (+ Dr)]``, the latent ``c [B, S, R (+ Dr)]`` (kv_a_layernorm output, whole sequence;
    with DeepSeek's RoPE its last Dr channels are the rotated key part every head shares), the
    ``kv_b_proj`` weight ``[Hh * (Dn + Dv), R]``; the keys and values are expanded for all heads and
    every selected key is attended with a mask (``sparse_attention_reference``). The fast ops
    (``absorbed``, ``megaseq.ops.sparse_mla.absorbed``; Triton) take the same arguments and run NoPE latents only.
    """
    del head_probs  # autograd's backward here does not hand the probabilities out
    Hh, Dq = q_BQHD.shape[2], q_BQHD.shape[3]
    R = kv_b_weight.shape[1]
    Dr = c_BSR.shape[-1] - R
    k, v = expand_latent(c_BSR[..., :R] if Dr else c_BSR, kv_b_weight, Hh, Dq - Dr)
    if Dr:
        B, S = c_BSR.shape[:2]
        k = torch.cat([k, c_BSR[..., R:].unsqueeze(1).expand(B, Hh, S, Dr)], dim=-1)
    return sparse_attention_reference(q_BQHD.transpose(1, 2), k, v, idx_BQW, scale, return_lse)
