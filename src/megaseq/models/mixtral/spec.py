"""Mixtral's config.json in and out, and its preset (torch-free: the planner reads this).

Mixtral (``mistralai/Mixtral-8x7B-v0.1``, HF ``mixtral``): every layer GQA softmax attention (no q/k norm,
no biases) + 8 SwiGLU experts top-2, softmax router renormalised over the top-2 with its weights kept in
float32, trained with the auxiliary load-balancing loss (``router_aux_loss_coef``; 0.02 in the published
config, HF's default 0.001). The experts' width is config.json's ``intermediate_size``.

``from_hf`` refuses what megaseq's Mixtral does not implement: a sliding window (Mixtral's released
configs set none), router jitter noise, attention dropout, an activation other than SiLU, RoPE types
other than default / linear / YaRN.

Presets: ``mixtral-tiny``, a CPU-sized Mixtral on the DNA vocabulary.
"""

from __future__ import annotations

from typing import Any

from megaseq.models.hf_fields import FULL_ATTENTION, ROPE_FIELDS, HFFields
from megaseq.models.registry import Family
from megaseq.models.spec import DNA_VOCAB_SIZE, ModelSpec, rope_from_hf, rope_to_hf

FAMILY = Family(name="mixtral", hf_model_types=("mixtral",), layer_kinds=("attention",), segmentable=True,
                tiles_whole_layer=False, balance="aux_loss")
AUX_LOSS_COEF = 0.001  # MixtralConfig's default (the released checkpoints' config.json say 0.02)
_EXTRA = ("bos_token_id", "eos_token_id", "initializer_range")


# output_router_logits: transformers' switch for adding the auxiliary loss; megaseq's moe.balance decides
HF_FIELDS = HFFields(
    read=ROPE_FIELDS | {
        "num_hidden_layers", "hidden_size", "num_attention_heads", "vocab_size", "rms_norm_eps",
        "tie_word_embeddings", "pad_token_id", "num_local_experts", "num_experts", "num_experts_per_tok",
        "intermediate_size", "router_aux_loss_coef", "num_key_value_heads", "head_dim", "max_position_embeddings"},
    carried=frozenset({"output_router_logits"}),
    required={"hidden_act": (("silu",), "the MLPs are SwiGLU, which needs 'silu'"),
              "attention_dropout": ((0, 0.0), "no attention dropout (set it to 0)"),
              "router_jitter_noise": ((0, 0.0), "no router jitter noise (set it to 0)"), **FULL_ATTENTION})


def from_hf(c: dict[str, Any]) -> ModelSpec:
    """A ``mixtral`` config.json as a spec."""
    HF_FIELDS.check(c, "mixtral")
    theta, scaling, partial = rope_from_hf(c, "mixtral", default_theta=1e6)
    if partial != 1.0:
        raise ValueError(f"mixtral partial_rotary_factor {partial} is not supported (Mixtral rotates whole heads)")
    n, H, heads = c.get("num_hidden_layers", 32), c.get("hidden_size", 4096), c.get("num_attention_heads", 32)
    return ModelSpec(
        family="mixtral", vocab_size=c.get("vocab_size", 32000), hidden_size=H, num_layers=n,
        layer_types=("attention",) * n, mlp_types=("moe",) * n, rms_norm_eps=c.get("rms_norm_eps", 1e-5),
        tie_word_embeddings=c.get("tie_word_embeddings", False), pad_token_id=c.get("pad_token_id"),
        num_experts=c.get("num_local_experts", c.get("num_experts", 8)),
        num_experts_per_tok=c.get("num_experts_per_tok", 2), moe_intermediate_size=c.get("intermediate_size", 14336),
        router="softmax", norm_topk_prob=True, router_weights_fp32=True,
        router_aux_loss_coef=c.get("router_aux_loss_coef", AUX_LOSS_COEF),
        num_attention_heads=heads, num_key_value_heads=c.get("num_key_value_heads", 8),
        head_dim=c.get("head_dim") or H // heads, rope_theta=theta, rope_scaling=scaling,
        max_position_embeddings=c.get("max_position_embeddings", 4096 * 32),
        hf_extra={k: c[k] for k in _EXTRA if k in c},
    )


def to_hf(s: ModelSpec) -> dict[str, Any]:
    """The ``mixtral`` config.json (architectures ``MixtralForCausalLM``)."""
    if (s.router != "softmax" or not s.norm_topk_prob or s.num_shared_experts or "dense" in s.mlp_types
            or s.qk_norm or s.attention_bias or s.o_proj_bias):
        raise ValueError("this spec cannot be written as a MixtralConfig: it needs every layer MoE with a "
                         "renormalised softmax router, no shared experts, no q/k norms and no biases")
    return {
        "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "vocab_size": s.vocab_size,
        "hidden_size": s.hidden_size, "intermediate_size": s.moe_intermediate_size,
        "num_hidden_layers": s.num_layers, "num_attention_heads": s.num_attention_heads,
        "num_key_value_heads": s.num_key_value_heads, "head_dim": s.head_dim, "hidden_act": "silu",
        "max_position_embeddings": s.max_position_embeddings or 4096 * 32, "rms_norm_eps": s.rms_norm_eps,
        "pad_token_id": s.pad_token_id, "tie_word_embeddings": s.tie_word_embeddings,
        "rope_parameters": rope_to_hf(s), "sliding_window": None, "attention_dropout": 0.0,
        "num_experts_per_tok": s.num_experts_per_tok, "num_local_experts": s.num_experts,
        "router_aux_loss_coef": s.router_aux_loss_coef, "router_jitter_noise": 0.0, **s.hf_extra,
    }


def mixtral_tiny() -> ModelSpec:
    n = 4
    return ModelSpec(
        family="mixtral", vocab_size=DNA_VOCAB_SIZE, hidden_size=64, num_layers=n, layer_types=("attention",) * n,
        mlp_types=("moe",) * n, rms_norm_eps=1e-5, pad_token_id=0, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=48, router="softmax", norm_topk_prob=True, router_weights_fp32=True,
        router_aux_loss_coef=0.02, num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=1e6,
    )


PRESETS = {"mixtral-tiny": mixtral_tiny}
