"""Triton kernels of op ``rms_norm`` (imported lazily by ``triton_rms_norm``).

Shapes: R rows, H features (BH = H padded to a power of two: a whole row sits in registers), BR rows per
block, NB row blocks per program of the backward (its ``grad weight`` partial sum ``[H]`` stays in
registers over them). Offsets are int64 (``R * H`` passes 2^31 at 1M tokens x 2048).

Numerics are Hugging Face's: statistics in fp32, the normalised row rounded to the input dtype before the
weight multiplies it (in the output dtype ``promote_types(weight, x)``). The backward takes the weight's
gradient ``sum_r gy * xn`` in fp32 (autograd rounds each product to bf16 first), the input's through ``gy * w``
rounded to x's dtype, as autograd does.
"""

import triton
import triton.language as tl


@triton.jit
def _row_block(rb, R, H: tl.constexpr, BR: tl.constexpr, BH: tl.constexpr):
    r = (rb * BR + tl.arange(0, BR)).to(tl.int64)
    c = tl.arange(0, BH)
    mask = (r < R)[:, None] & (c < H)[None, :]
    return r, c, mask, r[:, None] * H + c[None, :]


@triton.jit
def rms_norm_fwd_kernel(x_ptr, w_ptr, y_ptr, rstd_ptr, R, eps, H: tl.constexpr, BR: tl.constexpr,
                        BH: tl.constexpr):
    r, c, mask, off = _row_block(tl.program_id(0), R, H, BR, BH)
    x_raw = tl.load(x_ptr + off, mask=mask, other=0.0)
    x = x_raw.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=1) / H + eps)
    w = tl.load(w_ptr + c, mask=c < H, other=0.0).to(tl.float32)
    xn = (x * rstd[:, None]).to(x_raw.dtype).to(tl.float32)
    tl.store(y_ptr + off, w[None, :] * xn, mask=mask)
    tl.store(rstd_ptr + r, rstd, mask=r < R)


@triton.jit
def rms_norm_bwd_kernel(x_ptr, w_ptr, gy_ptr, rstd_ptr, gx_ptr, gw_part_ptr, R, H: tl.constexpr,
                        BR: tl.constexpr, BH: tl.constexpr, NB: tl.constexpr):
    pid = tl.program_id(0)
    c = tl.arange(0, BH)
    w = tl.load(w_ptr + c, mask=c < H, other=0.0).to(tl.float32)
    gw = tl.zeros((BH,), dtype=tl.float32)
    for i in range(NB):
        r, c, mask, off = _row_block(pid * NB + i, R, H, BR, BH)
        x_raw = tl.load(x_ptr + off, mask=mask, other=0.0)
        x = x_raw.to(tl.float32)
        gy = tl.load(gy_ptr + off, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + r, mask=r < R, other=0.0)
        xn = x * rstd[:, None]
        gw += tl.sum(gy * xn.to(x_raw.dtype).to(tl.float32), axis=0)
        gxn = (gy * w[None, :]).to(x_raw.dtype).to(tl.float32)  # autograd's grad of xn, in x's dtype
        gx = rstd[:, None] * (gxn - xn * (tl.sum(gxn * xn, axis=1) / H)[:, None])
        tl.store(gx_ptr + off, gx, mask=mask)
    tl.store(gw_part_ptr + pid.to(tl.int64) * H + c, gw, mask=c < H)
