"""gpt-oss's config.json in and out, and its preset (torch-free: the planner reads this).

gpt-oss (``openai/gpt-oss-20b``, ``openai/gpt-oss-120b``, HF ``gpt_oss``): GQA attention with q/k/v/o biases
and a learned sink logit per query head, sliding-window (``sliding_window`` keys, itself included) and full
layers alternating as ``layer_types`` says, YaRN RoPE; every layer a MoE whose router (with a bias) takes
the top-k logits and softmaxes over those K, and whose experts (with biases) run the clamped SwiGLU
``(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)``, ``g = clamp(gate, max=limit)``; RMSNorm and
an untied head. Trained with the auxiliary load-balancing loss (``router_aux_loss_coef``).

``from_hf`` refuses every field it does not implement (``HF_FIELDS``, ``models/hf_fields.py``): layer types other
than sliding / full attention, attention dropout, an activation other than SiLU (the experts' activation is
fixed by ``swiglu_alpha`` / ``swiglu_limit``), RoPE types other than default / linear / YaRN, a quantization
method other than MXFP4 (whose expert blocks the checkpoint loader dequantizes to the model's dtype:
``state_dict_adapter``). ``experts_per_token`` and ``initial_context_length`` (fields OpenAI's config
carries beside HF's) are refused when they disagree with ``num_experts_per_tok`` and YaRN's original length.
Fields that never change a step are kept in ``hf_extra`` and written back; ``quantization_config`` is not:
an export holds bf16 (or the run's dtype) weights.

Presets: ``gpt-oss-tiny``, a CPU-sized gpt-oss on the DNA vocabulary.
"""

from __future__ import annotations

from typing import Any

from megaseq.models.hf_fields import HFFields
from megaseq.models.registry import Family
from megaseq.models.spec import DNA_VOCAB_SIZE, ModelSpec, rope_from_hf, rope_to_hf

FAMILY = Family(name="gpt_oss", hf_model_types=("gpt_oss",), layer_kinds=("attention",), segmentable=False,
                tiles_whole_layer=False, balance="aux_loss")
AUX_LOSS_COEF = 0.001  # GptOssConfig's router_aux_loss_coef default (the published configs say 0.9)
LAYER_TYPES = ("sliding_attention", "full_attention")
_YARN = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
         "original_max_position_embeddings": 4096}  # GptOssConfig's default rope_parameters


def _layer_types(c: dict[str, Any], n: int) -> list[str]:
    types = c.get("layer_types") or ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n)]
    bad = sorted({t for t in types if t not in LAYER_TYPES})
    if bad or len(types) != n:
        raise ValueError(f"config.json layer_types must hold num_hidden_layers ({n}) entries of "
                         f"{' / '.join(LAYER_TYPES)}; got {len(types)} entries{f', with {bad}' if bad else ''}")
    return list(types)


