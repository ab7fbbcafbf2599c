"""Op ``hc_mix`` in Triton: mHC's normalised-streams projection with the flattened streams read once each way.

Shapes: R = B * S tokens, D = N * H (the flattened streams), M = (2 + N) * N mixing outputs (24 for N = 4).

Contract (as ``ops/mhc/reference.py: hc_mix_reference``): ``mix = F.linear(flat * rsqrt(mean(flat^2) + eps),
fn)`` in the matmul's dtype (autocast's where it is on, else the compute dtype float32), differentiable in the
streams and ``fn``.

Why a kernel: with bf16 weights (the default) the streams are bf16 and ``fn`` float32 (HF keeps it so), so the
float32 GEMM of the reference, and of the closed-form ``torch_fused`` (``ops/mhc/mix_fused.py``), first widens the
``[R, D]`` streams into a float32 copy that it keeps for the backward (1 GiB per hyper-connection at 32K tokens
of glm5-flash-1gpu, 16 a step), runs on the CUDA cores (cuBLAS has no fp32 tensor-core GEMM without tf32), and
the backward makes three more float32 ``[R, D]`` passes (``d_u @ fn``, the widened streams, the
multiply-add) before rounding back. Here (``ops/mhc/mix_kernels.py``):

- forward: one pass over the bf16 streams computes ``u = flat @ fn^T`` and each row's sum of squares (with
  bf16 streams as three exact bf16 tensor-core products of ``fn``'s bf16 pieces, ``split_bf16x3``);
  ``mix = r * u`` with ``r = rsqrt(ss / D + eps)``. Saved: the streams themselves (the layer keeps them
  anyway), ``u`` ``[R, M]`` and ``r`` ``[R]`` in float32: 100 bytes a token instead of 4 * D.
- backward: ``d_u = r * g``, ``coef = -(sum(g * u) * r^3 / D)`` on ``[R, M]`` in torch, then one pass over the
  streams writes ``d_flat = d_u @ fn + coef * flat`` and sums ``d_fn = d_u^T @ flat`` per row chunk.

Numerics: float32 throughout (exact bf16 products or ``input_precision="ieee"``): the reference's values and
gradients to float32 rounding under bf16 weights; under bf16 autocast (fp32 weights) the reference multiplies
bf16-rounded operands and this kernel does not, so the two agree to bf16 rounding and this one is the closer
to exact. float64 runs the reference or ``torch_fused`` (float64 exactness).

Timings and errors: ``benchmarks/kernels/glue_gpu.py --only hc_mix`` (``benchmarks/results/speed/runs/
2026-12-02_hc-mix-triton/``).
"""

from __future__ import annotations

import torch

from megaseq.ops._triton_util import cdiv, kernels, next_pow2, triton_supports
from megaseq.ops.mhc.mix_fused import _mm_dtype, hc_mix_fused_supports

KERNELS = "mhc.mix_kernels"
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MAX_M = 128  # [BT, MP] and [MP, BD] fp32 tiles in registers
ROW_CHUNKS = 64  # the backward's dfn partial sums: at most this many [M, D] float32 slots
MIN_CHUNK = 1024  # rows per backward program at least


def chunk_rows(R: int, max_bt: int) -> int:
    """Rows per backward program: at least ``MIN_CHUNK``, at most ``ROW_CHUNKS`` chunks, a multiple of
    ``max_bt`` (every config's row block then divides it)."""
    rows = max(MIN_CHUNK, cdiv(R, ROW_CHUNKS))
    return cdiv(rows, max_bt) * max_bt


def split_bf16x3(w: torch.Tensor) -> torch.Tensor:
    """``[3, *w.shape]`` bf16 pieces ``hi, mid, lo`` with ``hi + mid + lo == w`` for a float32 ``w`` (8 + 8 + 8
    mantissa bits: exact but where a piece would fall below bf16's smallest normal)."""
    hi = w.to(torch.bfloat16)
    rest = w - hi.float()
    mid = rest.to(torch.bfloat16)
    return torch.stack([hi, mid, (rest - mid.float()).to(torch.bfloat16)])


def scale_grad_coef(g_RM: torch.Tensor, u_RM: torch.Tensor, r_R: torch.Tensor, D: int) -> torch.Tensor:
    """The gradient through the RMS scale, per row: ``d_flat += coef * flat`` with ``coef = -sum(g * u) r^3 / D``."""
    return -(g_RM * u_RM).sum(-1) * r_R.pow(3) / D


