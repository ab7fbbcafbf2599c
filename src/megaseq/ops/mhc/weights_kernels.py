"""Triton kernels of op ``hc_weights`` (imported lazily by ``triton_mhc``: megaseq imports without Triton).

Shapes: T tokens (B * S flattened), N streams, NP = N padded to a power of two, M = 2N + N*N columns of
``mix``, BT tokens per program. A comb matrix is ``[BT, NP, NP]``: axis 1 is its row i (dim -2 of
``comb_BSNN``), axis 2 its column j; padded rows and columns hold 0.

Sinkhorn order (HF's): ``A_0 = col(P)``, then ``A_p = col(row(A_{p-1}))`` for p = 1 .. iters-1, where
``col`` divides by the column sums (sum over i) + eps and ``row`` by the row sums (sum over j) + eps.
The backward walks the pairs in reverse. It needs the input of every normalisation, which it recomputes
from ``P`` (no per-iteration state leaves the registers): pairs go in segments of ``SEG``; each segment
first rebuilds its starting matrix from ``P``, then each pair of the segment from that checkpoint, so
the work is about ``iters^2 / (2 SEG) + iters * SEG / 2`` pairs instead of ``iters^2 / 2``.
"""

import triton
import triton.language as tl


@triton.jit
def _col(X, eps):
    """Divide by the column sums (over i) + eps."""
    return X / (tl.sum(X, axis=1)[:, None, :] + eps)


@triton.jit
def _row(X, eps):
    """Divide by the row sums (over j) + eps."""
    return X / (tl.sum(X, axis=2)[:, :, None] + eps)


@triton.jit
def _col_bwd(X, gY, eps):
    """Gradient through ``Y = X / (colsum(X) + eps)``: ``(gY - colsum(gY * Y)) / (colsum(X) + eps)``."""
    d = tl.sum(X, axis=1)[:, None, :] + eps
    Y = X / d
    return (gY - tl.sum(gY * Y, axis=1)[:, None, :]) / d


@triton.jit
def _row_bwd(X, gY, eps):
    d = tl.sum(X, axis=2)[:, :, None] + eps
    Y = X / d
    return (gY - tl.sum(gY * Y, axis=2)[:, :, None]) / d


@triton.jit
def _tile(pid, T, N: tl.constexpr, NP: tl.constexpr, BT: tl.constexpr):
    """Token indices of this program and the masks of its [BT, NP] vectors and [BT, NP, NP] matrices."""
    t = pid * BT + tl.arange(0, BT)
    n = tl.arange(0, NP)
    vec_m = (t < T)[:, None] & (n < N)[None, :]
    mat_m = vec_m[:, :, None] & (n < N)[None, None, :]
    return t, n, vec_m, mat_m


@triton.jit
def _softmax_rows(mix_ptr, base_ptr, s_comb, row, n, mat_m, hc_eps, N: tl.constexpr):
    """Raw comb weights, their row softmax ``sm`` and ``P = sm + eps`` (0 on padding)."""
    ij = n[:, None] * N + n[None, :]
    w = tl.load(mix_ptr + row[:, None, None] + 2 * N + ij[None, :, :], mask=mat_m, other=0.0).to(tl.float32)
    b = tl.load(base_ptr + 2 * N + ij, mask=(n < N)[:, None] & (n < N)[None, :], other=0.0).to(tl.float32)
    z = tl.where(mat_m, w * s_comb + b[None, :, :], -1e30)  # -1e30: a padded row stays finite (uniform)
    e = tl.exp(z - tl.max(z, axis=2)[:, :, None])
    sm = tl.where(mat_m, e / tl.sum(e, axis=2)[:, :, None], 0.0)
    P = tl.where(mat_m, sm + hc_eps, 0.0)
    return w, sm, P


