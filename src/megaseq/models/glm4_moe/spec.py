"""GLM-4.5's config.json in and out, and its preset (torch-free: the planner reads this).

GLM-4.5 / GLM-4.5-Air / GLM-4.6 (HF ``glm4_moe``): every layer GQA softmax attention with half of each head
rotated (``partial_rotary_factor`` 0.5), q/k/v biases, optional per-head q/k RMSNorm (``use_qk_norm``); the
first ``first_k_dense_replace`` layers dense SwiGLU, the rest a sigmoid-routed MoE with a score-correction
bias (group-limited top-k, ``routed_scaling_factor``) and shared experts, trained auxiliary-loss-free
(the bias update, ``moe.balance bias``).

Not modelled: the multi-token-prediction layer (``num_nextn_predict_layers``, checkpoint layer
``num_hidden_layers``): its tensors are skipped on load, it is not trained, and the export says
``num_nextn_predict_layers: 0``. ``from_hf`` warns once when a checkpoint has one, and refuses RoPE types
other than default / linear / YaRN, another activation, attention dropout.

Presets: ``glm4-moe-tiny``, a CPU-sized GLM-4.5 on the DNA vocabulary.
"""

from __future__ import annotations

import warnings
from typing import Any

from megaseq.models.hf_fields import FULL_ATTENTION, ROPE_FIELDS, HFFields
from megaseq.models.registry import Family
from megaseq.models.spec import DNA_VOCAB_SIZE, ModelSpec, rope_from_hf, rope_to_hf

FAMILY = Family(name="glm4_moe", hf_model_types=("glm4_moe",), layer_kinds=("attention",), segmentable=True,
                tiles_whole_layer=False, balance="bias",
                fp32_params=("router",))
_EXTRA = ("bos_token_id", "eos_token_id", "initializer_range")
MTP_NOTE = ("the checkpoint's multi-token-prediction layer (num_nextn_predict_layers = {n}) is not modelled: "
            "megaseq skips its tensors on load, does not train it, and exports num_nextn_predict_layers 0")


# output_router_logits: megaseq's moe.balance decides how the routers are balanced
HF_FIELDS = HFFields(
    read=ROPE_FIELDS | {
        "num_nextn_predict_layers", "num_mtp_layers", "num_hidden_layers", "hidden_size", "num_attention_heads",
        "first_k_dense_replace", "vocab_size", "rms_norm_eps", "tie_word_embeddings", "pad_token_id",
        "intermediate_size", "n_routed_experts", "num_local_experts", "num_experts_per_tok", "moe_intermediate_size",
        "n_shared_experts", "n_group", "topk_group", "norm_topk_prob", "routed_scaling_factor",
        "num_key_value_heads", "head_dim", "max_position_embeddings", "use_qk_norm", "attention_bias"},
    carried=frozenset({"output_router_logits"}),
    required={"hidden_act": (("silu",), "the MLPs are SwiGLU, which needs 'silu'"),
              "attention_dropout": ((0, 0.0), "no attention dropout (set it to 0)"), **FULL_ATTENTION})


