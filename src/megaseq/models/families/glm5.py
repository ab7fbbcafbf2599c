"""GLM-5.3-Flash (HF ``glm5_next``, text part ``Glm5NextTextModel``) assembled from megaseq blocks.

Shapes: B batch, S tokens (this rank's shard under context parallelism), N = hc_mult streams,
H hidden, V vocab.

    ids --embed_tokens--> [B, S, H] --N copies--> h [B, S, N, H]
    per layer:  attn_hc -> input_layernorm -> KDA or MLA/DSA -> merge
                ffn_hc  -> post_attention_layernorm -> dense SwiGLU or MoE -> merge
    mean over streams -> norm -> hidden [B, S, H]; lm_head -> logits [B, S, V]

Module names mirror the HF text model (``embed_tokens``, ``layers.N.self_attn...``, ``norm``) plus
``lm_head``, so a ``Glm5NextTextModel`` state dict loads 1:1 (``lm_head`` comes from the CausalLM
wrapper). The layer input ``h`` (N x hidden) is the checkpoint boundary. ``ctx.carry`` passes a full
DSA layer's selection to the ``shared`` layers after it.
"""

from __future__ import annotations

import torch
from torch import nn

from megaseq.models.blocks.kda import GatedRMSNorm, KimiDeltaAttention, init_kda_
from megaseq.models.blocks.mhc import HyperConnection, collapse_streams, expand_streams
from megaseq.models.blocks.mla_dsa import Indexer, MLASparseAttention
from megaseq.models.blocks.mlp import MLP
from megaseq.models.blocks.moe import FP32_PARAM_SUFFIXES as MOE_FP32_SUFFIXES
from megaseq.models.blocks.moe import Experts, MoE, TopKRouter
from megaseq.models.blocks.norm import RMSNorm
from megaseq.models.context import SeqContext, positions_from_doc_ids
from megaseq.models.spec import ModelSpec

# tensors HF keeps in float32 in a bf16 model (``_keep_in_fp32_modules_strict``), by name suffix
FP32_PARAM_SUFFIXES = MOE_FP32_SUFFIXES + (
    "conv1d.weight", "forget_gate.dt_bias", "forget_gate.A_log",
    "attn_hc.base", "attn_hc.scale", "ffn_hc.base", "ffn_hc.scale",
)
INIT_STD = 0.02  # HF's initializer_range default


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
        self.attn_hc = HyperConnection(spec)
        self.input_layernorm = RMSNorm(spec.hidden_size, eps=spec.rms_norm_eps)
        if self.layer_type == "kda":
            self.self_attn = KimiDeltaAttention(spec, layer=f"{name}.self_attn")
        elif self.layer_type == "dsa":
            self.self_attn = MLASparseAttention(spec, layer_idx, topk_source, layer=f"{name}.self_attn")
        else:
            raise ValueError(f"glm5_next layer {layer_idx}: layer type {self.layer_type!r} is not kda or dsa")
        self.ffn_hc = HyperConnection(spec)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, eps=spec.rms_norm_eps)
        if spec.mlp_types[layer_idx] == "moe":
            self.mlp = MoE(spec, layer=f"{name}.mlp")
        else:
            self.mlp = MLP(spec.hidden_size, spec.intermediate_size, spec.swiglu_limit)

    def forward(self, h_BSNH: torch.Tensor, ctx: SeqContext) -> torch.Tensor:
        post, comb, x = self.attn_hc(h_BSNH)
        y = self.self_attn(self.input_layernorm(x), ctx)
        h_BSNH = self.attn_hc.merge(post, comb, y, h_BSNH)
        post, comb, x = self.ffn_hc(h_BSNH)
        y = self.mlp(self.post_attention_layernorm(x))
        return self.ffn_hc.merge(post, comb, y, h_BSNH)


class Glm5Model(nn.Module):
    """GLM-5.3-Flash CausalLM (see docs/architecture.md for the interface)."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        if spec.family != "glm5_next":
            raise ValueError(f"Glm5Model needs a glm5_next spec, got family {spec.family!r}")
        self.spec = spec
        pad = spec.pad_token_id
        pad = pad if pad is not None and 0 <= pad < spec.vocab_size else None  # presets may name no real row
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size, padding_idx=pad)
        sources = _topk_sources(spec)
        self.layers = nn.ModuleList(Glm5DecoderLayer(spec, i, sources[i]) for i in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, eps=spec.rms_norm_eps)
        self.lm_head = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)
        if spec.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.reset_parameters()

    # ---- the CausalLM interface ------------------------------------------------------------------
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``[B, S]`` ids -> the initial streams ``[B, S, N, H]``."""
        return expand_streams(self.embed_tokens(input_ids), self.spec.hc_mult)

    def final_hidden(self, h_BSNH: torch.Tensor) -> torch.Tensor:
        """Stream mean + final RMSNorm -> ``[B, S, H]``."""
        return self.norm(collapse_streams(h_BSNH))

    def forward(self, input_ids: torch.Tensor, doc_ids: torch.Tensor | None = None,
                ctx: SeqContext | None = None) -> torch.Tensor:
        """Final hidden states ``[B, S, H]``; ``doc_ids [B, S]`` keeps packed documents apart."""
        if ctx is None:
            pos = None if doc_ids is None else positions_from_doc_ids(doc_ids)
            ctx = SeqContext(doc_ids=doc_ids, position_ids=pos)
        elif doc_ids is not None and ctx.doc_ids is None:
            raise ValueError("with a ctx, pass doc_ids inside it (ctx.doc_ids), not to the model")
        ctx.carry.pop("topk", None)
        ctx.carry.pop("topk_layer", None)
        h = self.embed(input_ids)
        for layer in self.layers:
            h = layer(h, ctx)
        return self.final_hidden(h)

    def logits(self, hidden_BSH: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden_BSH)

    # ---- initialisation (HF ``Glm5NextPreTrainedModel._init_weights``) ----------------------------
    @torch.no_grad()
    def reset_parameters(self, std: float = INIT_STD) -> None:
        """Normal(0, std) for linears, conv, embeddings, router and experts; ones for norms; GLM's
        special tensors (hc fn/base/scale, indexer pooling, A_log, dt_bias). Uses the global RNG."""
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Conv1d)):
                module.weight.normal_(0.0, std)
                if module.bias is not None:
                    module.bias.zero_()
            elif isinstance(module, nn.Embedding):
                module.weight.normal_(0.0, std)
                if module.padding_idx is not None:
                    module.weight[module.padding_idx].zero_()
            elif isinstance(module, (RMSNorm, GatedRMSNorm, nn.LayerNorm)):
                module.weight.fill_(1.0)
                if getattr(module, "bias", None) is not None:
                    module.bias.zero_()
            elif isinstance(module, HyperConnection):
                module.fn.normal_(0.0, 0.02)  # HF uses 0.02 here whatever initializer_range is
                module.base.zero_()
                module.scale.fill_(1.0)
            elif isinstance(module, Experts):
                module.gate_up_proj.normal_(0.0, std)
                module.down_proj.normal_(0.0, std)
            elif isinstance(module, TopKRouter):
                module.weight.normal_(0.0, std)
                if hasattr(module, "e_score_correction_bias"):
                    module.e_score_correction_bias.zero_()
            elif isinstance(module, Indexer):
                module.index_kpool_compress_ape.zero_()
                module.index_kpool_compress_gate.fill_(1.0)
            elif isinstance(module, KimiDeltaAttention):
                init_kda_(module)
