"""Ops ``moe_permute`` and ``moe_combine`` in Triton: the routed rows out of token order and back, one pass each.

Shapes: N tokens, K experts per token, M = N * K rows, H hidden. ``order_M`` (the slots ``j = n * K + k``
sorted by expert) and ``inverse_M`` (``inverse[order[m]] = m``) come from ``Experts.forward``.

The references (``ops/moe_glue/reference.py``) are torch's indexing and arithmetic::

    permute: x_MH = x_NH[order_M // K]                                   (grouped_mm then casts to bf16)
    combine: out_NH = (y_MH[inverse_M] * w_NK.reshape(-1, 1)).to(dtype).view(N, K, H).sum(1).to(dtype)

The profile of a glm5-flash-1gpu step (``benchmarks/results/lora/runs/2026-12-02_48-layers-128k/``) shows
the experts' forward dominated by this glue, not the grouped GEMMs. With an fp32 stream the permutation writes
``[M, H]`` in fp32 and casts it; the combine gathers ``y``, multiplies bf16 by fp32 weights in a mixed-dtype
elementwise kernel (torch's slowest path) into another fp32 ``[M, H]`` and sums it; the backward repeats each.

Here the permutation gathers and casts in one kernel (its rows leave already in the matmul's dtype: a cast
commutes with a gather), and its backward sums each token's K row gradients in fp32; the combine reads each
token's K rows, weights and sums them in fp32 (rounding each product as the reference does) and writes
``[N, H]``; its backward writes y's gradient by gather-and-scale and the weights' by one dot per slot. No
``[M, H]`` float32 tensor is made in either direction. Results agree with the references up to the order
of the fp32 sums (``tests/ops/moe_glue/test_triton_moe_glue.py``; bitwise where nothing is summed).
"""

from __future__ import annotations

import torch

from megaseq.ops._triton_util import cdiv, kernels, triton_supports

KERNELS = "moe_glue.kernels"
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
HALF = (torch.bfloat16, torch.float16)


def _grid(rows: int, H: int):
    return lambda meta: (cdiv(rows, meta["BR"]), cdiv(H, meta["BH"]))


def _sum_rows(y_MH: torch.Tensor, inverse_M: torch.Tensor, w_M: torch.Tensor | None, out: torch.Tensor, K: int,
              round_p: bool = False, round_d: bool = False) -> torch.Tensor:
    N, H = out.shape
    if N * H:
        kernels(KERNELS).sum_rows_kernel[_grid(N, H)](y_MH, inverse_M, y_MH if w_M is None else w_M, out, N, H, K,
                                                      HAS_W=w_M is not None, ROUND_P=round_p, ROUND_D=round_d)
    return out


def _gather_rows(x_NH: torch.Tensor, order_M: torch.Tensor, scale_M: torch.Tensor | None, out: torch.Tensor, K: int,
                 pre_round: bool = False) -> torch.Tensor:
    M, H = out.shape
    if M * H:
        kernels(KERNELS).gather_rows_kernel[_grid(M, H)](x_NH, order_M, x_NH if scale_M is None else scale_M, out, M,
                                                         H, K, x_NH.stride(0), HAS_SCALE=scale_M is not None,
                                                         PRE_ROUND=pre_round)
    return out


