"""The chunked vocabulary projection + cross-entropy (never N x V logits at once), and the loss entry point.

Shapes: N tokens, H hidden, V vocabulary, C tokens per chunk, Vc vocabulary entries per strip.

The plain reference (``plain_linear_cross_entropy``) and the online log-sum-exp live in
``megaseq.ops.vocab_loss.reference``; this module is the memory scheme built on them.

``chunked_linear_cross_entropy`` computes the same loss and the same gradients with a bounded working
set: the forward walks token chunks (and, optionally, vocabulary strips) folding each ``C x Vc`` strip
of logits into an online log-sum-exp state, and keeps only the per-token log-sum-exp; the backward
recomputes each chunk's logits, forms ``softmax - onehot`` and accumulates ``grad_hidden`` and
``grad_weight`` chunk by chunk (grad_weight in fp32 for low-precision inputs).

Reductions as ``megaseq.ops.vocab_loss.reference``.
"""

from __future__ import annotations

import torch

from megaseq.memory.rules import WEIGHT_GRAD_ROWS  # the planner's formula counts these blocks
from megaseq.ops import dispatch
from megaseq.ops.vocab_loss.reference import (
    LSEState,
    acc_dtype,
    check_shapes,
    lse_init,
    lse_logsumexp,
    lse_update,
    reduce_loss,
)


