"""GLM-4.5 as a megaseq CausalLM: pre-norm layers of partially rotated GQA attention + dense or MoE MLP.

Module names mirror ``Glm4MoeForCausalLM`` minus ``model.`` (``layers.N.self_attn.q_proj.bias``,
``layers.N.mlp.gate.e_score_correction_bias``, ``layers.N.mlp.shared_experts.gate_proj``). The router
weight and its correction bias stay float32 in a bf16 model (HF's ``_keep_in_fp32_modules_strict``).
"""

from __future__ import annotations

from megaseq.models.common.attention import Attention
from megaseq.models.common.decoder import CausalLM
from megaseq.models.common.moe import FP32_PARAM_SUFFIXES as MOE_FP32_SUFFIXES
from megaseq.models.common.prenorm import PreNormDecoderLayer
from megaseq.models.spec import ModelSpec

FP32_PARAM_SUFFIXES = MOE_FP32_SUFFIXES


class Glm4MoeModel(CausalLM):
    """The CausalLM interface of docs/architecture.md for the ``glm4_moe`` family."""

    def __init__(self, spec: ModelSpec) -> None:
        if spec.family != "glm4_moe" or set(spec.layer_types) != {"attention"} or spec.hc_mult != 1:
            raise ValueError(f"Glm4MoeModel needs a glm4_moe spec of attention layers, got {spec.family!r} "
                             f"{sorted(set(spec.layer_types))}")
        super().__init__(spec, lambda i: PreNormDecoderLayer(spec, i, Attention(spec, f"layers.{i}.self_attn")))


Model = Glm4MoeModel
