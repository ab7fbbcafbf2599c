"""Op ``indexer_kl``: the indexer's side of the indexer objective, ``KL(target || softmax(indexer scores))`` per query.

Shapes: c queries, I indexer heads, D indexer head dim, P pooled keys, K selected pools per query, n keys.

Given the indexer's queries ``q_cID`` (the work dtype), head weights ``w_cI`` (fp32), pooled keys ``keys_PD`` (any
float dtype: the dots take them in the queries'), the pool of each selected slot ``pools_cK`` (int32/int64) and
the sparse stage's target ``target_cK`` (fp32, summing to 1 over the candidates ``cand_cK``, bool), the op
returns ``rows_kl [c]`` fp32::

    score[k] = sum_i w[i] * relu(scale * q[i] . keys[pools[k]])
    rows_kl  = sum_k xlogy(t[k], t[k]) - sum_{k in cand} t[k] * log_softmax_cand(score)[k]

differentiable with respect to ``q_cID``, ``w_cI`` and ``keys_PD``. Slots outside ``cand`` contribute nothing
(their pools are never read); a row without a candidate gives ``sum_k xlogy(t, t)`` (0 for the objective's
target, which is 0 there) and no gradient. ``models.common.indexer_objective`` calls it once per query chunk.

Implementations (``ops.table``):

- ``torch_gather`` (the reference): the selected keys gathered into ``[c, K, D]`` (``index_select``: its backward
  is an ``index_add_``), the dots ``[c, I, K]`` in the work dtype, the heads' weighted sum and the KL in fp32.
  Autograd keeps several fp32 ``[c, I, K]`` tensors and a ``[c, K, D]`` gradient for its backward.
- ``triton`` (``kl_kernel``, opt-in): one program per query, two passes over its K pools in blocks (the
  candidates' log-sum-exp; then the KL and the gradients, the dots recomputed), the key rows gathered by pool
  index straight into the dot operand. Its forward writes the KL and the gradients ``dq [c, I, D]``,
  ``dw [c, I]`` and ``dkeys [P, D]`` (fp32, ``dkeys`` by atomic adds); its backward scales them by the incoming
  gradient (``ChunkedKL`` sums the rows: one scalar), or reruns the kernel with per-row weights for any other
  gradient. Nothing of size ``c * I * K`` or ``c * K * D`` exists. Opt-in: not in ``model.kernels fast``
  until it is measured on a GPU; a run prefers it with ``dispatch.configured(preferred={"indexer_kl":
  ["triton"]})``.
"""

from __future__ import annotations

import torch

from megaseq.ops._triton_util import interpreted_run_problem

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MAX_HEADS = 64  # kl_kernel holds [heads, D] query and gradient tiles in registers
MAX_DIM = 256
# cpu tensors are accepted only with TRITON_INTERPRET=1 *and* this flag (the CPU tests set both), as for op
# indexer_target: the variable alone would send every CPU call of other tests to the (slow) interpreter
CPU_INTERPRETER: bool = False


# ---- the reference -------------------------------------------------------------------------------------
def index_scores(q_cID: torch.Tensor, w_cI: torch.Tensor, keys: torch.Tensor, scale: float) -> torch.Tensor:
    """``sum_h w_h relu(scale * q_h . k)`` (``indexer_topk``'s scores): keys ``[n, D]`` -> ``[c, n]``, or each
    row's own ``[c, K, D]`` -> ``[c, K]``. The dot products in the queries' and keys' dtype (bf16 operands under
    autocast, as the selection kernel's), the heads' weighted sum in ``w_cI``'s."""
    eq = "cid,nd->cin" if keys.dim() == 2 else "cid,ckd->cik"
    dots = torch.einsum(eq, q_cID, keys.to(q_cID.dtype)).to(w_cI.dtype)
    return torch.einsum("ci,cin->cn", w_cI, dots.mul(scale).relu())


def kl_rows(target_cn: torch.Tensor, index_cn: torch.Tensor, cand_cn: torch.Tensor) -> torch.Tensor:
    """``KL(target || softmax(index))`` per row over the candidates ``[c]`` (0 for rows without any)."""
    has = cand_cn.any(-1, keepdim=True)
    x = index_cn.masked_fill(~cand_cn, torch.finfo(index_cn.dtype).min)
    logp = torch.where(has, x, 0.0).log_softmax(-1).masked_fill(~cand_cn, 0.0)
    return (torch.xlogy(target_cn, target_cn) - target_cn * logp).sum(-1)


def indexer_kl_reference(q_cID: torch.Tensor, w_cI: torch.Tensor, keys_PD: torch.Tensor, pools_cK: torch.Tensor,
                         target_cK: torch.Tensor, cand_cK: torch.Tensor, scale: float) -> torch.Tensor:
    """``rows_kl [c]``: the selected keys gathered, ``index_scores``, ``kl_rows``."""
    # index_select, not keys_PD[pools]: its backward is an index_add_, where advanced indexing's is a sorting
    # index_put_ (on an H100 at 16K, 0.29 s of a 0.74 s step)
    keys = keys_PD.index_select(0, pools_cK.flatten().long()).view(*pools_cK.shape, keys_PD.shape[-1])
    return kl_rows(target_cK, index_scores(q_cID, w_cI, keys, scale), cand_cK)


