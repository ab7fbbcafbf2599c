"""Triton kernels of ops ``moe_permute`` and ``moe_combine`` (imported lazily by ``triton_moe_glue``).

Shapes: N tokens, K experts per token, M = N * K routed rows, H columns; BR rows x BH columns per program.
Slot ``j = n * K + k`` is token n's k-th choice; ``order[m]`` the slot of sorted row m, ``inv[j]`` the
sorted row of slot j (``inv[order[m]] = m``). Offsets are int64 (``M * H`` passes 2^31: 262K rows x 8K).

- ``gather_rows_kernel``: ``out[m] = x[order[m] // K] * scale[order[m]]`` (no scale: a plain gather), cast
  to out's dtype in the store: the permutation's forward, and the combine's gradient of y (``PRE_ROUND``:
  x rounded to out's half dtype before the product, where torch's product runs in that dtype).
- ``sum_rows_kernel``: ``out[n] = sum_k round(y[inv[n K + k]] * w[n K + k])``, accumulated in fp32, one
  rounding to out's dtype: the combine's forward (``ROUND_P``: each product rounded to y's dtype first, as
  torch does when y and w are both half; ``ROUND_D``: then to out's dtype, the reference's ``.to(dtype)``
  before its sum), and without w the permutation's gradient of x.
- ``row_dot_kernel``: ``gw[j] = sum_h g[n, h] * y[inv[j], h]`` in fp32: the combine's gradient of w.
"""

import triton
import triton.language as tl

from megaseq.ops._triton_util import interpreting

_ROW_CONFIGS = [triton.Config({"BR": br, "BH": bh}, num_warps=w)
                for br, bh, w in ((4, 512, 4), (8, 256, 4), (2, 1024, 4), (1, 2048, 8), (16, 256, 8))]
ROW_CONFIGS = _ROW_CONFIGS[:1] if interpreting() else _ROW_CONFIGS
_DOT_CONFIGS = [triton.Config({"BR": br, "BH": bh}, num_warps=w)
                for br, bh, w in ((4, 512, 4), (8, 256, 4), (2, 1024, 4), (16, 128, 4))]
DOT_CONFIGS = _DOT_CONFIGS[:1] if interpreting() else _DOT_CONFIGS


@triton.autotune(configs=ROW_CONFIGS, key=["H", "HAS_SCALE", "PRE_ROUND"])
@triton.jit
def gather_rows_kernel(x_ptr, order_ptr, scale_ptr, out_ptr, M, H, K, stride_x, HAS_SCALE: tl.constexpr,
                       PRE_ROUND: tl.constexpr, BR: tl.constexpr, BH: tl.constexpr):
    m = (tl.program_id(0) * BR + tl.arange(0, BR)).to(tl.int64)
    cols = tl.program_id(1) * BH + tl.arange(0, BH)
    in_m = m < M
    mask = in_m[:, None] & (cols < H)[None, :]
    slot = tl.load(order_ptr + m, mask=in_m, other=0).to(tl.int64)
    v = tl.load(x_ptr + (slot // K)[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
    if HAS_SCALE:
        v = v.to(tl.float32)
        if PRE_ROUND:  # x rounded to out's (half) dtype before the product, as autograd casts it
            v = v.to(out_ptr.dtype.element_ty).to(tl.float32)
        s = tl.load(scale_ptr + slot, mask=in_m, other=0.0).to(tl.float32)
        v = v * s[:, None]
    tl.store(out_ptr + m[:, None] * H + cols[None, :], v.to(out_ptr.dtype.element_ty), mask=mask)


@triton.autotune(configs=ROW_CONFIGS, key=["H", "K", "HAS_W", "ROUND_P", "ROUND_D"])
@triton.jit
def sum_rows_kernel(y_ptr, inv_ptr, w_ptr, out_ptr, N, H, K, HAS_W: tl.constexpr, ROUND_P: tl.constexpr,
                    ROUND_D: tl.constexpr, BR: tl.constexpr, BH: tl.constexpr):
    n = (tl.program_id(0) * BR + tl.arange(0, BR)).to(tl.int64)
    cols = tl.program_id(1) * BH + tl.arange(0, BH)
    in_n = n < N
    mask = in_n[:, None] & (cols < H)[None, :]
    acc = tl.zeros((BR, BH), dtype=tl.float32)
    for k in range(K):
        j = n * K + k
        row = tl.load(inv_ptr + j, mask=in_n, other=0).to(tl.int64)
        p = tl.load(y_ptr + row[:, None] * H + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if HAS_W:
            w = tl.load(w_ptr + j, mask=in_n, other=0.0).to(tl.float32)
            p = p * w[:, None]
            if ROUND_P:
                p = p.to(y_ptr.dtype.element_ty).to(tl.float32)
        if ROUND_D:
            p = p.to(out_ptr.dtype.element_ty).to(tl.float32)
        acc += p
    tl.store(out_ptr + n[:, None] * H + cols[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.autotune(configs=DOT_CONFIGS, key=["H"])
@triton.jit
def row_dot_kernel(g_ptr, y_ptr, inv_ptr, out_ptr, M, H, K, BR: tl.constexpr, BH: tl.constexpr):
    j = (tl.program_id(0) * BR + tl.arange(0, BR)).to(tl.int64)
    in_j = j < M
    row = tl.load(inv_ptr + j, mask=in_j, other=0).to(tl.int64)
    n = j // K
    acc = tl.zeros((BR,), dtype=tl.float32)
    for h0 in range(0, H, BH):
        cols = h0 + tl.arange(0, BH)
        mask = in_j[:, None] & (cols < H)[None, :]
        g = tl.load(g_ptr + n[:, None] * H + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        y = tl.load(y_ptr + row[:, None] * H + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        acc += tl.sum(g * y, axis=1)
    tl.store(out_ptr + j, acc.to(out_ptr.dtype.element_ty), mask=in_j)
