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
from torch import nn

from megaseq.models.spec import ModelSpec
from megaseq.ops import dispatch

# ---- ops hc_weights, hc_collapse, hc_merge: the references (fast ones: megaseq.ops.mhc.weights_triton*) ----------


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
    implementation that runs has a ``carry`` variant (``fn.carry``: ``ops.mhc.mix_triton``,
    ``ops.mhc.streams_triton``) and autograd records, ``(out, view of the streams)`` from it, whose backward
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
