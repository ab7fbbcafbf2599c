"""GLM-5.3-Flash's config.json in and out, and its presets (torch-free: the planner reads this).

HF ``glm5_next`` (the multimodal checkpoint; its ``text_config`` is the language model) and
``glm5_next_text``. ``from_hf`` reads the text part; ``to_hf`` writes the multimodal ``glm5_next`` config
with a tiny ``vision_config``: transformers has no text-only causal LM for ``glm5_next`` (the text model
has no ``lm_head``), so an export that ``from_pretrained`` can give logits from is the multimodal class
(see ``state_dict_adapter``).

Presets:
- ``glm5-flash``        the full GLM-5.3-Flash text model (45 layers, hidden 4096), for planning.
- ``glm5-flash-1gpu``   the largest-context workhorse for one H200 host: the same layer pattern at
                        hidden 2048, 8 layers (6 KDA + 2 DSA), 32 experts top-8, full vocabulary, 4 streams.
- ``glm5-flash-slice``  the full model's real layer shapes with 4 layers (3 KDA + 1 DSA), so per-layer
                        throughput can be set beside the full model's.
- ``glm5-flash-tiny``   a CPU-sized model of the same layer pattern (the embedded default, DNA vocab).
"""

from __future__ import annotations

from typing import Any

from megaseq.models.hf_fields import FULL_ATTENTION, HFFields, check_hf_fields
from megaseq.models.registry import Family
from megaseq.models.spec import DNA_VOCAB_SIZE, ModelSpec

FAMILY = Family(name="glm5_next", hf_model_types=("glm5_next", "glm5_next_text"), layer_kinds=("kda", "dsa"),
                segmentable=True, tiles_whole_layer=True, fp32_params=("router", "kda", "hc"), balance="bias")

# Hugging Face spellings of the layer types, across transformers versions.
_HF_LAYER_TYPES = {
    "linear_attention": "kda",
    "indexed_attention": "dsa",  # transformers 5.24
    "deepseek_sparse_attention": "dsa",  # transformers 5.17
    "full_attention": "dsa",  # glm5_next maps full_attention to indexed_attention
}


# the text fields from_hf reads into the spec (and to_hf writes back)
_TEXT_READ = frozenset({
    "num_hidden_layers", "layer_types", "mlp_layer_types", "indexer_types", "index_topk_pattern", "index_topk_freq",
    "index_skip_topk_offset", "linear_attn_config", "linear_lower_bound", "vocab_size", "hidden_size",
    "rms_norm_eps", "tie_word_embeddings", "pad_token_id", "intermediate_size", "swiglu_limit", "n_routed_experts",
    "num_local_experts", "num_experts_per_tok", "moe_intermediate_size", "n_shared_experts", "n_group",
    "topk_group", "norm_topk_prob", "routed_scaling_factor", "num_attention_heads", "num_key_value_heads",
    "attention_bias", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
    "index_topk", "index_n_heads", "index_head_dim", "index_kpool", "index_kpool_always_select_tail",
    "linear_num_heads", "linear_head_dim", "linear_conv_kernel_dim", "hc_mult", "hc_sinkhorn_iters", "hc_eps",
})
# text fields that do not change a training step (carried to the export unchanged)
# (num_nextn_predict_layers: the multi-token-prediction layer, which megaseq neither runs nor trains; its
# tensors are skipped on load and carried to the export from the source)
_TEXT_CARRIED = frozenset({"max_position_embeddings", "router_aux_loss_coef", "head_dim", "qk_head_dim",
                           "num_nextn_predict_layers"})