def from_hf(c: dict[str, Any]) -> ModelSpec:
    """A ``glm4_moe`` config.json as a spec."""
    HF_FIELDS.check(c, "glm4_moe")
    params = c.get("rope_parameters") or {}
    if "partial_rotary_factor" not in params and "partial_rotary_factor" not in c:
        c = {**c, "partial_rotary_factor": 0.5}  # Glm4MoeConfig's default
    theta, scaling, partial = rope_from_hf(c, "glm4_moe")
    mtp = c.get("num_nextn_predict_layers", c.get("num_mtp_layers", 0)) or 0
    if mtp:
        warnings.warn("glm4_moe: " + MTP_NOTE.format(n=mtp), stacklevel=2)
    n, H, heads = c.get("num_hidden_layers", 46), c.get("hidden_size", 4096), c.get("num_attention_heads", 96)
    dense = c.get("first_k_dense_replace", 1)
    return ModelSpec(
        family="glm4_moe", vocab_size=c.get("vocab_size", 151552), hidden_size=H, num_layers=n,
        layer_types=("attention",) * n, mlp_types=tuple("dense" if i < dense else "moe" for i in range(n)),
        rms_norm_eps=c.get("rms_norm_eps", 1e-5), tie_word_embeddings=c.get("tie_word_embeddings", False),
        pad_token_id=c.get("pad_token_id"), intermediate_size=c.get("intermediate_size", 10944),
        num_experts=c.get("n_routed_experts", c.get("num_local_experts", 128)),
        num_experts_per_tok=c.get("num_experts_per_tok", 8), moe_intermediate_size=c.get("moe_intermediate_size", 1408),
        num_shared_experts=c.get("n_shared_experts", 1), router="sigmoid_bias", n_group=c.get("n_group", 1),
        topk_group=c.get("topk_group", 1), norm_topk_prob=c.get("norm_topk_prob", True),
        routed_scaling_factor=c.get("routed_scaling_factor", 1.0),
        num_attention_heads=heads, num_key_value_heads=c.get("num_key_value_heads", 8),
        head_dim=c.get("head_dim") or H // heads, rope_theta=theta, rope_scaling=scaling,
        max_position_embeddings=c.get("max_position_embeddings", 131072), partial_rotary_factor=partial,
        qk_norm=c.get("use_qk_norm", False), attention_bias=c.get("attention_bias", False), o_proj_bias=False,
        hf_extra={k: c[k] for k in _EXTRA if k in c},
    )


def to_hf(s: ModelSpec) -> dict[str, Any]:
    """The ``glm4_moe`` config.json (architectures ``Glm4MoeForCausalLM``)."""
    dense = s.mlp_types.index("moe") if "moe" in s.mlp_types else s.num_layers
    if s.router != "sigmoid_bias" or any(m != ("dense" if i < dense else "moe") for i, m in enumerate(s.mlp_types)):
        raise ValueError("this spec cannot be written as a Glm4MoeConfig: it needs a sigmoid router and dense "
                         "layers only before the first MoE layer")
    return {
        "architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe", "vocab_size": s.vocab_size,
        "hidden_size": s.hidden_size, "intermediate_size": s.intermediate_size, "num_hidden_layers": s.num_layers,
        "num_attention_heads": s.num_attention_heads, "num_key_value_heads": s.num_key_value_heads,
        "head_dim": s.head_dim, "hidden_act": "silu", "max_position_embeddings": s.max_position_embeddings or 131072,
        "rms_norm_eps": s.rms_norm_eps, "tie_word_embeddings": s.tie_word_embeddings, "pad_token_id": s.pad_token_id,
        "rope_parameters": rope_to_hf(s, with_partial=True), "attention_bias": s.attention_bias,
        "attention_dropout": 0.0, "moe_intermediate_size": s.moe_intermediate_size,
        "num_experts_per_tok": s.num_experts_per_tok, "n_shared_experts": s.num_shared_experts,
        "n_routed_experts": s.num_experts, "routed_scaling_factor": s.routed_scaling_factor, "n_group": s.n_group,
        "topk_group": s.topk_group, "first_k_dense_replace": dense, "norm_topk_prob": s.norm_topk_prob,
        "use_qk_norm": s.qk_norm, "num_nextn_predict_layers": 0, **s.hf_extra,
    }


def glm4_moe_tiny() -> ModelSpec:
    n = 4
    return ModelSpec(
        family="glm4_moe", vocab_size=DNA_VOCAB_SIZE, hidden_size=64, num_layers=n, layer_types=("attention",) * n,
        mlp_types=("dense",) + ("moe",) * (n - 1), rms_norm_eps=1e-5, pad_token_id=0, intermediate_size=128,
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, num_shared_experts=1, router="sigmoid_bias",
        routed_scaling_factor=2.5, num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=1e6,
        partial_rotary_factor=0.5, qk_norm=True, attention_bias=True,
    )


PRESETS = {"glm4-moe-tiny": glm4_moe_tiny}
