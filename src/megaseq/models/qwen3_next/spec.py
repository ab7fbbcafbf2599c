"""Qwen3-Next's config.json in and out, and its preset (torch-free: the planner reads this).

Qwen3-Next (``Qwen/Qwen3-Next-80B-A3B-*``, HF ``qwen3_next``): three gated DeltaNet layers
(``models.common.gdn``) to one gated attention layer (``Attention`` with ``attn_output_gate``: each head's
query and a sigmoid gate from ``q_proj``, per-head q/k norms, a quarter of each head rotated), every norm
zero-centered (``x * (1 + w)``), each layer a softmax-routed MoE (512 experts top-10) with one gated shared
expert, trained with the auxiliary load-balancing loss (``router_aux_loss_coef`` 0.001).

Not modelled: the multi-token-prediction module (``mtp.*`` tensors; skipped on load with a note, not
trained, not exported). Refused: RoPE types other than default / linear / YaRN, another activation,
attention dropout, a ``decoder_sparse_step`` other than 1 with dense layers outside ``mlp_only_layers``.

Presets: ``qwen3-next-tiny``.
"""

from __future__ import annotations

from typing import Any

from megaseq.models.hf_fields import FULL_ATTENTION, ROPE_FIELDS, HFFields
from megaseq.models.registry import Family
from megaseq.models.spec import DNA_VOCAB_SIZE, ModelSpec, rope_from_hf, rope_to_hf

FAMILY = Family(name="qwen3_next", hf_model_types=("qwen3_next",), layer_kinds=("gdn", "attention"),
                segmentable=True, tiles_whole_layer=False, balance="aux_loss")
AUX_LOSS_COEF = 0.001  # Qwen3NextConfig's router_aux_loss_coef
_EXTRA = ("bos_token_id", "eos_token_id", "initializer_range")
_KINDS = {"linear_attention": "gdn", "full_attention": "attention"}


# output_router_logits: transformers' switch for adding the auxiliary loss; megaseq's moe.balance decides
HF_FIELDS = HFFields(
    read=ROPE_FIELDS | {
        "num_hidden_layers", "layer_types", "full_attention_interval", "decoder_sparse_step", "mlp_only_layers",
        "num_experts", "vocab_size", "hidden_size", "rms_norm_eps", "tie_word_embeddings", "pad_token_id",
        "intermediate_size", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size",
        "norm_topk_prob", "router_aux_loss_coef", "num_attention_heads", "num_key_value_heads", "head_dim",
        "max_position_embeddings", "attention_bias", "linear_num_key_heads", "linear_key_head_dim",
        "linear_num_value_heads", "linear_value_head_dim", "linear_conv_kernel_dim"},
    carried=frozenset({"output_router_logits"}),
    required={"hidden_act": (("silu",), "the MLPs are SwiGLU, which needs 'silu'"),
              "attention_dropout": ((0, 0.0), "no attention dropout (set it to 0)"), **FULL_ATTENTION,
              "shared_expert_intermediate_size": lambda v, c: None if v is None or v > 0 else
              "a gated shared expert of positive width (megaseq's Qwen3-Next always has one)"})


def from_hf(c: dict[str, Any]) -> ModelSpec:
    """A ``qwen3_next`` config.json as a spec."""
    HF_FIELDS.check(c, "qwen3_next")
    params = c.get("rope_parameters") or {}
    if "partial_rotary_factor" not in params and "partial_rotary_factor" not in c:
        c = {**c, "partial_rotary_factor": 0.25}  # Qwen3NextConfig's default
    theta, scaling, partial = rope_from_hf(c, "qwen3_next")
    n = c.get("num_hidden_layers", 48)
    types = c.get("layer_types") or [
        "linear_attention" if (i + 1) % c.get("full_attention_interval", 4) else "full_attention" for i in range(n)]
    bad = sorted({t for t in types if t not in _KINDS})
    if bad:
        raise ValueError(f"qwen3_next layer types {bad} are not implemented; supported: {', '.join(_KINDS)}")
    step, mlp_only = c.get("decoder_sparse_step", 1), set(c.get("mlp_only_layers") or [])
    experts = c.get("num_experts", 512)
    mlp = ["moe" if i not in mlp_only and experts > 0 and (i + 1) % step == 0 else "dense" for i in range(n)]
    return ModelSpec(
        family="qwen3_next", vocab_size=c.get("vocab_size", 151936), hidden_size=c.get("hidden_size", 2048),
        num_layers=n, layer_types=tuple(_KINDS[t] for t in types), mlp_types=tuple(mlp),
        rms_norm_eps=c.get("rms_norm_eps", 1e-6), tie_word_embeddings=c.get("tie_word_embeddings", False),
        pad_token_id=c.get("pad_token_id"), intermediate_size=c.get("intermediate_size", 5632),
        num_experts=experts, num_experts_per_tok=c.get("num_experts_per_tok", 10),
        moe_intermediate_size=c.get("moe_intermediate_size", 512), num_shared_experts=1, shared_expert_gate=True,
        shared_expert_intermediate_size=c.get("shared_expert_intermediate_size", 512), router="softmax",
        norm_topk_prob=c.get("norm_topk_prob", True), router_aux_loss_coef=c.get("router_aux_loss_coef", AUX_LOSS_COEF),
        num_attention_heads=c.get("num_attention_heads", 16), num_key_value_heads=c.get("num_key_value_heads", 2),
        head_dim=c.get("head_dim", 256), rope_theta=theta, rope_scaling=scaling, partial_rotary_factor=partial,
        max_position_embeddings=c.get("max_position_embeddings", 32768), qk_norm=True, attn_output_gate=True,
        norm_zero_centered=True, attention_bias=c.get("attention_bias", False),
        o_proj_bias=c.get("attention_bias", False), linear_num_heads=c.get("linear_num_key_heads", 16),
        linear_head_dim=c.get("linear_key_head_dim", 128), linear_num_value_heads=c.get("linear_num_value_heads", 32),
        linear_value_head_dim=c.get("linear_value_head_dim", 128),
        linear_conv_kernel=c.get("linear_conv_kernel_dim", 4),
        hf_extra={k: c[k] for k in _EXTRA if k in c},
    )


