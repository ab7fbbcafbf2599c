"""Op ``linear_cross_entropy`` through Liger Kernel's fused linear cross-entropy (GPU, optional package).

Shapes: N tokens, H hidden, V vocabulary.

Contract (both implementations, as ``memory/vocab_loss.py``): ``linear_cross_entropy(hidden [N, H],
weight [V, H], labels [N], ignore_index=-100, reduction="mean" | "sum" | "none", num_items=None)``;
``mean`` divides by the non-ignored tokens or by ``num_items`` when given (a batch whose tokens are all
ignored gives 0, not NaN); ``none`` gives per-token losses, 0 at ignored tokens; losses are fp32 for
bf16/fp16 inputs. The reference is megaseq's ``plain_linear_cross_entropy`` (full ``[N, V]`` logits).

Liger walks token chunks, writes each chunk's ``softmax - onehot`` over its
bf16 logits in place and folds it into ``grad hidden`` and ``grad weight`` during the forward; the
backward only scales them (``sum``/``mean``; ``none`` recomputes). Working memory beyond the inputs is
the two gradients plus one chunk of logits (``LIGER_CHUNK_ROWS``; ``benchmarks/results/kernels/h200_ops.md``).

Chunk rows: Liger's own rule keeps a chunk of logits near the size of the hidden states (``N * H / V`` rows,
rounded up to a power of two): 128 rows at 8K tokens of glm5-flash (H 2048, V 154,880), so 64 GEMMs of
K = 128 and 64 read-modify-writes of the whole ``[V, H]`` weight gradient, several times its GEMMs' FLOP time
(``benchmarks/results/kernels/h200_ops.md``). megaseq sets Liger's ``chunk_mem_const`` so
that a chunk is the largest power of two up to ``CHUNK_ROWS`` (4096: 1.2 GiB of bf16 logits at V 154,880),
within the chunked loss's ``chunk_tokens`` (the plan's fp32 chunk of that many rows).
The weight gradient accumulates in the weight's dtype across chunks unless ``WEIGHT_GRAD_DTYPE`` is set
(float32: exact to fp32 accumulation like megaseq's chunked loss, V * H * 4 bytes more, 2.4 GiB here).
Liger is called with ``sum`` or ``none`` only; megaseq divides for ``mean`` (Liger's own ``mean`` divides by
zero on an all-ignored batch, and has no ``num_items``).

It also implements op ``chunked_linear_cross_entropy`` (the loss where the memory plan bounds it,
``memory.chunked_loss``; reference ``memory.vocab_loss.chunked_linear_cross_entropy``): Liger's working set is
itself bounded (one chunk of about ``N * H / V`` rows of logits beside the two gradients), below the
reference's ``chunk_tokens x V`` float32 chunk, so the plan stays an upper bound; the chunk sizes are the
reference's and Liger ignores them.

Timings, peaks and errors: ``benchmarks/kernels/glue_gpu.py`` (``benchmarks/results/kernels/h200_ops.md``).
"""

from __future__ import annotations

import functools
import importlib.util

import torch

from megaseq.ops.vocab_loss.reference import REDUCTIONS
from megaseq.ops.workspace import LIGER_CHUNK_ROWS

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# dtype of Liger's weight-gradient accumulator; None: the weight's (bf16 for a bf16 head: Liger's default)
WEIGHT_GRAD_DTYPE: torch.dtype | None = None


# rows of one chunk of logits at most (a power of two); None: Liger's own rule (about N * H / V rows)
CHUNK_ROWS: int | None = LIGER_CHUNK_ROWS


