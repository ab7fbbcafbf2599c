"""DeepSeek-V3's config.json in and out, and its preset (torch-free: the planner reads this).

DeepSeek-V3 (HF ``deepseek_v3``): every layer dense MLA (``models.common.mla``: q LoRA, a 512-wide latent,
64 RoPE dims shared by the heads, interleaved pairs, YaRN); the first ``first_k_dense_replace`` layers a
dense SwiGLU, the rest 256 routed experts top-8 under group-limited sigmoid routing (8 groups, top-4 groups)
with a score-correction bias, one shared expert, ``routed_scaling_factor`` 2.5. It trains
auxiliary-loss-free (the bias update, ``moe.balance bias``, rate 0.001 as the paper's); DeepSeek's
complementary sequence-wise loss (alpha 1e-4) is not implemented.

Not modelled, with a note: the multi-token-prediction module (``num_nextn_predict_layers``, checkpoint layer
``num_hidden_layers``; skipped on load, not trained, exported as 0). Refused: FP8 weights (the released
checkpoints are block-quantized: ``*.weight_scale_inv`` tensors; the loader names them, dequantize to bf16
first), routing other than ``noaux_tc`` / sigmoid, ``moe_layer_freq`` other than 1, another activation,
attention dropout, key/value heads fewer than the heads, RoPE types other than default / linear / YaRN.
``quantization_config`` is kept aside (not exported: megaseq writes bf16/fp32 weights).

``common_from_hf`` / ``common_to_hf`` are shared with ``deepseek_v32`` (the same model plus an indexer).
Presets: ``deepseek-v3-tiny``.
"""

from __future__ import annotations

import warnings
from typing import Any

from megaseq.models.hf_fields import FULL_ATTENTION, ROPE_FIELDS, HFFields
from megaseq.models.registry import Family
from megaseq.models.spec import DNA_VOCAB_SIZE, ModelSpec, rope_from_hf, rope_to_hf

FAMILY = Family(name="deepseek_v3", hf_model_types=("deepseek_v3",), layer_kinds=("mla",), segmentable=True,
                tiles_whole_layer=False, balance="bias",
                fp32_params=("router",))
_EXTRA = ("bos_token_id", "eos_token_id", "initializer_range")
MTP_NOTE = ("{family}: the checkpoint's multi-token-prediction module (num_nextn_predict_layers = {n}) is not "
            "modelled: megaseq skips its tensors on load, does not train it, and exports num_nextn_predict_layers 0")


def _heads_match(value: Any, c: dict[str, Any]) -> str | None:
    return None if value in (None, c.get("num_attention_heads", 128)) else \
        "num_attention_heads (MLA gives every head its own keys)"


def _rope_head_dim(value: Any, c: dict[str, Any]) -> str | None:
    # transformers sets head_dim to qk_rope_head_dim (the rotated width) and qk_head_dim to nope + rope
    return None if value in (None, c.get("qk_rope_head_dim", 64)) else "qk_rope_head_dim (the rotated width)"


def _qk_head_dim(value: Any, c: dict[str, Any]) -> str | None:
    want = c.get("qk_nope_head_dim", 128) + c.get("qk_rope_head_dim", 64)
    return None if value in (None, want) else f"qk_nope_head_dim + qk_rope_head_dim ({want})"


# aux_loss_alpha / seq_aux: DeepSeek's sequence-wise balance loss, which transformers does not compute either;
# ep_size: the original code's expert-parallel degree; quantization_config: the released FP8 checkpoints' (the
# loader names their scale tensors; dequantize to bf16 first); output_router_logits: megaseq's moe.balance decides
HF_FIELDS = HFFields(
    read=ROPE_FIELDS | {
        "num_hidden_layers", "mlp_layer_types", "first_k_dense_replace", "vocab_size", "hidden_size",
        "rms_norm_eps", "tie_word_embeddings", "pad_token_id", "intermediate_size", "n_routed_experts",
        "num_experts_per_tok", "moe_intermediate_size", "n_shared_experts", "n_group", "topk_group",
        "norm_topk_prob", "routed_scaling_factor", "num_attention_heads", "attention_bias", "q_lora_rank",
        "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "rope_interleave",
        "max_position_embeddings", "num_nextn_predict_layers", "num_mtp_layers", "bos_token_id", "eos_token_id",
        "initializer_range"},
    carried=frozenset({"aux_loss_alpha", "seq_aux", "ep_size", "quantization_config", "output_router_logits"}),
    required={
        "hidden_act": (("silu",), "the MLPs are SwiGLU, which needs 'silu'"),
        "attention_dropout": ((0, 0.0), "no attention dropout (set it to 0)"),
        "topk_method": (("noaux_tc",), "'noaux_tc' routing (the score-correction bias)"),
        "scoring_func": (("sigmoid",), "the 'sigmoid' router"),
        "moe_layer_freq": ((1,), "MoE in every layer after the dense ones (moe_layer_freq 1)"),
        "pretraining_tp": ((1, None), "pretraining_tp 1"),
        "num_key_value_heads": _heads_match, "head_dim": _rope_head_dim, "qk_head_dim": _qk_head_dim,
        **FULL_ATTENTION,
    })


def _check(c: dict[str, Any], family: str, fields: HFFields) -> None:
    fields.check(c, family)
    mtp = c.get("num_nextn_predict_layers", c.get("num_mtp_layers", 0)) or 0
    if mtp:
        warnings.warn(MTP_NOTE.format(family=family, n=mtp), stacklevel=3)