def _rope(c: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    if not c.get("rope_parameters") and not c.get("rope_scaling"):
        c = {**c, "rope_parameters": {**_YARN, "rope_theta": c.get("rope_theta", 150000.0)}}
    theta, scaling, partial = rope_from_hf(c, "gpt_oss", default_theta=150000.0)
    if partial != 1.0:
        raise ValueError(f"gpt_oss partial_rotary_factor {partial} is not supported (gpt-oss rotates whole heads)")
    return theta, scaling


def from_hf(c: dict[str, Any]) -> ModelSpec:
    """A ``gpt_oss`` config.json as a spec."""
    _check_gpt_oss_supported(c)
    n, H = c.get("num_hidden_layers", 36), c.get("hidden_size", 2880)
    types = _layer_types(c, n)
    theta, scaling = _rope(c)
    heads = c.get("num_attention_heads", 64)
    window = c.get("sliding_window") or 0
    sliding = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    if sliding and window < 1:
        raise ValueError("config.json sliding_window must be a positive number of keys when layer_types has "
                         "'sliding_attention' layers")
    _check_aliases(c, scaling)
    return ModelSpec(
        family="gpt_oss", vocab_size=c.get("vocab_size", 201088), hidden_size=H, num_layers=n,
        layer_types=("attention",) * n, mlp_types=("moe",) * n, rms_norm_eps=c.get("rms_norm_eps", 1e-5),
        tie_word_embeddings=c.get("tie_word_embeddings", False), pad_token_id=c.get("pad_token_id"),
        num_experts=c.get("num_local_experts", c.get("num_experts", 128)),
        num_experts_per_tok=c.get("num_experts_per_tok", 4), moe_intermediate_size=c.get("intermediate_size", 2880),
        router="topk_softmax", router_bias=True, expert_bias=True,
        swiglu_alpha=float(c.get("swiglu_alpha", 1.702)), swiglu_limit=float(c.get("swiglu_limit", 7.0)),
        router_aux_loss_coef=c.get("router_aux_loss_coef", AUX_LOSS_COEF),
        num_attention_heads=heads, num_key_value_heads=c.get("num_key_value_heads", 8),
        head_dim=c.get("head_dim") or H // heads, rope_theta=theta, rope_scaling=scaling,
        max_position_embeddings=c.get("max_position_embeddings", 131072),
        attention_bias=c.get("attention_bias", True), o_proj_bias=c.get("attention_bias", True),
        attention_sinks=True, sliding_window=window if sliding else 0, sliding_layers=sliding,
        hf_extra={k: v for k, v in c.items() if k not in _WRITTEN and k != "quantization_config"},
    )


def _check_aliases(c: dict[str, Any], scaling: dict[str, Any]) -> None:
    """OpenAI's own names for two HF fields: carried, but refused when they disagree with HF's."""
    k = c.get("num_experts_per_tok", 4)
    if "experts_per_token" in c and c["experts_per_token"] != k:
        raise ValueError(f"config.json experts_per_token ({c['experts_per_token']}) disagrees with "
                         f"num_experts_per_tok ({k}), which transformers reads: make them equal")
    original = scaling.get("original_max_position_embeddings")
    if "initial_context_length" in c and original is not None and c["initial_context_length"] != original:
        raise ValueError(f"config.json initial_context_length ({c['initial_context_length']}) disagrees with "
                         f"rope_parameters.original_max_position_embeddings ({original}), which transformers reads")


def _mxfp4_only(q: Any) -> bool:
    return q is None or (isinstance(q, dict) and q.get("quant_method") == "mxfp4")


_READ = frozenset({
    "num_hidden_layers", "hidden_size", "layer_types", "rope_parameters", "rope_scaling", "rope_theta",
    "partial_rotary_factor", "num_attention_heads", "sliding_window", "vocab_size", "rms_norm_eps",
    "tie_word_embeddings", "pad_token_id", "num_local_experts", "num_experts", "num_experts_per_tok",
    "intermediate_size", "swiglu_alpha", "swiglu_limit", "router_aux_loss_coef", "num_key_value_heads", "head_dim",
    "max_position_embeddings", "attention_bias", "experts_per_token", "initial_context_length",
    "quantization_config",
})
# output_router_logits: transformers' switch for adding the auxiliary loss; megaseq's moe.balance decides
_CARRIED = frozenset({"output_router_logits"})
_REQUIRED: dict[str, tuple[tuple[Any, ...], str]] = {
    "hidden_act": (("silu",), "the experts run gpt-oss's clamped SwiGLU, whose config says 'silu'"),
    "attention_dropout": ((0, 0.0), "no attention dropout (set it to 0)"),
}
HF_FIELDS = HFFields(read=_READ, carried=_CARRIED, required=_REQUIRED)


def _check_gpt_oss_supported(c: dict[str, Any]) -> None:
    """Options megaseq's gpt_oss does not implement: refuse them rather than run a different model."""
    HF_FIELDS.check(c, "gpt_oss")
    if not _mxfp4_only(c.get("quantization_config")):
        raise ValueError(f"config.json quantization_config {c['quantization_config']!r} is not supported by "
                         "megaseq's gpt_oss: it reads bf16 / fp32 checkpoints and MXFP4 ones (quant_method "
                         "'mxfp4', dequantized at load); dequantize other formats to bf16 first")
    if c.get("attention_bias") is False:
        raise ValueError("config.json attention_bias false is not supported by megaseq's gpt_oss (gpt-oss has "
                         "q/k/v/o biases): remove the field")


# ---- config.json out ------------------------------------------------------------------------
def to_hf(s: ModelSpec) -> dict[str, Any]:
    """The ``gpt_oss`` config.json (architectures ``GptOssForCausalLM``)."""
    if (s.router != "topk_softmax" or not (s.router_bias and s.expert_bias and s.attention_sinks)
            or s.swiglu_alpha is None or "dense" in s.mlp_types or s.qk_norm or not s.attention_bias):
        raise ValueError("this spec cannot be written as a GptOssConfig: it needs every layer MoE with the "
                         "top-k-softmax router, biases, sinks and the clamped SwiGLU, and no q/k norms")
    types = ["sliding_attention" if i in s.sliding_layers else "full_attention" for i in range(s.num_layers)]
    return {
        "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "vocab_size": s.vocab_size,
        "hidden_size": s.hidden_size, "intermediate_size": s.moe_intermediate_size,
        "num_hidden_layers": s.num_layers, "num_attention_heads": s.num_attention_heads,
        "num_key_value_heads": s.num_key_value_heads, "head_dim": s.head_dim, "hidden_act": "silu",
        "max_position_embeddings": s.max_position_embeddings, "rms_norm_eps": s.rms_norm_eps,
        "pad_token_id": s.pad_token_id, "tie_word_embeddings": s.tie_word_embeddings,
        "rope_parameters": rope_to_hf(s), "sliding_window": s.sliding_window or None, "layer_types": types,
        "attention_dropout": 0.0, "attention_bias": True, "num_local_experts": s.num_experts,
        "num_experts_per_tok": s.num_experts_per_tok, "swiglu_alpha": s.swiglu_alpha,
        "swiglu_limit": s.swiglu_limit, "router_aux_loss_coef": s.router_aux_loss_coef,
        **s.hf_extra,  # every source field the spec does not write itself, unchanged
    }


# what to_hf writes from the spec (a source's value of these is not carried, it is rewritten)
_WRITTEN = frozenset({
    "architectures", "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act", "max_position_embeddings",
    "rms_norm_eps", "pad_token_id", "tie_word_embeddings", "rope_parameters", "rope_scaling", "rope_theta",
    "partial_rotary_factor", "sliding_window", "layer_types", "attention_dropout", "attention_bias",
    "num_local_experts", "num_experts", "num_experts_per_tok", "swiglu_alpha", "swiglu_limit",
    "router_aux_loss_coef", "dtype", "torch_dtype",
})


# ---- presets ---------------------------------------------------------------------------------
def gpt_oss_tiny() -> ModelSpec:
    """4 layers (sliding, full, sliding, full), window 64, 8 experts top-2, YaRN as the published models."""
    n = 4
    return ModelSpec(
        family="gpt_oss", vocab_size=DNA_VOCAB_SIZE, hidden_size=64, num_layers=n, layer_types=("attention",) * n,
        mlp_types=("moe",) * n, rms_norm_eps=1e-5, pad_token_id=0, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=48, router="topk_softmax", router_bias=True, expert_bias=True, swiglu_alpha=1.702,
        swiglu_limit=7.0, router_aux_loss_coef=AUX_LOSS_COEF, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, rope_theta=150000.0, rope_scaling=dict(_YARN), max_position_embeddings=131072,
        attention_bias=True, o_proj_bias=True, attention_sinks=True, sliding_window=64, sliding_layers=(0, 2),
    )


PRESETS = {"gpt-oss-tiny": gpt_oss_tiny}