# ---- the Triton kernel ---------------------------------------------------------------------------------
def _shape_problem(q_cID, w_cI, keys_PD, pools_cK, target_cK, cand_cK) -> str | None:
    if q_cID.dim() != 3 or keys_PD.dim() != 2 or q_cID.shape[-1] != keys_PD.shape[-1]:
        return f"needs q [c, I, D] and keys [P, D] (got {tuple(q_cID.shape)}, {tuple(keys_PD.shape)})"
    if tuple(w_cI.shape) != tuple(q_cID.shape[:2]):
        return f"head weights {tuple(w_cI.shape)} are not [c, I] = {tuple(q_cID.shape[:2])}"
    ck = pools_cK.shape
    if pools_cK.dim() != 2 or ck[0] != q_cID.shape[0] or target_cK.shape != ck or cand_cK.shape != ck:
        return (f"pools {tuple(ck)}, target {tuple(target_cK.shape)} and candidates {tuple(cand_cK.shape)} are "
                f"not one [c, K] with c = {q_cID.shape[0]}")
    I, D = q_cID.shape[1:]
    if I > MAX_HEADS or D > MAX_DIM:
        return f"I = {I} heads of D = {D}: the kernel holds [I, D] tiles up to I = {MAX_HEADS}, D = {MAX_DIM}"
    return None


def _dtype_problem(q_cID, w_cI, keys_PD, pools_cK, target_cK, cand_cK) -> str | None:
    if q_cID.dtype not in DTYPES or keys_PD.dtype not in DTYPES:
        return f"dtypes q {q_cID.dtype}, keys {keys_PD.dtype} (runs bf16/fp16/fp32 for each)"
    if w_cI.dtype != torch.float32 or target_cK.dtype != torch.float32:
        return f"head weights {w_cI.dtype} and target {target_cK.dtype} must be fp32"
    if cand_cK.dtype != torch.bool or pools_cK.dtype not in (torch.int32, torch.int64):
        return f"candidates {cand_cK.dtype} must be bool and pools {pools_cK.dtype} int32/int64"
    if keys_PD.shape[0] >= 2**31:
        return f"P = {keys_PD.shape[0]} pooled keys (the kernel indexes them with int32 pools up to 2^31)"
    return None


def indexer_kl_supports(q_cID: torch.Tensor, w_cI: torch.Tensor, keys_PD: torch.Tensor, pools_cK: torch.Tensor,
                        target_cK: torch.Tensor, cand_cK: torch.Tensor, scale: float) -> str | None:
    """None when ``triton`` can run these arguments, else the reason."""
    args = (q_cID, w_cI, keys_PD, pools_cK, target_cK, cand_cK)
    why = _shape_problem(*args) or _dtype_problem(*args)
    if why is not None:
        return why
    # the head weights and the target are fp32 (above): a bf16 among the tensors is the queries' or the keys'
    return interpreted_run_problem(args, "q, the head weights, the keys, pools, target and candidates",
                                   CPU_INTERPRETER)


class FusedKL(torch.autograd.Function):
    """``rows_kl [c]`` whose gradients the kernel's forward already computed (for a gradient of 1 per row); the
    backward scales them by the incoming gradient where that is one value for every row (a sum's), else runs
    the kernel again with the rows' gradients as weights."""

    @staticmethod
    def forward(ctx, q_cID, w_cI, keys_PD, pools_cK, target_cK, cand_cK, scale: float):
        from megaseq.ops._triton_util import kernels

        kern = kernels("indexer.kl_kernel")
        args = (q_cID.contiguous(), w_cI.contiguous(), keys_PD.contiguous(), pools_cK.contiguous(),
                target_cK.contiguous(), cand_cK.contiguous())
        grads = any(ctx.needs_input_grad[:3])
        kl_c, dq, dw, dk = kern.indexer_kl(*args, float(scale), grads=grads)
        ctx.scale, ctx.kern = float(scale), kern
        ctx.dtypes = (q_cID.dtype, w_cI.dtype, keys_PD.dtype)
        ctx.save_for_backward(dq, dw, dk, *args)
        return kl_c

    @staticmethod
    def backward(ctx, grad_c: torch.Tensor):
        dq, dw, dk, *args = ctx.saved_tensors
        if grad_c.numel() <= 1 or grad_c.stride(0) == 0:  # one value for every row (the gradient of a sum)
            g = grad_c.reshape(-1)[:1].float() if grad_c.numel() else grad_c.new_zeros(1, dtype=torch.float32)
            dq, dw, dk = dq * g.view(1, 1, 1), dw * g.view(1, 1), dk * g.view(1, 1)
        else:
            _, dq, dw, dk = ctx.kern.indexer_kl(*args, ctx.scale, grads=True, row_weight=grad_c.float().contiguous())
        out = [g.to(dt) if need else None
               for g, dt, need in zip((dq, dw, dk), ctx.dtypes, ctx.needs_input_grad[:3], strict=True)]
        return (*out, None, None, None, None)


def indexer_kl_triton(q_cID: torch.Tensor, w_cI: torch.Tensor, keys_PD: torch.Tensor, pools_cK: torch.Tensor,
                      target_cK: torch.Tensor, cand_cK: torch.Tensor, scale: float) -> torch.Tensor:
    """The reference's contract and result, ``rows_kl [c]`` fp32, in one kernel (``FusedKL``)."""
    return FusedKL.apply(q_cID, w_cI, keys_PD, pools_cK, target_cK, cand_cK, scale)
