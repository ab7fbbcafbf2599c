"""Op ``indexer_target``: the main attention's probabilities over each query's selected slots, summed over heads.

Shapes: c queries, Hh heads, C latent width (R, or R + Dr with DeepSeek's RoPE part), S keys, W selected
slots per query, n keys of ``head_summed_probs``.

The sparse stage of the indexer objective (``models.common.indexer_kl.sparse_target``) needs, per query,
``m[w] = sum_h softmax_w(scale * q_abs[h] . c[idx[w]])`` over the valid slots (``0 <= idx < S``): 0 on empty
slots and on every slot of a query without a valid one. ``q_abs [c, Hh, C]`` are the absorbed queries
(``q . k = q_abs . c``) in the attention's work dtype, ``c_SC`` the latents in the same dtype, ``idx_cW`` the
selection (int32 or int64).

``lse`` (optional, ``[c, Hh]``, any strides): each head's base-2 log-sum-exp over the query's valid slots, as op
``sparse_attention`` hands it out (``return_lse``, ``ops.sparse_mla.reference``: ``+inf`` for a query without a
valid slot). Given it, ``m[w] = sum_h 2^(LOG2E * scale * q_abs[h] . c[idx[w]] - lse[h])``: no softmax of its own,
one pass over the slots. The attention computed it over the same queries, latents, selection and scale, so the
sparse stage's objective passes it (``models.common.indexer_objective``).

Implementations (``ops.table``):

- ``torch_gather`` (the reference): the selected latents gathered into ``[c, W, C]``, the scores ``[c, Hh, W]``
  in the work dtype, then softmax (given ``lse``: the scores exponentiated in place) and the sum over heads in
  fp32 (or wider). Working set per query ``W * C`` work-dtype bytes and two ``[Hh, W]`` fp32 tensors, one given
  ``lse`` (``ops.workspace.indexer_target_row_bytes``).
- ``triton`` (``target_kernel``): one program per query, the latents gathered into the dot operand a slot
  block at a time, two passes (log-sum-exp per head, then the head-summed probabilities), or the second alone
  given ``lse``; it writes only ``m [c, W]`` fp32 (and without ``lse`` its own ``lse2 [c, Hh]`` fp32). Its scores
  keep the fp32 accumulator instead of the reference's rounding to the work dtype, so in bf16 it is the closer
  of the two to the float64 computation.
"""

from __future__ import annotations

import math

import torch

from megaseq.ops._triton_util import interpreted_run_problem

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MAX_LATENT = 1024  # target_kernel.MAX_LATENT (the kernel module imports triton)
# cpu tensors are accepted only with TRITON_INTERPRET=1 *and* this flag (the CPU tests set both), as for the fused
# sparse MLA: the variable alone would send every CPU call of other tests to the (slow) interpreter
CPU_INTERPRETER: bool = False


# ---- the reference -------------------------------------------------------------------------------------
def head_summed_probs(q_abs_cHC: torch.Tensor, keys: torch.Tensor, valid_cn: torch.Tensor,
                      scale: float, lse2_cH: torch.Tensor | None = None) -> torch.Tensor:
    """``sum_h softmax_n(scale * q_h . k_n)`` over the valid keys ``[c, n]`` (0 elsewhere, and on rows with none):
    ``keys`` is ``[n, C]`` (shared by the rows) or ``[c, n, C]`` (each row's own). fp32 (or wider) out. ``lse2_cH``:
    each head's base-2 log-sum-exp (the module docstring's ``lse``) in place of the softmax's own."""
    eq = "chr,nr->chn" if keys.dim() == 2 else "chr,cnr->chn"
    # the scores in the inputs' dtype (the attention's work dtype, as the op), softmax and sums in fp32 or wider
    s = torch.einsum(eq, q_abs_cHC, keys).to(torch.promote_types(keys.dtype, torch.float32)) * scale
    s = s.masked_fill_(~valid_cn[:, None, :], float("-inf"))
    has = valid_cn.any(-1)
    s = s.masked_fill_(~has[:, None, None], 0.0)
    if lse2_cH is None:
        p = s.softmax(-1)
    else:  # in place (one [c, Hh, n] tensor); the natural log-sum-exp is lse2 * ln 2; +inf (no valid slot) gives 0
        p = s.sub_((lse2_cH.to(s.dtype) * math.log(2.0)).unsqueeze(-1)).exp_()
    return p.masked_fill_(~has[:, None, None], 0.0).sum(1)


