"""Manifold-constrained hyper-connections (mHC): the 4-stream residual of GLM-5.3-Flash.

Shapes: B batch, S tokens, N = hc_mult streams, H hidden; ``h_BSNH`` is a layer's residual state.

Each block (attention or MLP) is wrapped by one ``HyperConnection``::

    post_BSN, comb_BSNN, x_BSH = hc(h_BSNH)        # x = sum_n pre[n] * h[n]: the block's input
    y_BSH = block(norm(x_BSH))
    h_BSNH = hc.merge(post_BSN, comb_BSNN, y_BSH, h_BSNH)   # post[n] * y + comb^T @ h

``pre``, ``post`` and ``comb`` come from one linear map ``fn`` of the RMS-normalised, flattened
streams, a per-output bias ``base`` and three gains ``scale``; ``comb`` is made doubly stochastic
by Sinkhorn iterations. Everything is token-separable (no mixing along S), so sequence sharding
and tiling never change the result.

Precision: the weights are computed in ``promote_types(dtype, float32)``: float32 for a bf16/fp32
model, exactly as ``Glm5NextTextHyperConnection`` does, and float64 for a float64 model (HF would
down-cast to float32 there, which breaks float64 exactness tests under any reshaping of the batch).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from megaseq.models.spec import ModelSpec
from megaseq.ops import dispatch, hc_mix, triton_hc_mix, triton_mhc, triton_mhc_streams  # noqa: F401  (register the fused ops, opt-in)
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


# ---- ops hc_weights, hc_collapse, hc_merge: the references (fast ones: megaseq.ops.triton_mhc*) ----------
@dispatch.register("hc_mix", "torch", reference=True)
def hc_mix_reference(h_BSNH: torch.Tensor, fn_MD: torch.Tensor, norm_eps: float) -> torch.Tensor:
    """``mix_BSM``: ``fn`` applied to the flattened streams after an unweighted RMSNorm over all N*H features
    (HF's ``Glm5NextTextUnweightedRMSNorm``), in the compute dtype (bf16 under autocast: ``F.linear``'s)."""
    B, S, N, H = h_BSNH.shape
    cd = compute_dtype(h_BSNH.dtype)
    flat = h_BSNH.reshape(B, S, N * H).to(cd)
    flat = flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + norm_eps)
    return F.linear(flat, fn_MD.to(cd))


@dispatch.register("hc_weights", "torch", reference=True)
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


@dispatch.register("hc_collapse", "torch", reference=True)
def hc_collapse_reference(pre_BSN: torch.Tensor, h_BSNH: torch.Tensor) -> torch.Tensor:
    """The block input ``x = sum_n pre[n] * h[n]``, in h's dtype."""
    return (pre_BSN.unsqueeze(-1) * h_BSNH).sum(dim=2).to(h_BSNH.dtype)


@dispatch.register("hc_merge", "torch", reference=True)
def hc_merge_reference(post_BSN: torch.Tensor, comb_BSNN: torch.Tensor, y_BSH: torch.Tensor,
                       residual_BSNH: torch.Tensor) -> torch.Tensor:
    """``post[n] * y + sum_m comb[m, n] * residual[m]`` in the residual's dtype (HF's op order)."""
    dtype = residual_BSNH.dtype
    return post_BSN.to(dtype).unsqueeze(-1) * y_BSH.unsqueeze(-2) + torch.matmul(
        comb_BSNN.to(dtype).transpose(-1, -2), residual_BSNH
    )


