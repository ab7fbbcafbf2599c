"""Ops ``hc_collapse`` and ``hc_merge``: the stream-wide halves of a hyper-connection, one Triton kernel each way.

Shapes: B batch, S tokens, N streams, H hidden; T = B * S.

``hc_collapse(pre_BSN, h_BSNH) -> x_BSH``: the block's input ``sum_n pre[n] * h[n]`` in h's dtype. In torch
the product is a float32 ``[B, S, N, H]`` temporary (1 GiB at 32K tokens, N = 4, H = 2048) written and read
again, and its backward another; here h is read once and x written once (grad: ``gh`` written, ``gpre``
reduced in registers).

``hc_merge(post_BSN, comb_BSNN, y_BSH, residual_BSNH) -> h_BSNH``: the new streams ``post[n] * y +
sum_m comb[m, n] * residual[m]`` in the residual's dtype; the torch reference runs a broadcast product, a
batched ``[N, N] @ [N, H]`` GEMM per token and an add, each a pass over ``[B, S, N, H]``. The kernel rounds
as the reference does (post and comb cast to the stream dtype, each term rounded, then the sum), so bf16
results agree to the last bit but where the GEMM's order of summation differs. Its gradients accumulate in
fp32 and round once, where autograd rounds the bf16 products of each term: closer to exact.

Both are token-separable: sequence sharding and tiling never change the result. References:
``ops/mhc/reference.py``; timings: ``benchmarks/kernels/glue_gpu.py`` (``benchmarks/results/kernels/h200_ops.md``).
"""

from __future__ import annotations

import torch

from megaseq.ops._triton_util import cdiv, kernels, next_pow2, triton_supports

KERNELS = "mhc.streams_kernels"
MAX_STREAMS = 8
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


# the references, ``torch``, are ``ops.mhc.reference.hc_collapse_reference`` / ``hc_merge_reference``


# ---- Triton -------------------------------------------------------------------------------------------
def _grid(T: int):
    return lambda meta: (cdiv(T, meta["BT"]),)


class _Collapse(torch.autograd.Function):
    @staticmethod
    def forward(ctx, pre_BSN, h_BSNH, carry=False):
        K = kernels(KERNELS)
        *lead, N, H = h_BSNH.shape
        pre_TN, h_TNH = pre_BSN.reshape(-1, N).contiguous(), h_BSNH.reshape(-1, N, H).contiguous()
        T = h_TNH.shape[0]
        x_TH = torch.empty(T, H, device=h_TNH.device, dtype=h_TNH.dtype)
        if T > 0:
            K.hc_collapse_fwd_kernel[_grid(T)](pre_TN, h_TNH, x_TH, T, H=H, N=N, NP=next_pow2(N))
        ctx.save_for_backward(pre_TN, h_TNH)
        ctx.shapes = (tuple(pre_BSN.shape), tuple(h_BSNH.shape))
        ctx.set_materialize_grads(False)
        x = x_TH.view(*lead, H)
        # carry: the streams again (autograd makes them a view with this node), for the merge's residual; their
        # gradient from there comes back to this backward, which adds it into its own as it writes it
        return (x, h_BSNH) if carry else x

    @staticmethod
    def backward(ctx, g_x, g_h_carried=None):
        K = kernels(KERNELS)
        pre_TN, h_TNH = ctx.saved_tensors
        T, N, H = h_TNH.shape
        pre_shape, h_shape = ctx.shapes
        if g_x is None:  # only the carried streams were used
            return None, None if g_h_carried is None else g_h_carried.reshape(h_shape), None
        g_pre = torch.empty(T, N, device=h_TNH.device, dtype=torch.float32)
        g_h = torch.empty_like(h_TNH)
        acc = None if g_h_carried is None else g_h_carried.reshape(T, N, H).contiguous()
        if T > 0:
            K.hc_collapse_bwd_kernel[_grid(T)](pre_TN, h_TNH, g_x.reshape(T, H).contiguous(),
                                               g_h if acc is None else acc, g_pre, g_h, T, H=H, N=N,
                                               NP=next_pow2(N), HAS_ACC=acc is not None)
        return g_pre.to(pre_TN.dtype).view(pre_shape), g_h.view(h_shape), None


