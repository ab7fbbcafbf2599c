"""OLMoE as a megaseq CausalLM: pre-norm layers of softmax attention (q/k RMSNorm over all heads) + MoE.

Module names mirror ``OlmoeForCausalLM`` minus its ``model.`` prefix (``layers.N.self_attn.q_norm``,
``layers.N.mlp.gate.weight``, ``layers.N.mlp.experts.gate_up_proj``), so the adapter is a prefix map plus
the per-expert fusion. Parallel axes as Qwen3-MoE's: attention goes context-parallel through Ulysses
(``SeqContext``), the rest is token-separable.
"""

from __future__ import annotations

from megaseq.models.common.attention import Attention
from megaseq.models.common.decoder import CausalLM
from megaseq.models.common.prenorm import PreNormDecoderLayer
from megaseq.models.spec import ModelSpec

FP32_PARAM_SUFFIXES: tuple[str, ...] = ()  # HF's OLMoE keeps nothing in float32


class OlmoeModel(CausalLM):
    """The CausalLM interface of docs/architecture.md for the ``olmoe`` family."""

    def __init__(self, spec: ModelSpec) -> None:
        if spec.family != "olmoe" or set(spec.layer_types) != {"attention"} or spec.hc_mult != 1:
            raise ValueError(f"OlmoeModel needs an olmoe spec of attention layers, got {spec.family!r} "
                             f"{sorted(set(spec.layer_types))}")
        super().__init__(spec, lambda i: PreNormDecoderLayer(spec, i, Attention(spec, f"layers.{i}.self_attn")))


Model = OlmoeModel
