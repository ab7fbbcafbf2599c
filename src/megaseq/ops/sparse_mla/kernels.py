"""Triton kernels of the fused sparse MLA (``triton_sparse_mla.py`` owns the op, this file the GPU code).

Shapes: B batch, Q queries per batch row, N = B * Q flattened queries, S keys per batch row, Hh heads,
R latent rank (kv_lora_rank), RP = R padded to a power of two, W selected slots per query,
BH heads per program (>= 16: ``tl.dot`` needs M, N, K >= 16), BW slots per loop step.

Both kernels run one program per (query, head block): the latent rows ``c[idx]`` of the query's W slots
are gathered ``BW`` at a time straight into the dot operands (no ``[N, W, R]`` gather in memory) and
shared by the ``BH`` heads of the program. The per-head tensors ``q_abs``, ``o_lat``, ``do_lat`` and
``dq_abs`` are ``[Hh, N, R]`` (the layout of the batched GEMMs around the kernels: no permute copy), the
log-sum-exp ``[Hh, N]`` fp32 in base 2 (``lse2 = max + log2(sum)`` of the base-2 logits
``scale * log2(e) * q_abs . c``).

- forward: online softmax over the slots; ``o_lat = softmax(scale * q_abs c^T) @ c`` and ``lse2``.
- backward: ``delta = rowsum(o_lat * do_lat)`` (= ``sum_j p_j dp_j``), then per slot block the scores
  and ``p`` again, ``dp = do_lat c^T``, ``ds = scale * p * (dp - delta)``, ``dq_abs += ds @ c`` and
  ``dc[idx] += ds^T q_abs + p^T do_lat``, the last by fp32 atomics (relaxed, result unused; on Hopper
  Triton 3.6 emits ``atom.global.gpu.relaxed.add.v4.f32``: 4-wide, since the row pointers are provably
  contiguous with R constexpr).

- backward, latent gradient key-major (``MEGASEQ_MLA_DC=pool``, from the scores computed again; ``atomic`` keeps the
  per-query atomics for every slot): where the selection comes in the GLM indexer's pools (``pool_layout``: aligned
  blocks of kp consecutive keys, then a tail of kp - 1 slots), the slot pass does the atomics for the tail only and
  writes ``delta``, and ``sparse_mla_bwd_pool_dc_kernel`` sums each selected pool's ``[kp, R]`` gradient from the
  queries that chose it (sorted by pool, ``pool_entries``; in chunks of ``POOL_CHUNK`` queries; ``POOL_QUERIES``
  queries of a row sorted at once), one atomic add per chunk instead of one per query. It recomputes the scores
  (about 40% more dot FLOPs) and removes about 39 G fp32 atomic adds per DSA layer at 32K
  (``benchmarks/kernels/sparse_mla_configs.py`` times the ways). Its working set
  (``ops.workspace.sparse_mla_pool_bytes``, in the plan): the sort's keys and order, ``POOL_SORT_BYTES`` (64) per
  selected pool at most, and ``delta``.
  The default is ``MEGASEQ_MLA_DC=saved``: the slot pass (``SAVE_PDS``) leaves the pool slots'
  ``p`` and ``ds`` (the dot operands it has, in the work dtype) in ``[queries, K, Hh, kp]`` blocks, ``SAVED_QUERIES``
  queries of one batch row at a time, and ``sparse_mla_bwd_pool_saved_kernel`` sums ``p^T do_lat + ds^T q_abs``
  from them: two dots a step instead of four, no exponentials, no key block, ``lse`` or ``delta``
  (``benchmarks/results/speed/runs/2026-12-04_mla-saved-gradient/``). Its buffer and the chunk's sort are in
  the plan (``ops.workspace.sparse_mla_pool_bytes``).
  The layout is checked by one pass over the selection, ``pool_layout_kernel`` (one int32 flag; the torch
  reference is ``pool_layout_reference``): in the op's forward, read back with its
  empty-row check (``triton_sparse_mla.checks``), else in the backward (``layout="check"``). The pool pass's
  programs go a block of queries at a time (``pool_entries``, ``pool_query_block``), so those running together
  read the same rows from L2.

Empty slots (``idx < 0`` or ``>= S``) read no memory and weigh 0. A query with no valid slot gets
``o_lat = 0`` and ``lse2 = +inf`` (so its backward is 0); the op hands such batch rows to ``absorbed``.
W is a compile-time constant (one per model: index_topk + kpool - 1): Triton 3.6's interpreter cannot
loop to a run-time bound under NumPy >= 2.3 (``int()`` of its 1-element scalar arrays). Offsets that can
pass 2^31 (``h * N * R``, ``n * W``, ``b * S * R``) are int64.

Precision: the dots take the work dtype's operands with fp32 accumulation (fp32 operands with
``input_precision="ieee"``: no tf32), the softmax and ``ds`` are fp32, as ``absorbed``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.compiler.errors import CompilationError
from triton.runtime.errors import OutOfResources

from megaseq.ops import switches, workspace
from megaseq.ops._triton_util import _fix_interpreter_index, interpreting
from megaseq.ops.autotune import use_persistent_cache
from megaseq.ops.sparse_mla.reference import LOG2E  # the host's scale to base 2 (target_kernel imports it here)

use_persistent_cache()  # before any kernel of this module compiles (its tuning reads the tables in ``_pick``)


@dataclass(frozen=True)
class Config:
    """One launch configuration: heads and slots per program step, warps, software-pipeline stages."""

    BH: int
    BW: int
    num_warps: int
    num_stages: int


# the autotune spaces (MEGASEQ_MLA_AUTOTUNE=1): a handful each, pruned to BH <= the padded head count
FWD_CONFIGS = (Config(16, 32, 8, 2), Config(16, 64, 8, 2), Config(16, 32, 4, 2), Config(32, 32, 8, 2),
               Config(64, 32, 8, 2))
BWD_CONFIGS = (Config(16, 32, 8, 2), Config(16, 16, 8, 2), Config(16, 16, 4, 2), Config(32, 16, 8, 2),
               Config(16, 32, 8, 3))


def _head_block(Hh: int, cap: int) -> int:
    return min(cap, max(16, triton.next_power_of_2(Hh)))


def default_config(kind: str, Hh: int, R: int, dtype: torch.dtype) -> Config:
    """The untuned choice. fp32 (the checking path) halves the slot block: its tiles are twice the bytes.
    The backward holds ``dq_abs [BH, R]`` and ``dc [BW, R]`` in fp32 registers, hence BH = 16.

    bf16 at R = 512 with 16 heads per program: the fastest of ``benchmarks/kernels/sparse_mla_configs.py``
    (``benchmarks/results/kernels/h200_ops.md``). Four warps win throughout (more programs resident per SM); a
    64-slot backward block needs more shared memory than an SM has at 2 stages. A 32-head forward block keeps the
    untimed (32, 32, 8, 2): (32, 64, 4) would hold twice the registers per thread of the timed (16, 64, 4).

    ptxas for sm_90 at R = 512, W = 2063, bf16 (``compile_ptx``; registers per thread, shared memory):
    forward (16, 32, 8 warps) 103 regs, 50 KB (4 warps: 202 regs, every warp holds all of q_abs);
    (32, 32, 8) 180, 68 KB; (64, 32, 8) 255, 131 KB, wgmma. Backward (16, 32, 8) 250, 98 KB;
    (16, 16, 8) 168, 82 KB; (32, 32, 8, 1 stage) and (16, 32, 4, 1) spill; (16, 64, 8) needs 262 KB.
    The defaults: forward (16, 64, 4, 2) 204 regs, no spill, 84 KB; backward (16, 32, 4, 2) 255 regs with 180
    bytes of spill, 98 KB, and still the fastest timed."""
    wide = dtype == torch.float32 or R > 512
    if kind == "fwd":
        BH = _head_block(Hh, 32)
        if wide or BH > 16:
            return Config(BH, 16 if wide else 32, 8, 2)
        return Config(16, 64, 4, 2)
    return Config(16, 16, 8, 1) if wide else Config(16, 32, 4, 2)


def _autotune_space(kind: str, Hh: int, R: int, dtype: torch.dtype) -> list[Config]:
    bh_max = _head_block(Hh, 64)
    space = [c for c in (FWD_CONFIGS if kind == "fwd" else BWD_CONFIGS) if c.BH <= bh_max]
    if dtype == torch.float32 or R > 512:
        space = [Config(c.BH, min(c.BW, 16), c.num_warps, 1) for c in space]
    return list(dict.fromkeys(space)) or [default_config(kind, Hh, R, dtype)]


# ---- kernels -------------------------------------------------------------------------------------------
@triton.jit
def _gather_latents(c_row0, idx_row, w0, W: tl.constexpr, S, offs_r, R: tl.constexpr, RP: tl.constexpr,
                    BW: tl.constexpr):
    """Slots ``w0 .. w0 + BW`` of one query: the latent rows [BW, RP] (0 where empty), their row index
    (int64, 0 where empty) and the validity mask."""
    offs_w = w0 + tl.arange(0, BW)
    key = tl.load(idx_row + offs_w, mask=offs_w < W, other=-1)
    valid = (key >= 0) & (key < S)
    row = tl.where(valid, key, 0).to(tl.int64)
    ptrs = c_row0 + row[:, None] * R + offs_r[None, :]
    if RP == R:
        c_WR = tl.load(ptrs, mask=valid[:, None], other=0.0)
    else:
        c_WR = tl.load(ptrs, mask=valid[:, None] & (offs_r[None, :] < R), other=0.0)
    return c_WR, row, valid


@triton.jit
def _head_tile(h_off, n_off, offs_r, mask_h, R: tl.constexpr, RP: tl.constexpr):
    """Element offsets (int64) and mask of one query's [BH, RP] tile of a ``[Hh, N, R]`` tensor (read or
    written once per program: the mask on R costs nothing here, unlike in the slot loop)."""
    return h_off[:, None] + n_off + offs_r[None, :], mask_h[:, None] & (offs_r[None, :] < R)


@triton.jit
def sparse_mla_fwd_kernel(qabs_ptr, c_ptr, idx_ptr, olat_ptr, lse_ptr, scale_log2, N, Q, S, stride_h,
                          W: tl.constexpr, Hh: tl.constexpr, R: tl.constexpr, RP: tl.constexpr, BH: tl.constexpr,
                          BW: tl.constexpr, DOT_PREC: tl.constexpr):
    NHB: tl.constexpr = (Hh + BH - 1) // BH
    pid = tl.program_id(0)
    n = pid // NHB
    offs_h = (pid % NHB) * BH + tl.arange(0, BH)
    mask_h = offs_h < Hh
    offs_r = tl.arange(0, RP)
    n64 = n.to(tl.int64)
    h_off = offs_h.to(tl.int64) * stride_h
    t_off, t_mask = _head_tile(h_off, n64 * R, offs_r, mask_h, R, RP)
    qa_HR = tl.load(qabs_ptr + t_off, mask=t_mask, other=0.0)
    c_row0 = c_ptr + (n64 // Q) * S * R
    idx_row = idx_ptr + n64 * W

    m_H = tl.full([BH], float("-inf"), tl.float32)
    l_H = tl.zeros([BH], tl.float32)
    acc_HR = tl.zeros([BH, RP], tl.float32)
    for w0 in range(0, W, BW):
        c_WR, _, valid = _gather_latents(c_row0, idx_row, w0, W, S, offs_r, R, RP, BW)
        s_HW = tl.dot(qa_HR, tl.trans(c_WR), input_precision=DOT_PREC) * scale_log2
        s_HW = tl.where(valid[None, :], s_HW, float("-inf"))
        m_new = tl.maximum(m_H, tl.max(s_HW, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # all empty so far: keep exp2 finite
        alpha = tl.exp2(m_H - m_safe)
        p_HW = tl.exp2(s_HW - m_safe[:, None])
        l_H = l_H * alpha + tl.sum(p_HW, 1)
        acc_HR = acc_HR * alpha[:, None] + tl.dot(p_HW.to(c_WR.dtype), c_WR, input_precision=DOT_PREC)
        m_H = m_new

    empty = l_H == 0.0
    o_HR = acc_HR / tl.where(empty, 1.0, l_H)[:, None]
    tl.store(olat_ptr + t_off, o_HR.to(olat_ptr.dtype.element_ty), mask=t_mask)
    lse2 = tl.where(empty, float("inf"), m_H + tl.log2(tl.where(empty, 1.0, l_H)))
    tl.store(lse_ptr + offs_h.to(tl.int64) * N + n64, lse2, mask=mask_h)


@triton.jit
def sparse_mla_bwd_kernel(qabs_ptr, dolat_ptr, olat_ptr, lse_ptr, c_ptr, idx_ptr, dqabs_ptr, dc_ptr, delta_ptr,
                          scale, scale_log2, N, Q, S, stride_h, W: tl.constexpr, Hh: tl.constexpr, R: tl.constexpr,
                          RP: tl.constexpr,
                          BH: tl.constexpr, BW: tl.constexpr, DOT_PREC: tl.constexpr, DC_START: tl.constexpr = 0,
                          STORE_DELTA: tl.constexpr = False, p_ptr=None, ds_ptr=None, N0=0, KP: tl.constexpr = 16,
                          SAVE_PDS: tl.constexpr = False, probs_ptr=None, STORE_PROBS: tl.constexpr = False):
    """``dq_abs`` over all W slots; ``dc`` (fp32 atomics) for the slots from ``DC_START`` on (0: all; the pool
    pass, ``sparse_mla_bwd_pool_dc_kernel``, sums the others); with ``STORE_DELTA`` it writes ``delta [Hh, N]``
    for that pass. With ``SAVE_PDS`` the programs are the queries ``N0 ..`` (one per program and head block) and
    the slots before ``DC_START`` (K = DC_START / KP pools) leave their ``p`` and ``ds`` (the dot operands, in the
    work dtype) in ``p_ptr`` / ``ds_ptr`` ``[n - N0, K, Hh, KP]`` for ``sparse_mla_bwd_pool_saved_kernel``. With
    ``STORE_PROBS`` every slot's probability summed over the program's heads goes to ``probs_ptr [N, W]`` fp32
    (op ``indexer_target``'s result, from the ``p`` this pass recomputes anyway): stored where one program holds
    every head, else added (fp32 atomics into a zeroed buffer)."""
    NHB: tl.constexpr = (Hh + BH - 1) // BH
    pid = tl.program_id(0)
    n = N0 + pid // NHB
    offs_h = (pid % NHB) * BH + tl.arange(0, BH)
    mask_h = offs_h < Hh
    offs_r = tl.arange(0, RP)
    n64 = n.to(tl.int64)
    h_off = offs_h.to(tl.int64) * stride_h
    t_off, t_mask = _head_tile(h_off, n64 * R, offs_r, mask_h, R, RP)
    qa_HR = tl.load(qabs_ptr + t_off, mask=t_mask, other=0.0)
    do_HR = tl.load(dolat_ptr + t_off, mask=t_mask, other=0.0)
    o_HR = tl.load(olat_ptr + t_off, mask=t_mask, other=0.0)
    delta_H = tl.sum(o_HR.to(tl.float32) * do_HR.to(tl.float32), 1)
    lse2_H = tl.load(lse_ptr + offs_h.to(tl.int64) * N + n64, mask=mask_h, other=float("inf"))
    if STORE_DELTA:
        tl.store(delta_ptr + offs_h.to(tl.int64) * N + n64, delta_H, mask=mask_h)
    b64 = n64 // Q
    c_row0 = c_ptr + b64 * S * R
    dc_row0 = dc_ptr + b64 * S * R
    idx_row = idx_ptr + n64 * W

    dq_HR = tl.zeros([BH, RP], tl.float32)
    for w0 in range(0, W, BW):
        c_WR, row, valid = _gather_latents(c_row0, idx_row, w0, W, S, offs_r, R, RP, BW)
        s_HW = tl.dot(qa_HR, tl.trans(c_WR), input_precision=DOT_PREC) * scale_log2
        p_HW = tl.where(valid[None, :], tl.exp2(s_HW - lse2_H[:, None]), 0.0)
        dp_HW = tl.dot(do_HR, tl.trans(c_WR), input_precision=DOT_PREC)
        ds_HW = (p_HW * (dp_HW - delta_H[:, None]) * scale).to(c_WR.dtype)  # d(q_abs . c), scale folded
        dq_HR = tl.dot(ds_HW, c_WR, dq_HR, input_precision=DOT_PREC)
        if STORE_PROBS:  # the head-summed probabilities (heads past Hh have lse +inf: p = 0)
            offs_p = w0 + tl.arange(0, BW)
            if NHB == 1:
                tl.store(probs_ptr + n64 * W + offs_p, tl.sum(p_HW, 0), mask=offs_p < W)
            else:
                tl.atomic_add(probs_ptr + n64 * W + offs_p, tl.sum(p_HW, 0), mask=offs_p < W, sem="relaxed")
        if SAVE_PDS:
            if w0 < DC_START:  # a pool slot: its p and ds for the pool pass
                offs_w = w0 + tl.arange(0, BW)
                blk = (n64 - N0) * (DC_START // KP) + offs_w // KP
                s_off = blk[None, :] * (Hh * KP) + offs_h[:, None] * KP + (offs_w % KP)[None, :]
                s_mask = mask_h[:, None] & (offs_w < DC_START)[None, :]
                tl.store(p_ptr + s_off, p_HW.to(p_ptr.dtype.element_ty), mask=s_mask)
                tl.store(ds_ptr + s_off, ds_HW, mask=s_mask)
        dc_ptrs = dc_row0 + row[:, None] * R + offs_r[None, :]
        if DC_START == 0:  # every slot's latent gradient here (the default, the loop as timed)
            dc_WR = tl.dot(tl.trans(p_HW.to(c_WR.dtype)), do_HR, input_precision=DOT_PREC)
            dc_WR = tl.dot(tl.trans(ds_HW), qa_HR, dc_WR, input_precision=DOT_PREC)
            if RP == R:
                tl.atomic_add(dc_ptrs, dc_WR, mask=valid[:, None], sem="relaxed")
            else:
                tl.atomic_add(dc_ptrs, dc_WR, mask=valid[:, None] & (offs_r[None, :] < R), sem="relaxed")
        elif w0 + BW > DC_START:  # the pool pass sums the slots before DC_START
            dc_WR = tl.dot(tl.trans(p_HW.to(c_WR.dtype)), do_HR, input_precision=DOT_PREC)
            dc_WR = tl.dot(tl.trans(ds_HW), qa_HR, dc_WR, input_precision=DOT_PREC)
            mine = valid & (w0 + tl.arange(0, BW) >= DC_START)
            tl.atomic_add(dc_ptrs, dc_WR, mask=mine[:, None] & (offs_r[None, :] < R), sem="relaxed")

    tl.store(dqabs_ptr + t_off, dq_HR.to(dqabs_ptr.dtype.element_ty), mask=t_mask)


@triton.jit
def _pool_rows(qabs_ptr, dolat_ptr, qn_ptr, ent_ptr, j0, end, stride_h, offs_r, Hh: tl.constexpr, R: tl.constexpr,
               BR: tl.constexpr):
    """Rows ``j0 .. j0 + BR`` of a pool program's (entry, head) rows (``j // Hh`` the entry, ``j % Hh`` the head):
    their ``q_abs`` and ``do_lat`` rows [BR, RP] (0 past ``end``), head (int64), the saved block's index ``ent``
    (int64; 0 where ``ent_ptr`` is None), query ``qn`` (int64) and the mask ``j < end * Hh``."""
    j = j0 + tl.arange(0, BR)
    jm = j < end * Hh
    h64 = (j % Hh).to(tl.int64)
    n64 = tl.load(qn_ptr + j // Hh, mask=jm, other=0).to(tl.int64)
    if ent_ptr is not None:
        e64 = tl.load(ent_ptr + j // Hh, mask=jm, other=0).to(tl.int64)
    else:
        e64 = tl.zeros([BR], tl.int64)
    off = h64 * stride_h + n64 * R
    tmask = jm[:, None] & (offs_r < R)[None, :]
    qa_JR = tl.load(qabs_ptr + off[:, None] + offs_r[None, :], mask=tmask, other=0.0)
    do_JR = tl.load(dolat_ptr + off[:, None] + offs_r[None, :], mask=tmask, other=0.0)
    return qa_JR, do_JR, h64, e64, n64, jm


@triton.jit
def sparse_mla_bwd_pool_dc_kernel(qabs_ptr, dolat_ptr, lse_ptr, delta_ptr, c_ptr, qn_ptr, pool_ptr, lo_ptr, hi_ptr,
                                  dc_ptr, scale, scale_log2, N, S, NP, stride_h, Hh: tl.constexpr, R: tl.constexpr,
                                  RP: tl.constexpr, KP: tl.constexpr, BR: tl.constexpr, DOT_PREC: tl.constexpr):
    """The latent gradient of one pool of KP keys from a chunk of the queries that selected it (key-major, one
    atomic add of ``[KP, R]`` per chunk instead of one per query): program ``pid`` owns pool
    ``pool[pid] = b * NP + p`` (keys ``p * KP ..`` of batch row b) and the selecting queries
    ``qn[lo[pid] : hi[pid]]`` (flattened ``b * Q + q``). It walks their (query, head) rows BR at a time: the
    scores and ``p`` again, ``dp = do_lat c^T``, ``ds = scale * p * (dp - delta)``, and
    ``dc += p^T do_lat + ds^T q_abs`` in registers, added once at the end."""
    pid = tl.program_id(0)
    pool = tl.load(pool_ptr + pid)
    start = tl.load(lo_ptr + pid)
    end = tl.load(hi_ptr + pid)
    b64 = (pool // NP).to(tl.int64)
    offs_r = tl.arange(0, RP)
    rmask = offs_r < R
    keys = ((pool % NP) * KP + tl.arange(0, KP)).to(tl.int64)
    c_off = b64 * S * R + keys[:, None] * R + offs_r[None, :]
    c_KR = tl.load(c_ptr + c_off, mask=rmask[None, :] & (end > start), other=0.0)
    acc_KR = tl.zeros([KP, RP], tl.float32)
    for j0 in range(start * Hh, end * Hh, BR):
        qa_JR, do_JR, h64, _, n64, jm = _pool_rows(qabs_ptr, dolat_ptr, qn_ptr, None, j0, end, stride_h, offs_r, Hh,
                                                   R, BR)
        lse2_J = tl.load(lse_ptr + h64 * N + n64, mask=jm, other=float("inf"))
        delta_J = tl.load(delta_ptr + h64 * N + n64, mask=jm, other=0.0)
        s_JK = tl.dot(qa_JR, tl.trans(c_KR), input_precision=DOT_PREC) * scale_log2
        p_JK = tl.where(jm[:, None], tl.exp2(s_JK - lse2_J[:, None]), 0.0)
        dp_JK = tl.dot(do_JR, tl.trans(c_KR), input_precision=DOT_PREC)
        ds_JK = (p_JK * (dp_JK - delta_J[:, None]) * scale).to(c_KR.dtype)
        acc_KR = tl.dot(tl.trans(p_JK.to(c_KR.dtype)), do_JR, acc_KR, input_precision=DOT_PREC)
        acc_KR = tl.dot(tl.trans(ds_JK), qa_JR, acc_KR, input_precision=DOT_PREC)
    tl.atomic_add(dc_ptr + c_off, acc_KR, mask=rmask[None, :] & (end > start), sem="relaxed")


@triton.jit
def sparse_mla_bwd_pool_saved_kernel(qabs_ptr, dolat_ptr, p_ptr, ds_ptr, qn_ptr, ent_ptr, pool_ptr, lo_ptr, hi_ptr,
                                     dc_ptr, S, NP, stride_h, Hh: tl.constexpr, R: tl.constexpr, RP: tl.constexpr,
                                     KP: tl.constexpr, BR: tl.constexpr, DOT_PREC: tl.constexpr):
    """``sparse_mla_bwd_pool_dc_kernel``'s sum from the ``p`` and ``ds`` the slot pass saved (``SAVE_PDS``):
    program ``pid`` owns pool ``pool[pid] = b * NP + p`` and the entries ``lo[pid] : hi[pid]``, each a selecting
    query ``qn`` (flattened ``b * Q + q``: its ``q_abs`` and ``do_lat`` rows) and the index ``ent`` of its
    ``[Hh, KP]`` block of ``p`` and ``ds``; ``dc += p^T do_lat + ds^T q_abs`` over their (query, head) rows, BR at
    a time, added once at the end. No scores again: two dots a step instead of four, no exponentials. (Its
    prologue is the recomputing kernel's as written: a shared helper reorders the PTX of the kernels timed.)"""
    pid = tl.program_id(0)
    pool = tl.load(pool_ptr + pid)
    start = tl.load(lo_ptr + pid)
    end = tl.load(hi_ptr + pid)
    b64 = (pool // NP).to(tl.int64)
    offs_r = tl.arange(0, RP)
    offs_k = tl.arange(0, KP)
    rmask = offs_r < R
    keys = ((pool % NP) * KP + offs_k).to(tl.int64)
    acc_KR = tl.zeros([KP, RP], tl.float32)
    for j0 in range(start * Hh, end * Hh, BR):
        qa_JR, do_JR, h64, e64, _, jm = _pool_rows(qabs_ptr, dolat_ptr, qn_ptr, ent_ptr, j0, end, stride_h, offs_r,
                                                   Hh, R, BR)
        s_off = (e64 * Hh + h64)[:, None] * KP + offs_k[None, :]
        p_JK = tl.load(p_ptr + s_off, mask=jm[:, None], other=0.0)
        ds_JK = tl.load(ds_ptr + s_off, mask=jm[:, None], other=0.0)
        acc_KR = tl.dot(tl.trans(p_JK), do_JR, acc_KR, input_precision=DOT_PREC)
        acc_KR = tl.dot(tl.trans(ds_JK), qa_JR, acc_KR, input_precision=DOT_PREC)
    c_off = b64 * S * R + keys[:, None] * R + offs_r[None, :]
    tl.atomic_add(dc_ptr + c_off, acc_KR, mask=rmask[None, :] & (end > start), sem="relaxed")


@triton.jit
def pool_layout_kernel(idx_ptr, flag_ptr, N, Q, S, L, stride_b, stride_q, KP: tl.constexpr, BN: tl.constexpr,
                       BS: tl.constexpr):
    """The pool-layout check of slots ``pid1 * BS ..`` (of the first ``L = K * KP``) of the flattened queries
    ``pid0 * BN ..`` (``n = b * Q + q``); where one is out of place it writes 0 to ``flag`` (every such program
    the same 0: no atomics). Each slot is checked against its block's first key, so nothing is reduced per block:
    a block whose first key is valid must be a pool (``first % KP == 0``, ``first + KP <= S``, the slot holds
    ``first + slot % KP``: so none of its keys is empty), any other must be empty (its keys < 0 or >= S). Keys
    stay in idx's dtype: ``first + i`` can wrap only where ``first > S - KP``, which already fails."""
    n = tl.program_id(0).to(tl.int64) * BN + tl.arange(0, BN)
    s = tl.program_id(1) * BS + tl.arange(0, BS)
    m = (n < N)[:, None] & (s < L)[None, :]
    row = ((n // Q) * stride_b + (n % Q) * stride_q)[:, None]
    v = tl.load(idx_ptr + row + s[None, :], mask=m, other=-1)
    first = tl.load(idx_ptr + row + (s // KP * KP)[None, :], mask=m, other=-1)  # a broadcast, same lines as v
    lead = (first >= 0) & (first < S)
    pool = ((first & (KP - 1)) == 0) & (first <= S - KP) & (v == first + (s % KP)[None, :])
    bad = m & tl.where(lead, ~pool, (v >= 0) & (v < S))
    tl.store(flag_ptr, 0, mask=tl.max(bad.to(tl.int32)) > 0)


# ---- launchers -----------------------------------------------------------------------------------------
def _dot_precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"  # tf32 is ignored for 16-bit operands


def _autotune() -> bool:
    return switches.mla_autotune()


_TUNED: dict[tuple, Config] = {}  # timed here (MEGASEQ_MLA_AUTOTUNE=1)
_UNTIMED: dict[tuple, Config] = {}  # from the tuned table, else the default
TABLE_KERNEL = "megaseq.ops.sparse_mla.kernels.sparse_mla"


def _pick(kind: str, Hh: int, R: int, dtype: torch.dtype, run, N: int = 0) -> Config:
    """The config for this (kind, Hh, R, dtype) and length bucket of N. With ``MEGASEQ_MLA_AUTOTUNE=1`` the
    fastest of the space (timed once per key with ``triton.testing.do_bench`` and kept in the user's tuned
    table; ``run(cfg)`` launches on the real arguments and must be repeatable: the backward's ``dc`` is
    re-zeroed by the caller after tuning); otherwise the tuned table's (``ops.autotune``: shipped for the GPU,
    or tuned on this machine), else the default."""
    from megaseq.ops import autotune

    key = (kind, Hh, R, dtype, autotune.seq_bucket(N))
    fields = {"kind": kind, "Hh": Hh, "R": R, "dtype": str(dtype)}
    if not _autotune():
        if key not in _UNTIMED:
            hit = autotune.table().lookup(TABLE_KERNEL, fields, N)
            _UNTIMED[key] = (default_config(kind, Hh, R, dtype) if hit is None else
                             Config(hit["kwargs"]["BH"], hit["kwargs"]["BW"], hit["num_warps"], hit["num_stages"]))
        return _UNTIMED[key]
    if key not in _TUNED:
        times = {}
        for cfg in _autotune_space(kind, Hh, R, dtype):
            try:
                times[cfg] = triton.testing.do_bench(lambda c=cfg: run(c), warmup=5, rep=20)
            except (OutOfResources, CompilationError):  # a config over the shared-memory or register limit
                times[cfg] = float("inf")
        best = min(times, key=times.get)
        c = _TUNED[key] = best if times[best] < float("inf") else default_config(kind, Hh, R, dtype)
        autotune.table().record(TABLE_KERNEL, fields, N, {"kwargs": {"BH": c.BH, "BW": c.BW}, "num_warps": c.num_warps,
                                                         "num_stages": c.num_stages, "tuned": "full"})
    return _TUNED[key]


def forward(q_abs_HNR: torch.Tensor, c_BSR: torch.Tensor, idx_BQW: torch.Tensor,
            scale: float, config: Config | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``o_lat [Hh, N, R]`` (q_abs's dtype) and ``lse2 [Hh, N]`` fp32 of the sparse softmax (``config``:
    a launch configuration to use instead of the default or tuned one, for
    ``benchmarks/kernels/sparse_mla_configs.py``)."""
    Hh, N, R = q_abs_HNR.shape
    B, S, _ = c_BSR.shape
    Q, W = idx_BQW.shape[1:]
    o_lat = torch.empty_like(q_abs_HNR)
    lse2 = torch.empty(Hh, N, dtype=torch.float32, device=q_abs_HNR.device)

    def run(cfg: Config) -> None:
        grid = (N * triton.cdiv(Hh, cfg.BH),)
        sparse_mla_fwd_kernel[grid](q_abs_HNR, c_BSR, idx_BQW, o_lat, lse2, scale * LOG2E, N, Q, S, N * R,
                                    W=W, Hh=Hh, R=R, RP=triton.next_power_of_2(R), BH=cfg.BH, BW=cfg.BW,
                                    DOT_PREC=_dot_precision(q_abs_HNR.dtype), num_warps=cfg.num_warps,
                                    num_stages=cfg.num_stages)

    run(config or _pick("fwd", Hh, R, q_abs_HNR.dtype, run, N))
    return o_lat, lse2


# the latent gradient's ways (``MEGASEQ_MLA_DC``): ``pool``, the default, sums each selected pool's block
# key-major, from the queries that chose it, and leaves only the tail slots to the atomics (the atomics alone
# where the selection is not in pools); ``saved`` is ``pool`` from the ``p`` and ``ds`` the slot pass left in
# memory (``SAVED_QUERIES`` queries at a time) instead of the scores computed again; ``atomic`` adds each query's
# [W, R] block by fp32 atomics
DC_MODES = switches.MLA_DC_MODES
POOL_MODES = ("pool", "saved")  # the modes that run a pool pass where the selection is in pools
POOL_SIZES = (16, 32, 64, 128)  # the pool pass's tl.dot needs at least 16 keys a pool
POOL_SCAN_ROWS = 4096  # query rows per step of the layout check ([rows, K, kp] int32 temporaries)
# (rows, warps, stages) of the pool pass: the fastest of sparse_mla_configs.py's rows 16 / 32 / 64, warps 4 / 8,
# stages 1 / 2 (benchmarks/results/kernels/h200_ops.md)
POOL_CONFIG = (32, 4, 2)
POOL_CHUNK = 256  # selecting queries per program of the pool pass at most
# the pool pass's programs go a block of queries at a time (pool_entries): None picks it (pool_query_block), an int
# sets it (0: one block, the programs in pool order; benchmarks/kernels/sparse_mla_configs.py --pool-blocks)
POOL_QUERY_BLOCK: int | None = None
POOL_BLOCK_MIN = 1024  # queries a block at least: 32 MB of q_abs and do_lat rows at 16 heads x 512 bf16
POOL_BLOCK_ENTRIES = 64  # the mean selecting queries per (block, pool) the picked block aims at, at least
POOL_QUERIES = 32768  # queries per batch row whose pool entries are sorted at once (ops.workspace.POOL_QUERIES)
# ``saved``: queries of a batch row per slot pass and pool pass, whose p and ds ([queries, K, Hh, kp] each, the work
# dtype) are held at once (ops.workspace.sparse_mla_pool_bytes)
SAVED_QUERIES = workspace.SAVED_QUERIES
# (rows, warps, stages) of sparse_mla_bwd_pool_saved_kernel: the fastest of the whole backward of one layer
# (benchmarks/results/kernels/h200_ops.md)
POOL_SAVED_CONFIG = (16, 4, 2)


def dc_mode() -> str:
    """``MEGASEQ_MLA_DC`` (``ops.switches.mla_dc``)."""
    return switches.mla_dc()


def pool_candidates(W: int) -> list[tuple[int, int]]:
    """The pool sizes kp a selection of W slots per query could be in, in the order they are tried, each with its
    K = (W + 1) // kp - 1 blocks: ``POOL_SIZES`` with ``(W + 1) % kp == 0`` and at least one block."""
    return [(kp, (W + 1) // kp - 1) for kp in POOL_SIZES if (W + 1) % kp == 0 and W + 1 >= 2 * kp]


def layout_kernel_runs(idx_BQW: torch.Tensor) -> bool:
    """Whether ``pool_layout_kernel`` checks this selection (CUDA, or the CPU under the interpreter)."""
    return idx_BQW.is_cuda or interpreting()


def pool_layout(idx_BQW: torch.Tensor, S: int) -> int | None:
    """The pool size kp if the first ``W - (kp - 1)`` slots of every query come in blocks of kp that are each
    empty or the kp consecutive keys of pool ``first // kp`` (what the GLM indexer selects, before its tail of
    kp - 1 slots), else None; the first candidate (``pool_candidates``) that holds. On CUDA (or the CPU under
    the interpreter) one pass of ``pool_layout_kernel`` and one host sync per candidate tried; elsewhere
    ``pool_layout_reference``."""
    if layout_kernel_runs(idx_BQW):
        return pool_layout_triton(idx_BQW, S)
    return pool_layout_reference(idx_BQW, S)


# the layout check's programs: BN queries x BS slots, POOL_LAYOUT_BLOCK slots in all, BS <= POOL_LAYOUT_SLOTS.
# One query of 2048 slots a program, 4 warps: the fastest of those timed (benchmarks/results/kernels/h200_ops.md)
POOL_LAYOUT_BLOCK = 2048
POOL_LAYOUT_SLOTS = 2048
POOL_LAYOUT_WARPS = 4


def pool_layout_blocks(L: int) -> tuple[int, int]:
    """``(BN, BS)`` of ``pool_layout_kernel`` for L checked slots a query."""
    BS = min(triton.next_power_of_2(L), POOL_LAYOUT_SLOTS)
    return max(1, POOL_LAYOUT_BLOCK // BS), BS


def pool_layout_triton(idx_BQW: torch.Tensor, S: int) -> int | None:
    """``pool_layout`` by ``pool_layout_kernel``: each query's first K * kp slots read once, one int32 flag
    (1 = every block holds) read back per candidate kp."""
    for kp, K in pool_candidates(idx_BQW.shape[2]):
        if idx_BQW.shape[0] * idx_BQW.shape[1] == 0 or bool(pool_layout_flag(idx_BQW, S, kp, K).item()):
            return kp
    return None


def pool_layout_flag(idx_BQW: torch.Tensor, S: int, kp: int, K: int) -> torch.Tensor:
    """One pass of ``pool_layout_kernel`` for the candidate ``(kp, K)``: its int32 flag ``[1]`` (1 = every block
    holds), on the device, not read back (``triton_sparse_mla`` reads it with its other check in one sync)."""
    B, Q, _ = idx_BQW.shape
    if idx_BQW.stride(2) != 1:
        idx_BQW = idx_BQW.contiguous()
    N, L = B * Q, K * kp
    BN, BS = pool_layout_blocks(L)
    flag = torch.ones(1, dtype=torch.int32, device=idx_BQW.device)
    if N:
        pool_layout_kernel[(triton.cdiv(N, BN), triton.cdiv(L, BS))](
            idx_BQW, flag, N, Q, S, L, idx_BQW.stride(0), idx_BQW.stride(1), KP=kp, BN=BN, BS=BS,
            num_warps=POOL_LAYOUT_WARPS)
    return flag


def pool_layout_reference(idx_BQW: torch.Tensor, S: int) -> int | None:
    """``pool_layout`` in torch (the kernel's reference, and where Triton cannot run): elementwise passes over
    ``[B, POOL_SCAN_ROWS, K, kp]`` chunks, one host sync per candidate kp."""
    B, Q, W = idx_BQW.shape
    for kp, K in pool_candidates(W):
        ar = torch.arange(kp, device=idx_BQW.device, dtype=idx_BQW.dtype)
        ok = torch.ones((), dtype=torch.bool, device=idx_BQW.device)
        for a in range(0, Q, POOL_SCAN_ROWS):
            v = idx_BQW[:, a:a + POOL_SCAN_ROWS, :K * kp].unflatten(-1, (K, kp))
            first = v[..., 0]
            empty = ((v < 0) | (v >= S)).all(-1)
            pool = (first >= 0) & (first % kp == 0) & (first + kp <= S) & (v == first[..., None] + ar).all(-1)
            ok &= (empty | pool).all()
        if bool(ok):
            return kp
    return None


def pool_query_block(NP: int, K: int) -> int:
    """The pool pass's query block (``POOL_QUERY_BLOCK``, else picked): at least ``POOL_BLOCK_MIN`` queries, and
    enough that a pool has ``POOL_BLOCK_ENTRIES`` selecting queries a block on average (K of NP pools chosen per
    query: ``block * K / NP``), so that a program's fixed cost (its pool's keys read, one atomic add of
    ``[kp, R]``) stays small beside its rows; a power of two."""
    if POOL_QUERY_BLOCK is not None:
        return POOL_QUERY_BLOCK
    return triton.next_power_of_2(max(POOL_BLOCK_MIN, -(-POOL_BLOCK_ENTRIES * NP // max(K, 1))))


def pool_entries(idx_BQW: torch.Tensor, S: int, kp: int, chunk: int | None = None, q0: int = 0,
                 Q: int | None = None, block: int | None = None, slots: bool = False
                 ) -> tuple[torch.Tensor, ...]:
    """For the pool pass over the queries ``idx_BQW`` holds (queries ``q0 ..`` of ``Q`` per batch row, default
    all of them): ``qn`` (int32), the flattened query ``b * Q + q`` of every selected pool block, sorted by
    query block, then pool; then per program its pool ``b * NP + p`` (int32) and its range ``lo, hi`` (int64)
    of ``qn``: the queries of one block of ``block`` queries (default ``pool_query_block``) that selected the
    pool, in chunks of at most ``chunk`` (default ``POOL_CHUNK``). NP = S // kp pools per row.

    The programs go block by block: those running at once read the ``q_abs`` and ``do_lat`` rows of the same
    ``block`` queries (32 MB at 1024 queries of 16 heads x 512 bf16 each), which stay in L2 between them; in
    pool order instead each pool's chunks spanned thousands of queries, and the pass re-read every row from
    memory once per pool that selected it.

    No host sync: the programs are as many as their bound ``segments + ceil(entries / chunk)`` (a segment a
    (row, block, pool); ``sum ceil(count / chunk)``), the ones past the real count empty (``lo = hi``: the pass
    adds nothing for them); a count read back instead drained the GPU's queue once a layer's backward.

    ``slots``: a sixth tensor ``ent`` (int32) beside ``qn``, each entry's place ``(b * Qs + q - q0) * K + k`` among
    the ``K`` pool blocks of the queries given (k: the block's index in its query's selection), where the slot pass
    left its ``p`` and ``ds`` (``SAVE_PDS``)."""
    B, Qs, W = idx_BQW.shape
    Q = Q or Qs
    K, NP = (W + 1) // kp - 1, S // kp
    chunk = chunk or POOL_CHUNK
    block = pool_query_block(NP, K) if block is None else block
    block = max(1, min(block, Qs) if block > 0 else Qs)  # 0: one block (the programs in pool order)
    nb = -(-Qs // block)
    dev = idx_BQW.device
    first = idx_BQW[..., :K * kp:kp].long()
    valid = (first >= 0) & (first < S)
    row = (torch.arange(B, device=dev)[:, None] * nb + torch.arange(Qs, device=dev)[None] // block)[..., None] * NP
    segments = B * nb * NP
    key = torch.where(valid, row + first.div(kp, rounding_mode="floor"), segments).flatten()
    del first, valid, row
    sorted_key, order = key.sort(stable=True)
    del key
    qn = order.div(K, rounding_mode="floor")  # b * Qs + q - q0
    ent = order.to(torch.int32) if slots else None
    del order
    if Qs != Q or q0:
        qn = qn.div(Qs, rounding_mode="floor") * Q + q0 + qn.remainder(Qs)
    qn = qn.to(torch.int32)
    if segments == 0:
        empty = torch.zeros(0, dtype=torch.int64, device=dev)
        return (qn, empty.int(), empty, empty, NP) + ((ent,) if slots else ())
    seg = torch.searchsorted(sorted_key, torch.arange(segments + 1, device=dev))
    del sorted_key
    count = seg[1:] - seg[:-1]
    chunks = (count + chunk - 1).div(chunk, rounding_mode="floor")
    upto = torch.cumsum(chunks, 0)  # programs of the segments up to each
    bound = segments + -(-(B * Qs * K) // chunk)
    t = torch.arange(bound, device=dev)
    sid = torch.searchsorted(upto, t, right=True).clamp_(max=segments - 1)  # the segment of program t
    lo = seg[sid] + (t - (upto[sid] - chunks[sid])) * chunk
    hi = torch.minimum(lo + chunk, seg[sid + 1])
    lo = torch.minimum(lo, hi)  # past the real programs: empty
    pool = sid.div(nb * NP, rounding_mode="floor") * NP + sid.remainder(NP)
    return (qn, pool.to(torch.int32), lo, hi, NP) + ((ent,) if slots else ())


def backward(q_abs_HNR: torch.Tensor, do_lat_HNR: torch.Tensor, o_lat_HNR: torch.Tensor, lse2_HN: torch.Tensor,
             c_BSR: torch.Tensor, idx_BQW: torch.Tensor, scale: float,
             config: Config | None = None, dc: str | None = None,
             pool_config: tuple[int, int, int] | None = None,
             layout: int | None | str = "check",
             probs: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``dq_abs [Hh, N, R]`` (q_abs's dtype) and the latent gradient ``dc [B, S, R]`` fp32 (``config``: as in
    ``forward``; ``dc``: one of ``DC_MODES``, default ``MEGASEQ_MLA_DC`` (else ``saved``); ``saved`` and ``pool``
    fall back to ``atomic`` where the selection is not in pools, ``pool_layout``; ``pool_config``: the pool pass's
    (rows per step, warps, stages), default ``POOL_SAVED_CONFIG`` or ``POOL_CONFIG``; ``layout``: ``pool_layout``'s
    answer when the caller has it, the forward's, else ``"check"``). ``probs``: a zeroed ``[N, W]`` fp32 buffer
    the slot pass fills with each slot's probability summed over the heads (``STORE_PROBS``)."""
    Hh, N, R = q_abs_HNR.shape
    B, S, _ = c_BSR.shape
    Q, W = idx_BQW.shape[1:]
    mode = dc or dc_mode()
    if mode not in DC_MODES:
        raise ValueError(f"dc must be one of {', '.join(DC_MODES)}, got {mode!r}")
    kp = None if mode not in POOL_MODES else pool_layout(idx_BQW, S) if layout == "check" else layout
    dq_abs = torch.empty_like(q_abs_HNR)
    dc_BSR = torch.zeros(B, S, R, dtype=torch.float32, device=c_BSR.device)
    flags = {} if probs is None else {"probs_ptr": probs, "STORE_PROBS": True}
    if kp and mode == "saved":
        return _backward_saved(q_abs_HNR, do_lat_HNR, o_lat_HNR, lse2_HN, c_BSR, idx_BQW, scale, config, pool_config,
                               kp, dq_abs, dc_BSR, probs, flags)
    RP, prec = triton.next_power_of_2(R), _dot_precision(q_abs_HNR.dtype)
    delta = torch.empty(Hh, N, dtype=torch.float32, device=c_BSR.device) if kp else lse2_HN
    slot_args = (q_abs_HNR, do_lat_HNR, o_lat_HNR, lse2_HN, c_BSR, idx_BQW, dq_abs, dc_BSR, delta, scale)
    _tuned_run("bwd", config, q_abs_HNR, dc_BSR, lambda cfg: _slot_pass(
        cfg, N, *slot_args, W - (kp - 1) if kp else 0, STORE_DELTA=kp is not None, **flags), probs)
    if kp:
        if interpreting():
            _fix_interpreter_index()  # the pass loops to bounds it loads
        rows, warps, stages = pool_config or POOL_CONFIG
        for a in range(0, Q, POOL_QUERIES):  # the sort's working set bounded whatever the length
            qn, pool, lo, hi, NP = pool_entries(idx_BQW[:, a:a + POOL_QUERIES], S, kp, q0=a, Q=Q)
            if pool.numel():
                sparse_mla_bwd_pool_dc_kernel[(pool.numel(),)](
                    q_abs_HNR, do_lat_HNR, lse2_HN, delta, c_BSR, qn, pool, lo, hi, dc_BSR, scale, scale * LOG2E, N,
                    S, NP, N * R, Hh=Hh, R=R, RP=RP, KP=kp, BR=rows, DOT_PREC=prec, num_warps=warps,
                    num_stages=stages)
            del qn, pool, lo, hi
    return dq_abs, dc_BSR


def _backward_saved(q_abs_HNR, do_lat_HNR, o_lat_HNR, lse2_HN, c_BSR, idx_BQW, scale, config, pool_config, kp,
                    dq_abs, dc_BSR, probs=None, flags=None) -> tuple[torch.Tensor, torch.Tensor]:
    """``backward`` with ``dc="saved"`` on a selection in pools of ``kp``: per batch row, ``SAVED_QUERIES`` queries
    at a time, the slot pass (``SAVE_PDS``: ``dq_abs``, the tail's atomics, and the pool slots' ``p`` and ``ds``
    left in one buffer) and then the pool pass over those queries' entries (``sparse_mla_bwd_pool_saved_kernel``)."""
    Hh, N, R = q_abs_HNR.shape
    B, S, _ = c_BSR.shape
    Q, W = idx_BQW.shape[1:]
    K = (W + 1) // kp - 1
    RP, prec = triton.next_power_of_2(R), _dot_precision(q_abs_HNR.dtype)
    chunk = max(1, min(Q, SAVED_QUERIES))
    pds = torch.empty(2, chunk * K * Hh * kp, dtype=q_abs_HNR.dtype, device=q_abs_HNR.device)
    rows, warps, stages = pool_config or POOL_SAVED_CONFIG
    if interpreting():
        _fix_interpreter_index()  # the pool pass loops to bounds it loads
    # delta is not stored (STORE_DELTA off): lse2 stands in for its pointer
    slot_args = (q_abs_HNR, do_lat_HNR, o_lat_HNR, lse2_HN, c_BSR, idx_BQW, dq_abs, dc_BSR, lse2_HN, scale)

    def run(cfg: Config) -> None:
        for b in range(B):
            for a in range(0, Q, chunk):
                nq = min(chunk, Q - a)
                _slot_pass(cfg, nq, *slot_args, K * kp, STORE_DELTA=False, p_ptr=pds[0], ds_ptr=pds[1],
                           N0=b * Q + a, KP=kp, SAVE_PDS=True, **(flags or {}))
                qn, pool, lo, hi, NP, ent = pool_entries(idx_BQW[b:b + 1, a:a + nq], S, kp, q0=a, Q=Q, slots=True)
                if pool.numel():
                    if b:
                        qn += b * Q
                        pool += b * NP
                    sparse_mla_bwd_pool_saved_kernel[(pool.numel(),)](
                        q_abs_HNR, do_lat_HNR, pds[0], pds[1], qn, ent, pool, lo, hi, dc_BSR, S, NP, N * R, Hh=Hh,
                        R=R, RP=RP, KP=kp, BR=rows, DOT_PREC=prec, num_warps=warps, num_stages=stages)
                del qn, pool, lo, hi, ent

    _tuned_run("bwd_saved", config, q_abs_HNR, dc_BSR, run, probs)  # tuned apart: its timed run has the pool pass
    return dq_abs, dc_BSR


def _slot_pass(cfg: Config, programs: int, q_abs_HNR, do_lat_HNR, o_lat_HNR, lse2_HN, c_BSR, idx_BQW, dq_abs, dc_BSR,
               delta, scale: float, dc_start: int, **flags) -> None:
    """``sparse_mla_bwd_kernel`` over ``programs`` queries (from ``N0`` in ``flags``, default 0), ``DC_START =
    dc_start``; ``flags`` its other switches (``STORE_DELTA``, ``SAVE_PDS`` and the saved buffer's arguments)."""
    Hh, N, R = q_abs_HNR.shape
    Q, W = idx_BQW.shape[1:]
    sparse_mla_bwd_kernel[(programs * triton.cdiv(Hh, cfg.BH),)](
        q_abs_HNR, do_lat_HNR, o_lat_HNR, lse2_HN, c_BSR, idx_BQW, dq_abs, dc_BSR, delta, scale, scale * LOG2E, N, Q,
        c_BSR.shape[1], N * R, W=W, Hh=Hh, R=R, RP=triton.next_power_of_2(R), BH=cfg.BH, BW=cfg.BW,
        DOT_PREC=_dot_precision(q_abs_HNR.dtype), DC_START=dc_start, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages, **flags)


def _bucket(N: int) -> int:
    from megaseq.ops.autotune import seq_bucket

    return seq_bucket(N)


def _tuned_run(kind: str, config: Config | None, q_abs_HNR: torch.Tensor, dc_BSR: torch.Tensor, run,
               probs: torch.Tensor | None = None) -> None:
    """``run(cfg)`` once with ``config``, else the default or tuned one for ``kind`` (``_pick``); tuning may have run
    the atomics several times, so ``dc`` (and ``probs``) are zeroed after it."""
    Hh, N, R = q_abs_HNR.shape
    tuning = config is None and _autotune() and (kind, Hh, R, q_abs_HNR.dtype, _bucket(N)) not in _TUNED
    cfg = config or _pick(kind, Hh, R, q_abs_HNR.dtype, run, N)
    if tuning:
        dc_BSR.zero_()
        if probs is not None:
            probs.zero_()
    run(cfg)


def compile_ptx(kind: str, dtype: torch.dtype, Hh: int, R: int, W: int, cfg: Config | None = None,
                arch: int = 90, probs: bool = False) -> tuple[str, int]:
    """PTX and shared-memory bytes of one kernel compiled for ``sm_<arch>`` without a GPU (Triton's
    bundled ptxas also checks that it assembles): what the CPU test uses to catch code that only the
    interpreter accepts, and a way to read registers, spills (``ptxas -v`` on the PTX) and the atomics'
    width. Needs triton imported without ``TRITON_INTERPRET``. ``layout``: ``pool_layout_kernel`` for 16-key
    pools on an idx of ``dtype`` (int32 or int64; Hh and R unused), its row stride W not taken as aligned.
    ``probs``: a slot pass (``bwd*``) that also writes the head-summed probabilities (``STORE_PROBS``)."""
    if kind == "layout":
        ptrs = {"idx_ptr": {torch.int32: "*i32", torch.int64: "*i64"}[dtype], "flag_ptr": "*i32"}
        ints = {"N": "i32", "Q": "i32", "S": "i32", "L": "i32", "stride_b": "i64", "stride_q": "i32"}
        BN, BS = pool_layout_blocks((W + 1) // 16 * 16 - 16)
        consts = {"KP": 16, "BN": BN, "BS": BS}
        aligned = [n for n in (*ptrs, *ints) if n != "stride_q"]  # stride_q = W, odd in the real shapes
        return _compile(pool_layout_kernel, {**ptrs, **ints}, consts, aligned, POOL_LAYOUT_WARPS, 3, arch)

    cfg = cfg or default_config("fwd" if kind == "fwd" else "bwd", Hh, R, dtype)
    t = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32"}[dtype]
    ints = {"N": "i32", "Q": "i32", "S": "i32", "stride_h": "i64"}
    if kind == "fwd":
        fn, ptrs = sparse_mla_fwd_kernel, {"qabs_ptr": t, "c_ptr": t, "idx_ptr": "*i32", "olat_ptr": t,
                                           "lse_ptr": "*fp32", "scale_log2": "fp32"}
    elif kind in ("bwd", "bwd_tail", "bwd_save"):  # bwd_tail: the slot pass beside the pool pass (atomics for the
        # tail only); bwd_save: the same, leaving the pool slots' p and ds for the saved pool pass
        fn, ptrs = sparse_mla_bwd_kernel, {"qabs_ptr": t, "dolat_ptr": t, "olat_ptr": t, "lse_ptr": "*fp32",
                                           "c_ptr": t, "idx_ptr": "*i32", "dqabs_ptr": t, "dc_ptr": "*fp32",
                                           "delta_ptr": "*fp32", "scale": "fp32", "scale_log2": "fp32"}
        ptrs.update({"p_ptr": t, "ds_ptr": t})  # read only with SAVE_PDS
        ptrs["probs_ptr"] = "*fp32"  # written only with STORE_PROBS (``probs``)
    elif kind == "pool_saved":  # the pool pass from the saved p and ds, 16-key pools
        fn, ptrs = sparse_mla_bwd_pool_saved_kernel, {"qabs_ptr": t, "dolat_ptr": t, "p_ptr": t, "ds_ptr": t,
                                                      "qn_ptr": "*i32", "ent_ptr": "*i32", "pool_ptr": "*i32",
                                                      "lo_ptr": "*i64", "hi_ptr": "*i64", "dc_ptr": "*fp32"}
        ints = {"S": "i32", "NP": "i32", "stride_h": "i64"}
    else:  # "pool": the key-major latent gradient, 16-key pools, after a bwd with DC_START = W - 15
        fn, ptrs = sparse_mla_bwd_pool_dc_kernel, {"qabs_ptr": t, "dolat_ptr": t, "lse_ptr": "*fp32",
                                                   "delta_ptr": "*fp32", "c_ptr": t, "qn_ptr": "*i32",
                                                   "pool_ptr": "*i32", "lo_ptr": "*i64", "hi_ptr": "*i64",
                                                   "dc_ptr": "*fp32", "scale": "fp32", "scale_log2": "fp32"}
        ints = {"N": "i32", "S": "i32", "NP": "i32", "stride_h": "i64"}
    consts = {"W": W, "Hh": Hh, "R": R, "RP": triton.next_power_of_2(R), "BH": cfg.BH, "BW": cfg.BW,
              "DOT_PREC": _dot_precision(dtype)}
    if kind in ("bwd", "bwd_tail", "bwd_save"):
        ints["N0"] = "i32"
        consts.update(DC_START=W - 15 if kind != "bwd" else 0, STORE_DELTA=kind == "bwd_tail", KP=16,
                      SAVE_PDS=kind == "bwd_save", STORE_PROBS=probs)
    if kind in ("pool", "pool_saved"):
        consts = {"Hh": Hh, "R": R, "RP": triton.next_power_of_2(R), "KP": 16,
                  "BR": (POOL_CONFIG if kind == "pool" else POOL_SAVED_CONFIG)[0], "DOT_PREC": _dot_precision(dtype)}
    aligned = [n for n, ty in ptrs.items() if ty.startswith("*")] + list(ints)  # as Triton specializes them
    return _compile(fn, {**ptrs, **ints}, consts, aligned, cfg.num_warps, cfg.num_stages, arch)


def _compile(fn, types: dict[str, str], consts: dict, aligned: list[str], num_warps: int, num_stages: int,
             arch: int) -> tuple[str, int]:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = {**types, **dict.fromkeys(consts, "constexpr")}
    names = list(fn.arg_names)
    src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(n),): v for n, v in consts.items()},
                    attrs={(names.index(n),): [["tt.divisibility", 16]] for n in aligned})
    compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32),
                              options={"num_warps": num_warps, "num_stages": num_stages})
    return compiled.asm["ptx"], compiled.metadata.shared