# text fields megaseq implements only at one value: (allowed values, what is supported)
_TEXT_REQUIRED: dict[str, tuple[tuple[Any, ...], str]] = {
    "hidden_act": (("silu",), "the MLPs are SwiGLU, which needs 'silu'"),
    "attention_dropout": ((0, 0.0), "no attention dropout (set it to 0)"),
    "qk_rope_head_dim": ((0,), "GLM-5's MLA layers are NoPE (qk_rope_head_dim 0)"),
    "rope_scaling": ((None, {}), "GLM-5's MLA layers are NoPE: no RoPE, so no RoPE scaling"),
    "rope_parameters": ((None, {}), "GLM-5's MLA layers are NoPE: no RoPE parameters"),
    "output_router_logits": ((False, None), "megaseq's --moe.balance chooses how the routers are balanced "
                                            "(GLM-5's: the score-correction bias); set it to false, and use "
                                            "--moe.balance aux_loss for the auxiliary load-balancing loss"),
}
# the text section's declaration (the multimodal top level is checked against _TOP_CARRIED)
HF_FIELDS = HFFields(_TEXT_READ, _TEXT_CARRIED, {
    **_TEXT_REQUIRED, **FULL_ATTENTION, "quantization_config": ((None,), "quantized weights are not supported")})
_LINEAR_ATTN_FIELDS = frozenset({"head_dim", "num_heads", "short_conv_kernel_size", "gate_lower_bound", "safe_gate"})
# top-level glm5_next fields besides text_config: the vision tower's config and its token ids (carried)
_TOP_CARRIED = frozenset({"vision_config", "image_token_id", "video_token_id", "image_start_token_id",
                          "image_end_token_id", "video_start_token_id", "video_end_token_id", "tie_word_embeddings",
                          "text_config"})


def from_hf(c: dict[str, Any]) -> ModelSpec:
    """A ``glm5_next`` (its ``text_config``) or ``glm5_next_text`` config.json as a spec. Every field is either
    read, carried unchanged to the export (``hf_extra``: ``text_config`` and ``glm5_next`` for the top level),
    or refused when megaseq does not implement it (``_TEXT_REQUIRED``, unknown fields)."""
    top: dict[str, Any] = {}
    if c.get("model_type") == "glm5_next" and isinstance(c.get("text_config"), dict):
        check_hf_fields(c, "glm5_next", "", _TOP_CARRIED, {"quantization_config": ((None,), "quantized weights "
                                                                                   "are not supported")})
        top = {k: v for k, v in c.items() if k not in ("text_config", "model_type", "dtype", "torch_dtype",
                                                       "architectures")}
        c = {**c["text_config"], "tie_word_embeddings": c.get("tie_word_embeddings", False)}
    _check_text(c, "text_config." if top else "")
    extra = {k: v for k, v in c.items() if k not in _WRITTEN}
    return _from_text_config(c).replace(hf_extra={"text_config": extra, **({"glm5_next": top} if top else {})})


def _check_text(c: dict[str, Any], where: str) -> None:
    HF_FIELDS.check(c, "glm5_next", where)
    for name, allowed in (("mlp_layer_types", ("dense", "sparse")), ("indexer_types", ("full", "shared"))):
        bad = sorted({v for v in c.get(name) or [] if v not in allowed})
        if bad:
            raise ValueError(f"config.json {where}{name} holds {bad}; megaseq's glm5_next supports "
                             f"{' and '.join(allowed)}")
    lin = c.get("linear_attn_config") or {}
    unknown = sorted(set(lin) - _LINEAR_ATTN_FIELDS)
    if unknown:
        raise ValueError(f"config.json {where}linear_attn_config.{unknown[0]} is not supported by megaseq's "
                         f"glm5_next (it reads {', '.join(sorted(_LINEAR_ATTN_FIELDS))})")
    if "q_lora_rank" in c and not c["q_lora_rank"]:
        raise ValueError(f"config.json {where}q_lora_rank = {c['q_lora_rank']!r}: megaseq's glm5_next MLA needs a "
                         "low-rank query (q_lora_rank > 0), as transformers' does")
    heads, kv = c.get("num_attention_heads", 64), c.get("num_key_value_heads")
    if kv is not None and kv != heads:
        raise ValueError(f"config.json {where}num_key_value_heads = {kv} differs from num_attention_heads = {heads}; "
                         "GLM-5's MLA needs them equal")


