"""Triton kernels of op ``swiglu`` (imported lazily by ``triton_swiglu``).

Shapes: R rows, I columns; BR x BC tiles. Rows of gate and up may be strided (the two halves of a fused
``[R, 2I]`` gate-up projection, as the routed experts produce); outputs are contiguous. Offsets are int64
(``R * I`` passes 2^31 at 262K routed rows x 8K).

Rounding follows torch on half inputs: the clamped values and ``silu(gate)`` are rounded to the input dtype
before the product (``F.silu`` returns the input dtype), the product once; the backward rounds each
autograd step's result the same way (mul, then silu's backward in fp32), so bf16 results match torch's to
the last bit but for exp's rounding.
"""

import triton
import triton.language as tl

from megaseq.ops._triton_util import interpreting

_CONFIGS = [triton.Config({"BR": br, "BC": bc}, num_warps=w)
            for br, bc, w in ((1, 1024, 4), (4, 512, 4), (8, 256, 4), (2, 2048, 8), (16, 256, 8))]
CONFIGS = _CONFIGS[:1] if interpreting() else _CONFIGS


@triton.jit
def _load(g_ptr, u_ptr, g_stride, u_stride, R, I, limit, HAS_LIMIT: tl.constexpr, BR: tl.constexpr,
          BC: tl.constexpr):
    """This tile's raw gate and up (fp32), their clamped values rounded to the input dtype, offsets, mask.

    (A jit function cannot return a dtype: callers name it as ``g_ptr.dtype.element_ty``.)
    """
    r = (tl.program_id(0) * BR + tl.arange(0, BR)).to(tl.int64)
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    mask = (r < R)[:, None] & (c < I)[None, :]
    g_raw = tl.load(g_ptr + r[:, None] * g_stride + c[None, :], mask=mask, other=0.0)
    u_raw = tl.load(u_ptr + r[:, None] * u_stride + c[None, :], mask=mask, other=0.0)
    g, u = g_raw.to(tl.float32), u_raw.to(tl.float32)
    if HAS_LIMIT:
        gc = tl.minimum(g, limit).to(g_ptr.dtype.element_ty).to(tl.float32)
        uc = tl.minimum(tl.maximum(u, -limit), limit).to(g_ptr.dtype.element_ty).to(tl.float32)
    else:
        gc, uc = g, u
    return g, u, gc, uc, r[:, None] * I + c[None, :], mask


@triton.autotune(configs=CONFIGS, key=["I", "HAS_LIMIT"])
@triton.jit
def swiglu_fwd_kernel(g_ptr, u_ptr, out_ptr, g_stride, u_stride, R, I, limit, HAS_LIMIT: tl.constexpr,
                      BR: tl.constexpr, BC: tl.constexpr):
    _, _, gc, uc, off, mask = _load(g_ptr, u_ptr, g_stride, u_stride, R, I, limit, HAS_LIMIT, BR, BC)
    s = (gc * tl.sigmoid(gc)).to(g_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + off, s * uc, mask=mask)


@triton.autotune(configs=CONFIGS, key=["I", "HAS_LIMIT"])
@triton.jit
def swiglu_bwd_kernel(g_ptr, u_ptr, go_ptr, gg_ptr, gu_ptr, g_stride, u_stride, R, I, limit,
                      HAS_LIMIT: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr):
    """``gu = go * silu(gc)``, ``gg = silu'(gc) * (go * uc)``, each zero where its clamp was active (torch's
    clamp passes the gradient at the bound itself: ``x <= limit``)."""
    g, u, gc, uc, off, mask = _load(g_ptr, u_ptr, g_stride, u_stride, R, I, limit, HAS_LIMIT, BR, BC)
    go = tl.load(go_ptr + off, mask=mask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(gc)
    s = (gc * sig).to(g_ptr.dtype.element_ty).to(tl.float32)
    gu = go * s
    gs = (go * uc).to(g_ptr.dtype.element_ty).to(tl.float32)
    gg = gs * sig * (1 + gc * (1 - sig))
    if HAS_LIMIT:
        gu = tl.where((u >= -limit) & (u <= limit), gu, 0.0)
        gg = tl.where(g <= limit, gg, 0.0)
    tl.store(gu_ptr + off, gu, mask=mask)
    tl.store(gg_ptr + off, gg, mask=mask)
