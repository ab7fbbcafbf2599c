"""Triton kernel of op ``indexer_topk``: the lightning indexer's head-summed scores on tensor cores.

Shapes: c query rows of one chunk, n pools scored (the chunk's causal prefix), I indexer heads,
D indexer head dim (Dp: D padded to a power of two), BQ x BP the tile of one program.

One program scores a ``[BQ, BP]`` tile of (query, pool) pairs: it loads the pool keys once, then loops
over the I heads, each a ``[BQ, D] x [D, BP]`` tensor-core dot with fp32 accumulation, relu'd and
weighted by ``w[q, h] * scale`` into a ``[BQ, BP]`` fp32 accumulator in registers. The head scores
``[c, I, n]`` of the reference never exist. Pairs that are not visible (pool end after the query, or
another document) are written as ``floor`` (the dtype's min, as the reference); a tile with no visible
pair skips the dots (the causal upper half of a chunk, pools of other documents).

Operands are rounded to ``LOW`` (bf16 on the GPU; fp16 under the Triton interpreter, whose bf16 is
broken). An operand that is not already exact in ``LOW`` is split in registers into ``hi + lo``
(``hi = LOW(x)``, ``lo = LOW(x - hi)``, ``|x - hi - lo| <= u^2 |x|``) when ``SPLIT`` is set: one dot per
pair of parts, ``hi.hi + hi.lo + lo.hi`` (``lo.lo`` dropped, ``u^2``), two dots when only one operand is
split. Without ``SPLIT`` a non-exact operand is simply rounded (relative error ``u``). The error bound of
the result is derived in ``indexer_topk.score_error_bound``.

``scale > 0`` is folded into the head weight (``relu(scale * x) = scale * relu(x)``). Row offsets are
int64: ``c * n`` passes 2^31 for chunks of 32K rows at 1M tokens.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from megaseq.ops.triton_autotune import install as _install_autotune

_install_autotune()  # before any kernel of this module compiles: the cache directory and the tuned tables

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

# a handful of tiles: 8 warps for the 128 x 128 accumulator, fewer stages where two operands are split
CONFIGS = [
    triton.Config({"BQ": 128, "BP": 128}, num_warps=8, num_stages=2),
    triton.Config({"BQ": 64, "BP": 128}, num_warps=4, num_stages=3),
    triton.Config({"BQ": 128, "BP": 64}, num_warps=4, num_stages=3),
    triton.Config({"BQ": 64, "BP": 256}, num_warps=8, num_stages=2),
]


@triton.jit
def _index_scores_kernel(q_ptr, w_ptr, k_ptr, end_ptr, pdoc_ptr, qpos_ptr, qdoc_ptr, out_ptr,
                         C, N, stride_qc, stride_qh, stride_qd, stride_wc, stride_wh, stride_kp, stride_kd,
                         stride_oc, scale, floor,
                         NUM_HEADS: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, LOW: tl.constexpr,
                         SPLIT_Q: tl.constexpr, SPLIT_K: tl.constexpr, BQ: tl.constexpr, BP: tl.constexpr):
    pid_p = tl.program_id(0)  # pools fastest: programs running together share one query block
    pid_q = tl.program_id(1)
    offs_q = pid_q * BQ + tl.arange(0, BQ)
    offs_p = pid_p * BP + tl.arange(0, BP)
    offs_d = tl.arange(0, DP)
    in_q = offs_q < C
    in_p = offs_p < N
    in_d = offs_d < D
    q_pos = tl.load(qpos_ptr + offs_q, mask=in_q, other=-1)
    q_doc = tl.load(qdoc_ptr + offs_q, mask=in_q, other=-1)
    p_end = tl.load(end_ptr + offs_p, mask=in_p, other=0)
    p_doc = tl.load(pdoc_ptr + offs_p, mask=in_p, other=0)
    valid = (p_end[None, :] <= q_pos[:, None]) & (p_doc[None, :] == q_doc[:, None])
    valid = valid & in_q[:, None] & in_p[None, :]
    rows_q = offs_q.to(tl.int64)
    acc = tl.zeros((BQ, BP), dtype=tl.float32)
    if tl.max(valid.to(tl.int32)) > 0:
        k_off = offs_p.to(tl.int64)[:, None] * stride_kp + offs_d[None, :] * stride_kd
        k = tl.load(k_ptr + k_off, mask=in_p[:, None] & in_d[None, :], other=0.0)
        k_hi = k.to(LOW)
        kt_hi = tl.trans(k_hi)
        if SPLIT_K:
            kt_lo = tl.trans((k.to(tl.float32) - k_hi.to(tl.float32)).to(LOW))
        q_base = q_ptr + rows_q[:, None] * stride_qc + offs_d[None, :] * stride_qd
        for h in range(NUM_HEADS):
            q = tl.load(q_base + h * stride_qh, mask=in_q[:, None] & in_d[None, :], other=0.0)
            q_hi = q.to(LOW)
            s = tl.dot(q_hi, kt_hi)
            if SPLIT_K:
                s = tl.dot(q_hi, kt_lo, s)
            if SPLIT_Q:
                q_lo = (q.to(tl.float32) - q_hi.to(tl.float32)).to(LOW)
                s = tl.dot(q_lo, kt_hi, s)
            w = tl.load(w_ptr + rows_q * stride_wc + h * stride_wh, mask=in_q, other=0.0).to(tl.float32)
            acc += (w * scale)[:, None] * tl.maximum(s, 0.0)
    acc = tl.where(valid, acc, floor)
    out_off = rows_q[:, None] * stride_oc + offs_p[None, :]
    tl.store(out_ptr + out_off, acc, mask=in_q[:, None] & in_p[None, :])


_tuned = triton.autotune(configs=CONFIGS, key=["NUM_HEADS", "DP", "SPLIT_Q", "SPLIT_K"])(_index_scores_kernel)


def low_dtype() -> torch.dtype:
    """The dtype of the dot operands: bf16 on the GPU, fp16 under the interpreter (its bf16 is broken)."""
    return torch.float16 if INTERPRET else torch.bfloat16


def splits(q_dtype: torch.dtype, k_dtype: torch.dtype, split: bool) -> tuple[bool, bool]:
    """Which operands are split into hi + lo: those not exact in the low dtype, when ``split``."""
    low = low_dtype()
    return split and q_dtype != low, split and k_dtype != low


def index_scores(q_cID: torch.Tensor, w_cI: torch.Tensor, keys_PD: torch.Tensor, pool_end_P: torch.Tensor,
                 pool_doc_P: torch.Tensor, q_pos_c: torch.Tensor, q_doc_c: torch.Tensor, num_pools: int,
                 scale: float, floor: float, split: bool = True) -> torch.Tensor:
    """Low-precision index scores ``[c, n]`` fp32 of a chunk against the first ``n = num_pools`` pools.

    ``q`` and ``keys`` in fp32/bf16/fp16 (any strides), ``w`` in any float dtype; ``floor`` where the pool
    is not visible to the query. The positions and documents are read as given (int64).
    """
    c, I, D = q_cID.shape
    n = num_pools
    out_cn = torch.empty(c, n, dtype=torch.float32, device=q_cID.device)
    if c == 0 or n == 0:
        return out_cn
    sq, sk = splits(q_cID.dtype, keys_PD.dtype, split)
    low = tl.float16 if INTERPRET else tl.bfloat16
    args = (q_cID, w_cI, keys_PD, pool_end_P.contiguous(), pool_doc_P.contiguous(), q_pos_c.contiguous(),
            q_doc_c.contiguous(), out_cn, c, n, *q_cID.stride(), *w_cI.stride(), *keys_PD.stride(),
            out_cn.stride(0), float(scale), float(floor))
    meta = dict(NUM_HEADS=I, D=D, DP=triton.next_power_of_2(D), LOW=low, SPLIT_Q=sq, SPLIT_K=sk)
    if INTERPRET:  # one small tile: the interpreter runs each program in numpy
        grid = (triton.cdiv(n, 16), triton.cdiv(c, 16))
        _index_scores_kernel[grid](*args, **meta, BQ=16, BP=16)
    else:
        def grid(cfg):
            return (triton.cdiv(n, cfg["BP"]), triton.cdiv(c, cfg["BQ"]))

        _tuned[grid](*args, **meta)
    return out_cn
