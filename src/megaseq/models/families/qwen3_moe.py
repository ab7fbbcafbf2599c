"""Qwen3-MoE as a megaseq CausalLM: softmax attention (GQA + RoPE + q/k norm) and softmax-routed MoE.

Shapes: B batch, S_loc tokens on this rank, H hidden, V vocabulary.

Module names mirror ``transformers``' ``Qwen3MoeForCausalLM`` minus its ``model.`` prefix
(``embed_tokens``, ``layers.N.self_attn.q_proj``, ``layers.N.mlp.gate.weight``,
``layers.N.mlp.experts.gate_up_proj``, ``norm``, ``lm_head``), so ``hf_io`` is a prefix map plus the
per-expert fusion. The residual stream is one hidden state wide (``hc_mult = 1``): every layer
boundary, and so every checkpoint boundary, is ``h_BSH``.

Parallel axes: attention is the only token-mixing block and goes context-parallel through the
``SeqContext`` hooks; norms, MLP and MoE are token-separable and never see the sharding.
"""

from __future__ import annotations

import torch
from torch import nn

from megaseq.models.blocks.attention import Attention
from megaseq.models.blocks.mlp import MLP
from megaseq.models.blocks.moe import MoE
from megaseq.models.blocks.norm import RMSNorm
from megaseq.models.context import SeqContext, positions_from_doc_ids
from megaseq.models.spec import ModelSpec

INIT_STD = 0.02  # HF's initializer_range default for Qwen3-MoE


class Qwen3MoeDecoderLayer(nn.Module):
    """``h + attn(norm(h))`` then ``h + mlp(norm(h))``; ``mlp`` is a MoE or a dense SwiGLU."""

    def __init__(self, spec: ModelSpec, index: int) -> None:
        super().__init__()
        name = f"layers.{index}"
        self.self_attn = Attention(spec, layer=f"{name}.self_attn")
        if spec.mlp_types[index] == "moe":
            self.mlp: nn.Module = MoE(spec, layer=f"{name}.mlp")
        else:
            self.mlp = MLP(spec.hidden_size, spec.intermediate_size)
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)

    def forward(self, h_BSH: torch.Tensor, ctx: SeqContext) -> torch.Tensor:
        h_BSH = h_BSH + self.self_attn(self.input_layernorm(h_BSH), ctx)
        return h_BSH + self.mlp(self.post_attention_layernorm(h_BSH))


class Qwen3MoeModel(nn.Module):
    """The CausalLM interface of docs/architecture.md for the ``qwen3_moe`` family."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        if spec.family != "qwen3_moe":
            raise ValueError(f"Qwen3MoeModel needs a qwen3_moe spec, got family {spec.family!r}")
        if spec.hc_mult != 1:
            raise ValueError(f"qwen3_moe has a plain residual stream: hc_mult must be 1, got {spec.hc_mult}")
        bad = sorted({k for k in spec.layer_types if k != "attention"})
        if bad:
            raise ValueError(f"qwen3_moe layers are all 'attention'; got layer types {bad}")
        self.spec = spec
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size, padding_idx=spec.pad_token_id)
        self.layers = nn.ModuleList(Qwen3MoeDecoderLayer(spec, i) for i in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.lm_head = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)
        self.reset_parameters()
        if spec.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    @torch.no_grad()
    def reset_parameters(self, std: float = INIT_STD) -> None:
        """HF's init: normal(0, std) for projections, embeddings, router and experts; norms at 1."""
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                module.weight.normal_(0.0, std)
                if getattr(module, "bias", None) is not None:
                    module.bias.zero_()
            elif isinstance(module, RMSNorm):
                module.weight.fill_(1.0)
            elif isinstance(module, MoE):
                for p in (module.gate.weight, module.experts.gate_up_proj, module.experts.down_proj):
                    p.normal_(0.0, std)
        if self.spec.pad_token_id is not None:
            self.embed_tokens.weight[self.spec.pad_token_id].zero_()

    # ---- the CausalLM interface -------------------------------------------------------------
    def embed(self, input_ids_BS: torch.Tensor) -> torch.Tensor:
        """``[B, S_loc] -> h_BSH``: the first layer boundary."""
        return self.embed_tokens(input_ids_BS)

    def final_hidden(self, h_BSH: torch.Tensor) -> torch.Tensor:
        """The final RMSNorm (no hyper-connection streams to collapse here)."""
        return self.norm(h_BSH)

    def logits(self, hidden_BSH: torch.Tensor) -> torch.Tensor:
        """``[B, S, V]``; only for small inputs (training uses the chunked losses on ``lm_head``)."""
        return self.lm_head(hidden_BSH)

    def forward(self, input_ids: torch.Tensor, doc_ids: torch.Tensor | None = None,
                ctx: SeqContext | None = None) -> torch.Tensor:
        """``input_ids [B, S_loc] -> hidden [B, S_loc, H]`` (final norm applied, before lm_head)."""
        if ctx is None:
            positions = positions_from_doc_ids(doc_ids) if doc_ids is not None else None
            ctx = SeqContext(doc_ids=doc_ids, position_ids=positions)
        h = self.embed(input_ids)
        for layer in self.layers:
            h = layer(h, ctx)
        return self.final_hidden(h)