def chunk_mem_const(n: int, h: int, v: int, rows: int) -> int:
    """Liger's ``chunk_mem_const`` for chunks of at most ``rows`` (a power of two) and as few as it allows:
    Liger takes ``inc = cdiv(V, C * H)`` and chunks of ``min(next_pow2(cdiv(N, inc)), N)`` rows. Its smallest
    chunks (C = 1, its default: about ``N * H / V`` rows) are the floor: past ``rows * V / H`` tokens (2.3M
    at V 154,880, H 2048, rows 4096) the chunks are Liger's own."""
    if rows < 1 or rows & (rows - 1):
        raise ValueError(f"chunk rows must be a power of two, got {rows}")
    k = -(-n // rows)  # chunks needed
    if k <= 1:
        return -(-v // h)  # inc = 1: the whole batch in one chunk
    return max(1, (v - 1) // ((k - 1) * h))  # the largest C with C * (k - 1) * H < V: inc >= k


def liger_chunk_rows(n: int, h: int, v: int, c: int) -> int:
    """The rows of Liger's chunks for ``chunk_mem_const`` c (its rule, for the tests and the docs)."""
    inc = -(-v // (c * h))
    return min(1 << max(0, (-(-n // inc) - 1).bit_length()), n)


def _chunk_arg(hidden: torch.Tensor, weight: torch.Tensor, rows: int | None) -> tuple[int, ...]:
    if rows is None or not _takes_chunk_const():
        return ()
    return (chunk_mem_const(hidden.shape[0], hidden.shape[1], weight.shape[0], rows),)


@functools.cache
def _no_sync_function() -> type:
    """Liger's fused linear cross-entropy Function with a backward that scales the gradients its forward computed
    without first asking whether ``grad_output`` is 1 (Liger's ``torch.equal`` is a host sync at the start of
    every backward: the GPU's queue drained there, and the backward's first kernels launched from it). The
    scaling is Liger's: each gradient times ``grad_output`` in fp32, stored in its dtype (here by torch, in place:
    the backward runs once); ``reduction="none"`` keeps Liger's backward (it recomputes the gradients)."""
    from liger_kernel.ops.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyFunction as LigerFLCE

    class NoSyncFLCE(LigerFLCE):
        @staticmethod
        def backward(ctx, grad_output, *rest):
            if ctx.defer_grads:
                return LigerFLCE.backward(ctx, grad_output, *rest)
            grads = scale_saved_gradients(grad_output, *ctx.saved_tensors)
            return (grads[0], grads[1], None, grads[2], *([None] * 14))[: len(ctx.needs_input_grad)]

    return NoSyncFLCE


def scale_saved_gradients(grad_output: torch.Tensor, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
    """Each gradient (computed by the forward for a loss of 1) times the 0-d ``grad_output``, in place."""
    return tuple(None if g is None else g.mul_(grad_output) for g in grads)


@functools.cache
def _takes_chunk_const() -> bool:  # liger-kernel 0.8.5 has it; older releases chunk by their rule only (once)
    import inspect

    from liger_kernel.ops.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyFunction as LigerFLCE

    return "chunk_mem_const" in inspect.signature(LigerFLCE.forward).parameters


# the reference, ``torch``, is ``ops.vocab_loss.reference.plain_linear_cross_entropy`` (rows: ``ops.table``)


def liger_loss_supports(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100,
                        reduction: str = "mean", num_items: int | float | torch.Tensor | None = None) -> str | None:
    if reduction not in REDUCTIONS:
        return f"reduction {reduction!r} (one of {REDUCTIONS})"
    if importlib.util.find_spec("liger_kernel") is None:
        return "liger-kernel is not installed (pip install liger-kernel)"
    if hidden.device.type != "cuda" or weight.device != hidden.device or labels.device != hidden.device:
        return f"devices {hidden.device}/{weight.device}/{labels.device} (Liger's kernels need one cuda device)"
    if hidden.dim() != 2 or weight.dim() != 2 or labels.dim() != 1 or hidden.shape[1] != weight.shape[1] \
            or labels.shape[0] != hidden.shape[0]:
        return f"shapes hidden {tuple(hidden.shape)}, weight {tuple(weight.shape)}, labels {tuple(labels.shape)}"
    if hidden.dtype != weight.dtype or hidden.dtype not in DTYPES:
        return f"dtypes {hidden.dtype}/{weight.dtype} (one of {', '.join(map(str, DTYPES))}, the same for both)"
    return None


def linear_cross_entropy_liger(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                               ignore_index: int = -100, reduction: str = "mean",
                               num_items: int | float | torch.Tensor | None = None,
                               chunk_rows: int | None = CHUNK_ROWS) -> torch.Tensor:
    """Same contract as ``linear_cross_entropy_reference``; Liger computes the gradients during the forward,
    in chunks of at most ``chunk_rows`` tokens (a power of two; None: Liger's rule)."""
    mode = "none" if reduction == "none" else "sum"
    LigerFLCE = _no_sync_function()
    # positional: input, weight, target, bias, ce_weight, ignore_index, lse_square_scale, label_smoothing,
    # reduction, softcap, return_z_loss, accum_dtype, use_token_scaling, return_token_accuracy,
    # return_predicted_tokens, ce_impl, ce_mode, chunk_mem_const
    chunk = _chunk_arg(hidden, weight, chunk_rows)
    extra = (False, False, False, None, None, *chunk) if chunk else ()
    loss = LigerFLCE.apply(hidden.contiguous(), weight.contiguous(), labels.contiguous(), None, None, ignore_index,
                           0.0, 0.0, mode, None, False, WEIGHT_GRAD_DTYPE, *extra)[0]
    if reduction != "mean":
        return loss
    if num_items is not None:
        return loss / num_items
    return loss / (labels != ignore_index).sum().clamp(min=1)


def chunked_liger_supports(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk_tokens: int,
                           vocab_chunk: int | None = None, ignore_index: int = -100, reduction: str = "mean",
                           num_items: int | float | torch.Tensor | None = None) -> str | None:
    """``liger_loss_supports`` for op ``chunked_linear_cross_entropy``'s arguments."""
    return liger_loss_supports(hidden, weight, labels, ignore_index, reduction, num_items)


def chunked_linear_cross_entropy_liger(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                                       chunk_tokens: int, vocab_chunk: int | None = None, ignore_index: int = -100,
                                       reduction: str = "mean",
                                       num_items: int | float | torch.Tensor | None = None) -> torch.Tensor:
    """Same contract as the reference ``chunked_linear_cross_entropy``: chunks of at most ``chunk_tokens``
    (rounded down to a power of two) and ``CHUNK_ROWS`` tokens; Liger takes no vocabulary chunks."""
    del vocab_chunk
    rows = None if CHUNK_ROWS is None else min(CHUNK_ROWS, 1 << (max(chunk_tokens, 1).bit_length() - 1))
    return linear_cross_entropy_liger(hidden, weight, labels, ignore_index, reduction, num_items, rows)
