"""Op ``hc_mix``, fused: mHC's normalised-streams projection with the RMS scale applied after the GEMM.

Shapes: R = B * S tokens, D = N * H (the flattened streams), M = (2 + N) * N mixing outputs (24 for N = 4).

The reference (``ops/mhc/reference.py: hc_mix_reference``, HF's order of ops)::

    flat = h.reshape(R, D).float();  flat = flat * rsqrt(mean(flat^2) + eps);  mix = F.linear(flat, fn)

makes the normalised ``[R, D]`` float32 tensor (1 GiB at 32K tokens of glm5-flash-1gpu, 16 times a step),
squares it into another, casts it to bf16 for the GEMM, and autograd's backward walks back through each
(pow, mean, rsqrt, two products, the cast): about ten passes over ``[R, D]``. The scale is one number per
token and the GEMM is linear, so ``mix = r * (flat @ fn^T)`` with ``r = rsqrt(sum(flat^2) / D + eps)``:

- forward: ``r`` from one reduction (``torch.linalg.vector_norm``, no ``[R, D]`` temporary), the GEMM on
  the flattened streams in the matmul dtype (the cast autocast would make), ``r`` applied to ``[R, M]``;
- backward: ``d_u = r * d_mix``, ``d_r = sum(d_mix * u)``, ``d_fn = d_u^T @ flat``, and
  ``d_flat = d_u @ fn - (d_r * r^3 / D) * flat`` (one GEMM and one fused multiply-add over ``[R, D]``).

Numerics: in float32 and float64 the same value as the reference to rounding (the tests hold float64 to
1e-12); under bf16 autocast the GEMM's operand is the unnormalised stream rounded to bf16 instead of the
normalised one (the same relative rounding), so the mix agrees to bf16 rounding, not bit for bit. Opt-in
(``model.kernels fast``).
"""

from __future__ import annotations

import torch


def _mm_dtype(h: torch.Tensor, cd: torch.dtype) -> torch.dtype:
    """The GEMM's dtype as the reference's ``F.linear`` picks it: autocast's where it is on, else ``cd``."""
    dev = h.device.type
    if torch.is_autocast_enabled(dev):
        return torch.get_autocast_dtype(dev)
    return cd


class _HcMix(torch.autograd.Function):
    @staticmethod
    def forward(ctx, flat_RD, fn_MD, eps, cd, mm):
        D = flat_RD.shape[1]
        r_R = torch.rsqrt(torch.linalg.vector_norm(flat_RD, dim=-1, dtype=cd).square() / D + eps)
        flat_mm = flat_RD.to(mm)
        fn_mm = fn_MD.to(mm)
        u_RM = flat_mm @ fn_mm.T
        mix = (u_RM.to(cd) * r_R[:, None]).to(mm)
        ctx.save_for_backward(flat_RD, flat_mm if flat_mm is not flat_RD else None, fn_MD, r_R, u_RM)
        ctx.cd, ctx.mm = cd, mm
        return mix

    @staticmethod
    def backward(ctx, g_RM):
        with torch.autocast(g_RM.device.type, enabled=False):  # backward may run in the caller's autocast
            return _HcMix._backward(ctx, g_RM)

    @staticmethod
    def _backward(ctx, g_RM):
        flat_RD, flat_mm, fn_MD, r_R, u_RM = ctx.saved_tensors
        cd, mm = ctx.cd, ctx.mm
        flat_mm = flat_RD if flat_mm is None else flat_mm
        D = flat_RD.shape[1]
        g = g_RM.to(cd)
        d_u = (g * r_R[:, None]).to(mm)
        d_fn = (d_u.T @ flat_mm).to(fn_MD.dtype) if ctx.needs_input_grad[1] else None
        d_flat = None
        if ctx.needs_input_grad[0]:
            d_r = (g * u_RM.to(cd)).sum(-1)
            coef = -(d_r * r_R.pow(3) / D)
            d_flat = torch.addcmul((d_u @ fn_MD.to(mm)).to(cd), flat_RD.to(cd), coef[:, None]).to(flat_RD.dtype)
        return d_flat, d_fn, None, None, None


def hc_mix_fused_supports(h_BSNH: torch.Tensor, fn_MD: torch.Tensor, norm_eps: float) -> str | None:
    if h_BSNH.dim() != 4 or fn_MD.dim() != 2 or fn_MD.shape[1] != h_BSNH.shape[2] * h_BSNH.shape[3]:
        return f"h {tuple(h_BSNH.shape)} / fn {tuple(fn_MD.shape)}: needs [B, S, N, H] and [M, N * H]"
    if h_BSNH.device != fn_MD.device:
        return "h and fn are on different devices"
    return None


def hc_mix_fused(h_BSNH: torch.Tensor, fn_MD: torch.Tensor, norm_eps: float) -> torch.Tensor:
    """Same contract as ``hc_mix_reference``: ``[B, S, M]`` in the matmul's dtype."""
    B, S, N, H = h_BSNH.shape
    cd = torch.promote_types(h_BSNH.dtype, torch.float32)
    mm = _mm_dtype(h_BSNH, cd)
    with torch.autocast(h_BSNH.device.type, enabled=False):
        mix = _HcMix.apply(h_BSNH.reshape(B * S, N * H), fn_MD, float(norm_eps), cd, mm)
    return mix.view(B, S, -1)
