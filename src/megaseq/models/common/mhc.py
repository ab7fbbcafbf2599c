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

import torch
import torch.nn.functional as F
from torch import nn

from megaseq.models.spec import ModelSpec


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype HF computes "in float32" in: float32, or float64 when the model is float64."""
    return torch.promote_types(dtype, torch.float32)


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


class HyperConnection(nn.Module):
    """Computes ``(post, comb, collapsed input)`` from the N streams; HF name ``attn_hc`` / ``ffn_hc``."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
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
        """``h_BSNH -> (post_BSN, comb_BSNN, x_BSH)``; post/comb in the compute dtype, x in h's dtype."""
        B, S, N, _ = h_BSNH.shape
        cd = compute_dtype(h_BSNH.dtype)
        flat = h_BSNH.reshape(B, S, -1).to(cd)
        # unweighted RMSNorm over all N*H features (HF's Glm5NextTextUnweightedRMSNorm)
        flat = flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + self.norm_eps)
        mix = F.linear(flat, self.fn.to(cd))
        pre_w, post_w, comb_w = mix.split([N, N, N * N], dim=-1)
        pre_b, post_b, comb_b = self.base.to(cd).split([N, N, N * N])
        pre_s, post_s, comb_s = self.scale.to(cd).unbind(0)
        pre = torch.sigmoid(pre_w * pre_s + pre_b) + self.hc_eps
        post = 2 * torch.sigmoid(post_w * post_s + post_b)
        comb = torch.softmax(comb_w.view(B, S, N, N) * comb_s + comb_b.view(N, N), dim=-1) + self.hc_eps
        comb = sinkhorn(comb, self.sinkhorn_iters, self.hc_eps)
        x_BSH = (pre.unsqueeze(-1) * h_BSNH).sum(dim=2).to(h_BSNH.dtype)
        return post, comb, x_BSH

    @staticmethod
    def merge(post_BSN: torch.Tensor, comb_BSNN: torch.Tensor, y_BSH: torch.Tensor,
              residual_BSNH: torch.Tensor) -> torch.Tensor:
        """New streams: ``post[n] * y + sum_m comb[m, n] * residual[m]`` (HF's op order)."""
        dtype = residual_BSNH.dtype
        return post_BSN.to(dtype).unsqueeze(-1) * y_BSH.unsqueeze(-2) + torch.matmul(
            comb_BSNN.to(dtype).transpose(-1, -2), residual_BSNH
        )


def expand_streams(x_BSH: torch.Tensor, hc_mult: int) -> torch.Tensor:
    """Embedding output to the initial streams: N copies, ``[B, S, H] -> [B, S, N, H]``."""
    return x_BSH.unsqueeze(2).expand(-1, -1, hc_mult, -1).contiguous()


def collapse_streams(h_BSNH: torch.Tensor) -> torch.Tensor:
    """Final hyper head of GLM-5.3-Flash: the unweighted mean of the streams, ``-> [B, S, H]``."""
    return h_BSNH.mean(dim=2)