def selected(idx_cW: torch.Tensor, S: int) -> torch.Tensor:
    """``[c, W]`` bool: the slots that hold a key (``0 <= idx < S``)."""
    return (idx_cW >= 0) & (idx_cW < S)


def indexer_target_reference(q_abs_cHC: torch.Tensor, c_SC: torch.Tensor, idx_cW: torch.Tensor,
                             scale: float, lse: torch.Tensor | None = None) -> torch.Tensor:
    """``m [c, W]`` fp32 (or wider): the latents of the selected slots gathered, then ``head_summed_probs`` (with
    the attention's base-2 ``lse [c, Hh]`` when given)."""
    ok = selected(idx_cW, c_SC.shape[0])
    keys = c_SC.index_select(0, torch.where(ok, idx_cW.long(), 0).reshape(-1)).view(*idx_cW.shape, -1)
    return head_summed_probs(q_abs_cHC, keys, ok, scale, lse)


# ---- the Triton kernel ---------------------------------------------------------------------------------
def indexer_target_supports(q_abs_cHC: torch.Tensor, c_SC: torch.Tensor, idx_cW: torch.Tensor,
                            scale: float, lse: torch.Tensor | None = None) -> str | None:
    """None when ``triton`` can run these arguments, else the reason."""
    if q_abs_cHC.dim() != 3 or c_SC.dim() != 2 or q_abs_cHC.shape[-1] != c_SC.shape[-1]:
        return f"needs q_abs [c, Hh, C] and latents [S, C] (got {tuple(q_abs_cHC.shape)}, {tuple(c_SC.shape)})"
    if idx_cW.dim() != 2 or idx_cW.shape[0] != q_abs_cHC.shape[0]:
        return f"idx {tuple(idx_cW.shape)} is not [c, W] for q_abs {tuple(q_abs_cHC.shape)}"
    if idx_cW.dtype not in (torch.int32, torch.int64) or c_SC.shape[0] >= 2**31:
        return f"idx must be int32/int64 with S < 2^31 (got {idx_cW.dtype}, S = {c_SC.shape[0]})"
    if lse is not None and (lse.shape != q_abs_cHC.shape[:2] or lse.dtype != torch.float32
                            or lse.device != q_abs_cHC.device):
        return (f"lse {tuple(lse.shape)} {lse.dtype} on {lse.device} is not [c, Hh] = "
                f"{tuple(q_abs_cHC.shape[:2])} fp32 on q_abs's device")
    C = c_SC.shape[-1]
    if C > MAX_LATENT:
        return f"latent width C = {C}: the kernel holds [slots, C] tiles up to C = {MAX_LATENT}"
    if q_abs_cHC.dtype not in DTYPES or c_SC.dtype != q_abs_cHC.dtype:
        return f"dtypes q_abs {q_abs_cHC.dtype}, latents {c_SC.dtype} (runs one of bf16/fp16/fp32)"
    # the latents share q_abs's dtype (above), so a bf16 q_abs is the interpreter's bf16 case
    return interpreted_run_problem((q_abs_cHC, c_SC, idx_cW), "q_abs, the latents and idx", CPU_INTERPRETER)


@torch.no_grad()
def indexer_target_triton(q_abs_cHC: torch.Tensor, c_SC: torch.Tensor, idx_cW: torch.Tensor,
                          scale: float, lse: torch.Tensor | None = None) -> torch.Tensor:
    """The reference's contract and result, ``m [c, W]`` fp32, without a gathered ``[c, W, C]`` or ``[c, Hh, W]``
    (given ``lse``, one pass over the slots: the kernel reads it with its strides)."""
    from megaseq.ops._triton_util import kernels

    kern = kernels("indexer.target_kernel")
    return kern.target(q_abs_cHC.contiguous(), c_SC.contiguous(), idx_cW.contiguous(), float(scale), lse2=lse)[0]
