"""Qwen3-MoE's config.json in and out, and its preset (torch-free: the planner reads this).

``from_hf`` refuses the options megaseq's Qwen3-MoE does not implement (RoPE types other than default,
linear and YaRN; sliding windows; an activation other than SiLU; attention dropout; router jitter; fields it
does not know) rather than run a different model; every source field ``to_hf`` does not write itself is kept
in ``hf_extra`` and written back unchanged, so an export keeps the source checkpoint's whole config. YaRN
(``rope_parameters: {rope_type: yarn, factor, original_max_position_embeddings}``, as Qwen3's model cards
describe for contexts past 32K) runs as ``models.common.rope`` computes it. ``router_aux_loss_coef`` is the
auxiliary load-balancing loss's coefficient (``moe.balance``, ``train/balance.py``); ``output_router_logits``
(whether transformers adds that loss) is carried: in megaseq ``moe.balance`` decides.

Presets: ``qwen3-moe-tiny``, a CPU-sized Qwen3-MoE (softmax attention + GQA + RoPE + softmax router).
"""

from __future__ import annotations

from typing import Any

from megaseq.models.hf_fields import FULL_ATTENTION, ROPE_FIELDS, HFFields
from megaseq.models.registry import Family
from megaseq.models.spec import DNA_VOCAB_SIZE, ModelSpec, rope_from_hf, rope_to_hf

FAMILY = Family(name="qwen3_moe", hf_model_types=("qwen3_moe",), layer_kinds=("attention",), segmentable=True,
                tiles_whole_layer=False, balance="aux_loss")
AUX_LOSS_COEF = 0.001  # Qwen3MoeConfig's router_aux_loss_coef default


def from_hf(c: dict[str, Any]) -> ModelSpec:
    """A ``qwen3_moe`` config.json as a spec."""
    n = c.get("num_hidden_layers", 24)
    step = c.get("decoder_sparse_step", 1)
    mlp_only = set(c.get("mlp_only_layers") or [])
    # transformers 5 writes the attribute-mapped name num_local_experts; hub configs say num_experts
    num_experts = c.get("num_experts", c.get("num_local_experts", 128))
    _check_qwen3_moe_supported(c)
    theta, scaling, partial = rope_from_hf(c, "qwen3_moe")
    if partial != 1.0:
        raise ValueError(f"qwen3_moe partial_rotary_factor {partial} is not supported (Qwen3 rotates whole heads)")
    mlp = [
        "moe" if (i not in mlp_only and num_experts > 0 and (i + 1) % step == 0) else "dense" for i in range(n)
    ]
    heads = c.get("num_attention_heads", 32)
    return ModelSpec(
        family="qwen3_moe",
        vocab_size=c.get("vocab_size", 151936),
        hidden_size=c.get("hidden_size", 2048),
        num_layers=n,
        layer_types=("attention",) * n,
        mlp_types=tuple(mlp),
        rms_norm_eps=c.get("rms_norm_eps", 1e-6),
        tie_word_embeddings=c.get("tie_word_embeddings", False),
        pad_token_id=c.get("pad_token_id"),
        intermediate_size=c.get("intermediate_size", 6144),
        num_experts=num_experts,
        num_experts_per_tok=c.get("num_experts_per_tok", 8),
        moe_intermediate_size=c.get("moe_intermediate_size", 768),
        router="softmax",
        norm_topk_prob=c.get("norm_topk_prob", False),
        router_aux_loss_coef=c.get("router_aux_loss_coef", AUX_LOSS_COEF),
        num_attention_heads=heads,
        num_key_value_heads=c.get("num_key_value_heads", 4),
        head_dim=c.get("head_dim") or c.get("hidden_size", 2048) // heads,
        rope_theta=theta, rope_scaling=scaling, max_position_embeddings=c.get("max_position_embeddings", 0),
        qk_norm=True,
        attention_bias=c.get("attention_bias", False),
        o_proj_bias=c.get("attention_bias", False),
        hf_extra={k: v for k, v in c.items() if k not in _WRITTEN},
    )


