"""OLMoE's config.json in and out, and its preset (torch-free: the planner reads this).

OLMoE (``allenai/OLMoE-1B-7B-0924``, HF ``olmoe``): every layer softmax attention (q/k RMSNorm over all
heads' channels, optional ``clip_qkv``) + a 64-expert top-8 softmax-routed MoE without shared experts,
trained with the auxiliary load-balancing loss (``router_aux_loss_coef`` 0.01). Its experts' width is
config.json's ``intermediate_size`` (there is no dense MLP).

``from_hf`` refuses what megaseq's OLMoE does not implement: RoPE types other than default / linear /
YaRN, an activation other than SiLU, attention dropout, a ``head_dim`` other than hidden / heads (HF's
q/k norms are sized from the hidden size).

Presets: ``olmoe-tiny``, a CPU-sized OLMoE on the DNA vocabulary.
"""

from __future__ import annotations

from typing import Any

from megaseq.models.hf_fields import FULL_ATTENTION, ROPE_FIELDS, HFFields
from megaseq.models.registry import Family
from megaseq.models.spec import DNA_VOCAB_SIZE, ModelSpec, rope_from_hf, rope_to_hf

FAMILY = Family(name="olmoe", hf_model_types=("olmoe",), layer_kinds=("attention",), segmentable=True,
                tiles_whole_layer=False, balance="aux_loss")
AUX_LOSS_COEF = 0.01  # OlmoeConfig's router_aux_loss_coef (the paper's)
_EXTRA = ("bos_token_id", "eos_token_id", "initializer_range")


# output_router_logits: transformers' switch for adding the auxiliary loss; megaseq's moe.balance decides
HF_FIELDS = HFFields(
    read=ROPE_FIELDS | {
        "num_hidden_layers", "hidden_size", "num_attention_heads", "head_dim", "vocab_size", "rms_norm_eps",
        "tie_word_embeddings", "pad_token_id", "num_experts", "num_local_experts", "num_experts_per_tok",
        "intermediate_size", "norm_topk_prob", "router_aux_loss_coef", "num_key_value_heads",
        "max_position_embeddings", "clip_qkv", "attention_bias"},
    carried=frozenset({"output_router_logits"}),
    required={"hidden_act": (("silu",), "the MLPs are SwiGLU, which needs 'silu'"),
              "attention_dropout": ((0, 0.0), "no attention dropout (set it to 0)"), **FULL_ATTENTION})


def from_hf(c: dict[str, Any]) -> ModelSpec:
    """An ``olmoe`` config.json as a spec."""
    HF_FIELDS.check(c, "olmoe")
    theta, scaling, partial = rope_from_hf(c, "olmoe")
    n, H = c.get("num_hidden_layers", 16), c.get("hidden_size", 2048)
    heads = c.get("num_attention_heads", 16)
    head_dim = c.get("head_dim") or H // heads
    if head_dim * heads != H or partial != 1.0:
        raise ValueError(f"olmoe head_dim {head_dim} x {heads} heads != hidden_size {H} (or a partial rotary "
                         "factor): HF's OLMoE sizes its q/k norms from hidden_size, megaseq implements that only")
    return ModelSpec(
        family="olmoe", vocab_size=c.get("vocab_size", 50304), hidden_size=H, num_layers=n,
        layer_types=("attention",) * n, mlp_types=("moe",) * n, rms_norm_eps=c.get("rms_norm_eps", 1e-5),
        tie_word_embeddings=c.get("tie_word_embeddings", False), pad_token_id=c.get("pad_token_id", 1),
        num_experts=c.get("num_experts", c.get("num_local_experts", 64)),
        num_experts_per_tok=c.get("num_experts_per_tok", 8), moe_intermediate_size=c.get("intermediate_size", 2048),
        router="softmax", norm_topk_prob=c.get("norm_topk_prob", False),
        router_aux_loss_coef=c.get("router_aux_loss_coef", AUX_LOSS_COEF),
        num_attention_heads=heads, num_key_value_heads=c.get("num_key_value_heads") or heads, head_dim=head_dim,
        rope_theta=theta, rope_scaling=scaling, max_position_embeddings=c.get("max_position_embeddings", 4096),
        qk_norm=True, qk_norm_scope="all", clip_qkv=c.get("clip_qkv"),
        attention_bias=c.get("attention_bias", False), o_proj_bias=c.get("attention_bias", False),
        hf_extra={k: c[k] for k in _EXTRA if k in c},
    )


def to_hf(s: ModelSpec) -> dict[str, Any]:
    """The ``olmoe`` config.json (architectures ``OlmoeForCausalLM``)."""
    if s.router != "softmax" or s.num_shared_experts or "dense" in s.mlp_types or s.qk_norm_scope != "all":
        raise ValueError("this spec cannot be written as an OlmoeConfig: it needs every layer MoE with a softmax "
                         "router, no shared experts and q/k norms over all heads")
    return {
        "architectures": ["OlmoeForCausalLM"], "model_type": "olmoe", "vocab_size": s.vocab_size,
        "hidden_size": s.hidden_size, "intermediate_size": s.moe_intermediate_size,
        "num_hidden_layers": s.num_layers, "num_attention_heads": s.num_attention_heads,
        "num_key_value_heads": s.num_key_value_heads, "hidden_act": "silu",
        "max_position_embeddings": s.max_position_embeddings or 4096, "rms_norm_eps": s.rms_norm_eps,
        "pad_token_id": s.pad_token_id, "tie_word_embeddings": s.tie_word_embeddings,
        "rope_parameters": rope_to_hf(s), "attention_bias": s.attention_bias, "attention_dropout": 0.0,
        "clip_qkv": s.clip_qkv, "num_experts_per_tok": s.num_experts_per_tok, "num_experts": s.num_experts,
        "router_aux_loss_coef": s.router_aux_loss_coef, "norm_topk_prob": s.norm_topk_prob, **s.hf_extra,
    }


def olmoe_tiny() -> ModelSpec:
    n = 4
    return ModelSpec(
        family="olmoe", vocab_size=DNA_VOCAB_SIZE, hidden_size=64, num_layers=n, layer_types=("attention",) * n,
        mlp_types=("moe",) * n, rms_norm_eps=1e-5, pad_token_id=0, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=32, router="softmax", norm_topk_prob=False, router_aux_loss_coef=AUX_LOSS_COEF,
        num_attention_heads=4, num_key_value_heads=4, head_dim=16, rope_theta=10000.0, qk_norm=True,
        qk_norm_scope="all",
    )


PRESETS = {"olmoe-tiny": olmoe_tiny}
