"""Triton kernels of ops ``hc_collapse`` and ``hc_merge`` (imported lazily by ``triton_mhc_streams``).

Shapes: T tokens (B * S flattened), N streams (NP padded to a power of two), H hidden, BT tokens and BH
hidden columns per block. Streams ``[T, N, H]`` are contiguous; one program owns BT tokens and walks H
in blocks of BH, so the per-token reductions over H (grad pre, grad post, grad comb) stay in registers.
Offsets are int64 (``T * N * H`` passes 2^31 at 128K tokens).

``hc_merge`` rounds as the reference does in bf16: post and comb cast to the stream dtype first, the
two terms ``post * y`` and ``comb^T @ residual`` each rounded to it, then their sum (exact in fp32).
"""

import triton
import triton.language as tl

from megaseq.ops._triton_util import interpreting

_CONFIGS = [triton.Config({"BT": bt, "BH": bh}, num_warps=w)
            for bt, bh, w in ((4, 256, 4), (8, 256, 8), (2, 512, 4), (4, 512, 8), (16, 128, 4))]
CONFIGS = _CONFIGS[:1] if interpreting() else _CONFIGS  # the interpreter cannot time configs


@triton.jit
def _rows(pid, T, N: tl.constexpr, NP: tl.constexpr, BT: tl.constexpr):
    t = pid * BT + tl.arange(0, BT)
    n = tl.arange(0, NP)
    vec_m = (t < T)[:, None] & (n < N)[None, :]
    return t.to(tl.int64), t < T, n, vec_m


@triton.autotune(configs=CONFIGS, key=["H", "N"])
@triton.jit
def hc_collapse_fwd_kernel(pre_ptr, h_ptr, x_ptr, T, H: tl.constexpr, N: tl.constexpr, NP: tl.constexpr,
                           BT: tl.constexpr, BH: tl.constexpr):
    """``x[t, :] = sum_n pre[t, n] * h[t, n, :]`` in fp32, stored in x's dtype."""
    t, tm, n, vec_m = _rows(tl.program_id(0), T, N, NP, BT)
    pre = tl.load(pre_ptr + t[:, None] * N + n[None, :], mask=vec_m, other=0.0).to(tl.float32)
    for h0 in range(0, H, BH):
        h = h0 + tl.arange(0, BH)
        m3 = vec_m[:, :, None] & (h < H)[None, None, :]
        hv = tl.load(h_ptr + t[:, None, None] * (N * H) + n[None, :, None] * H + h[None, None, :], mask=m3,
                     other=0.0).to(tl.float32)
        x = tl.sum(pre[:, :, None] * hv, axis=1)
        tl.store(x_ptr + t[:, None] * H + h[None, :], x, mask=tm[:, None] & (h < H)[None, :])


@triton.autotune(configs=CONFIGS, key=["H", "N", "HAS_ACC"])
@triton.jit
def hc_collapse_bwd_kernel(pre_ptr, h_ptr, gx_ptr, gacc_ptr, gpre_ptr, gh_ptr, T, H: tl.constexpr, N: tl.constexpr,
                           NP: tl.constexpr, HAS_ACC: tl.constexpr, BT: tl.constexpr, BH: tl.constexpr):
    """``gh = pre * gx`` (h's dtype; ``HAS_ACC``: plus ``gacc``, the streams' gradient from their other uses,
    summed in fp32 and rounded once) and ``gpre[t, n] = sum_h gx[t, h] * h[t, n, h]`` (fp32)."""
    t, tm, n, vec_m = _rows(tl.program_id(0), T, N, NP, BT)
    pre = tl.load(pre_ptr + t[:, None] * N + n[None, :], mask=vec_m, other=0.0).to(tl.float32)
    gpre = tl.zeros((BT, NP), dtype=tl.float32)
    for h0 in range(0, H, BH):
        h = h0 + tl.arange(0, BH)
        m3 = vec_m[:, :, None] & (h < H)[None, None, :]
        off3 = t[:, None, None] * (N * H) + n[None, :, None] * H + h[None, None, :]
        hv = tl.load(h_ptr + off3, mask=m3, other=0.0).to(tl.float32)
        gx = tl.load(gx_ptr + t[:, None] * H + h[None, :], mask=tm[:, None] & (h < H)[None, :],
                     other=0.0).to(tl.float32)
        gh = pre[:, :, None] * gx[:, None, :]
        if HAS_ACC:
            gh += tl.load(gacc_ptr + off3, mask=m3, other=0.0).to(tl.float32)
        tl.store(gh_ptr + off3, gh, mask=m3)
        gpre += tl.sum(gx[:, None, :] * hv, axis=2)
    tl.store(gpre_ptr + t[:, None] * N + n[None, :], gpre, mask=vec_m)