def _from_text_config(c: dict[str, Any]) -> ModelSpec:
    n = c.get("num_hidden_layers", 45)
    layer_types = c.get("layer_types") or [
        "linear_attention" if i % 4 != 3 else "indexed_attention" for i in range(n)
    ]
    try:
        kinds = [_HF_LAYER_TYPES[t] for t in layer_types]
    except KeyError as e:
        raise ValueError(
            f"unknown glm5_next layer type {e.args[0]!r}; known: {', '.join(_HF_LAYER_TYPES)}"
        ) from None
    mlp = c.get("mlp_layer_types") or ["dense"] * min(3, n) + ["sparse"] * (n - 3)
    indexer = c.get("indexer_types")
    if indexer is None:
        pattern = c.get("index_topk_pattern")
        if pattern is not None:
            indexer = [{"F": "full", "S": "shared"}[ch] for ch in pattern] if isinstance(pattern, str) else pattern
        else:
            freq = max(c.get("index_topk_freq", 1), 1)
            offset = c.get("index_skip_topk_offset", 2)
            indexer = ["full" if (max(i - offset + 1, 0) % freq) == 0 else "shared" for i in range(n)]
    lin = c.get("linear_attn_config") or {}
    lower = lin.get("gate_lower_bound", c.get("linear_lower_bound", -5.0))
    return ModelSpec(
        family="glm5_next",
        vocab_size=c.get("vocab_size", 154880),
        hidden_size=c.get("hidden_size", 4096),
        num_layers=n,
        layer_types=tuple(kinds),
        mlp_types=tuple("moe" if m == "sparse" else "dense" for m in mlp),
        rms_norm_eps=c.get("rms_norm_eps", 1e-5),
        tie_word_embeddings=c.get("tie_word_embeddings", False),
        pad_token_id=c.get("pad_token_id", 154820),
        intermediate_size=c.get("intermediate_size", 12288),
        swiglu_limit=c.get("swiglu_limit", 10.0),
        num_experts=c.get("n_routed_experts", c.get("num_local_experts", 288)),
        num_experts_per_tok=c.get("num_experts_per_tok", 8),
        moe_intermediate_size=c.get("moe_intermediate_size", 2048),
        num_shared_experts=c.get("n_shared_experts", 1),
        router="sigmoid_bias",
        n_group=c.get("n_group", 1),
        topk_group=c.get("topk_group", 1),
        norm_topk_prob=c.get("norm_topk_prob", True),
        routed_scaling_factor=c.get("routed_scaling_factor", 2.5),
        num_attention_heads=c.get("num_attention_heads", 64),
        num_key_value_heads=c.get("num_key_value_heads", c.get("num_attention_heads", 64)),
        attention_bias=c.get("attention_bias", False),
        q_lora_rank=c.get("q_lora_rank", 1536),
        kv_lora_rank=c.get("kv_lora_rank", 512),
        qk_nope_head_dim=c.get("qk_nope_head_dim", 256),
        qk_rope_head_dim=c.get("qk_rope_head_dim", 0),
        v_head_dim=c.get("v_head_dim", 256),
        index_topk=c.get("index_topk", 2048),
        index_n_heads=c.get("index_n_heads", 32),
        index_head_dim=c.get("index_head_dim", 128),
        index_kpool=c.get("index_kpool", 16),
        index_kpool_always_select_tail=c.get("index_kpool_always_select_tail", True),
        indexer_types=tuple(indexer),
        linear_num_heads=lin.get("num_heads", c.get("linear_num_heads", 64)),
        linear_head_dim=lin.get("head_dim", c.get("linear_head_dim", 128)),
        linear_conv_kernel=lin.get("short_conv_kernel_size", c.get("linear_conv_kernel_dim", 4)),
        linear_lower_bound=lower,
        hc_mult=c.get("hc_mult", 4),
        hc_sinkhorn_iters=c.get("hc_sinkhorn_iters", 20),
        hc_eps=c.get("hc_eps", 1e-6),
    )


