"""DeepSeek-V3 as a megaseq CausalLM: pre-norm layers of dense MLA with RoPE + dense or MoE MLP.

Module names mirror ``DeepseekV3ForCausalLM`` minus ``model.`` (``layers.N.self_attn.kv_a_proj_with_mqa``,
``layers.N.mlp.gate.e_score_correction_bias``, ``layers.N.mlp.shared_experts.gate_proj``). The router weight
and its correction bias stay float32 in a bf16 model (HF's ``_keep_in_fp32_modules_strict``). MLA goes
context-parallel through Ulysses (its keys expanded per head first); the rest is token-separable.
"""

from __future__ import annotations

from megaseq.models.common.decoder import CausalLM
from megaseq.models.common.mla import MultiLatentAttention
from megaseq.models.common.moe import FP32_PARAM_SUFFIXES as MOE_FP32_SUFFIXES
from megaseq.models.common.prenorm import PreNormDecoderLayer
from megaseq.models.spec import ModelSpec

FP32_PARAM_SUFFIXES = MOE_FP32_SUFFIXES


class DeepseekV3Model(CausalLM):
    """The CausalLM interface of docs/architecture.md for the ``deepseek_v3`` family."""

    def __init__(self, spec: ModelSpec) -> None:
        if spec.family != "deepseek_v3" or set(spec.layer_types) != {"mla"} or spec.hc_mult != 1:
            raise ValueError(f"DeepseekV3Model needs a deepseek_v3 spec of mla layers, got {spec.family!r} "
                             f"{sorted(set(spec.layer_types))}")
        super().__init__(spec, lambda i: PreNormDecoderLayer(
            spec, i, MultiLatentAttention(spec, f"layers.{i}.self_attn", latent_norm_eps=1e-6)))


Model = DeepseekV3Model