def to_hf(s: ModelSpec) -> dict[str, Any]:
    """The ``qwen3_next`` config.json (architectures ``Qwen3NextForCausalLM``)."""
    if s.router != "softmax" or not s.shared_expert_gate or not s.attn_output_gate or not s.norm_zero_centered:
        raise ValueError("this spec cannot be written as a Qwen3NextConfig: it needs a softmax router with a gated "
                         "shared expert, gated attention and zero-centered norms")
    kinds = {v: k for k, v in _KINDS.items()}
    return {
        "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", "vocab_size": s.vocab_size,
        "hidden_size": s.hidden_size, "intermediate_size": s.intermediate_size, "num_hidden_layers": s.num_layers,
        "num_attention_heads": s.num_attention_heads, "num_key_value_heads": s.num_key_value_heads,
        "hidden_act": "silu", "max_position_embeddings": s.max_position_embeddings or 32768,
        "rms_norm_eps": s.rms_norm_eps, "tie_word_embeddings": s.tie_word_embeddings, "pad_token_id": s.pad_token_id,
        "rope_parameters": rope_to_hf(s, with_partial=True), "attention_bias": s.attention_bias,
        "attention_dropout": 0.0, "head_dim": s.head_dim, "linear_conv_kernel_dim": s.linear_conv_kernel,
        "linear_key_head_dim": s.linear_head_dim, "linear_value_head_dim": s.linear_value_head_dim or s.linear_head_dim,
        "linear_num_key_heads": s.linear_num_heads,
        "linear_num_value_heads": s.linear_num_value_heads or s.linear_num_heads, "decoder_sparse_step": 1,
        "moe_intermediate_size": s.moe_intermediate_size,
        "shared_expert_intermediate_size": s.shared_expert_intermediate_size,
        "num_experts_per_tok": s.num_experts_per_tok, "num_experts": s.num_experts, "norm_topk_prob": s.norm_topk_prob,
        "router_aux_loss_coef": s.router_aux_loss_coef,
        "mlp_only_layers": [i for i, m in enumerate(s.mlp_types) if m == "dense"],
        "layer_types": [kinds[k] for k in s.layer_types], **s.hf_extra,
    }


def qwen3_next_tiny() -> ModelSpec:
    n = 8
    return ModelSpec(
        family="qwen3_next", vocab_size=DNA_VOCAB_SIZE, hidden_size=64, num_layers=n,
        layer_types=tuple("attention" if i % 4 == 3 else "gdn" for i in range(n)), mlp_types=("moe",) * n,
        rms_norm_eps=1e-6, pad_token_id=0, intermediate_size=128, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=32, num_shared_experts=1, shared_expert_gate=True, shared_expert_intermediate_size=32,
        router="softmax", norm_topk_prob=True, router_aux_loss_coef=AUX_LOSS_COEF, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, rope_theta=10000.0, partial_rotary_factor=0.25, qk_norm=True,
        attn_output_gate=True, norm_zero_centered=True, linear_num_heads=2, linear_head_dim=16,
        linear_num_value_heads=4, linear_value_head_dim=16, linear_conv_kernel=4,
    )


PRESETS = {"qwen3-next-tiny": qwen3_next_tiny}