class HyperConnection(nn.Module):
    """Computes ``(post, comb, collapsed input)`` from the N streams; HF name ``attn_hc`` / ``ffn_hc``."""

    def __init__(self, spec: ModelSpec, layer: str = "hc") -> None:
        super().__init__()
        self.layer = layer  # name in the dispatcher's per-layer record
        N, H = spec.hc_mult, spec.hidden_size
        self.hc_mult = N
        self.sinkhorn_iters = spec.hc_sinkhorn_iters
        self.hc_eps = spec.hc_eps
        self.norm_eps = spec.rms_norm_eps
        width = (2 + N) * N  # pre (N) + post (N) + comb (N x N)
        self.fn = nn.Parameter(torch.empty(width, N * H).normal_(0.0, 0.02))
        self.base = nn.Parameter(torch.zeros(width, dtype=torch.float32))
        self.scale = nn.Parameter(torch.ones(3, dtype=torch.float32))

    @torch.no_grad()
    def init_weights(self, std: float) -> None:
        """HF's init: ``fn`` normal(0, 0.02) whatever ``initializer_range`` is, ``base`` 0, ``scale`` 1."""
        self.fn.normal_(0.0, 0.02)
        self.base.zero_()
        self.scale.fill_(1.0)

    def forward(self, h_BSNH: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``h_BSNH -> (post_BSN, comb_BSNN, x_BSH)``; post/comb in the compute dtype, x in h's dtype (``carrying``
        without the streams: a carried view left unused adds nothing to the gradient)."""
        return self.carrying(h_BSNH)[:3]

    def carrying(self, h_BSNH: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``forward``'s ``(post, comb, x)`` and the streams to give ``merge`` as its residual: ``h`` itself, or
        where the kernels that run can carry their gradient (``call_carrying``), a view of it whose gradient
        their backward adds into the streams' as they write it (fewer passes over ``[B, S, N, H]`` than
        autograd's adds of the three uses' gradients). The same values and, but for rounding, the same
        gradients as ``forward`` with ``h`` as the residual."""
        N = h_BSNH.shape[2]
        mix, h_BSNH = call_carrying("hc_mix", self.layer, 0, h_BSNH, self.fn, self.norm_eps)
        pre, post, comb = dispatch.call("hc_weights", mix, self.base, self.scale, N, self.sinkhorn_iters, self.hc_eps,
                                        layer=self.layer)
        x_BSH, h_BSNH = call_carrying("hc_collapse", self.layer, 1, pre, h_BSNH)
        return post, comb, x_BSH, h_BSNH

    def merge(self, post_BSN: torch.Tensor, comb_BSNN: torch.Tensor, y_BSH: torch.Tensor,
              residual_BSNH: torch.Tensor) -> torch.Tensor:
        """New streams: ``post[n] * y + sum_m comb[m, n] * residual[m]`` (op ``hc_merge``)."""
        return dispatch.call("hc_merge", post_BSN, comb_BSNN, y_BSH, residual_BSNH, layer=self.layer)


def call_carrying(op: str, layer: str, at: int, *args: Any) -> tuple[Any, torch.Tensor]:
    """Op ``op`` through the dispatcher, and the streams (argument ``at``) to use after it: where the
    implementation that runs has a ``carry`` variant (``fn.carry``: ``ops.triton_hc_mix``,
    ``ops.triton_mhc_streams``) and autograd records, ``(out, view of the streams)`` from it, whose backward
    adds the view's gradient into the streams' gradient as its kernel writes it; elsewhere ``(out, the streams
    themselves)``, autograd adding the gradients of their uses."""
    impl = dispatch.select(op, layer, *args)
    carry = getattr(impl.fn, "carry", None)
    if carry is None or not torch.is_grad_enabled():
        return impl.fn(*args), args[at]
    return carry(*args)


def expand_streams(x_BSH: torch.Tensor, hc_mult: int) -> torch.Tensor:
    """Embedding output to the initial streams: N copies, ``[B, S, H] -> [B, S, N, H]``."""
    return x_BSH.unsqueeze(2).expand(-1, -1, hc_mult, -1).contiguous()


def collapse_streams(h_BSNH: torch.Tensor) -> torch.Tensor:
    """Final hyper head of GLM-5.3-Flash: the unweighted mean of the streams, ``-> [B, S, H]``."""
    return h_BSNH.mean(dim=2)
