"""Mixtral as a megaseq CausalLM: pre-norm layers of GQA softmax attention + an 8-expert top-2 MoE.

Module names mirror ``MixtralForCausalLM`` in memory (``layers.N.mlp.gate.weight``,
``layers.N.mlp.experts.gate_up_proj``); on disk the MoE is ``block_sparse_moe`` with per-expert ``w1`` /
``w3`` / ``w2`` (``state_dict_adapter``). The router's weights stay float32 in a bf16 model, as HF's.
"""

from __future__ import annotations

from megaseq.models.common.attention import Attention
from megaseq.models.common.decoder import CausalLM
from megaseq.models.common.prenorm import PreNormDecoderLayer
from megaseq.models.spec import ModelSpec

FP32_PARAM_SUFFIXES: tuple[str, ...] = ()  # HF's Mixtral keeps no parameter in float32


class MixtralModel(CausalLM):
    """The CausalLM interface of docs/architecture.md for the ``mixtral`` family."""

    def __init__(self, spec: ModelSpec) -> None:
        if spec.family != "mixtral" or set(spec.layer_types) != {"attention"} or spec.hc_mult != 1:
            raise ValueError(f"MixtralModel needs a mixtral spec of attention layers, got {spec.family!r} "
                             f"{sorted(set(spec.layer_types))}")
        super().__init__(spec, lambda i: PreNormDecoderLayer(spec, i, Attention(spec, f"layers.{i}.self_attn")))


Model = MixtralModel
