"""Kimi-Linear's config.json in and out, and its preset (torch-free: the planner reads this).

Kimi-Linear (``moonshotai/Kimi-Linear-48B-A3B``, HF ``kimi_linear``): Kimi Delta Attention layers (KDA,
``models.common.kda``, no gate lower bound) with a dense MLA every few layers (``models.common.mla``, NoPE:
its rope dims are kept but never rotated), pre-norm, the first ``first_k_dense_replace`` layers a dense
SwiGLU and the rest a sigmoid-routed MoE with a score-correction bias and shared experts, trained
auxiliary-loss-free (``moe.balance bias``). The checkpoint's ``linear_attn_config`` (1-indexed
``full_attn_layers`` / ``kda_layers``, head dims, conv kernel) and its attribute spellings
(``num_expert_group``, ``num_experts_per_token``, ``moe_renormalize``, ``model_max_length``) are read as HF
reads them.

Refused: an MLA that rotates (``mla_use_nope`` false: HF's Kimi-Linear is NoPE only), a router other than
sigmoid (``moe_router_activation_func``), another activation, attention dropout, fewer key/value heads than
heads, RoPE parameters (the MLA is NoPE), a sliding window.

``tie_word_embeddings``: transformers never ties this class (its ``_tied_weights_keys`` is empty), so neither
does megaseq: a config saying true loads and trains ``embed_tokens`` and ``lm_head`` apart, as transformers
does, and the flag is carried to the export unchanged.

Presets: ``kimi-linear-tiny``.
"""

from __future__ import annotations

from typing import Any

from megaseq.models.hf_fields import FULL_ATTENTION, HFFields
from megaseq.models.registry import Family
from megaseq.models.spec import DNA_VOCAB_SIZE, ModelSpec

FAMILY = Family(name="kimi_linear", hf_model_types=("kimi_linear",), layer_kinds=("kda", "mla"),
                segmentable=True, tiles_whole_layer=False, balance="bias",
                fp32_params=("router",))
# carried to the export (tie_word_embeddings: what the source says; transformers never ties this class)
_EXTRA = ("bos_token_id", "eos_token_id", "initializer_range", "tie_word_embeddings")


def _heads_match(value: Any, c: dict[str, Any]) -> str | None:
    return None if value in (None, c.get("num_attention_heads", 32)) else "num_attention_heads (MLA)"


_NOPE = "Kimi-Linear's MLA is NoPE (mla_use_nope): no RoPE parameters"
# use_grouped_topk, moe_layer_freq, num_nextn_predict_layers: the original code's, which transformers does not
# read (its routing follows num_expert_group / topk_group, every layer after the dense ones is MoE, no MTP);
# rope_theta: unused by a NoPE MLA; head_dim / qk_head_dim: transformers derives them from the MLA's dims
HF_FIELDS = HFFields(
    read=frozenset({
        "num_attention_heads", "num_hidden_layers", "linear_attn_config", "layer_types", "mlp_layer_types",
        "first_k_dense_replace", "vocab_size", "hidden_size", "rms_norm_eps", "tie_word_embeddings", "pad_token_id",
        "intermediate_size", "num_experts", "num_local_experts", "num_experts_per_token", "num_experts_per_tok",
        "moe_intermediate_size", "num_shared_experts", "n_shared_experts", "num_expert_group", "n_group",
        "topk_group", "moe_renormalize", "norm_topk_prob", "routed_scaling_factor", "attention_bias",
        "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "model_max_length",
        "max_position_embeddings", "linear_num_heads", "linear_head_dim", "linear_conv_kernel_dim"}),
    carried=frozenset({"use_grouped_topk", "moe_layer_freq", "num_nextn_predict_layers", "rope_theta", "head_dim",
                       "qk_head_dim", "output_router_logits"}),
    required={
        "hidden_act": (("silu",), "the MLPs are SwiGLU, which needs 'silu'"),
        "attention_dropout": ((0, 0.0, None), "no attention dropout (set it to 0)"),
        "mla_use_nope": ((True,), "HF's Kimi-Linear MLA is NoPE only (mla_use_nope true)"),
        "moe_router_activation_func": (("sigmoid",), "the 'sigmoid' router"),
        "num_key_value_heads": _heads_match,
        "rope_scaling": ((None, {}), _NOPE), "rope_parameters": ((None, {}), _NOPE),
        "pretraining_tp": ((1, None), "pretraining_tp 1"),
        **FULL_ATTENTION,
    })


def _pick(c: dict[str, Any], *names: str, default: Any = None) -> Any:
    for n in names:
        if c.get(n) is not None:
            return c[n]
    return default


def _layer_types(c: dict[str, Any], n: int) -> list[str]:
    if c.get("layer_types"):
        types = c["layer_types"]
    else:
        lin = c.get("linear_attn_config") or {}
        if "full_attn_layers" in lin and "kda_layers" in lin:
            types = [None] * n
            for key, kind in (("full_attn_layers", "full_attention"), ("kda_layers", "linear_attention")):
                for i in lin[key]:
                    if not 1 <= i <= n:
                        raise ValueError(f"kimi_linear linear_attn_config.{key} names layer {i} (numbered from 1) "
                                         f"but num_hidden_layers is {n}: list layers 1 to {n} only")
                    types[i - 1] = kind
        else:
            types = ["full_attention" if i and i % 4 == 0 else "linear_attention" for i in range(n)]
    kinds = {"full_attention": "mla", "linear_attention": "kda"}
    bad = sorted({str(t) for t in types if t not in kinds})
    if bad or len(types) != n:
        raise ValueError(f"kimi_linear layer types {bad or types}: expected {n} of full_attention / linear_attention")
    return [kinds[t] for t in types]


