"""Triton kernels of op ``hc_mix`` (imported lazily by ``triton_hc_mix``: megaseq imports without Triton).

Shapes: T tokens (B * S flattened), D = N * H flattened stream features, M = (2 + N) * N mixing outputs
(24 for N = 4), MP = M padded to a power of two (at least 16: ``tl.dot``'s smallest side). ``x`` is the
flattened streams ``[T, D]`` in their own dtype (bf16 with bf16 weights), ``fn`` the ``[M, D]`` weight.

Everything is computed in float32, so the products are those of the float32 GEMM that HF's
``Glm5NextTextHyperConnection`` runs, summed in another order: the forward with bf16 streams (``SPLIT``)
multiplies them by the three bf16 pieces of ``fn`` on the tensor cores (each product exact in fp32); every
other dot widens its operands to fp32 as they are loaded and runs with ``input_precision="ieee"`` (fp32 FMAs,
no tf32). Offsets are int64 (``T * D`` passes 2^31 at
256K tokens of a 4 x 2048 stream).

- forward, one program per BT tokens walking D in blocks of BD: ``u = x @ fn^T`` and the sum of squares of
  each row from the same loads; ``r = rsqrt(ss / D + eps)``, ``mix = r * u``.
- backward, one program per (BD columns, chunk of rows): ``dx = du @ fn + coef * x`` for its rows and
  columns, and its chunk's share of ``dfn = du^T @ x`` in registers, written to its own slot of a
  ``[chunks, M, D]`` buffer (summed by torch: deterministic, no atomics). ``x`` is read once, ``dx``
  written once.
"""

import triton
import triton.language as tl

from megaseq.ops._triton_util import interpreting

_FWD = [triton.Config({"BT": bt, "BD": bd}, num_warps=w)
        for bt, bd, w in ((32, 128, 4), (64, 128, 4), (64, 64, 4), (128, 64, 8), (32, 256, 8))]
_BWD = [triton.Config({"BT": bt, "BD": bd}, num_warps=w)
        for bt, bd, w in ((32, 128, 4), (64, 128, 4), (64, 64, 4), (32, 256, 8), (128, 64, 8))]
FWD_CONFIGS = _FWD[:1] if interpreting() else _FWD  # the interpreter cannot time configs
BWD_CONFIGS = _BWD[:1] if interpreting() else _BWD
MAX_BT = max(c.kwargs["BT"] for c in _BWD)  # a backward row chunk is a multiple of every config's BT


@triton.autotune(configs=FWD_CONFIGS, key=["D", "M", "SPLIT"])
@triton.jit
def hc_mix_fwd_kernel(x_ptr, fn_ptr, u_ptr, r_ptr, mix_ptr, T, D, M, eps, MP: tl.constexpr, SPLIT: tl.constexpr,
                      BT: tl.constexpr, BD: tl.constexpr):
    """``u[t] = x[t] @ fn^T`` (fp32), ``r[t] = rsqrt(mean(x[t]^2) + eps)``, ``mix[t] = r[t] * u[t]`` (mix's dtype).

    ``SPLIT`` (bf16 streams): ``fn`` comes as three bf16 pieces ``[3, M, D]`` whose sum is the fp32 weight
    (``triton_hc_mix.split_bf16x3``), and ``u`` is three bf16 tensor-core products summed in fp32: a bf16
    stream times a bf16 piece is exact in fp32, so this is the fp32 GEMM's value, summed in another order,
    at tensor-core speed (the FMA dot is compute-bound)."""
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    tm = t < T
    rows = t.to(tl.int64) * D
    m = tl.arange(0, MP)
    mm = m < M
    acc = tl.zeros((BT, MP), dtype=tl.float32)
    ss = tl.zeros((BT,), dtype=tl.float32)
    for d0 in range(0, D, BD):
        d = d0 + tl.arange(0, BD)
        dm = d < D
        wm = mm[:, None] & dm[None, :]
        w_off = m[:, None] * D + d[None, :]
        if SPLIT:
            xb = tl.load(x_ptr + rows[:, None] + d[None, :], mask=tm[:, None] & dm[None, :], other=0.0)
            lo = tl.dot(xb, tl.trans(tl.load(fn_ptr + 2 * M * D + w_off, mask=wm, other=0.0)))
            lo = tl.dot(xb, tl.trans(tl.load(fn_ptr + M * D + w_off, mask=wm, other=0.0)), lo)
            acc += tl.dot(xb, tl.trans(tl.load(fn_ptr + w_off, mask=wm, other=0.0)), lo)
            x = xb.to(tl.float32)
        else:
            x = tl.load(x_ptr + rows[:, None] + d[None, :], mask=tm[:, None] & dm[None, :], other=0.0).to(tl.float32)
            w = tl.load(fn_ptr + w_off, mask=wm, other=0.0).to(tl.float32)
            acc += tl.dot(x, tl.trans(w), input_precision="ieee")  # per block, then summed: the error of a
            # sum of D / BD block sums, not of one running sum over D
        ss += tl.sum(x * x, axis=1)
    r = tl.rsqrt(ss / D + eps)
    out = t[:, None] * M + m[None, :]
    om = tm[:, None] & mm[None, :]
    tl.store(u_ptr + out, acc, mask=om)
    tl.store(r_ptr + t, r, mask=tm)
    tl.store(mix_ptr + out, (acc * r[:, None]).to(mix_ptr.dtype.element_ty), mask=om)