class _Permute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_NH, order_M, inverse_M, K, dtype):
        out = torch.empty(order_M.numel(), x_NH.shape[1], device=x_NH.device, dtype=dtype)
        _gather_rows(x_NH, order_M, None, out, K)
        ctx.save_for_backward(inverse_M)
        ctx.K, ctx.x_shape, ctx.x_dtype = K, x_NH.shape, x_NH.dtype
        return out

    @staticmethod
    def backward(ctx, g_MH):
        (inverse_M,) = ctx.saved_tensors
        gx = torch.empty(ctx.x_shape, device=g_MH.device, dtype=ctx.x_dtype)
        return _sum_rows(g_MH.contiguous(), inverse_M, None, gx, ctx.K), None, None, None, None


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y_MH, order_M, inverse_M, weights_NK, dtype):
        N, K = weights_NK.shape
        w_M = weights_NK.reshape(-1).contiguous()
        prod = torch.promote_types(y_MH.dtype, weights_NK.dtype)
        out = torch.empty(N, y_MH.shape[1], device=y_MH.device, dtype=dtype)
        _sum_rows(y_MH, inverse_M, w_M, out, K, round_p=prod in HALF, round_d=dtype in HALF)
        ctx.save_for_backward(y_MH, order_M, inverse_M, w_M)
        ctx.prod_half, ctx.w_shape = prod in HALF, weights_NK.shape
        return out

    @staticmethod
    def backward(ctx, g_NH):
        y_MH, order_M, inverse_M, w_M = ctx.saved_tensors
        g_NH = g_NH.contiguous()
        K = ctx.w_shape[1]
        gy = _gather_rows(g_NH, order_M, w_M, torch.empty_like(y_MH), K, pre_round=ctx.prod_half)
        gw = torch.empty_like(w_M)
        M, H = y_MH.shape
        if M * H:
            kernels(KERNELS).row_dot_kernel[lambda meta: (cdiv(M, meta["BR"]),)](g_NH, y_MH, inverse_M, gw, M, H, K)
        return gy, None, None, gw.view(ctx.w_shape), None


def _index_problem(order_M: torch.Tensor, inverse_M: torch.Tensor, M: int) -> str | None:
    for name, t in (("order_M", order_M), ("inverse_M", inverse_M)):
        if t.dim() != 1 or t.numel() != M or t.dtype not in (torch.int32, torch.int64):
            return f"{name} {tuple(t.shape)} {t.dtype}: needs int32/int64 [{M}]"
    return None


def moe_permute_triton_supports(x_NH, order_M, inverse_M, K, dtype) -> str | None:
    if x_NH.dim() != 2 or x_NH.stride(-1) != 1:
        return f"x {tuple(x_NH.shape)} is not [N, H] with unit column stride"
    if x_NH.dtype not in DTYPES or dtype not in DTYPES:
        return f"dtypes {x_NH.dtype} -> {dtype} (the kernels run bf16/fp16/fp32; float64 runs the reference)"
    return _index_problem(order_M, inverse_M, x_NH.shape[0] * K) or triton_supports(x_NH, order_M, inverse_M)


def moe_combine_triton_supports(y_MH, order_M, inverse_M, weights_NK, dtype) -> str | None:
    if y_MH.dim() != 2 or not y_MH.is_contiguous() or weights_NK.dim() != 2:
        return f"y {tuple(y_MH.shape)} / weights {tuple(weights_NK.shape)}: needs contiguous [M, H] and [N, K]"
    if weights_NK.numel() != y_MH.shape[0]:
        return f"weights {tuple(weights_NK.shape)} do not match y's {y_MH.shape[0]} rows"
    if any(d not in DTYPES for d in (y_MH.dtype, weights_NK.dtype, dtype)):
        return f"dtypes {y_MH.dtype}, {weights_NK.dtype} -> {dtype} (bf16/fp16/fp32; float64 runs the reference)"
    return _index_problem(order_M, inverse_M, y_MH.shape[0]) or triton_supports(y_MH, order_M, inverse_M,
                                                                                  weights_NK)


def moe_permute_triton(x_NH: torch.Tensor, order_M: torch.Tensor, inverse_M: torch.Tensor, K: int,
                       dtype: torch.dtype) -> torch.Tensor:
    """Same contract as ``moe_permute_reference``; the rows come out in ``dtype``."""
    return _Permute.apply(x_NH, order_M, inverse_M, int(K), dtype)


def moe_combine_triton(y_MH: torch.Tensor, order_M: torch.Tensor, inverse_M: torch.Tensor, weights_NK: torch.Tensor,
                       dtype: torch.dtype) -> torch.Tensor:
    """Same contract as ``moe_combine_reference``."""
    return _Combine.apply(y_MH, order_M, inverse_M, weights_NK, dtype)
