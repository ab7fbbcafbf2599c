"""GLM-5.3-Flash (HF ``glm5_next``, text part ``Glm5NextTextModel``) assembled from the common blocks.

Shapes: B batch, S tokens (this rank's shard under context parallelism), N = hc_mult streams,
H hidden, V vocab, T = B * S tokens flattened.

    ids --embed_tokens--> [B, S, H] --N copies--> h [B, S, N, H]
    per layer:  attn_hc -> input_layernorm -> KDA or MLA/DSA -> merge
                ffn_hc  -> post_attention_layernorm -> dense SwiGLU or MoE -> merge
    mean over streams -> norm -> hidden [B, S, H]; lm_head -> logits [B, S, V]

Module names mirror the HF text model (``embed_tokens``, ``layers.N.self_attn...``, ``norm``) plus
``lm_head``, so a ``Glm5NextTextModel`` state dict loads 1:1 (``lm_head`` comes from the CausalLM
wrapper). The layer input ``h`` (N x hidden) is the checkpoint boundary. ``ctx.carry`` passes a full
DSA layer's selection to the ``shared`` layers after it.

Everything in a layer but its token mixer is token-separable; ``Glm5DecoderLayer.parts()`` says so, and
``memory.tiling.tile_layer`` (applied by ``parallelize``) runs those parts in tiles. The model itself knows
no memory scheme.
"""

from __future__ import annotations

import torch
from torch import nn

from megaseq.models.common.context import SeqContext
from megaseq.models.common.decoder import CausalLM, LayerParts
from megaseq.models.common.kda import KimiDeltaAttention
from megaseq.models.common.mhc import HyperConnection, collapse_streams, expand_streams
from megaseq.models.common.mla_dsa import MLASparseAttention
from megaseq.models.common.mlp import MLP
from megaseq.models.common.moe import FP32_PARAM_SUFFIXES as MOE_FP32_SUFFIXES
from megaseq.models.common.moe import MoE
from megaseq.models.common.norm import RMSNorm
from megaseq.models.spec import ModelSpec

# tensors HF keeps in float32 in a bf16 model (``_keep_in_fp32_modules_strict``), by name suffix
FP32_PARAM_SUFFIXES = MOE_FP32_SUFFIXES + (
    "conv1d.weight", "forget_gate.dt_bias", "forget_gate.A_log",
    "attn_hc.base", "attn_hc.scale", "ffn_hc.base", "ffn_hc.scale",
)


def _topk_sources(spec: ModelSpec) -> list[int | None]:
    """Per layer: None for a full-indexer DSA layer (or a non-DSA layer), else the layer it reuses."""
    sources: list[int | None] = []
    last_full = None
    for i, kind in enumerate(spec.layer_types):
        shared = kind == "dsa" and spec.indexer_types[i] == "shared"
        sources.append(last_full if shared else None)
        if kind == "dsa" and not shared:
            last_full = i
    return sources


class Glm5DecoderLayer(nn.Module):
    """One GLM-5.3-Flash layer over the N-stream residual ``h [B, S, N, H] -> [B, S, N, H]``."""

    def __init__(self, spec: ModelSpec, layer_idx: int, topk_source: int | None = None) -> None:
        super().__init__()
        name = f"layers.{layer_idx}"
        self.layer_type = spec.layer_types[layer_idx]
        self.attn_hc = HyperConnection(spec, layer=f"{name}.attn_hc")
        self.input_layernorm = RMSNorm(spec.hidden_size, eps=spec.rms_norm_eps)
        if self.layer_type == "kda":
            self.self_attn = KimiDeltaAttention(spec, layer=f"{name}.self_attn")
        elif self.layer_type == "dsa":
            self.self_attn = MLASparseAttention(spec, layer_idx, topk_source, layer=f"{name}.self_attn")
        else:
            raise ValueError(f"glm5_next layer {layer_idx}: layer type {self.layer_type!r} is not kda or dsa")
        self.ffn_hc = HyperConnection(spec, layer=f"{name}.ffn_hc")
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, eps=spec.rms_norm_eps)
        if spec.mlp_types[layer_idx] == "moe":
            self.mlp = MoE(spec, layer=f"{name}.mlp")
        else:
            self.mlp = MLP(spec.hidden_size, spec.intermediate_size, spec.swiglu_limit)

    def forward(self, h_BSNH: torch.Tensor, ctx: SeqContext) -> torch.Tensor:
        # carrying: the merge's residual is the streams as the fast kernels hand them on, so that their
        # backward sums the three uses' gradients as they write them (HyperConnection.carrying)
        post, comb, x, h_BSNH = self.attn_hc.carrying(h_BSNH)
        y = self.self_attn(self.input_layernorm(x), ctx)
        h_BSNH = self.attn_hc.merge(post, comb, y, h_BSNH)
        post, comb, x, h_BSNH = self.ffn_hc.carrying(h_BSNH)
        y = self.mlp(self.post_attention_layernorm(x))
        return self.ffn_hc.merge(post, comb, y, h_BSNH)

    # ---- the layer at its token mixer (what tiling schemes need) -------------------------------------
    def parts(self) -> LayerParts:
        """The same computation as ``forward``, split at the token mixer (``LayerParts``): before it
        ``attn_hc`` + ``input_layernorm``; after it the residual merge, ``ffn_hc``,
        ``post_attention_layernorm``, the MLP/MoE and the second merge."""
        return LayerParts(self._mixer_input, (self.attn_hc, self.input_layernorm), self.self_attn,
                          self._after_mixer, (self.ffn_hc, self.post_attention_layernorm, self.mlp))

    def _mixer_input(self, h_TNH: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        post, comb, x = self.attn_hc(h_TNH.unsqueeze(0))
        return post[0], comb[0], self.input_layernorm(x[0])

    def _after_mixer(self, post_TN, comb_TNN, y_TH, h_TNH) -> torch.Tensor:
        h_TNH = self.attn_hc.merge(post_TN, comb_TNN, y_TH, h_TNH)
        post, comb, x, h_BTNH = self.ffn_hc.carrying(h_TNH.unsqueeze(0))
        y = self.mlp(self.post_attention_layernorm(x[0]))
        return self.ffn_hc.merge(post[0], comb[0], y, h_BTNH[0])


class Glm5Model(CausalLM):
    """GLM-5.3-Flash CausalLM (see docs/architecture.md for the interface)."""

    def __init__(self, spec: ModelSpec) -> None:
        if spec.family != "glm5_next":
            raise ValueError(f"Glm5Model needs a glm5_next spec, got family {spec.family!r}")
        sources = _topk_sources(spec)
        super().__init__(spec, lambda i: Glm5DecoderLayer(spec, i, sources[i]))

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``[B, S]`` ids -> the initial streams ``[B, S, N, H]``."""
        return expand_streams(self.embed_tokens(input_ids), self.spec.hc_mult)

    def final_hidden(self, h_BSNH: torch.Tensor) -> torch.Tensor:
        """Stream mean + final RMSNorm -> ``[B, S, H]``."""
        return self.norm(collapse_streams(h_BSNH))


Model = Glm5Model