def from_hf(c: dict[str, Any]) -> ModelSpec:
    """A ``kimi_linear`` config.json as a spec."""
    heads = c.get("num_attention_heads", 32)
    HF_FIELDS.check(c, "kimi_linear")
    n = c.get("num_hidden_layers", 27)
    lin = c.get("linear_attn_config") or {}
    mlp = c.get("mlp_layer_types") or ["dense" if i < c.get("first_k_dense_replace", 1) else "sparse"
                                       for i in range(n)]
    return ModelSpec(
        family="kimi_linear", vocab_size=c.get("vocab_size", 163840), hidden_size=c.get("hidden_size", 2304),
        num_layers=n, layer_types=tuple(_layer_types(c, n)),
        mlp_types=tuple("moe" if m == "sparse" else "dense" for m in mlp), rms_norm_eps=c.get("rms_norm_eps", 1e-5),
        tie_word_embeddings=False, pad_token_id=c.get("pad_token_id", 163839),
        intermediate_size=c.get("intermediate_size", 9216),
        num_experts=_pick(c, "num_experts", "num_local_experts", default=256),
        num_experts_per_tok=_pick(c, "num_experts_per_token", "num_experts_per_tok", default=8),
        moe_intermediate_size=c.get("moe_intermediate_size", 1024),
        num_shared_experts=_pick(c, "num_shared_experts", "n_shared_experts", default=1), router="sigmoid_bias",
        n_group=_pick(c, "num_expert_group", "n_group", default=1), topk_group=c.get("topk_group") or 1,
        norm_topk_prob=_pick(c, "moe_renormalize", "norm_topk_prob", default=True),
        routed_scaling_factor=c.get("routed_scaling_factor", 2.446),
        num_attention_heads=heads, num_key_value_heads=heads, attention_bias=c.get("attention_bias", False),
        q_lora_rank=c.get("q_lora_rank") or 0, kv_lora_rank=c.get("kv_lora_rank", 512),
        qk_nope_head_dim=c.get("qk_nope_head_dim", 128), qk_rope_head_dim=c.get("qk_rope_head_dim", 64),
        v_head_dim=c.get("v_head_dim", 128), mla_rotate=False,
        max_position_embeddings=_pick(c, "model_max_length", "max_position_embeddings", default=1048576),
        linear_num_heads=lin.get("num_heads", c.get("linear_num_heads", 32)),
        linear_head_dim=lin.get("head_dim", c.get("linear_head_dim", 128)),
        linear_conv_kernel=lin.get("short_conv_kernel_size", c.get("linear_conv_kernel_dim", 4)),
        linear_lower_bound=None, hf_extra={k: c[k] for k in _EXTRA if k in c},
    )


def to_hf(s: ModelSpec) -> dict[str, Any]:
    """The ``kimi_linear`` config.json (architectures ``KimiLinearForCausalLM``)."""
    if s.router != "sigmoid_bias" or s.mla_rotate or s.linear_lower_bound is not None:
        raise ValueError("this spec cannot be written as a KimiLinearConfig: it needs a sigmoid router, a NoPE MLA "
                         "and KDA without a gate lower bound")
    kinds = {"mla": "full_attention", "kda": "linear_attention"}
    return {
        "architectures": ["KimiLinearForCausalLM"], "model_type": "kimi_linear", "vocab_size": s.vocab_size,
        "hidden_size": s.hidden_size, "intermediate_size": s.intermediate_size,
        "moe_intermediate_size": s.moe_intermediate_size, "num_hidden_layers": s.num_layers,
        "num_attention_heads": s.num_attention_heads, "num_key_value_heads": s.num_attention_heads,
        "num_shared_experts": s.num_shared_experts, "routed_scaling_factor": s.routed_scaling_factor,
        "kv_lora_rank": s.kv_lora_rank, "q_lora_rank": s.q_lora_rank or None, "qk_rope_head_dim": s.qk_rope_head_dim,
        "v_head_dim": s.v_head_dim, "qk_nope_head_dim": s.qk_nope_head_dim, "num_expert_group": s.n_group,
        "topk_group": s.topk_group, "num_experts_per_token": s.num_experts_per_tok,
        "moe_renormalize": s.norm_topk_prob, "hidden_act": "silu", "model_max_length": s.max_position_embeddings,
        "rms_norm_eps": s.rms_norm_eps, "pad_token_id": s.pad_token_id, "tie_word_embeddings": s.tie_word_embeddings,
        "attention_bias": s.attention_bias, "attention_dropout": 0.0, "num_experts": s.num_experts,
        "mlp_layer_types": ["sparse" if m == "moe" else "dense" for m in s.mlp_types],
        "layer_types": [kinds[k] for k in s.layer_types], "linear_head_dim": s.linear_head_dim,
        "linear_num_heads": s.linear_num_heads, "linear_conv_kernel_dim": s.linear_conv_kernel,
        "mla_use_nope": True, "moe_router_activation_func": "sigmoid", **s.hf_extra,
    }


def kimi_linear_tiny() -> ModelSpec:
    n = 8
    return ModelSpec(
        family="kimi_linear", vocab_size=DNA_VOCAB_SIZE, hidden_size=64, num_layers=n,
        layer_types=tuple("mla" if i % 4 == 3 else "kda" for i in range(n)), mlp_types=("dense",) + ("moe",) * (n - 1),
        rms_norm_eps=1e-5, pad_token_id=0, intermediate_size=128, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=32, num_shared_experts=1, router="sigmoid_bias", routed_scaling_factor=2.446,
        num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
        v_head_dim=16, mla_rotate=False, linear_num_heads=4, linear_head_dim=16, linear_conv_kernel=4,
        linear_lower_bound=None,
    )


PRESETS = {"kimi-linear-tiny": kimi_linear_tiny}