# ---- config.json out ------------------------------------------------------------------------
# a vision tower small enough to cost nothing; it never runs on text input
_TINY_VISION = {"model_type": "glm5_next_vision", "depth": 1, "hidden_size": 16, "num_heads": 2,
                "intermediate_size": 16, "projection_intermediate_size": 16, "patch_size": 14,
                "image_size": 28}


def to_hf(s: ModelSpec) -> dict[str, Any]:
    """The multimodal ``glm5_next`` config.json (architectures ``Glm5NextForConditionalGeneration``)."""
    kinds = {"kda": "linear_attention", "dsa": "indexed_attention"}  # transformers >= 5.24 spelling
    if any(k not in kinds for k in s.layer_types):
        raise ValueError(f"glm5_next layers must be 'kda' or 'dsa', got {sorted(set(s.layer_types))}")
    extra = dict(s.hf_extra.get("text_config") or {})
    text = {
        "model_type": "glm5_next_text", "vocab_size": s.vocab_size, "hidden_size": s.hidden_size,
        "num_hidden_layers": s.num_layers, "layer_types": [kinds[k] for k in s.layer_types],
        "mlp_layer_types": ["sparse" if m == "moe" else "dense" for m in s.mlp_types],
        "rms_norm_eps": s.rms_norm_eps, "pad_token_id": s.pad_token_id, "hidden_act": "silu",
        "tie_word_embeddings": s.tie_word_embeddings, "intermediate_size": s.intermediate_size,
        "swiglu_limit": s.swiglu_limit, "n_routed_experts": s.num_experts,
        "num_experts_per_tok": s.num_experts_per_tok, "moe_intermediate_size": s.moe_intermediate_size,
        "n_shared_experts": s.num_shared_experts, "n_group": s.n_group, "topk_group": s.topk_group,
        "norm_topk_prob": s.norm_topk_prob, "routed_scaling_factor": s.routed_scaling_factor,
        "num_attention_heads": s.num_attention_heads, "num_key_value_heads": s.num_key_value_heads,
        "attention_bias": s.attention_bias, "q_lora_rank": s.q_lora_rank, "kv_lora_rank": s.kv_lora_rank,
        "qk_nope_head_dim": s.qk_nope_head_dim, "qk_rope_head_dim": s.qk_rope_head_dim,
        "v_head_dim": s.v_head_dim, "index_topk": s.index_topk, "index_n_heads": s.index_n_heads,
        "index_head_dim": s.index_head_dim, "index_kpool": s.index_kpool,
        "index_kpool_always_select_tail": s.index_kpool_always_select_tail,
        "indexer_types": list(s.indexer_types), "linear_num_heads": s.linear_num_heads,
        "linear_head_dim": s.linear_head_dim, "linear_conv_kernel_dim": s.linear_conv_kernel,
        "linear_lower_bound": s.linear_lower_bound, "hc_mult": s.hc_mult,
        "hc_sinkhorn_iters": s.hc_sinkhorn_iters, "hc_eps": s.hc_eps,
    }
    text = {**extra, **text}  # every source field the spec does not model, unchanged
    top = dict(s.hf_extra.get("glm5_next") or {})
    vision = dict(top.pop("vision_config", None) or {**_TINY_VISION, "out_hidden_size": s.hidden_size})
    return {**top, "architectures": ["Glm5NextForConditionalGeneration"], "model_type": "glm5_next",
            "text_config": text, "vision_config": vision, "tie_word_embeddings": s.tie_word_embeddings}


# what to_hf writes in text_config from the spec (a source's value of these is not carried, it is rewritten)
_WRITTEN = frozenset({
    "model_type", "vocab_size", "hidden_size", "num_hidden_layers", "layer_types", "mlp_layer_types",
    "rms_norm_eps", "pad_token_id", "hidden_act", "tie_word_embeddings", "intermediate_size", "swiglu_limit",
    "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size", "n_shared_experts", "n_group",
    "topk_group", "norm_topk_prob", "routed_scaling_factor", "num_attention_heads", "num_key_value_heads",
    "attention_bias", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
    "index_topk", "index_n_heads", "index_head_dim", "index_kpool", "index_kpool_always_select_tail",
    "indexer_types", "linear_num_heads", "linear_head_dim", "linear_conv_kernel_dim", "linear_lower_bound",
    "hc_mult", "hc_sinkhorn_iters", "hc_eps", "dtype", "torch_dtype",
})