class _Merge(torch.autograd.Function):
    @staticmethod
    def forward(ctx, post_BSN, comb_BSNN, y_BSH, residual_BSNH):
        K = kernels(KERNELS)
        *lead, N, H = residual_BSNH.shape
        post_TN, comb_TNN = post_BSN.reshape(-1, N).contiguous(), comb_BSNN.reshape(-1, N, N).contiguous()
        y_TH, res_TNH = y_BSH.reshape(-1, H).contiguous(), residual_BSNH.reshape(-1, N, H).contiguous()
        T = res_TNH.shape[0]
        out_TNH = torch.empty_like(res_TNH)
        if T > 0:
            K.hc_merge_fwd_kernel[_grid(T)](post_TN, comb_TNN, y_TH, res_TNH, out_TNH, T, H=H, N=N,
                                            NP=next_pow2(N))
        ctx.save_for_backward(post_TN, comb_TNN, y_TH, res_TNH)
        ctx.shapes = (post_BSN.shape, comb_BSNN.shape, y_BSH.shape, residual_BSNH.shape)
        return out_TNH.view(*lead, N, H)

    @staticmethod
    def backward(ctx, g_out):
        K = kernels(KERNELS)
        post_TN, comb_TNN, y_TH, res_TNH = ctx.saved_tensors
        T, N, H = res_TNH.shape
        kw = {"device": res_TNH.device, "dtype": torch.float32}
        g_post, g_comb = torch.empty(T, N, **kw), torch.empty(T, N, N, **kw)
        g_y, g_res = torch.empty_like(y_TH), torch.empty_like(res_TNH)
        if T > 0:
            K.hc_merge_bwd_kernel[_grid(T)](post_TN, comb_TNN, y_TH, res_TNH, g_out.reshape(T, N, H).contiguous(),
                                            g_post, g_comb, g_y, g_res, T, H=H, N=N, NP=next_pow2(N))
        post_shape, comb_shape, y_shape, res_shape = ctx.shapes
        return (g_post.to(post_TN.dtype).view(post_shape), g_comb.to(comb_TNN.dtype).view(comb_shape),
                g_y.view(y_shape), g_res.view(res_shape))


def _stream_supports(h_BSNH: torch.Tensor, *small: torch.Tensor) -> str | None:
    if h_BSNH.dtype not in DTYPES:
        return f"dtype {h_BSNH.dtype} (the kernels run {', '.join(map(str, DTYPES))}; the reference runs float64)"
    if h_BSNH.dim() < 2 or not 1 <= h_BSNH.shape[-2] <= MAX_STREAMS:
        return f"streams {tuple(h_BSNH.shape)} (expected [..., N, H] with 1 <= N <= {MAX_STREAMS})"
    for x in small:
        if x.dtype not in DTYPES:
            return f"dtype {x.dtype} of a weight (float64 runs the reference)"
    return triton_supports(h_BSNH, *small)


def hc_collapse_triton_supports(pre_BSN: torch.Tensor, h_BSNH: torch.Tensor) -> str | None:
    if pre_BSN.shape != h_BSNH.shape[:-1]:
        return f"pre {tuple(pre_BSN.shape)} vs streams {tuple(h_BSNH.shape)}"
    return _stream_supports(h_BSNH, pre_BSN)


def hc_collapse_triton(pre_BSN: torch.Tensor, h_BSNH: torch.Tensor) -> torch.Tensor:
    """Same contract as ``hc_collapse_reference``."""
    return _Collapse.apply(pre_BSN, h_BSNH)


def hc_collapse_triton_carry(pre_BSN: torch.Tensor, h_BSNH: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x, streams)``: ``hc_collapse_triton``'s x, and the streams as a view to use in their place downstream
    (the merge's residual). The gradient that view gets is added in the collapse's backward kernel as it writes
    the streams' gradient, not by autograd: one pass over ``[T, N, H]`` instead of a write and an add (read
    two, write one). ``models.common.mhc.call_carrying`` runs it."""
    return _Collapse.apply(pre_BSN, h_BSNH, True)


hc_collapse_triton.carry = hc_collapse_triton_carry


def hc_merge_triton_supports(post_BSN: torch.Tensor, comb_BSNN: torch.Tensor, y_BSH: torch.Tensor,
                             residual_BSNH: torch.Tensor) -> str | None:
    lead_N = residual_BSNH.shape[:-1]
    if post_BSN.shape != lead_N or comb_BSNN.shape != (*lead_N, lead_N[-1]) or \
            y_BSH.shape != (*lead_N[:-1], residual_BSNH.shape[-1]):
        return (f"shapes post {tuple(post_BSN.shape)}, comb {tuple(comb_BSNN.shape)}, y {tuple(y_BSH.shape)}, "
                f"residual {tuple(residual_BSNH.shape)}")
    # y may be in a narrower dtype than the streams (autocast's bf16 block output beside the fp32 streams of fp32
    # weights): the kernel reads it as fp32 and writes its gradient in y's dtype, as autograd does
    wider = torch.promote_types(y_BSH.dtype, residual_BSNH.dtype)
    if wider != residual_BSNH.dtype:
        return f"y {y_BSH.dtype} is wider than the residual's {residual_BSNH.dtype} (the reference returns {wider})"
    return _stream_supports(residual_BSNH, post_BSN, comb_BSNN, y_BSH)


def hc_merge_triton(post_BSN: torch.Tensor, comb_BSNN: torch.Tensor, y_BSH: torch.Tensor,
                    residual_BSNH: torch.Tensor) -> torch.Tensor:
    """Same contract as ``hc_merge_reference``."""
    return _Merge.apply(post_BSN, comb_BSNN, y_BSH, residual_BSNH)
