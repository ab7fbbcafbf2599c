"""Triton kernel of op ``indexer_kl``: the indexer objective's KL and its gradients, one program per query.

Shapes: c queries, I indexer heads (IP: padded to a power of two >= 16, ``tl.dot``'s least M), D head dim (DP:
padded likewise), P pooled keys, K selected pools per query, BK pools per loop step.

For query n, ``score[k] = sum_i w[i] relu(scale * q[i] . keys[pools[k]])`` over its candidate slots, and

1. pass 1, per block of BK slots: the keys gathered by pool index into the dot's ``[BK, DP]`` operand (in the
   queries' dtype: keys of another dtype are converted as they are read), the dots
   ``[IP, BK]`` on tensor cores (work-dtype operands, fp32 accumulation; fp32 operands with
   ``input_precision="ieee"``), the relu-weighted head sum, and per lane an online max and sum of ``exp``
   over the candidates (``_candidate_logits``: everything else is -inf): the log-sum-exp, and the target's
   mass on the candidates ``T``;
2. pass 2, the dots recomputed: ``p = softmax(score)``, the KL ``sum_k xlogy(t, t) - sum_cand t (score - lse)``,
   and the gradient ``g[k] = p[k] T - t[k]`` (0 off the candidates, times the row's weight in the backward's
   rerun) taken back through the head sum and the relu:
   ``dw[i] = sum_k g relu(.)``, ``d(q.k)[i, k] = g w[i] scale [dot > 0]``, ``dq = d(q.k) @ keys`` in registers,
   ``dkeys[pools[k]] += d(q.k)^T @ q`` with ``tl.atomic_add`` into ``[P, D]`` fp32 (``_add_key_grads``; a pool
   selected twice in a row, or by many rows, adds each time).

Written: ``kl [c]``, ``dq [c, I, D]``, ``dw [c, I]``, ``dkeys [P, D]``, all fp32 (without ``GRADS`` the KL alone).
Cost per query: two passes over K gathered key rows (``2 K D`` work-dtype bytes, from L2 when the keys fit) and
``2 I K D`` dot FLOPs a pass, two more dots in pass 2 (``6 I K D`` FLOPs in all); ``K D`` fp32 atomics.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@dataclass(frozen=True)
class Config:
    """Pools per loop step, warps, software-pipeline stages."""

    BK: int
    num_warps: int
    num_stages: int


def default_config(I: int, D: int, dtype: torch.dtype) -> Config:
    """128 pools a step for 16-bit operands with up to 32 heads of up to 128, else 32; fp32 operands 32, else 16;
    8 warps, 2 stages.

    Timed on an H100 at glm5-flash's indexer (I = 32, D = 128, K = 512, bf16, 2048 queries over 4096 pools, the
    forward and backward; ``benchmarks/kernels/indexer_kl_configs.py``, its result in
    ``benchmarks/results/kernels/indexer_kl/``): (128, 8, 2) the fastest of the six timed, 14% under (64, 8, 2),
    4.7x under the torch reference. Shared memory for sm_90: bf16 (128, 8, 2) 82 KB, (64, 8, 2) 49 KB; fp32
    (32, 8, 2) 49 KB; on 4 warps bf16 (32, 4, 1) spills."""
    small = I <= 32 and D <= 128
    if dtype.itemsize > 2:
        return Config(32 if small else 16, 8, 2)
    return Config(128 if small else 32, 8, 2)


def _dot_precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"  # tf32 is ignored for 16-bit operands


# ---- kernel --------------------------------------------------------------------------------------------
@triton.jit
def _gather_block(k_ptr, pool_row, cand_row, tgt_row, k0, K: tl.constexpr, offs_d, D: tl.constexpr,
                  DP: tl.constexpr, BK: tl.constexpr):
    """Slots ``k0 .. k0 + BK`` of one query: the key rows ``[BK, DP]`` in the keys' dtype (0 off the candidates and
    past D), their pool index (int64, 0 off the candidates), the candidate mask and the target (0 past K)."""
    offs_k = k0 + tl.arange(0, BK)
    inside = offs_k < K
    cand = (tl.load(cand_row + offs_k, mask=inside, other=0) != 0) & inside
    pool = tl.load(pool_row + offs_k, mask=cand, other=0).to(tl.int64)
    ptrs = k_ptr + pool[:, None] * D + offs_d[None, :]
    if DP == D:
        keys_KD = tl.load(ptrs, mask=cand[:, None], other=0.0)
    else:
        keys_KD = tl.load(ptrs, mask=cand[:, None] & (offs_d[None, :] < D), other=0.0)
    t_K = tl.load(tgt_row + offs_k, mask=inside, other=0.0)
    return keys_KD, pool, cand, t_K


@triton.jit
def _scores(q_ID, w_I, keys_KD, scale, DOT_PREC: tl.constexpr):
    """``(scale * q . k [IP, BK], score [BK])``: the scaled dots and their relu-weighted sum over the heads."""
    dots_IK = tl.dot(q_ID, tl.trans(keys_KD), input_precision=DOT_PREC) * scale
    return dots_IK, tl.sum(w_I[:, None] * tl.maximum(dots_IK, 0.0), 0)


@triton.jit
def _candidate_logits(s_K, cand):
    """The scores where the slot is a candidate, -inf elsewhere: what the softmax runs over."""
    return tl.where(cand, s_K, float("-inf"))


@triton.jit
def _add_key_grads(dk_ptr, pool, cand, offs_d, D: tl.constexpr, dk_KD):
    """``dkeys[pools[k]] += dk[k]`` for the candidate slots (atomics: pools repeat within and across rows; relaxed,
    as nothing in the kernel reads them back)."""
    tl.atomic_add(dk_ptr + pool[:, None] * D + offs_d[None, :], dk_KD, mask=cand[:, None] & (offs_d[None, :] < D),
                  sem="relaxed")


@triton.jit
def _row_lse(q_ID, w_I, k_ptr, pool_row, cand_row, tgt_row, offs_d, scale, K: tl.constexpr, D: tl.constexpr,
             DP: tl.constexpr, BK: tl.constexpr, DOT_PREC: tl.constexpr):
    """Pass 1: ``(lse, T)``, the candidates' log-sum-exp of the scores (0 without a candidate) and the target's
    mass on them; per lane an online max and sum, joined at the end."""
    m_K = tl.full([BK], float("-inf"), tl.float32)
    l_K = tl.zeros([BK], tl.float32)
    T_K = tl.zeros([BK], tl.float32)
    for k0 in range(0, K, BK):
        keys_KD, _pool, cand, t_K = _gather_block(k_ptr, pool_row, cand_row, tgt_row, k0, K, offs_d, D, DP, BK)
        _dots, s_K = _scores(q_ID, w_I, keys_KD.to(q_ID.dtype), scale, DOT_PREC)
        x_K = _candidate_logits(s_K, cand)
        m_new = tl.maximum(m_K, x_K)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # no candidate in this lane yet: keep exp finite
        l_K = l_K * tl.exp(m_K - m_safe) + tl.exp(x_K - m_safe)
        m_K = m_new
        T_K += tl.where(cand, t_K, 0.0)
    M = tl.max(m_K, 0)
    M_safe = tl.where(M == float("-inf"), 0.0, M)
    lsum = tl.sum(l_K * tl.exp(m_K - M_safe), 0)
    lse = tl.where(lsum > 0.0, M_safe + tl.log(tl.where(lsum > 0.0, lsum, 1.0)), 0.0)
    return lse, tl.sum(T_K, 0)


@triton.jit
def indexer_kl_kernel(q_ptr, w_ptr, k_ptr, pool_ptr, cand_ptr, tgt_ptr, rw_ptr, kl_ptr, dq_ptr, dw_ptr, dk_ptr,
                      scale, I: tl.constexpr, D: tl.constexpr, K: tl.constexpr, IP: tl.constexpr, DP: tl.constexpr,
                      BK: tl.constexpr, DOT_PREC: tl.constexpr, GRADS: tl.constexpr):
    """``rw_ptr``: each row's weight on its gradient (1, or the incoming gradient in the backward's rerun)."""
    n = tl.program_id(0).to(tl.int64)
    offs_i = tl.arange(0, IP)
    offs_d = tl.arange(0, DP)
    mask_i = offs_i < I
    mask_ID = mask_i[:, None] & (offs_d[None, :] < D)
    q_ID = tl.load(q_ptr + n * (I * D) + offs_i[:, None] * D + offs_d[None, :], mask=mask_ID, other=0.0)
    w_I = tl.load(w_ptr + n * I + offs_i, mask=mask_i, other=0.0)
    pool_row, cand_row, tgt_row = pool_ptr + n * K, cand_ptr + n * K, tgt_ptr + n * K
    lse, T = _row_lse(q_ID, w_I, k_ptr, pool_row, cand_row, tgt_row, offs_d, scale, K, D, DP, BK, DOT_PREC)
    rw = tl.load(rw_ptr + n)
    kl_K = tl.zeros([BK], tl.float32)
    dw_I = tl.zeros([IP], tl.float32)
    dq_ID = tl.zeros([IP, DP], tl.float32)
    for k0 in range(0, K, BK):
        keys_KD, pool, cand, t_K = _gather_block(k_ptr, pool_row, cand_row, tgt_row, k0, K, offs_d, D, DP, BK)
        keys_KD = keys_KD.to(q_ID.dtype)  # the dots in the queries' dtype, as the reference's
        dots_IK, s_K = _scores(q_ID, w_I, keys_KD, scale, DOT_PREC)
        logp_K = _candidate_logits(s_K, cand) - lse  # -inf off the candidates
        kl_K += tl.where(t_K > 0.0, t_K * tl.log(tl.where(t_K > 0.0, t_K, 1.0)), 0.0)
        kl_K -= t_K * tl.where(cand, logp_K, 0.0)
        if GRADS:
            g_K = tl.where(cand, tl.exp(logp_K) * T - t_K, 0.0) * rw
            dw_I += tl.sum(tl.maximum(dots_IK, 0.0) * g_K[None, :], 1)
            gd_IK = tl.where(dots_IK > 0.0, g_K[None, :] * w_I[:, None] * scale, 0.0).to(keys_KD.dtype)
            dq_ID = tl.dot(gd_IK, keys_KD, dq_ID, input_precision=DOT_PREC)
            dk_KD = tl.dot(tl.trans(gd_IK), q_ID, input_precision=DOT_PREC)
            _add_key_grads(dk_ptr, pool, cand, offs_d, D, dk_KD)
    tl.store(kl_ptr + n, tl.sum(kl_K, 0))
    if GRADS:
        tl.store(dq_ptr + n * (I * D) + offs_i[:, None] * D + offs_d[None, :], dq_ID, mask=mask_ID)
        tl.store(dw_ptr + n * I + offs_i, dw_I, mask=mask_i)


# ---- launcher ------------------------------------------------------------------------------------------
def indexer_kl(q_cID: torch.Tensor, w_cI: torch.Tensor, keys_PD: torch.Tensor, pools_cK: torch.Tensor,
               target_cK: torch.Tensor, cand_cK: torch.Tensor, scale: float, grads: bool = True,
               row_weight: torch.Tensor | None = None, config: Config | None = None):
    """``(kl [c], dq [c, I, D], dw [c, I], dkeys [P, D])`` fp32, the gradients of ``sum_n row_weight[n] kl[n]``
    (``row_weight`` None: 1 per row); ``grads`` False: the three gradients are None. Inputs contiguous (``ops.
    indexer.kl`` checks their dtypes and shapes); ``config`` replaces the default launch configuration."""
    c, I, D = q_cID.shape
    P, K = keys_PD.shape[0], pools_cK.shape[1]
    dev = q_cID.device
    kl_c = torch.zeros(c, dtype=torch.float32, device=dev)
    f32 = dict(dtype=torch.float32, device=dev)
    dq, dw, dk = ((torch.zeros(c, I, D, **f32), torch.zeros(c, I, **f32), torch.zeros(P, D, **f32)) if grads
                  else (None, None, None))
    if c == 0 or K == 0:
        return kl_c, dq, dw, dk
    cfg = config or default_config(I, D, q_cID.dtype)
    pools = pools_cK.to(torch.int32)  # P < 2^31 (supports); slots off the candidates are never read
    rw = row_weight if row_weight is not None else torch.ones(c, **f32)
    outs = (dq, dw, dk) if grads else (kl_c, kl_c, kl_c)
    indexer_kl_kernel[(c,)](q_cID, w_cI, keys_PD, pools, cand_cK.view(torch.uint8), target_cK, rw, kl_c, *outs,
                            float(scale), I=I, D=D, K=K, IP=max(16, triton.next_power_of_2(I)),
                            DP=max(16, triton.next_power_of_2(D)), BK=cfg.BK, DOT_PREC=_dot_precision(q_cID.dtype),
                            GRADS=grads, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return kl_c, dq, dw, dk


def compile_ptx(dtype: torch.dtype, I: int, D: int, K: int, cfg: Config | None = None, arch: int = 90,
                grads: bool = True, keys_dtype: torch.dtype | None = None) -> tuple[str, int]:
    """PTX and shared-memory bytes of the kernel compiled for ``sm_<arch>`` without a GPU (Triton's bundled ptxas
    also checks that it assembles): the CPU test's guard against code only the interpreter accepts. Needs
    triton imported without ``TRITON_INTERPRET``."""
    from megaseq.ops.sparse_mla.kernels import _compile

    cfg = cfg or default_config(I, D, dtype)
    ty = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32"}
    types = {"q_ptr": ty[dtype], "w_ptr": "*fp32", "k_ptr": ty[keys_dtype or dtype], "pool_ptr": "*i32",
             "cand_ptr": "*u8", "tgt_ptr": "*fp32", "rw_ptr": "*fp32", "kl_ptr": "*fp32", "dq_ptr": "*fp32",
             "dw_ptr": "*fp32", "dk_ptr": "*fp32", "scale": "fp32"}
    consts = {"I": I, "D": D, "K": K, "IP": max(16, triton.next_power_of_2(I)),
              "DP": max(16, triton.next_power_of_2(D)), "BK": cfg.BK, "DOT_PREC": _dot_precision(dtype),
              "GRADS": grads}
    aligned = [n for n in types if n != "scale"]
    return _compile(indexer_kl_kernel, types, consts, aligned, cfg.num_warps, cfg.num_stages, arch)