# ---- presets ---------------------------------------------------------------------------------
def _glm5_pattern(n: int) -> tuple[str, ...]:
    return tuple("dsa" if i % 4 == 3 else "kda" for i in range(n))


def _glm5_indexer(layer_types: tuple[str, ...]) -> tuple[str, ...]:
    """Every DSA layer runs its own indexer. (A 'shared' layer must directly follow a 'full' DSA layer,
    as in transformers; with DSA every 4th layer no layer can share.)"""
    return ("full",) * len(layer_types)


def glm5_flash() -> ModelSpec:
    n = 45
    lt = _glm5_pattern(n)
    return ModelSpec(
        family="glm5_next", vocab_size=154880, hidden_size=4096, num_layers=n, layer_types=lt,
        mlp_types=("dense",) * 3 + ("moe",) * (n - 3), rms_norm_eps=1e-5, pad_token_id=154820,
        intermediate_size=12288, swiglu_limit=10.0, num_experts=288, num_experts_per_tok=8,
        moe_intermediate_size=2048, num_shared_experts=1, router="sigmoid_bias", routed_scaling_factor=2.5,
        num_attention_heads=64, num_key_value_heads=64, q_lora_rank=1536, kv_lora_rank=512,
        qk_nope_head_dim=256, qk_rope_head_dim=0, v_head_dim=256, index_topk=2048, index_n_heads=32,
        index_head_dim=128, index_kpool=16, indexer_types=_glm5_indexer(lt),
        linear_num_heads=64, linear_head_dim=128, linear_conv_kernel=4, linear_lower_bound=-5.0,
        hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6,
    )


def glm5_flash_1gpu() -> ModelSpec:
    n = 8
    lt = _glm5_pattern(n)
    return glm5_flash().replace(
        hidden_size=2048, num_layers=n, layer_types=lt, mlp_types=("dense",) + ("moe",) * (n - 1),
        intermediate_size=6144, num_experts=32, moe_intermediate_size=1024,
        num_attention_heads=16, num_key_value_heads=16, linear_num_heads=16,
        indexer_types=_glm5_indexer(lt),
    )


def glm5_flash_slice() -> ModelSpec:
    n = 4
    lt = _glm5_pattern(n)
    return glm5_flash().replace(
        num_layers=n, layer_types=lt, mlp_types=("moe",) * n, num_experts=32,
        indexer_types=_glm5_indexer(lt),
    )


def glm5_flash_tiny() -> ModelSpec:
    n = 8
    lt = _glm5_pattern(n)
    return ModelSpec(
        family="glm5_next", vocab_size=DNA_VOCAB_SIZE, hidden_size=64, num_layers=n, layer_types=lt,
        mlp_types=("dense",) + ("moe",) * (n - 1), rms_norm_eps=1e-5, pad_token_id=0,
        intermediate_size=128, swiglu_limit=10.0, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=32, num_shared_experts=1, router="sigmoid_bias", routed_scaling_factor=2.5,
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=32,
        qk_nope_head_dim=16, qk_rope_head_dim=0, v_head_dim=16, index_topk=256, index_n_heads=16,
        index_head_dim=16, index_kpool=16, indexer_types=_glm5_indexer(lt),
        linear_num_heads=4, linear_head_dim=16, linear_conv_kernel=4, linear_lower_bound=-5.0,
        hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6,
    )


PRESETS = {
    "glm5-flash": glm5_flash,
    "glm5-flash-1gpu": glm5_flash_1gpu,
    "glm5-flash-slice": glm5_flash_slice,
    "glm5-flash-tiny": glm5_flash_tiny,
}
