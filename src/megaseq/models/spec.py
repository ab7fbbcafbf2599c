"""ModelSpec: one architecture description for every family megaseq builds.

A spec comes from a preset name (``presets.py``) or from a Hugging Face ``config.json``
(``from_hf_config``). Models, the planner and the checkpoint adapters all read the same
spec, so a shape is written down once. No torch import: the planner uses this module.

Layer kinds (``layer_types``):
  ``kda``        Kimi Delta Attention (linear attention with short conv and delta rule)
  ``dsa``        MLA with the DeepSeek sparse-attention lightning indexer (NoPE in GLM-5.3-Flash)
  ``attention``  full softmax attention with GQA and RoPE (Qwen3-MoE)
MLP kinds (``mlp_types``): ``dense`` (SwiGLU) or ``moe`` (routed experts + optional shared).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

LAYER_KINDS = ("kda", "dsa", "attention")
MLP_KINDS = ("dense", "moe")
FAMILIES = ("glm5_next", "qwen3_moe")

# Hugging Face spellings of the layer types, across transformers versions.
_HF_LAYER_TYPES = {
    "linear_attention": "kda",
    "indexed_attention": "dsa",  # transformers 5.24
    "deepseek_sparse_attention": "dsa",  # transformers 5.17
    "full_attention": "dsa",  # glm5_next maps full_attention to indexed_attention
}
# model_type values accepted per family (the text part of multimodal configs included).
HF_MODEL_TYPES = {
    "glm5_next": "glm5_next",
    "glm5_next_text": "glm5_next",
    "qwen3_moe": "qwen3_moe",
}


@dataclass
class ModelSpec:
    """Architecture of one model; every field is a plain number, string or tuple."""

    family: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    layer_types: tuple[str, ...]
    mlp_types: tuple[str, ...]
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    pad_token_id: int | None = None
    # dense MLP
    intermediate_size: int = 0
    swiglu_limit: float | None = None
    # MoE
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    num_shared_experts: int = 0
    router: str = "sigmoid_bias"  # "sigmoid_bias" (DeepSeek/GLM) or "softmax" (Qwen3/OLMoE/Mixtral)
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    # softmax attention (GQA + RoPE)
    num_attention_heads: int = 0
    num_key_value_heads: int = 0
    head_dim: int = 0
    rope_theta: float = 10000.0
    qk_norm: bool = False
    attention_bias: bool = False
    # MLA (GLM-5.3-Flash DSA layers: NoPE, so qk_rope_head_dim = 0)
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    # DSA lightning indexer
    index_topk: int = 0
    index_n_heads: int = 0
    index_head_dim: int = 0
    index_kpool: int = 1
    index_kpool_always_select_tail: bool = True
    indexer_types: tuple[str, ...] = ()
    # KDA
    linear_num_heads: int = 0
    linear_head_dim: int = 0
    linear_conv_kernel: int = 4
    linear_lower_bound: float | None = -5.0
    # mHC hyper-connections (hc_mult = 1 means a plain residual stream)
    hc_mult: int = 1
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    # anything a family needs to round-trip its HF config exactly
    hf_extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.layer_types = tuple(self.layer_types)
        self.mlp_types = tuple(self.mlp_types)
        self.indexer_types = tuple(self.indexer_types)
        if self.family not in FAMILIES:
            raise ValueError(f"model family {self.family!r} is not supported; supported: {', '.join(FAMILIES)}")
        if len(self.layer_types) != self.num_layers or len(self.mlp_types) != self.num_layers:
            raise ValueError(
                f"layer_types ({len(self.layer_types)}) and mlp_types ({len(self.mlp_types)}) must both have "
                f"num_layers = {self.num_layers} entries"
            )
        for kind in self.layer_types:
            if kind not in LAYER_KINDS:
                raise ValueError(f"unknown layer type {kind!r}; known: {', '.join(LAYER_KINDS)}")
        for kind in self.mlp_types:
            if kind not in MLP_KINDS:
                raise ValueError(f"unknown mlp type {kind!r}; known: {', '.join(MLP_KINDS)}")
        if "dsa" in self.layer_types:
            if len(self.indexer_types) != self.num_layers:
                raise ValueError("indexer_types needs one entry ('full' or 'shared') per layer")
            if self.index_topk % self.index_kpool:
                raise ValueError(
                    f"index_topk ({self.index_topk}) must be divisible by index_kpool ({self.index_kpool})"
                )
            for i, (kind, mode) in enumerate(zip(self.layer_types, self.indexer_types)):
                if kind == "dsa" and mode == "shared" and not (
                    i > 0 and self.layer_types[i - 1] == "dsa" and self.indexer_types[i - 1] == "full"
                ):
                    raise ValueError(
                        f"layer {i} has indexer_types 'shared' but layer {i - 1} is not a 'full' DSA layer: a "
                        "shared layer reuses the selection of the DSA layer right before it (as in transformers)"
                    )
        if "moe" in self.mlp_types and (self.num_experts < self.num_experts_per_tok or self.num_experts_per_tok < 1):
            raise ValueError(
                f"num_experts ({self.num_experts}) must be >= num_experts_per_tok ({self.num_experts_per_tok}) >= 1"
            )

    # ---- derived sizes -------------------------------------------------------------------
    def count(self, kind: str) -> int:
        """Number of layers of a layer kind or MLP kind."""
        return sum(k == kind for k in self.layer_types) + sum(k == kind for k in self.mlp_types)

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def replace(self, **changes: Any) -> ModelSpec:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        for k, v in d.items():
            if isinstance(v, tuple):
                d[k] = list(v)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelSpec:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise ValueError(f"unknown ModelSpec fields: {sorted(unknown)}")
        return cls(**d)


# ---- Hugging Face config.json ------------------------------------------------------------
def from_hf_config(cfg: dict[str, Any] | str | Path) -> ModelSpec:
    """Build a spec from a HF ``config.json`` (dict, file, or checkpoint directory)."""
    if not isinstance(cfg, dict):
        path = Path(cfg)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise ValueError(f"no Hugging Face config at {path}: pass a checkpoint directory or its config.json")
        cfg = json.loads(path.read_text())
    model_type = cfg.get("model_type")
    if model_type == "glm5_next" and isinstance(cfg.get("text_config"), dict):
        cfg = {**cfg["text_config"], "tie_word_embeddings": cfg.get("tie_word_embeddings", False)}
        model_type = "glm5_next_text"
    family = HF_MODEL_TYPES.get(model_type or "")
    if family is None:
        raise ValueError(
            f"unsupported architecture: model_type {model_type!r}. megaseq supports "
            f"{', '.join(sorted(HF_MODEL_TYPES))} (families {', '.join(FAMILIES)})"
        )
    return _FROM_HF[family](cfg)


def _glm5_from_hf(c: dict[str, Any]) -> ModelSpec:
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


def _qwen3_moe_from_hf(c: dict[str, Any]) -> ModelSpec:
    n = c.get("num_hidden_layers", 24)
    step = c.get("decoder_sparse_step", 1)
    mlp_only = set(c.get("mlp_only_layers") or [])
    # transformers 5 writes the attribute-mapped name num_local_experts; hub configs say num_experts
    num_experts = c.get("num_experts", c.get("num_local_experts", 128))
    _check_qwen3_moe_supported(c)
    mlp = [
        "moe" if (i not in mlp_only and num_experts > 0 and (i + 1) % step == 0) else "dense" for i in range(n)
    ]
    rope = c.get("rope_parameters") or {}
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
        num_attention_heads=heads,
        num_key_value_heads=c.get("num_key_value_heads", 4),
        head_dim=c.get("head_dim") or c.get("hidden_size", 2048) // heads,
        rope_theta=rope.get("rope_theta", c.get("rope_theta", 10000.0)),
        qk_norm=True,
        attention_bias=c.get("attention_bias", False),
        hf_extra={k: c[k] for k in _QWEN3_MOE_EXTRA if k in c},
    )


# config.json fields a qwen3_moe spec does not model but an export should carry through unchanged
_QWEN3_MOE_EXTRA = ("max_position_embeddings", "bos_token_id", "eos_token_id", "initializer_range",
                    "router_aux_loss_coef", "hidden_act")


def _check_qwen3_moe_supported(c: dict[str, Any]) -> None:
    """Options megaseq's qwen3_moe does not implement: refuse them rather than run a different model."""
    rope = c.get("rope_parameters") or c.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise ValueError(f"qwen3_moe rope_type {rope_type!r} is not supported (only 'default' RoPE); "
                         "remove rope scaling from config.json or use a checkpoint without it")
    if c.get("use_sliding_window"):
        raise ValueError("qwen3_moe use_sliding_window=true is not supported; set it to false in config.json")
    if c.get("hidden_act", "silu") != "silu":
        raise ValueError(f"qwen3_moe hidden_act {c['hidden_act']!r} is not supported (SwiGLU needs 'silu')")


_FROM_HF = {"glm5_next": _glm5_from_hf, "qwen3_moe": _qwen3_moe_from_hf}
