"""The references of the mHC ops (``models.common.mhc`` describes the block): ``hc_mix`` (the ``fn`` linear of
the RMS-normalised streams), ``hc_weights`` (the gates and the Sinkhorn-normalised ``comb``), ``hc_collapse``
(the block input) and ``hc_merge`` (the new streams). Weights in ``promote_types(dtype, float32)``."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megaseq.ops.amp import compute_dtype


def sinkhorn(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """Doubly stochastic ``[..., N, N]`` by alternate normalisation, in HF's exact order.

    The reference starts with one column normalisation (sum over dim -2), then runs ``iters - 1``
    (row, column) pairs: ``2 * iters - 1`` normalisations in all, ending on columns.
    """
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return comb


def hc_mix_reference(h_BSNH: torch.Tensor, fn_MD: torch.Tensor, norm_eps: float) -> torch.Tensor:
    """``mix_BSM``: ``fn`` applied to the flattened streams after an unweighted RMSNorm over all N*H features
    (HF's ``Glm5NextTextUnweightedRMSNorm``), in the compute dtype (bf16 under autocast: ``F.linear``'s)."""
    B, S, N, H = h_BSNH.shape
    cd = compute_dtype(h_BSNH.dtype)
    flat = h_BSNH.reshape(B, S, N * H).to(cd)
    flat = flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + norm_eps)
    return F.linear(flat, fn_MD.to(cd))


def hc_weights_reference(mix_BSM: torch.Tensor, base_M: torch.Tensor, scale_3: torch.Tensor, N: int, iters: int,
                         hc_eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``mix`` (the ``fn`` linear's output, compute dtype) -> ``(pre_BSN, post_BSN, comb_BSNN)``: the sigmoid
    gates, the row softmax of ``comb`` and its Sinkhorn normalisation, in the compute dtype."""
    cd = compute_dtype(mix_BSM.dtype)
    mix = mix_BSM.to(cd)
    pre_w, post_w, comb_w = mix.split([N, N, N * N], dim=-1)
    pre_b, post_b, comb_b = base_M.to(cd).split([N, N, N * N])
    pre_s, post_s, comb_s = scale_3.to(cd).unbind(0)
    pre = torch.sigmoid(pre_w * pre_s + pre_b) + hc_eps
    post = 2 * torch.sigmoid(post_w * post_s + post_b)
    comb = torch.softmax(comb_w.unflatten(-1, (N, N)) * comb_s + comb_b.view(N, N), dim=-1) + hc_eps
    return pre, post, sinkhorn(comb, iters, hc_eps)


def hc_collapse_reference(pre_BSN: torch.Tensor, h_BSNH: torch.Tensor) -> torch.Tensor:
    """The block input ``x = sum_n pre[n] * h[n]``, in h's dtype."""
    return (pre_BSN.unsqueeze(-1) * h_BSNH).sum(dim=2).to(h_BSNH.dtype)


def hc_merge_reference(post_BSN: torch.Tensor, comb_BSNN: torch.Tensor, y_BSH: torch.Tensor,
                       residual_BSNH: torch.Tensor) -> torch.Tensor:
    """``post[n] * y + sum_m comb[m, n] * residual[m]`` in the residual's dtype (HF's op order)."""
    dtype = residual_BSNH.dtype
    return post_BSN.to(dtype).unsqueeze(-1) * y_BSH.unsqueeze(-2) + torch.matmul(
        comb_BSNN.to(dtype).transpose(-1, -2), residual_BSNH
    )