@triton.jit
def hc_weights_fwd_kernel(mix_ptr, base_ptr, scale_ptr, pre_ptr, post_ptr, comb_ptr, T, M, hc_eps, ITERS: tl.constexpr,
                          N: tl.constexpr, NP: tl.constexpr, BT: tl.constexpr):
    pid = tl.program_id(0)
    t, n, vec_m, mat_m = _tile(pid, T, N, NP, BT)
    row = t.to(tl.int64) * M  # int64: T * M passes 2^31 beyond ~89M tokens
    s_pre = tl.load(scale_ptr).to(tl.float32)
    s_post = tl.load(scale_ptr + 1).to(tl.float32)
    s_comb = tl.load(scale_ptr + 2).to(tl.float32)
    b_pre = tl.load(base_ptr + n, mask=n < N, other=0.0).to(tl.float32)
    b_post = tl.load(base_ptr + N + n, mask=n < N, other=0.0).to(tl.float32)
    w_pre = tl.load(mix_ptr + row[:, None] + n[None, :], mask=vec_m, other=0.0).to(tl.float32)
    w_post = tl.load(mix_ptr + row[:, None] + N + n[None, :], mask=vec_m, other=0.0).to(tl.float32)
    pre = tl.sigmoid(w_pre * s_pre + b_pre[None, :]) + hc_eps
    post = 2 * tl.sigmoid(w_post * s_post + b_post[None, :])
    vec_off = t.to(tl.int64)[:, None] * N + n[None, :]
    tl.store(pre_ptr + vec_off, pre, mask=vec_m)
    tl.store(post_ptr + vec_off, post, mask=vec_m)

    _, _, X = _softmax_rows(mix_ptr, base_ptr, s_comb, row, n, mat_m, hc_eps, N)
    X = _col(X, hc_eps)
    for _ in range(ITERS - 1):
        X = _col(_row(X, hc_eps), hc_eps)
    mat_off = t.to(tl.int64)[:, None, None] * (N * N) + (n[:, None] * N + n[None, :])[None, :, :]
    tl.store(comb_ptr + mat_off, X, mask=mat_m)


@triton.jit
def _sinkhorn_bwd(P, gA, mat_m, hc_eps, ITERS: tl.constexpr, SEG: tl.constexpr):
    """Gradient wrt ``P`` of the Sinkhorn output, given its gradient ``gA`` (see the module docstring).

    The segment loop is unrolled (its bounds are compile-time), the loops inside are not.
    Padded entries are zeroed after each pair: their denominators are eps alone, and the 1/eps factors would
    overflow to inf and then NaN (inf * 0) within a few pairs.
    """
    NUM_SEG: tl.constexpr = (ITERS - 1 + SEG - 1) // SEG
    for s in tl.static_range(NUM_SEG):
        p0 = 1 + (NUM_SEG - 1 - s) * SEG  # first pair of this segment (compile-time: s is a static index)
        p1 = ITERS if p0 + SEG > ITERS else p0 + SEG  # (an annotated constexpr cannot be reassigned per s)
        C = _col(P, hc_eps)
        for _ in range(1, p0):
            C = _col(_row(C, hc_eps), hc_eps)  # C = A_{p0 - 1}
        for q in range(p1 - p0):
            X = C
            for _ in range(p1 - 1 - q - p0):
                X = _col(_row(X, hc_eps), hc_eps)  # X = A_{p - 1}, p = p1 - 1 - q
            R = _row(X, hc_eps)
            gA = tl.where(mat_m, _row_bwd(X, tl.where(mat_m, _col_bwd(R, gA, hc_eps), 0.0), hc_eps), 0.0)
    return tl.where(mat_m, _col_bwd(P, gA, hc_eps), 0.0)


