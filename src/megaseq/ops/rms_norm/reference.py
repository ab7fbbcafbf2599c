"""Op ``rms_norm``'s pure-torch implementations: HF's numerics (``torch``, the reference) and the same forward
with a backward in row chunks (``torch_chunked``, the default on every device).

The variance is computed in float32 whatever the input dtype and the normalised value is cast back before the
weight multiplies it (``weight * x.to(input_dtype)``): the order HF uses, so bf16 outputs round the same way
and float64 parity is bitwise. ``full_precision_norms()`` computes the statistics in
``promote_types(x.dtype, float32)`` instead, for float64 exactness tests (``models.common.norm`` says why).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from megaseq.ops.workspace import norm_backward_rows

_FULL_PRECISION = False


@contextlib.contextmanager
def full_precision_norms() -> Iterator[None]:
    """Inside: RMSNorm statistics in ``promote_types(x.dtype, float32)`` instead of HF's float32 (see the
    module's docstring); only float64 inputs compute differently. For float64 exactness tests."""
    global _FULL_PRECISION
    before, _FULL_PRECISION = _FULL_PRECISION, True
    try:
        yield
    finally:
        _FULL_PRECISION = before


def _stats_dtype(x_dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(x_dtype, torch.float32) if _FULL_PRECISION else torch.float32


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Op ``rms_norm``'s reference (fast ones: ``megaseq.ops.rms_norm.fused``): HF's numerics."""
    return _normalise(x, weight, eps)[-1]


def _normalise(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, ...]:
    """HF's RMSNorm op for op: ``(x32, rstd, normed, y)``, the float32 input, ``rsqrt(mean(x32^2) + eps)``,
    the normalised value cast back to x's dtype and the output ``weight * normed``. Float32 for the statistics
    (HF does the same; in float64 this is a down-cast, as in HF)."""
    x32 = x.to(_stats_dtype(x.dtype))
    rstd = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    normed = (x32 * rstd).to(x.dtype)
    return x32, rstd, normed, weight * normed


class _RMSNormChunkedBackward(torch.autograd.Function):
    """``rms_norm_reference``'s forward (``_normalise``: the output is bitwise the same), and the same saved
    tensors (the float32 input, the per-row ``rstd``, the normalised value's cast where the weight trains),
    but a backward in row chunks of ``ops.workspace.norm_backward_rows``. Autograd's backward of the
    reference holds four to five float32 copies of the whole input at once, at long lengths the peak of a
    LoRA step (``benchmarks/results/lora/runs/2026-12-02_memory-census/``). Here the chunk's
    temporaries are bounded (``ops.workspace.norm_backward_temp``); the gradient is the same formula:
    ``dx = rstd * (dxhat - xhat * mean(dxhat * xhat))``, ``dxhat = (g * w).float()``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        x32, rstd, normed, y = _normalise(x, weight, eps)
        ctx.x_dtype = x.dtype
        ctx.save_for_backward(x32, rstd, weight, normed if ctx.needs_input_grad[1] else None)
        return y

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        x32, rstd, weight, normed = ctx.saved_tensors
        need_x, need_w = ctx.needs_input_grad[:2]
        H = x32.shape[-1]
        x_RH, r_R1, g_RH = x32.reshape(-1, H), rstd.reshape(-1, 1), g.reshape(-1, H)
        n_RH = normed.reshape(-1, H) if normed is not None else None
        gx = torch.empty(x_RH.shape, dtype=ctx.x_dtype, device=x32.device) if need_x else None
        acc = torch.promote_types(g.dtype, torch.float32)
        gw = torch.zeros(H, dtype=acc, device=x32.device) if need_w else None
        step = norm_backward_rows(H)
        for s in range(0, x_RH.shape[0], step):
            xs, rs, gs = x_RH[s:s + step], r_R1[s:s + step], g_RH[s:s + step]
            if need_w:  # weight * normed: autograd's product in the output dtype, summed over the rows
                gw += (gs * n_RH[s:s + step]).sum(0, dtype=acc)
            if need_x:
                dxhat = (gs * weight).to(ctx.x_dtype).to(x32.dtype)  # autograd casts to normed's dtype
                gx[s:s + step] = _input_grad(xs, rs, dxhat)  # cast to x's dtype (x.to(float32)'s backward)
                del dxhat
        return (gx.view(x32.shape) if need_x else None,
                gw.to(weight.dtype).view(weight.shape) if need_w else None, None)


def _input_grad(x32: torch.Tensor, rstd: torch.Tensor, dxhat: torch.Tensor) -> torch.Tensor:
    """The float32 input's gradient through ``xhat = x * rstd``, ``rstd = rsqrt(mean(x^2) + eps)``."""
    xhat = x32 * rstd
    return rstd * (dxhat - xhat * (dxhat * xhat).mean(-1, keepdim=True))


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Op ``rms_norm`` by default on every device: the reference's numerics with a backward in row chunks
    (``_RMSNormChunkedBackward``). Float64 (the parity tests' dtype) and no-grad calls run the reference:
    its backward rounds the float32 statistics' gradient in autograd's order, bitwise HF's."""
    if x.dtype == torch.float64 or not torch.is_grad_enabled() or not (x.requires_grad or weight.requires_grad):
        return rms_norm_reference(x, weight, eps)
    return _RMSNormChunkedBackward.apply(x, weight, eps)