# the fields from_hf reads, those that never change a training step (carried unchanged), and those megaseq
# implements at some values only (output_router_logits: transformers' switch for adding the auxiliary loss;
# megaseq's moe.balance decides)
HF_FIELDS = HFFields(
    read=ROPE_FIELDS | {
        "num_hidden_layers", "decoder_sparse_step", "mlp_only_layers", "num_experts", "num_local_experts",
        "num_attention_heads", "layer_types", "vocab_size", "hidden_size", "rms_norm_eps", "tie_word_embeddings",
        "pad_token_id", "intermediate_size", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
        "router_aux_loss_coef", "num_key_value_heads", "head_dim", "attention_bias", "max_position_embeddings"},
    carried=frozenset({"max_window_layers", "output_router_logits"}),
    required={
        "hidden_act": (("silu",), "the experts are SwiGLU, which needs 'silu'"),
        **FULL_ATTENTION,
        "attention_dropout": ((0, 0.0), "no attention dropout (set it to 0)"),
        "router_jitter_noise": ((0, 0.0, None), "no router jitter noise (set it to 0)"),
        "quantization_config": ((None,), "quantized weights are not supported"),
    })


def _check_qwen3_moe_supported(c: dict[str, Any]) -> None:
    """Options megaseq's qwen3_moe does not implement: refuse them rather than run a different model."""
    HF_FIELDS.check(c, "qwen3_moe")
    bad = sorted({t for t in c.get("layer_types") or [] if t != "full_attention"})
    if bad:
        raise ValueError(f"config.json layer_types holds {bad}; megaseq's qwen3_moe runs full attention in every "
                         "layer ('full_attention')")


# ---- config.json out ------------------------------------------------------------------------
def to_hf(s: ModelSpec) -> dict[str, Any]:
    if s.router != "softmax" or s.num_shared_experts or s.swiglu_limit is not None or not s.qk_norm \
            or s.o_proj_bias != s.attention_bias:
        raise ValueError("this qwen3_moe spec cannot be written as a Qwen3MoeConfig: it needs router "
                         "'softmax', no shared experts, no swiglu_limit and qk_norm true")
    extra = dict(s.hf_extra)
    return {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
        "vocab_size": s.vocab_size, "hidden_size": s.hidden_size, "num_hidden_layers": s.num_layers,
        "intermediate_size": s.intermediate_size, "rms_norm_eps": s.rms_norm_eps,
        "tie_word_embeddings": s.tie_word_embeddings, "pad_token_id": s.pad_token_id, "hidden_act": "silu",
        "num_attention_heads": s.num_attention_heads, "num_key_value_heads": s.num_key_value_heads,
        "head_dim": s.head_dim or s.hidden_size // s.num_attention_heads, "attention_bias": s.attention_bias,
        "rope_parameters": rope_to_hf(s), "max_position_embeddings": s.max_position_embeddings or 32768,
        "use_sliding_window": False, "sliding_window": None,
        "num_experts": s.num_experts, "num_experts_per_tok": s.num_experts_per_tok,
        "moe_intermediate_size": s.moe_intermediate_size, "norm_topk_prob": s.norm_topk_prob,
        "router_aux_loss_coef": s.router_aux_loss_coef, "decoder_sparse_step": 1, "attention_dropout": 0.0,
        "mlp_only_layers": [i for i, m in enumerate(s.mlp_types) if m == "dense"],
        **extra,  # every source field the spec does not write itself, unchanged
    }


# what to_hf writes from the spec (a source's value of these is not carried, it is rewritten)
_WRITTEN = frozenset({
    "architectures", "model_type", "vocab_size", "hidden_size", "num_hidden_layers", "intermediate_size",
    "rms_norm_eps", "tie_word_embeddings", "pad_token_id", "hidden_act", "num_attention_heads",
    "num_key_value_heads", "head_dim", "attention_bias", "rope_parameters", "rope_theta", "rope_scaling",
    "partial_rotary_factor", "max_position_embeddings", "use_sliding_window", "num_experts",
    "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob", "router_aux_loss_coef",
    "attention_dropout", "decoder_sparse_step", "mlp_only_layers", "dtype", "torch_dtype",
})



# ---- presets ---------------------------------------------------------------------------------
def qwen3_moe_tiny() -> ModelSpec:
    n = 4
    return ModelSpec(
        family="qwen3_moe", vocab_size=DNA_VOCAB_SIZE, hidden_size=64, num_layers=n,
        layer_types=("attention",) * n, mlp_types=("moe",) * n, rms_norm_eps=1e-6, pad_token_id=0,
        intermediate_size=128, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        router="softmax", norm_topk_prob=True, router_aux_loss_coef=AUX_LOSS_COEF, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16,
        rope_theta=10000.0, qk_norm=True,
    )


PRESETS = {"qwen3-moe-tiny": qwen3_moe_tiny}
