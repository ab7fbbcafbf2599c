"""Triton kernel of ``ops.adamw.fused`` (imported lazily: it imports Triton)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def master_adamw_kernel(w_ptr, g_ptr, m_ptr, a_ptr, s_ptr, coef_ptr, bc_ptr, hyper_ptr, ok_ptr, i, n,
                        HAS_COEF: tl.constexpr, HAS_OK: tl.constexpr, BLOCK: tl.constexpr):
    """One block of one parameter: ``bc_ptr[2 i], bc_ptr[2 i + 1]`` its fp32 bias correction and square
    root of the second; ``hyper_ptr`` fp64 (lr, beta1, beta2, eps, weight_decay); with ``HAS_OK`` the int32
    at ``ok_ptr`` (0: the step's loss or gradient norm is not finite) masks every load and store: nothing is
    written."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    if HAS_OK:
        mask = mask & (tl.load(ok_ptr) != 0)
    lr = tl.load(hyper_ptr)
    beta1 = tl.load(hyper_ptr + 1)
    beta2 = tl.load(hyper_ptr + 2)
    eps = tl.load(hyper_ptr + 3)
    wd = tl.load(hyper_ptr + 4)
    bc1 = tl.load(bc_ptr + 2 * i)
    bc2_sqrt = tl.load(bc_ptr + 2 * i + 1)
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_COEF:
        g = g * tl.load(coef_ptr)
    p = tl.load(m_ptr + offs, mask=mask, other=0.0)
    ea = tl.load(a_ptr + offs, mask=mask, other=0.0)
    es = tl.load(s_ptr + offs, mask=mask, other=0.0)
    p64 = p.to(tl.float64)
    p = (p64 - lr * wd * p64).to(tl.float32)
    g64 = g.to(tl.float64)
    ea = (beta1 * ea.to(tl.float64) + (1.0 - beta1) * g64).to(tl.float32)
    es = (beta2 * es.to(tl.float64) + (1.0 - beta2) * g64 * g64).to(tl.float32)
    step_size = (lr / bc1.to(tl.float64)).to(tl.float32)
    denom = (tl.div_rn(tl.sqrt_rn(es), bc2_sqrt).to(tl.float64) + eps).to(tl.float32)
    p = p - tl.div_rn(step_size * ea, denom)
    tl.store(m_ptr + offs, p, mask=mask)
    tl.store(a_ptr + offs, ea, mask=mask)
    tl.store(s_ptr + offs, es, mask=mask)
    tl.store(w_ptr + offs, p.to(w_ptr.dtype.element_ty), mask=mask)
