"""Op ``rms_norm``: RMSNorm exactly as Hugging Face computes it, as one Triton kernel each way.

Shapes: ``x`` any ``[..., H]``, ``weight [H]``; R = the leading dims flattened.

Contract (both implementations): ``rms_norm(x, weight, eps) -> weight * (x.float() * rsqrt(mean(x.float()^2)
+ eps)).to(x.dtype)`` in ``promote_types(weight.dtype, x.dtype)`` (``blocks/norm.py``), differentiable in x
and weight. torch runs it as about eight passes over ``[R, H]`` forward (the fp32 copy, square, mean,
rsqrt, product, cast, weight product) and saves the fp32 copy; the kernel reads x once, writes y and a
per-row fp32 ``rstd``, and the backward reads x, gy and rstd once (``grad weight``: per-program fp32
partial sums added by torch, deterministic).

Liger Kernel's ``LigerRMSNorm(casting_mode="llama")`` computes the same forward formula for a bf16 weight, but
it returns x's dtype where HF promotes (an fp32 weight on bf16 activations gives fp32 in HF), and its weight
gradient sums in another order; benchmarks/kernels/glue_gpu.py times both (``benchmarks/results/kernels/
h200_ops.md``).
"""

from __future__ import annotations

import torch

from megaseq.ops._triton_util import cdiv, kernels, next_pow2, triton_supports

KERNELS = "rms_norm.kernels"
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MAX_HIDDEN = 32768  # a whole row in registers
ELEMENTS_PER_BLOCK = 4096  # BR * BH: rows per block for small H


# the reference, ``torch``, is ``ops.rms_norm.reference.rms_norm_reference`` (rows: ``ops.table``)


def _config(H: int) -> tuple[int, int, int]:
    """(BH, BR, warps) for rows of H features."""
    BH = next_pow2(H)
    return BH, max(1, ELEMENTS_PER_BLOCK // BH), 8 if BH >= 4096 else 4


def _programs(device: torch.device) -> int:
    """Programs of the backward: a few per SM so each carries one partial weight gradient."""
    if device.type != "cuda":
        return 4
    return 4 * torch.cuda.get_device_properties(device).multi_processor_count


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        K = kernels(KERNELS)
        H = x.shape[-1]
        x_RH = x.reshape(-1, H).contiguous()
        w = weight.contiguous()
        R = x_RH.shape[0]
        BH, BR, warps = _config(H)
        y = torch.empty(R, H, device=x.device, dtype=torch.promote_types(weight.dtype, x.dtype))
        rstd = torch.empty(R, device=x.device, dtype=torch.float32)
        if R > 0:
            K.rms_norm_fwd_kernel[(cdiv(R, BR),)](x_RH, w, y, rstd, R, eps, H=H, BR=BR, BH=BH, num_warps=warps)
        ctx.save_for_backward(x_RH, w, rstd)
        ctx.shape = x.shape
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, g_y):
        K = kernels(KERNELS)
        x_RH, w, rstd = ctx.saved_tensors
        R, H = x_RH.shape
        BH, BR, warps = _config(H)
        blocks = cdiv(R, BR)
        NB = next_pow2(cdiv(blocks, _programs(x_RH.device)))  # a power of two: few recompilations
        P = max(1, cdiv(blocks, NB))
        g_x = torch.empty_like(x_RH)
        part = torch.zeros(P, H, device=x_RH.device, dtype=torch.float32)
        if R > 0:
            K.rms_norm_bwd_kernel[(P,)](x_RH, w, g_y.reshape(R, H).contiguous(), rstd, g_x, part, R, H=H, BR=BR,
                                        BH=BH, NB=NB, num_warps=warps)
        g_w = part.sum(0).to(w.dtype) if ctx.needs_input_grad[1] else None
        return g_x.view(ctx.shape), g_w, None


def rms_norm_triton_supports(x: torch.Tensor, weight: torch.Tensor, eps: float) -> str | None:
    if x.dim() == 0 or weight.shape != (x.shape[-1],):
        return f"shapes x {tuple(x.shape)} vs weight {tuple(weight.shape)}"
    if x.dtype not in DTYPES or weight.dtype not in DTYPES:
        return f"dtypes {x.dtype}/{weight.dtype} (float64 runs the reference)"
    if x.shape[-1] > MAX_HIDDEN:
        return f"hidden {x.shape[-1]} > {MAX_HIDDEN} (a whole row sits in registers)"
    return triton_supports(x, weight)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Same contract as ``rms_norm_reference``."""
    return _RMSNorm.apply(x, weight, float(eps))
