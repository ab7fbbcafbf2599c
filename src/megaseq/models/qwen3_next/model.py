"""Qwen3-Next as a megaseq CausalLM: pre-norm layers of gated DeltaNet (``linear_attn``) or gated attention
(``self_attn``) + a MoE with a gated shared expert, every norm zero-centered.

Module names mirror ``Qwen3NextForCausalLM`` minus ``model.`` (``layers.N.linear_attn.in_proj_qkvz``,
``layers.N.self_attn.q_norm``, ``layers.N.mlp.shared_expert_gate``). Both mixers go context-parallel through
Ulysses; the rest is token-separable.
"""

from __future__ import annotations

from torch import nn

from megaseq.models.common.attention import Attention
from megaseq.models.common.decoder import CausalLM
from megaseq.models.common.gdn import GatedDeltaNet
from megaseq.models.common.prenorm import PreNormDecoderLayer
from megaseq.models.spec import ModelSpec

FP32_PARAM_SUFFIXES: tuple[str, ...] = ()  # HF's Qwen3-Next keeps nothing in float32


def _layer(spec: ModelSpec, i: int) -> nn.Module:
    if spec.layer_types[i] == "gdn":
        return PreNormDecoderLayer(spec, i, GatedDeltaNet(spec, f"layers.{i}.linear_attn"), mixer_name="linear_attn")
    return PreNormDecoderLayer(spec, i, Attention(spec, f"layers.{i}.self_attn"))


class Qwen3NextModel(CausalLM):
    """The CausalLM interface of docs/architecture.md for the ``qwen3_next`` family."""

    def __init__(self, spec: ModelSpec) -> None:
        if spec.family != "qwen3_next" or not set(spec.layer_types) <= {"gdn", "attention"} or spec.hc_mult != 1:
            raise ValueError(f"Qwen3NextModel needs a qwen3_next spec of gdn / attention layers, got {spec.family!r} "
                             f"{sorted(set(spec.layer_types))}")
        super().__init__(spec, lambda i: _layer(spec, i))


Model = Qwen3NextModel
