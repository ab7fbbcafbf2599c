"""DeepSeek-V3.2 as a megaseq CausalLM: pre-norm layers of MLA + DeepSeek sparse attention + dense or MoE MLP.

Module names mirror ``DeepseekV32ForCausalLM`` minus ``model.`` (``layers.N.self_attn.indexer.wq_b``,
``layers.N.self_attn.indexer.k_norm.bias``). The MLA/DSA layer (``models.common.mla_dsa``) gathers the latent
``[c | k_rot]`` and the indexer keys (gather-KV context parallelism); every layer runs its own indexer.
"""

from __future__ import annotations

from megaseq.models.common.decoder import CausalLM
from megaseq.models.common.mla_dsa import MLASparseAttention
from megaseq.models.common.moe import FP32_PARAM_SUFFIXES as MOE_FP32_SUFFIXES
from megaseq.models.common.prenorm import PreNormDecoderLayer
from megaseq.models.spec import ModelSpec

FP32_PARAM_SUFFIXES = MOE_FP32_SUFFIXES


class DeepseekV32Model(CausalLM):
    """The CausalLM interface of docs/architecture.md for the ``deepseek_v32`` family."""

    def __init__(self, spec: ModelSpec) -> None:
        if spec.family != "deepseek_v32" or set(spec.layer_types) != {"dsa"} or spec.hc_mult != 1:
            raise ValueError(f"DeepseekV32Model needs a deepseek_v32 spec of dsa layers, got {spec.family!r} "
                             f"{sorted(set(spec.layer_types))}")
        super().__init__(spec, lambda i: PreNormDecoderLayer(
            spec, i, MLASparseAttention(spec, i, None, f"layers.{i}.self_attn", indexer="deepseek")))


Model = DeepseekV32Model