@triton.jit
def _gate_bwd(g_ptr, mix_ptr, base_ptr, s, row, vec_off, n, vec_m, col0, factor, HAS_G: tl.constexpr,
              N: tl.constexpr, BT: tl.constexpr, NP: tl.constexpr):
    """``factor * sigmoid(w * s + b)``'s gradient wrt its pre-activation, and the raw weights ``w``."""
    w = tl.load(mix_ptr + row[:, None] + col0 + n[None, :], mask=vec_m, other=0.0).to(tl.float32)
    if HAS_G:
        b = tl.load(base_ptr + col0 + n, mask=n < N, other=0.0).to(tl.float32)
        sig = tl.sigmoid(w * s + b[None, :])
        g = tl.load(g_ptr + vec_off, mask=vec_m, other=0.0).to(tl.float32)
        ga = tl.where(vec_m, g * factor * sig * (1 - sig), 0.0)
    else:
        ga = tl.zeros((BT, NP), dtype=tl.float32)
    return ga, w


@triton.jit
def hc_weights_bwd_kernel(mix_ptr, base_ptr, scale_ptr, gpre_ptr, gpost_ptr, gcomb_ptr, gmix_ptr, part_ptr,
                          T, M, hc_eps, ITERS: tl.constexpr, N: tl.constexpr, NP: tl.constexpr,
                          BT: tl.constexpr, SEG: tl.constexpr, HAS_GPRE: tl.constexpr, HAS_GPOST: tl.constexpr,
                          HAS_GCOMB: tl.constexpr):
    """Writes ``grad mix [T, M]`` and this program's partial sums ``part[pid] = (grad base [M], grad scale [3])``."""
    pid = tl.program_id(0)
    t, n, vec_m, mat_m = _tile(pid, T, N, NP, BT)
    row = t.to(tl.int64) * M
    vec_off = t.to(tl.int64)[:, None] * N + n[None, :]
    mat_off = t.to(tl.int64)[:, None, None] * (N * N) + (n[:, None] * N + n[None, :])[None, :, :]
    s_pre = tl.load(scale_ptr).to(tl.float32)
    s_post = tl.load(scale_ptr + 1).to(tl.float32)
    s_comb = tl.load(scale_ptr + 2).to(tl.float32)

    ga_pre, w_pre = _gate_bwd(gpre_ptr, mix_ptr, base_ptr, s_pre, row, vec_off, n, vec_m, 0, 1.0, HAS_GPRE,
                              N, BT, NP)
    ga_post, w_post = _gate_bwd(gpost_ptr, mix_ptr, base_ptr, s_post, row, vec_off, n, vec_m, N, 2.0, HAS_GPOST,
                                N, BT, NP)
    w_comb, sm, P = _softmax_rows(mix_ptr, base_ptr, s_comb, row, n, mat_m, hc_eps, N)
    if HAS_GCOMB:
        gA = tl.load(gcomb_ptr + mat_off, mask=mat_m, other=0.0).to(tl.float32)
        gP = _sinkhorn_bwd(P, gA, mat_m, hc_eps, ITERS, SEG)
        gz = sm * (gP - tl.sum(gP * sm, axis=2)[:, :, None])  # softmax backward (P = sm + eps)
    else:
        gz = tl.zeros((BT, NP, NP), dtype=tl.float32)

    ij = n[:, None] * N + n[None, :]
    tl.store(gmix_ptr + row[:, None] + n[None, :], ga_pre * s_pre, mask=vec_m)
    tl.store(gmix_ptr + row[:, None] + N + n[None, :], ga_post * s_post, mask=vec_m)
    tl.store(gmix_ptr + row[:, None, None] + 2 * N + ij[None, :, :], gz * s_comb, mask=mat_m)

    part = part_ptr + pid.to(tl.int64) * (M + 3)
    tl.store(part + n, tl.sum(ga_pre, axis=0), mask=n < N)
    tl.store(part + N + n, tl.sum(ga_post, axis=0), mask=n < N)
    tl.store(part + 2 * N + ij, tl.sum(gz, axis=0), mask=(n < N)[:, None] & (n < N)[None, :])
    tl.store(part + M, tl.sum(tl.sum(ga_pre * w_pre, axis=1), axis=0))
    tl.store(part + M + 1, tl.sum(tl.sum(ga_post * w_post, axis=1), axis=0))
    tl.store(part + M + 2, tl.sum(tl.sum(tl.sum(gz * w_comb, axis=2), axis=1), axis=0))