# ---- chunked autograd Function -----------------------------------------------------------------
def _addmm_acc(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``acc += a @ b`` with ``acc`` in fp32 while ``a``, ``b`` may be bf16 (fp32 output on CUDA)."""
    if acc.dtype == a.dtype:
        acc.addmm_(a, b)
    elif acc.is_cuda:
        torch.addmm(acc, a, b, out_dtype=acc.dtype, out=acc)
    else:
        acc.add_((a @ b).to(acc.dtype))


def _spans(total: int, step: int) -> list[tuple[int, int]]:
    return [(a, min(a + step, total)) for a in range(0, total, step)]


def _chunk_lse(h_CH: torch.Tensor, weight: torch.Tensor, labels_C: torch.Tensor,
               vocab_spans: list[tuple[int, int]], dtype: torch.dtype) -> LSEState:
    state = lse_init(h_CH.shape[0], h_CH.device, dtype)
    for v0, v1 in vocab_spans:
        state = lse_update(state, h_CH @ weight[v0:v1].T, labels_C, v0)
    return state


class _ChunkedLinearCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, chunk_tokens, vocab_chunk, ignore_index):
        N, V = hidden.shape[0], weight.shape[0]
        dtype = acc_dtype(hidden.dtype)
        vocab_spans = _spans(V, vocab_chunk or V)
        lse_N = torch.empty(N, device=hidden.device, dtype=dtype)
        loss_N = torch.empty(N, device=hidden.device, dtype=dtype)
        valid_N = labels != ignore_index
        for a, b in _spans(N, chunk_tokens):
            state = _chunk_lse(hidden[a:b], weight, labels[a:b], vocab_spans, dtype)
            lse_N[a:b] = lse_logsumexp(state)
            loss_N[a:b] = lse_N[a:b] - state.t
        loss_N = torch.where(valid_N, loss_N, torch.zeros_like(loss_N))
        ctx.save_for_backward(hidden, weight, labels, lse_N)
        ctx.spans = (chunk_tokens, vocab_spans, ignore_index)
        ctx.mark_non_differentiable(valid_N)
        return loss_N, valid_N

    @staticmethod
    def backward(ctx, grad_loss_N, _grad_valid):
        hidden, weight, labels, lse_N = ctx.saved_tensors
        chunk_tokens, vocab_spans, ignore_index = ctx.spans
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        dtype = lse_N.dtype
        # ignored tokens get no gradient; grad_loss_N carries the reduction's 1/denominator
        g_N = torch.where(labels != ignore_index, grad_loss_N.to(dtype), torch.zeros_like(lse_N))
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w32 = torch.zeros(weight.shape, device=weight.device, dtype=dtype) if need_w else None
        for a, b in _spans(hidden.shape[0], chunk_tokens):
            h_CH = hidden[a:b]
            gh_CH = torch.zeros(h_CH.shape, device=h_CH.device, dtype=dtype) if need_h else None
            rows = torch.arange(b - a, device=h_CH.device)
            for v0, v1 in vocab_spans:
                # softmax - onehot, scaled per token: one fp32 strip (from the recomputed bf16 logits by
                # type promotion) and the input-dtype result written straight from it
                p_CV = torch.sub(h_CH @ weight[v0:v1].T, lse_N[a:b, None]).exp_()
                local = labels[a:b] - v0
                hit = (local >= 0) & (local < v1 - v0)
                p_CV[rows[hit], local[hit]] -= 1
                if p_CV.dtype == hidden.dtype:
                    d_CV = p_CV.mul_(g_N[a:b, None])
                else:
                    d_CV = torch.mul(p_CV, g_N[a:b, None], out=torch.empty_like(p_CV, dtype=hidden.dtype))
                del p_CV
                if need_h:
                    _addmm_acc(gh_CH, d_CV, weight[v0:v1])
                if need_w:
                    for r0 in range(v0, v1, WEIGHT_GRAD_ROWS):
                        r1 = min(r0 + WEIGHT_GRAD_ROWS, v1)
                        _addmm_acc(grad_w32[r0:r1], d_CV[:, r0 - v0:r1 - v0].T, h_CH)
                del d_CV  # before the next strip's logits: otherwise two strips' results coexist
            if need_h:
                grad_h[a:b] = gh_CH
        grad_w = grad_w32.to(weight.dtype) if need_w else None
        return grad_h, grad_w, None, None, None, None


def chunked_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                                 chunk_tokens: int, vocab_chunk: int | None = None, ignore_index: int = -100,
                                 reduction: str = "mean",
                                 num_items: int | float | torch.Tensor | None = None) -> torch.Tensor:
    """Exact ``plain_linear_cross_entropy`` holding at most ``chunk_tokens x vocab_chunk`` logits.

    ``hidden [N,H]``, ``weight [V,H]``, ``labels [N]``; ``vocab_chunk=None`` means whole-vocabulary strips.
    """
    check_shapes(hidden, weight, labels, reduction)
    if chunk_tokens < 1:
        raise ValueError(f"memory.loss_chunk_tokens must be >= 1, got {chunk_tokens}")
    if vocab_chunk is not None and vocab_chunk < 1:
        raise ValueError(f"vocab_chunk must be >= 1 or None, got {vocab_chunk}")
    loss_N, valid_N = _ChunkedLinearCE.apply(hidden, weight, labels, int(chunk_tokens), vocab_chunk,
                                             ignore_index)
    return reduce_loss(loss_N, valid_N, reduction, num_items)


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                         chunk_tokens: int | None = None, vocab_chunk: int | None = None,
                         ignore_index: int = -100, reduction: str = "mean",
                         num_items: int | float | torch.Tensor | None = None) -> torch.Tensor:
    """The trainer's entry point: chunked when ``chunk_tokens`` is set (``MemoryPlan.loss_chunk_tokens``),
    plain otherwise. Leading dimensions of ``hidden [..., H]`` and ``labels [...]`` are flattened."""
    h_NH, labels_N = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1)
    if chunk_tokens:  # op chunked_linear_cross_entropy: this module's loss, or a fused one as bounded (Liger)
        out = dispatch.call("chunked_linear_cross_entropy", h_NH, weight, labels_N, chunk_tokens, vocab_chunk,
                            ignore_index, reduction, num_items, layer="loss")
    else:
        out = dispatch.call("linear_cross_entropy", h_NH, weight, labels_N, ignore_index, reduction, num_items,
                            layer="loss")
    return out.reshape(labels.shape) if reduction == "none" else out
