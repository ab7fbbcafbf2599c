"""Linear cross-entropy math shared by every loss scheme: the plain reference and the online log-sum-exp.

Shapes: N tokens, H hidden, V vocabulary, Vc vocabulary entries in one strip of logits.

``plain_linear_cross_entropy`` is the reference: ``logits_NV = hidden_NH @ weight_VH.T`` (upcast to fp32
for bf16/fp16, as Hugging Face's loss does) then ``F.cross_entropy``. Its peak grows as N x V.

The online log-sum-exp (``LSEState``, ``lse_init``, ``lse_update``, ``lse_finalize``) folds strips of
logits into a running (max, sum-exp, target logit) state; the loss is ``max + log(sum) - target``, exact.
Two schemes use it: the chunked loss (``memory.vocab_loss``, strips of one GPU's vocabulary) and Ring-DTP
(``parallel.ring_dtp``, strips of other ranks' vocabulary shards).

Reductions: ``mean`` divides by the number of non-ignored tokens (as ``torch.nn.functional.cross_entropy``),
or by ``num_items`` when given (gradient accumulation over micro-batches and ranks); a batch whose
tokens are all ignored gives 0, not NaN. ``none`` returns per-token losses (0 at ignored tokens).
Losses are fp32 for bf16/fp16 inputs, else the input dtype.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

REDUCTIONS = ("mean", "sum", "none")
def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype: fp32 for half types, else the dtype itself (fp64 stays fp64)."""
    return torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype


# ---- online log-sum-exp ----------------------------------------------------------------------
class LSEState(NamedTuple):
    """Running log-sum-exp per token: ``m`` max so far, ``s`` sum of exp(x - m), ``t`` target logit."""

    m: torch.Tensor  # [N]
    s: torch.Tensor  # [N]
    t: torch.Tensor  # [N] 0 until the strip holding the token's label has been seen


def lse_init(N: int, device: torch.device | str, dtype: torch.dtype = torch.float32) -> LSEState:
    """The empty state: max -inf, sum 0, target 0."""
    return LSEState(
        torch.full((N,), float("-inf"), device=device, dtype=dtype),
        torch.zeros(N, device=device, dtype=dtype),
        torch.zeros(N, device=device, dtype=dtype),
    )


def lse_update(state: LSEState, logits_strip: torch.Tensor, labels: torch.Tensor,
               vocab_offset: int) -> LSEState:
    """Fold one strip ``logits_strip [N, Vc]`` (vocabulary ids ``vocab_offset .. + Vc``) into ``state``.

    Labels outside the strip (other strips, or ignore_index < 0) leave ``t`` unchanged.
    """
    x_NV = logits_strip
    dtype = state.m.dtype
    Vc = x_NV.shape[1]
    local = labels - vocab_offset
    in_strip = (local >= 0) & (local < Vc)
    picked = x_NV.gather(1, local.clamp(0, Vc - 1)[:, None]).squeeze(1).to(dtype)
    t_new = state.t + torch.where(in_strip, picked, torch.zeros_like(picked))
    m_new = torch.maximum(state.m, x_NV.amax(dim=1).to(dtype))
    # one strip-sized temporary in the state's dtype: x - m (type promotion upcasts a bf16 strip on the
    # way, with no separate fp32 copy), then exp in place
    e_NV = torch.sub(x_NV, m_new[:, None])
    s_strip = e_NV.exp_().sum(dim=1)
    # exp(-inf - finite) = 0 on the first strip, so the empty state needs no special case
    s_new = state.s * torch.exp(state.m - m_new) + s_strip
    return LSEState(m_new, s_new, t_new)


def lse_logsumexp(state: LSEState) -> torch.Tensor:
    """``log(sum(exp(logits)))`` per token: what the backward needs to form the softmax."""
    return state.m + torch.log(state.s)


def lse_finalize(state: LSEState) -> torch.Tensor:
    """Per-token loss ``m + log s - t`` (callers mask ignored tokens)."""
    return lse_logsumexp(state) - state.t


# ---- reductions --------------------------------------------------------------------------------
def check_shapes(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, reduction: str) -> None:
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if hidden.dim() != 2 or weight.dim() != 2 or labels.dim() != 1:
        raise ValueError(f"expected hidden [N,H], weight [V,H], labels [N]; got {tuple(hidden.shape)}, "
                         f"{tuple(weight.shape)}, {tuple(labels.shape)} (flatten batch and sequence first)")
    if hidden.shape[1] != weight.shape[1] or hidden.shape[0] != labels.shape[0]:
        raise ValueError(f"shape mismatch: hidden {tuple(hidden.shape)}, weight {tuple(weight.shape)}, "
                         f"labels {tuple(labels.shape)}")


def _denominator(valid_N: torch.Tensor, num_items: int | float | torch.Tensor | None) -> torch.Tensor | float:
    if num_items is not None:
        return num_items
    return valid_N.sum().clamp(min=1)


def reduce_loss(loss_N: torch.Tensor, valid_N: torch.Tensor, reduction: str,
            num_items: int | float | torch.Tensor | None) -> torch.Tensor:
    if reduction == "none":
        return loss_N
    total = loss_N.sum()
    return total if reduction == "sum" else total / _denominator(valid_N, num_items)


# ---- plain reference ---------------------------------------------------------------------------
def plain_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                               ignore_index: int = -100, reduction: str = "mean",
                               num_items: int | float | torch.Tensor | None = None) -> torch.Tensor:
    """Reference loss: full ``[N, V]`` logits, upcast to fp32 for half inputs, then cross-entropy."""
    check_shapes(hidden, weight, labels, reduction)
    logits_NV = hidden @ weight.T
    logits_NV = logits_NV.to(acc_dtype(logits_NV.dtype))
    loss_N = F.cross_entropy(logits_NV, labels, ignore_index=ignore_index, reduction="none")
    return reduce_loss(loss_N, labels != ignore_index, reduction, num_items)
