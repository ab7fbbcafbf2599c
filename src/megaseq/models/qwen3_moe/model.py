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

from megaseq.models.common.attention import Attention
from megaseq.models.common.decoder import CausalLM
from megaseq.models.common.prenorm import PreNormDecoderLayer
from megaseq.models.spec import ModelSpec

# nothing stays float32 in a bf16 model: the router casts its weight to the input's dtype, as HF's does
FP32_PARAM_SUFFIXES: tuple[str, ...] = ()


def Qwen3MoeDecoderLayer(spec: ModelSpec, index: int) -> PreNormDecoderLayer:
    """``h + attn(norm(h))`` then ``h + mlp(norm(h))``; ``mlp`` is a MoE or a dense SwiGLU."""
    return PreNormDecoderLayer(spec, index, Attention(spec, layer=f"layers.{index}.self_attn"))


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