@triton.autotune(configs=CONFIGS, key=["H", "N"])
@triton.jit
def hc_merge_fwd_kernel(post_ptr, comb_ptr, y_ptr, res_ptr, out_ptr, T, H: tl.constexpr, N: tl.constexpr,
                        NP: tl.constexpr, BT: tl.constexpr, BH: tl.constexpr):
    """``out[t, n, :] = post[t, n] * y[t, :] + sum_m comb[t, m, n] * res[t, m, :]``."""
    t, tm, n, vec_m = _rows(tl.program_id(0), T, N, NP, BT)
    dt = out_ptr.dtype.element_ty
    post = tl.load(post_ptr + t[:, None] * N + n[None, :], mask=vec_m, other=0.0).to(dt).to(tl.float32)
    for h0 in range(0, H, BH):
        h = h0 + tl.arange(0, BH)
        m2 = tm[:, None] & (h < H)[None, :]
        y = tl.load(y_ptr + t[:, None] * H + h[None, :], mask=m2, other=0.0).to(tl.float32)
        acc = tl.zeros((BT, NP, BH), dtype=tl.float32)
        for m in tl.static_range(N):
            c_m = tl.load(comb_ptr + t[:, None] * (N * N) + m * N + n[None, :], mask=vec_m, other=0.0)
            r_m = tl.load(res_ptr + t[:, None] * (N * H) + m * H + h[None, :], mask=m2, other=0.0)
            acc += c_m.to(dt).to(tl.float32)[:, :, None] * r_m.to(tl.float32)[:, None, :]
        out = (post[:, :, None] * y[:, None, :]).to(dt).to(tl.float32) + acc.to(dt).to(tl.float32)
        tl.store(out_ptr + t[:, None, None] * (N * H) + n[None, :, None] * H + h[None, None, :], out,
                 mask=vec_m[:, :, None] & (h < H)[None, None, :])


@triton.autotune(configs=CONFIGS, key=["H", "N"])
@triton.jit
def hc_merge_bwd_kernel(post_ptr, comb_ptr, y_ptr, res_ptr, gout_ptr, gpost_ptr, gcomb_ptr, gy_ptr, gres_ptr,
                        T, H: tl.constexpr, N: tl.constexpr, NP: tl.constexpr, BT: tl.constexpr,
                        BH: tl.constexpr):
    """``gy = sum_n post[n] gout[n]``, ``gres[m] = sum_n comb[m, n] gout[n]`` (stream dtype); ``gpost[n] =
    sum_h gout[n] y``, ``gcomb[m, n] = sum_h gout[n] res[m]`` (fp32, in registers over the H blocks)."""
    t, tm, n, vec_m = _rows(tl.program_id(0), T, N, NP, BT)
    dt = gres_ptr.dtype.element_ty
    post = tl.load(post_ptr + t[:, None] * N + n[None, :], mask=vec_m, other=0.0).to(dt).to(tl.float32)
    gpost = tl.zeros((BT, NP), dtype=tl.float32)
    gcomb = tl.zeros((BT, NP, NP), dtype=tl.float32)  # [token, m, n]
    for h0 in range(0, H, BH):
        h = h0 + tl.arange(0, BH)
        m2 = tm[:, None] & (h < H)[None, :]
        go = tl.load(gout_ptr + t[:, None, None] * (N * H) + n[None, :, None] * H + h[None, None, :],
                     mask=vec_m[:, :, None] & (h < H)[None, None, :], other=0.0).to(tl.float32)
        y = tl.load(y_ptr + t[:, None] * H + h[None, :], mask=m2, other=0.0).to(tl.float32)
        tl.store(gy_ptr + t[:, None] * H + h[None, :], tl.sum(go * post[:, :, None], axis=1), mask=m2)
        gpost += tl.sum(go * y[:, None, :], axis=2)
        for m in tl.static_range(N):
            c_m = tl.load(comb_ptr + t[:, None] * (N * N) + m * N + n[None, :], mask=vec_m, other=0.0)
            off_m = t[:, None] * (N * H) + m * H + h[None, :]
            r_m = tl.load(res_ptr + off_m, mask=m2, other=0.0).to(tl.float32)
            tl.store(gres_ptr + off_m, tl.sum(c_m.to(dt).to(tl.float32)[:, :, None] * go, axis=1), mask=m2)
            gc_m = tl.sum(go * r_m[:, None, :], axis=2)  # [token, n]
            gcomb += tl.where(n[None, :, None] == m, gc_m[:, None, :], 0.0)
    tl.store(gpost_ptr + t[:, None] * N + n[None, :], gpost, mask=vec_m)
    tl.store(gcomb_ptr + t[:, None, None] * (N * N) + n[None, :, None] * N + n[None, None, :], gcomb,
             mask=vec_m[:, :, None] & (n < N)[None, None, :])