class _HcMixTriton(torch.autograd.Function):
    @staticmethod
    def forward(ctx, flat_RD, fn_MD, eps, out_dtype, carry=False):
        K = kernels(KERNELS)
        R, D = flat_RD.shape
        M = fn_MD.shape[0]
        kw = {"device": flat_RD.device, "dtype": torch.float32}
        u_RM, r_R = torch.empty(R, M, **kw), torch.empty(R, **kw)
        mix = torch.empty(R, M, device=flat_RD.device, dtype=out_dtype)
        split = flat_RD.dtype == torch.bfloat16 and flat_RD.is_cuda  # the interpreter's bf16 dot is not exact
        if R > 0:
            K.hc_mix_fwd_kernel[lambda meta: (cdiv(R, meta["BT"]),)](
                flat_RD, split_bf16x3(fn_MD.float()) if split else fn_MD, u_RM, r_R, mix, R, D, M, eps,
                MP=max(16, next_pow2(M)), SPLIT=split)
        ctx.save_for_backward(flat_RD, fn_MD, u_RM, r_R)
        ctx.set_materialize_grads(False)
        # carry: the streams again (a view with this node) for their other uses; their gradient from there comes
        # back here and is added in the backward kernel as it writes the streams' gradient
        return (mix, flat_RD) if carry else mix

    @staticmethod
    def backward(ctx, g_RM, g_carried=None):
        K = kernels(KERNELS)
        flat_RD, fn_MD, u_RM, r_R = ctx.saved_tensors
        need_x, need_fn = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        R, D = flat_RD.shape
        M = fn_MD.shape[0]
        if g_RM is None:  # only the carried streams were used
            return g_carried if need_x else None, None, None, None, None
        acc = g_carried.contiguous() if g_carried is not None and need_x else None
        g = g_RM.float()
        d_u = (g * r_R[:, None]).contiguous()
        coef = scale_grad_coef(g, u_RM, r_R, D).contiguous()
        chunk = chunk_rows(R, K.MAX_BT)
        n_chunks = max(cdiv(R, chunk), 1)
        d_flat = torch.empty_like(flat_RD) if need_x else None
        part = torch.empty(n_chunks, M, D, device=flat_RD.device, dtype=torch.float32) if need_fn else None
        if R > 0 and (need_x or need_fn):
            K.hc_mix_bwd_kernel[lambda meta: (cdiv(D, meta["BD"]), n_chunks)](
                flat_RD, fn_MD, d_u, coef, flat_RD if acc is None else acc, flat_RD if d_flat is None else d_flat,
                d_u if part is None else part, R, D, M, chunk, MP=max(16, next_pow2(M)), HAS_DX=need_x,
                HAS_DFN=need_fn, HAS_ACC=acc is not None)
        d_fn = None
        if need_fn:
            d_fn = (part.sum(0) if R > 0 else torch.zeros_like(fn_MD, dtype=torch.float32)).to(fn_MD.dtype)
        return d_flat, d_fn, None, None, None


def hc_mix_triton_supports(h_BSNH: torch.Tensor, fn_MD: torch.Tensor, norm_eps: float) -> str | None:
    why = hc_mix_fused_supports(h_BSNH, fn_MD, norm_eps)  # the shapes (the closed-form op's contract)
    if why is not None:
        return why
    if h_BSNH.dtype not in DTYPES or fn_MD.dtype not in DTYPES:
        return (f"dtypes h {h_BSNH.dtype}, fn {fn_MD.dtype} (the kernel computes in float32; float64 runs the "
                "reference, exactly)")
    if fn_MD.shape[0] > MAX_M:
        return f"{fn_MD.shape[0]} mixing outputs (the kernel holds them in registers: at most {MAX_M})"
    return triton_supports(h_BSNH, fn_MD)


def _apply(h_BSNH: torch.Tensor, fn_MD: torch.Tensor, norm_eps: float, carry: bool):
    B, S, N, H = h_BSNH.shape
    out = _mm_dtype(h_BSNH, torch.float32)
    with torch.autocast(h_BSNH.device.type, enabled=False):
        res = _HcMixTriton.apply(h_BSNH.reshape(B * S, N * H).contiguous(), fn_MD.contiguous(), float(norm_eps), out,
                                 carry)
    if carry:
        return res[0].view(B, S, -1), res[1].view(B, S, N, H)
    return res.view(B, S, -1)


def hc_mix_triton(h_BSNH: torch.Tensor, fn_MD: torch.Tensor, norm_eps: float) -> torch.Tensor:
    """Same contract as ``hc_mix_reference``: ``[B, S, M]`` in the matmul's dtype."""
    return _apply(h_BSNH, fn_MD, norm_eps, False)


def hc_mix_triton_carry(h_BSNH: torch.Tensor, fn_MD: torch.Tensor,
                        norm_eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(mix, streams)``: ``hc_mix_triton``'s mix, and the streams as a view to use in their place downstream
    (the collapse, the merge's residual). The gradient that view gets is added in the backward kernel as it
    writes the streams' gradient, not by autograd (a write and an add, read two, write one, per other use).
    ``models.common.mhc.call_carrying`` runs it."""
    return _apply(h_BSNH, fn_MD, norm_eps, True)


hc_mix_triton.carry = hc_mix_triton_carry
