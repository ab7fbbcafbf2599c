"""DeepSeek-V3.2's config.json in and out, and its preset (torch-free: the planner reads this).

DeepSeek-V3.2 (HF ``deepseek_v32``): DeepSeek-V3 (``deepseek_v3.spec``, whose notes and refusals apply: MTP
skipped, FP8 refused, no sequence-wise loss) with every layer DeepSeek sparse attention: a lightning
indexer (``index_n_heads`` x ``index_head_dim``, RoPE on its first ``qk_rope_head_dim`` dims) picks
``index_topk`` keys per query and the MLA attends to those only (``models.common.mla_dsa``, ``indexer
"deepseek"``). The indexer runs under ``no_grad`` as in HF (DeepSeek trains it with a separate KL loss,
not implemented): its weights are frozen in fine-tuning. HF's indexer skips the Hadamard rotation and FP8
scoring of DeepSeek's kernel (an orthogonal map and a precision choice); megaseq follows HF.

Presets: ``deepseek-v32-tiny``.
"""

from __future__ import annotations

from typing import Any

from megaseq.models.deepseek_v3.spec import HF_FIELDS as V3_FIELDS
from megaseq.models.deepseek_v3.spec import common_from_hf, common_to_hf
from megaseq.models.hf_fields import HFFields
from megaseq.models.registry import Family
from megaseq.models.spec import DNA_VOCAB_SIZE, ModelSpec

FAMILY = Family(name="deepseek_v32", hf_model_types=("deepseek_v32",), layer_kinds=("dsa",), segmentable=True,
                tiles_whole_layer=False, balance="bias",
                fp32_params=("router",))


def _indexed_only(value: Any, c: dict[str, Any]) -> str | None:
    return None if value is None or set(value) <= {"indexed_attention"} else "every layer indexed_attention"


HF_FIELDS: HFFields = V3_FIELDS.extended(
    read=frozenset({"index_topk", "index_n_heads", "index_head_dim"}),
    required={"mlp_bias": ((False, None), "no MLP biases"), "layer_types": _indexed_only})


def from_hf(c: dict[str, Any]) -> ModelSpec:
    """A ``deepseek_v32`` config.json as a spec."""
    fields = common_from_hf(c, "deepseek_v32", "dsa", HF_FIELDS)
    n = fields["num_layers"]
    return ModelSpec(**fields, index_topk=c.get("index_topk", 2048), index_n_heads=c.get("index_n_heads", 64),
                     index_head_dim=c.get("index_head_dim", 128), index_kpool=1,
                     index_kpool_always_select_tail=False, indexer_types=("full",) * n)


def to_hf(s: ModelSpec) -> dict[str, Any]:
    """The ``deepseek_v32`` config.json (architectures ``DeepseekV32ForCausalLM``)."""
    return {"architectures": ["DeepseekV32ForCausalLM"], "model_type": "deepseek_v32", **common_to_hf(s),
            "index_topk": s.index_topk, "index_n_heads": s.index_n_heads, "index_head_dim": s.index_head_dim,
            "mlp_layer_types": ["sparse" if m == "moe" else "dense" for m in s.mlp_types]}


def deepseek_v32_tiny() -> ModelSpec:
    n = 4
    return ModelSpec(
        family="deepseek_v32", vocab_size=DNA_VOCAB_SIZE, hidden_size=64, num_layers=n, layer_types=("dsa",) * n,
        mlp_types=("dense",) + ("moe",) * (n - 1), rms_norm_eps=1e-6, pad_token_id=0, intermediate_size=128,
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, num_shared_experts=1, router="sigmoid_bias",
        n_group=4, topk_group=2, routed_scaling_factor=2.5, num_attention_heads=4, num_key_value_heads=4,
        q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
        rope_interleave=True, rope_theta=10000.0, index_topk=64, index_n_heads=16, index_head_dim=16, index_kpool=1,
        index_kpool_always_select_tail=False, indexer_types=("full",) * n,
    )


PRESETS = {"deepseek-v32-tiny": deepseek_v32_tiny}
