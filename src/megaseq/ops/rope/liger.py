"""Op ``rope``: Liger Kernel's fused RoPE (``liger_kernel.ops.rope``), one Triton program per token rotating all
of its query and key heads.

Liger's kernel rotates in place. Here it runs on copies (``torch.clone``), so the op's inputs, and in backward
the incoming gradients, are never written: autograd may hold them elsewhere (a saved tensor, a gradient shared
by two branches). A copy and one in-place pass read and write each tensor twice; the reference's elementwise
chain (two products, the negation, the concatenation, the sum) reads and writes it about six times, and as many
in backward.

Shapes and contract: ``ops.rope.reference``. Timings: the step profiles under ``benchmarks/results/speed/``.
"""

from __future__ import annotations

import importlib.util

import torch

from megaseq.ops.liger_backends import quiet_backend_probes

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
quiet_backend_probes()  # Liger's RoPE probes optional backends on its first call, warning for each it lacks


# the reference, ``torch``, is ``ops.rope.reference.rope_reference`` (rows: ``ops.table``)


def liger_rope_supports(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> str | None:
    if importlib.util.find_spec("liger_kernel") is None:
        return "liger-kernel is not installed (pip install liger-kernel)"
    if len({t.device for t in (q, k, cos, sin)}) != 1 or q.device.type != "cuda":
        return f"devices {q.device}/{k.device}/{cos.device}/{sin.device} (Liger's kernels need one cuda device)"
    if q.dim() != 4 or k.dim() != 4 or q.shape[:2] != k.shape[:2] or q.shape[3] != k.shape[3]:
        return f"shapes q {tuple(q.shape)}, k {tuple(k.shape)} (expected [B, S, H, Dh] with the same B, S, Dh)"
    B, S, _, Dh = q.shape
    D = cos.shape[-1]
    if cos.shape != sin.shape or cos.dim() != 3 or cos.shape[0] not in (1, B) or cos.shape[1] != S \
            or D % 2 or not 0 < D <= Dh:
        return f"cos/sin {tuple(cos.shape)}/{tuple(sin.shape)} for q {tuple(q.shape)} (expected [B or 1, S, D], " \
               "D even and at most the head's dims)"
    if q.dtype not in DTYPES or k.dtype != q.dtype:
        return f"dtypes {q.dtype}/{k.dtype} (one of {', '.join(map(str, DTYPES))}, the same for both)"
    return None


class _LigerRope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, cos, sin):
        from liger_kernel.ops.rope import rope_forward

        q2, k2 = (t.clone(memory_format=torch.contiguous_format) for t in (q, k))
        cos, sin = cos.contiguous(), sin.contiguous()
        rope_forward(q2.transpose(1, 2), k2.transpose(1, 2), cos, sin)  # in place on the copies
        ctx.save_for_backward(cos, sin)
        return q2, k2

    @staticmethod
    def backward(ctx, dq, dk):
        from liger_kernel.ops.rope import rope_backward

        cos, sin = ctx.saved_tensors
        dq2, dk2 = (t.clone(memory_format=torch.contiguous_format) for t in (dq, dk))
        rope_backward(dq2.transpose(1, 2), dk2.transpose(1, 2), cos, sin)
        return dq2, dk2, None, None


def rope_liger(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return _LigerRope.apply(q, k, cos, sin)