@triton.autotune(configs=BWD_CONFIGS, key=["D", "M", "HAS_DX", "HAS_DFN", "HAS_ACC"])
@triton.jit
def hc_mix_bwd_kernel(x_ptr, fn_ptr, du_ptr, coef_ptr, acc_ptr, dx_ptr, dfn_ptr, T, D, M, CHUNK, MP: tl.constexpr,
                      HAS_DX: tl.constexpr, HAS_DFN: tl.constexpr, HAS_ACC: tl.constexpr, BT: tl.constexpr,
                      BD: tl.constexpr):
    """Columns ``BD * program_id(0)`` on, rows ``CHUNK * program_id(1)`` on (CHUNK a multiple of BT):
    ``dx = du @ fn + coef * x`` (dx's dtype; ``HAS_ACC``: plus ``acc [T, D]``, the streams' gradient from their
    other uses, summed in fp32 and rounded once) and ``dfn[program_id(1)] = du^T @ x`` over the chunk (fp32)."""
    d = tl.program_id(0) * BD + tl.arange(0, BD)
    dm = d < D
    c = tl.program_id(1)
    m = tl.arange(0, MP)
    mm = m < M
    w = tl.load(fn_ptr + m[:, None] * D + d[None, :], mask=mm[:, None] & dm[None, :], other=0.0).to(tl.float32)
    acc = tl.zeros((MP, BD), dtype=tl.float32)
    for t0 in range(c * CHUNK, tl.minimum(c * CHUNK + CHUNK, T), BT):
        t = t0 + tl.arange(0, BT)
        tm = t < T
        rows = t.to(tl.int64) * D
        xm = tm[:, None] & dm[None, :]
        x = tl.load(x_ptr + rows[:, None] + d[None, :], mask=xm, other=0.0).to(tl.float32)
        du = tl.load(du_ptr + t[:, None] * M + m[None, :], mask=tm[:, None] & mm[None, :], other=0.0)
        if HAS_DX:
            coef = tl.load(coef_ptr + t, mask=tm, other=0.0)
            dx = tl.dot(du, w, input_precision="ieee") + coef[:, None] * x
            if HAS_ACC:
                dx += tl.load(acc_ptr + rows[:, None] + d[None, :], mask=xm, other=0.0).to(tl.float32)
            tl.store(dx_ptr + rows[:, None] + d[None, :], dx.to(dx_ptr.dtype.element_ty), mask=xm)
        if HAS_DFN:
            acc += tl.dot(tl.trans(du), x, input_precision="ieee")
    if HAS_DFN:
        tl.store(dfn_ptr + c.to(tl.int64) * M * D + m[:, None] * D + d[None, :], acc, mask=mm[:, None] & dm[None, :])
