"""Triton kernel of op ``indexer_target``: the sparse stage's target of the indexer objective.

Shapes: c queries, Hh heads, C latent width (CP: padded to a power of two), S keys, W selected slots per
query, BH heads per block (>= 16: ``tl.dot`` needs M, N, K >= 16), BW slots per loop step, NHB head blocks.

One program per query computes ``m[w] = sum_h softmax_w(scale * q_abs[h] . c[idx[w]])`` over the query's
valid slots (``idx`` in ``[0, S)``), in two passes over its W slots:

1. per head block, an online max and sum of ``exp2`` of the base-2 logits ``scale * log2(e) * q . c``, as the
   fused sparse MLA's forward does: ``lse2 [Hh]`` (``+inf`` for a query with no valid slot);
2. per slot block, ``p = exp2(s - lse2)`` for every head block, summed over the (real) heads and stored.

Given ``lse2`` (``HAS_LSE``: the fused sparse MLA's forward computed exactly it for the same queries, latents,
selection and scale, and op ``sparse_attention`` hands it out), pass 1 is skipped: one pass over the slots, the
given ``[c, Hh]`` read with its strides (a view of the attention's ``[Hh, N]`` tensor reads without a copy).

The latent rows ``c[idx]`` are gathered ``BW`` at a time straight into the dot operand
(``sparse_mla.kernels._gather_latents``), so neither the gathered ``[c, W, C]`` latents nor the ``[c, Hh, W]``
scores of the torch reference ever exist: what the kernel writes is ``m [c, W]`` fp32 and ``lse2 [c, Hh]`` fp32.
With more heads than one block holds (``NHB > 1``) pass 1 writes each block's ``lse2`` and pass 2 reads them
back (after a barrier) and the query's head tiles again, from L2.

Empty slots (``idx < 0`` or ``>= S``) read no memory and get 0, so does every slot of a query without a valid
one. Dots take the work dtype's operands with fp32 accumulation (fp32 operands with ``input_precision="ieee"``:
no tf32); the softmax and the sums are fp32. W, Hh and C are compile-time constants (one set per model). Offsets
that can pass 2^31 are int64.

Cost per query: two passes over the W gathered rows of C (``2 * W * C`` work-dtype bytes read, mostly from L2
when the latents fit there) and ``4 * Hh * W * C`` dot FLOPs, half of each given ``lse2``; written ``4 * W`` bytes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# the fused sparse MLA's slot gather, launch configuration (heads per block, slots per step, warps, stages) and
# dot precision
from megaseq.ops.sparse_mla.kernels import LOG2E, Config, _dot_precision, _gather_latents

MAX_LATENT: int = 1024  # a program holds [BH, CP] query and [BW, CP] latent tiles


def default_config(Hh: int, C: int, dtype: torch.dtype) -> Config:
    """Heads in one block of 16 or 32 (more heads: blocks of 16); 64 slots a step for one block of 16 heads, else
    32; half that for fp32 operands and again for latents wider than 512 (``CP`` 1024), on 8 warps, 2 stages.

    ptxas for sm_90 (``compile_ptx``; registers per thread, shared memory, no spills): bf16, C = 512, W = 2063:
    16 heads (16, 64) 56 regs, 82 KB; 20 or 32 heads (32, 32) 48 regs, 66 KB; 64 heads (16, 32) 76 regs, 49 KB;
    fp32 16 heads (16, 32) 61 regs, 99 KB; bf16 128 heads at C = 576 (16, 16) 80 regs, 66 KB. On 4 warps the
    16-head (16, 64) block takes 255 registers. Untimed: no tuned table holds this kernel."""
    BH = 32 if 16 < Hh <= 32 else 16
    BW = 64 if Hh <= 16 else 32
    if dtype.itemsize > 2:
        BW //= 2
    if C > 512:
        BW //= 2
    return Config(BH, max(16, BW), 8, 2)


# ---- kernel --------------------------------------------------------------------------------------------
@triton.jit
def _head_tile(q_row, offs_h, offs_c, Hh: tl.constexpr, C: tl.constexpr):
    """The ``[BH, CP]`` absorbed queries of heads ``offs_h`` (0 past Hh and C)."""
    return tl.load(q_row + offs_h[:, None] * C + offs_c[None, :], mask=(offs_h < Hh)[:, None] & (offs_c[None, :] < C),
                   other=0.0)


@triton.jit
def _head_block_lse(q_row, c_ptr, idx_row, offs_h, offs_c, S, scale_log2, W: tl.constexpr, Hh: tl.constexpr,
                    C: tl.constexpr, CP: tl.constexpr, BH: tl.constexpr, BW: tl.constexpr, DOT_PREC: tl.constexpr):
    """Pass 1 for heads ``offs_h`` of one query: their ``[BH, CP]`` tile and ``lse2 [BH]`` (+inf: no valid slot)."""
    qa_HC = _head_tile(q_row, offs_h, offs_c, Hh, C)
    m_H = tl.full([BH], float("-inf"), tl.float32)
    l_H = tl.zeros([BH], tl.float32)
    for w0 in range(0, W, BW):
        c_WC, _, valid = _gather_latents(c_ptr, idx_row, w0, W, S, offs_c, C, CP, BW)
        s_HW = tl.dot(qa_HC, tl.trans(c_WC), input_precision=DOT_PREC) * scale_log2
        s_HW = tl.where(valid[None, :], s_HW, float("-inf"))
        m_new = tl.maximum(m_H, tl.max(s_HW, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # all empty so far: keep exp2 finite
        l_H = l_H * tl.exp2(m_H - m_safe) + tl.sum(tl.exp2(s_HW - m_safe[:, None]), 1)
        m_H = m_new
    empty = l_H == 0.0
    return qa_HC, tl.where(empty, float("inf"), m_H + tl.log2(tl.where(empty, 1.0, l_H)))


@triton.jit
def _head_block_probs(qa_HC, c_WC, valid, lse2_H, mask_h, scale_log2, DOT_PREC: tl.constexpr):
    """``[BW]``: the softmax probabilities of one slot block summed over the real heads of one head block."""
    s_HW = tl.dot(qa_HC, tl.trans(c_WC), input_precision=DOT_PREC) * scale_log2
    p_HW = tl.exp2(s_HW - lse2_H[:, None])
    return tl.sum(tl.where(mask_h[:, None] & valid[None, :], p_HW, 0.0), 0)


@triton.jit
def indexer_target_kernel(qabs_ptr, c_ptr, idx_ptr, lse_ptr, out_ptr, scale_log2, S, stride_ln, stride_lh,
                          W: tl.constexpr, Hh: tl.constexpr, C: tl.constexpr, CP: tl.constexpr, BH: tl.constexpr,
                          BW: tl.constexpr, DOT_PREC: tl.constexpr, HAS_LSE: tl.constexpr):
    """``lse_ptr`` (strides ``stride_ln`` per query, ``stride_lh`` per head): ``HAS_LSE`` the given ``lse2`` read,
    else where pass 1 writes its own."""
    NHB: tl.constexpr = (Hh + BH - 1) // BH
    n = tl.program_id(0).to(tl.int64)
    offs_c = tl.arange(0, CP)
    q_row = qabs_ptr + n * (Hh * C)
    idx_row = idx_ptr + n * W
    lse_row = lse_ptr + n * stride_ln
    if NHB == 1:  # the heads' tile and lse2 stay in registers between the passes
        offs_h = tl.arange(0, BH)
        mask_h = offs_h < Hh
        if HAS_LSE:
            qa_HC = _head_tile(q_row, offs_h, offs_c, Hh, C)
            lse2_H = tl.load(lse_row + offs_h.to(tl.int64) * stride_lh, mask=mask_h, other=float("inf"))
        else:
            qa_HC, lse2_H = _head_block_lse(q_row, c_ptr, idx_row, offs_h, offs_c, S, scale_log2, W, Hh, C, CP, BH,
                                            BW, DOT_PREC)
            tl.store(lse_row + offs_h.to(tl.int64) * stride_lh, lse2_H, mask=mask_h)
        for w0 in range(0, W, BW):
            c_WC, _, valid = _gather_latents(c_ptr, idx_row, w0, W, S, offs_c, C, CP, BW)
            m_W = _head_block_probs(qa_HC, c_WC, valid, lse2_H, mask_h, scale_log2, DOT_PREC)
            offs_w = w0 + tl.arange(0, BW)
            tl.store(out_ptr + n * W + offs_w, m_W, mask=offs_w < W)
    else:
        if not HAS_LSE:
            for hb in range(NHB):
                offs_h = hb * BH + tl.arange(0, BH)
                qa_HC, lse2_H = _head_block_lse(q_row, c_ptr, idx_row, offs_h, offs_c, S, scale_log2, W, Hh, C, CP,
                                                BH, BW, DOT_PREC)
                tl.store(lse_row + offs_h.to(tl.int64) * stride_lh, lse2_H, mask=offs_h < Hh)
            tl.debug_barrier()  # every thread of the program sees the lse2 just written
        for w0 in range(0, W, BW):
            c_WC, _rows, valid = _gather_latents(c_ptr, idx_row, w0, W, S, offs_c, C, CP, BW)
            m_W = tl.zeros([BW], tl.float32)
            for hb in range(NHB):
                offs_h = hb * BH + tl.arange(0, BH)
                mask_h = offs_h < Hh
                qa_HC = _head_tile(q_row, offs_h, offs_c, Hh, C)
                lse2_H = tl.load(lse_row + offs_h.to(tl.int64) * stride_lh, mask=mask_h, other=float("inf"))
                m_W += _head_block_probs(qa_HC, c_WC, valid, lse2_H, mask_h, scale_log2, DOT_PREC)
            offs_w = w0 + tl.arange(0, BW)
            tl.store(out_ptr + n * W + offs_w, m_W, mask=offs_w < W)


# ---- launcher ------------------------------------------------------------------------------------------
def target(q_abs_cHC: torch.Tensor, c_SC: torch.Tensor, idx_cW: torch.Tensor, scale: float,
           config: Config | None = None, lse2: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(m [c, W], lse2 [c, Hh])``: the head-summed probabilities over each query's valid slots and the base-2
    log-sum-exp of each head's logits, fp32. Inputs contiguous, one dtype; ``lse2`` (fp32 ``[c, Hh]``, any strides):
    the attention's, read instead of computed (pass 2 alone) and returned as given; ``config`` replaces the default
    launch configuration (tests, benchmarks)."""
    c, Hh, C = q_abs_cHC.shape
    S, W = c_SC.shape[0], idx_cW.shape[1]
    m_cW = torch.empty(c, W, dtype=torch.float32, device=q_abs_cHC.device)
    given = lse2 is not None
    if given:
        assert lse2.shape == (c, Hh) and lse2.dtype == torch.float32, (tuple(lse2.shape), lse2.dtype)
    lse2_cH = lse2 if given else torch.empty(c, Hh, dtype=torch.float32, device=q_abs_cHC.device)
    if c == 0 or W == 0:
        return m_cW.zero_(), lse2_cH if given else lse2_cH.fill_(float("inf"))
    cfg = config or default_config(Hh, C, q_abs_cHC.dtype)
    indexer_target_kernel[(c,)](q_abs_cHC, c_SC, idx_cW, lse2_cH, m_cW, scale * LOG2E, S, lse2_cH.stride(0),
                                lse2_cH.stride(1), W=W, Hh=Hh, C=C, CP=max(16, triton.next_power_of_2(C)), BH=cfg.BH,
                                BW=cfg.BW, DOT_PREC=_dot_precision(q_abs_cHC.dtype), HAS_LSE=given,
                                num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return m_cW, lse2_cH


def compile_ptx(dtype: torch.dtype, Hh: int, C: int, W: int, cfg: Config | None = None,
                arch: int = 90, has_lse: bool = False) -> tuple[str, int]:
    """PTX and shared-memory bytes of the kernel compiled for ``sm_<arch>`` without a GPU (Triton's bundled ptxas
    also checks that it assembles): the CPU test's guard against code only the interpreter accepts. Needs
    triton imported without ``TRITON_INTERPRET``."""
    from megaseq.ops.sparse_mla.kernels import _compile

    cfg = cfg or default_config(Hh, C, dtype)
    t = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32"}[dtype]
    types = {"qabs_ptr": t, "c_ptr": t, "idx_ptr": "*i32", "lse_ptr": "*fp32", "out_ptr": "*fp32",
             "scale_log2": "fp32", "S": "i32", "stride_ln": "i32", "stride_lh": "i32"}
    consts = {"W": W, "Hh": Hh, "C": C, "CP": max(16, triton.next_power_of_2(C)), "BH": cfg.BH, "BW": cfg.BW,
              "DOT_PREC": _dot_precision(dtype), "HAS_LSE": has_lse}
    aligned = [n for n in types if n not in ("scale_log2", "stride_ln", "stride_lh")]
    return _compile(indexer_target_kernel, types, consts, aligned, cfg.num_warps, cfg.num_stages, arch)