def common_from_hf(c: dict[str, Any], family: str, layer_kind: str, fields: HFFields = HF_FIELDS) -> dict[str, Any]:
    """The ModelSpec fields DeepSeek-V3 and V3.2 share, from a config.json (``fields``: the family's
    declaration)."""
    _check(c, family, fields)
    theta, scaling, partial = rope_from_hf(c, family)
    if partial != 1.0:
        raise ValueError(f"{family} partial_rotary_factor {partial} is not supported (MLA rotates qk_rope_head_dim)")
    n = c.get("num_hidden_layers", 61)
    mlp = c.get("mlp_layer_types") or ["dense"] * min(c.get("first_k_dense_replace", 3), n) + ["sparse"] * max(
        0, n - c.get("first_k_dense_replace", 3))
    heads = c.get("num_attention_heads", 128)
    extra = {k: c[k] for k in _EXTRA if k in c}
    return dict(
        family=family, vocab_size=c.get("vocab_size", 129280), hidden_size=c.get("hidden_size", 7168), num_layers=n,
        layer_types=(layer_kind,) * n, mlp_types=tuple("moe" if m == "sparse" else "dense" for m in mlp),
        rms_norm_eps=c.get("rms_norm_eps", 1e-6), tie_word_embeddings=c.get("tie_word_embeddings", False),
        pad_token_id=c.get("pad_token_id"), intermediate_size=c.get("intermediate_size", 18432),
        num_experts=c.get("n_routed_experts", 256), num_experts_per_tok=c.get("num_experts_per_tok", 8),
        moe_intermediate_size=c.get("moe_intermediate_size", 2048), num_shared_experts=c.get("n_shared_experts", 1),
        router="sigmoid_bias", n_group=c.get("n_group", 8), topk_group=c.get("topk_group", 4),
        norm_topk_prob=c.get("norm_topk_prob", True), routed_scaling_factor=c.get("routed_scaling_factor", 2.5),
        num_attention_heads=heads, num_key_value_heads=heads, attention_bias=c.get("attention_bias", False),
        q_lora_rank=c.get("q_lora_rank") or 0, kv_lora_rank=c.get("kv_lora_rank", 512),
        qk_nope_head_dim=c.get("qk_nope_head_dim", 128), qk_rope_head_dim=c.get("qk_rope_head_dim", 64),
        v_head_dim=c.get("v_head_dim", 128), rope_interleave=c.get("rope_interleave", True), rope_theta=theta,
        rope_scaling=scaling, max_position_embeddings=c.get("max_position_embeddings", 4096), hf_extra=extra,
    )


def from_hf(c: dict[str, Any]) -> ModelSpec:
    """A ``deepseek_v3`` config.json as a spec."""
    return ModelSpec(**common_from_hf(c, "deepseek_v3", "mla"))


def common_to_hf(s: ModelSpec) -> dict[str, Any]:
    dense = s.mlp_types.index("moe") if "moe" in s.mlp_types else s.num_layers
    if s.router != "sigmoid_bias" or any(m != ("dense" if i < dense else "moe") for i, m in enumerate(s.mlp_types)):
        raise ValueError(f"this spec cannot be written as a {s.family} config: it needs a sigmoid router and dense "
                         "layers only before the first MoE layer")
    return {
        "vocab_size": s.vocab_size, "hidden_size": s.hidden_size, "intermediate_size": s.intermediate_size,
        "moe_intermediate_size": s.moe_intermediate_size, "num_hidden_layers": s.num_layers,
        "num_attention_heads": s.num_attention_heads, "num_key_value_heads": s.num_attention_heads,
        "n_shared_experts": s.num_shared_experts, "n_routed_experts": s.num_experts,
        "routed_scaling_factor": s.routed_scaling_factor, "kv_lora_rank": s.kv_lora_rank,
        "q_lora_rank": s.q_lora_rank or None, "qk_rope_head_dim": s.qk_rope_head_dim, "v_head_dim": s.v_head_dim,
        "qk_nope_head_dim": s.qk_nope_head_dim, "n_group": s.n_group, "topk_group": s.topk_group,
        "num_experts_per_tok": s.num_experts_per_tok, "first_k_dense_replace": dense,
        "norm_topk_prob": s.norm_topk_prob, "hidden_act": "silu",
        "max_position_embeddings": s.max_position_embeddings or 4096, "rms_norm_eps": s.rms_norm_eps,
        "pad_token_id": s.pad_token_id, "tie_word_embeddings": s.tie_word_embeddings,
        "rope_parameters": rope_to_hf(s), "rope_interleave": s.rope_interleave, "attention_bias": s.attention_bias,
        "attention_dropout": 0.0, "num_nextn_predict_layers": 0, **s.hf_extra,
    }


def to_hf(s: ModelSpec) -> dict[str, Any]:
    """The ``deepseek_v3`` config.json (architectures ``DeepseekV3ForCausalLM``)."""
    return {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", **common_to_hf(s)}


def deepseek_v3_tiny() -> ModelSpec:
    n = 4
    return ModelSpec(
        family="deepseek_v3", vocab_size=DNA_VOCAB_SIZE, hidden_size=64, num_layers=n, layer_types=("mla",) * n,
        mlp_types=("dense",) + ("moe",) * (n - 1), rms_norm_eps=1e-6, pad_token_id=0, intermediate_size=128,
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, num_shared_experts=1, router="sigmoid_bias",
        n_group=4, topk_group=2, routed_scaling_factor=2.5, num_attention_heads=4, num_key_value_heads=4,
        q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
        rope_interleave=True, rope_theta=10000.0,
    )


PRESETS = {"deepseek-v3-tiny": deepseek_v3_tiny}
