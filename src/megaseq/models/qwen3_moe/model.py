"""Qwen3-MoE as a megaseq CausalLM: softmax attention (GQA + RoPE + q/k norm) and softmax-routed MoE.

Shapes: B batch, S_loc tokens on this rank, H hidden, V vocabulary.

Module names mirror ``transformers``' ``Qwen3MoeForCausalLM`` minus its ``model.`` prefix
(``embed_tokens``, ``layers.N.self_attn.q_proj``, ``layers.N.mlp.gate.weight``,
``layers.N.mlp.experts.gate_up_proj``, ``norm``, ``lm_head``), so the state-dict adapter is a prefix map
plus the per-expert fusion. The residual stream is one hidden state wide (``hc_mult = 1``): every layer
boundary, and so every checkpoint boundary, is ``h_BSH``.

Parallel axes: attention is the only token-mixing block and goes context-parallel through the
``SeqContext`` hooks; norms, MLP and MoE are token-separable and never see the sharding.
"""

from __future__ import annotations

import torch
from torch import nn

from megaseq.models.common.attention import Attention
from megaseq.models.common.context import SeqContext
from megaseq.models.common.decoder import CausalLM
from megaseq.models.common.mlp import MLP
from megaseq.models.common.moe import MoE
from megaseq.models.common.norm import RMSNorm
from megaseq.models.spec import ModelSpec

# nothing stays float32 in a bf16 model: the router casts its weight to the input's dtype, as HF's does
FP32_PARAM_SUFFIXES: tuple[str, ...] = ()


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


class Qwen3MoeModel(CausalLM):
    """The CausalLM interface of docs/architecture.md for the ``qwen3_moe`` family."""

    def __init__(self, spec: ModelSpec) -> None:
        if spec.family != "qwen3_moe":
            raise ValueError(f"Qwen3MoeModel needs a qwen3_moe spec, got family {spec.family!r}")
        if spec.hc_mult != 1:
            raise ValueError(f"qwen3_moe has a plain residual stream: hc_mult must be 1, got {spec.hc_mult}")
        bad = sorted({k for k in spec.layer_types if k != "attention"})
        if bad:
            raise ValueError(f"qwen3_moe layers are all 'attention'; got layer types {bad}")
        super().__init__(spec, lambda i: Qwen3MoeDecoderLayer(spec, i))


Model = Qwen3MoeModel
