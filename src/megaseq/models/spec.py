"""ModelSpec: one architecture description for every family megaseq builds.

A spec comes from a preset name (``presets.py``) or from a Hugging Face ``config.json``
(``from_hf_config``). Models, the planner and the checkpoint adapters all read the same
spec, so a shape is written down once. No torch import: the planner uses this module.

Layer kinds (``layer_types``):
  ``kda``        Kimi Delta Attention (linear attention with short conv and delta rule)
  ``dsa``        MLA with the DeepSeek sparse-attention lightning indexer (NoPE in GLM-5.3-Flash, RoPE in
                 DeepSeek-V3.2)
  ``attention``  full softmax attention with GQA and RoPE (Qwen3-MoE, OLMoE, Mixtral, GLM-4.5; Qwen3-Next's
                 gated attention with ``attn_output_gate``)
  ``mla``        dense multi-head latent attention (DeepSeek-V3 with RoPE, Kimi-Linear without)
  ``gdn``        gated DeltaNet (Qwen3-Next's linear attention)
MLP kinds (``mlp_types``): ``dense`` (SwiGLU) or ``moe`` (routed experts + optional shared).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megaseq.models.hf_fields import GENERIC_HF_FIELDS, HFFields, check_hf_fields  # noqa: F401 (re-exported)
from megaseq.models.registry import FAMILY_PACKAGES, family_for_model_type, family_module, hf_model_types

DNA_VOCAB_SIZE = 16  # A C G T N + specials, padded to 16 (see megaseq.data.tokenizer): the tiny presets' vocab
LAYER_KINDS = ("kda", "dsa", "attention", "mla", "gdn")
ROPE_TYPES = {  # rope_type -> the rope_parameters keys megaseq implements (models/common/rope.py)
    "default": (),
    "linear": ("factor",),
    "yarn": ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale", "mscale_all_dim",
             "attention_factor", "truncate"),
}
MLP_KINDS = ("dense", "moe")


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
    router: str = "sigmoid_bias"  # "sigmoid_bias" (DeepSeek/GLM), "softmax" (Qwen3/OLMoE/Mixtral) or
    # "topk_softmax" (gpt-oss: top-k of the logits, then a softmax over the K chosen)
    router_bias: bool = False  # the router's linear has a bias (gpt-oss)
    expert_bias: bool = False  # the routed experts' gate_up / down projections have biases (gpt-oss)
    swiglu_alpha: float | None = None  # gpt-oss's experts: (up + 1) * gate * sigmoid(alpha * gate), clamped
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    router_aux_loss_coef: float = 0.0  # the auxiliary balancing loss's coefficient (config.json's), softmax routers
    router_weights_fp32: bool = False  # the softmax router's weights stay float32 (Mixtral), else the logits' dtype
    shared_expert_intermediate_size: int = 0  # 0: moe_intermediate_size * num_shared_experts
    shared_expert_gate: bool = False  # sigmoid gate on the shared expert's output (Qwen3-Next)
    # softmax attention (GQA + RoPE)
    num_attention_heads: int = 0
    num_key_value_heads: int = 0
    head_dim: int = 0
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] = field(default_factory=dict)  # HF rope_parameters less rope_theta (check_rope)
    max_position_embeddings: int = 0  # YaRN's factor when its config gives none (HF's fallback)
    partial_rotary_factor: float = 1.0  # rotated fraction of each head (GLM-4.5 0.5, Qwen3-Next 0.25)
    qk_norm: bool = False
    qk_norm_scope: str = "head"  # q/k RMSNorm per head ("head": Qwen3, GLM-4.5) or over all heads ("all": OLMoE)
    clip_qkv: float | None = None  # clamp q, k, v to [-clip, clip] after the projections (OLMoE's option)
    attention_bias: bool = False  # q/k/v projection biases
    o_proj_bias: bool = False  # the output projection's bias (Qwen3-MoE / OLMoE tie it to attention_bias)
    attn_output_gate: bool = False  # sigmoid output gate from q_proj (Qwen3-Next's gated attention)
    attention_sinks: bool = False  # a learned logit per query head in every softmax's denominator (gpt-oss)
    sliding_window: int = 0  # the keys a query of a sliding layer sees, itself included (0: none)
    sliding_layers: tuple[int, ...] = ()  # the attention layers that use the sliding window (gpt-oss: even ones)
    norm_zero_centered: bool = False  # RMSNorm weights stored as w - 1 (Qwen3-Next: x * (1 + w))
    # MLA (GLM-5.3-Flash DSA layers: NoPE, so qk_rope_head_dim = 0)
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = False  # MLA's rotated dims in interleaved pairs (DeepSeek's rope_interleave)
    mla_rotate: bool = True  # MLA rotates its qk_rope_head_dim dims (False: Kimi-Linear's NoPE MLA keeps them)
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
    # gated DeltaNet (Qwen3-Next): value heads/dims when they differ from the key heads/dims above (0: same)
    linear_num_value_heads: int = 0
    linear_value_head_dim: int = 0
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
        self.sliding_layers = tuple(self.sliding_layers)
        if self.family not in FAMILY_PACKAGES:
            raise ValueError(f"model family {self.family!r} is not supported; supported: "
                             f"{', '.join(FAMILY_PACKAGES)}")
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
        if self.sliding_layers and (self.sliding_window < 1 or not all(
                0 <= i < self.num_layers and self.layer_types[i] == "attention" for i in self.sliding_layers)):
            raise ValueError(f"sliding_layers {list(self.sliding_layers)} must name 'attention' layers and need "
                             f"sliding_window >= 1 (got {self.sliding_window})")
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


def rope_from_hf(c: dict[str, Any], family: str, default_theta: float = 10000.0) -> tuple[float, dict[str, Any], float]:
    """``(rope_theta, rope_scaling, partial_rotary_factor)`` from a config.json's ``rope_parameters`` (or the
    legacy ``rope_theta`` + ``rope_scaling``); a ValueError naming the field for a RoPE type or key megaseq
    does not implement."""
    params = dict(c.get("rope_parameters") or {})
    legacy = c.get("rope_scaling") or {}
    if not params:
        params = dict(legacy)
    theta = params.pop("rope_theta", c.get("rope_theta", default_theta))
    partial = params.pop("partial_rotary_factor", c.get("partial_rotary_factor", 1.0))
    kind = params.pop("rope_type", params.pop("type", "default")) or "default"
    if kind not in ROPE_TYPES:
        raise ValueError(f"{family} rope_type {kind!r} is not supported; megaseq implements "
                         f"{', '.join(ROPE_TYPES)} RoPE (rope_parameters in config.json)")
    unknown = sorted(k for k in params if k not in ROPE_TYPES[kind] and params[k] is not None)
    if unknown:
        raise ValueError(f"{family} rope_parameters {unknown} are not implemented for rope_type {kind!r}; "
                         f"supported keys: {', '.join(ROPE_TYPES[kind]) or 'none'}")
    if kind == "yarn" and "original_max_position_embeddings" not in params:
        raise ValueError(f"{family} yarn RoPE needs rope_parameters.original_max_position_embeddings")
    scaling = {"rope_type": kind, **{k: v for k, v in params.items() if v is not None}} if kind != "default" else {}
    return float(theta), scaling, float(partial)


def rope_to_hf(s: ModelSpec, with_partial: bool = False) -> dict[str, Any]:
    """The ``rope_parameters`` of a spec (the inverse of ``rope_from_hf``)."""
    out: dict[str, Any] = {"rope_type": "default", **s.rope_scaling, "rope_theta": s.rope_theta}
    if with_partial:
        out["partial_rotary_factor"] = s.partial_rotary_factor
    return out


# ---- Hugging Face config.json ------------------------------------------------------------
def read_hf_config(cfg: dict[str, Any] | str | Path) -> dict[str, Any]:
    """A HF ``config.json`` as a dict (from a dict, the file, or a checkpoint directory); a file that is not
    a JSON object is one ValueError naming it (and the line)."""
    if isinstance(cfg, dict):
        return cfg
    path = Path(cfg)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ValueError(f"no Hugging Face config at {path}: pass a checkpoint directory or its config.json")
    try:
        c = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON (line {e.lineno}, column {e.colno}: {e.msg})") from None
    except UnicodeDecodeError:
        raise ValueError(f"{path} is not UTF-8 text: pass a Hugging Face config.json") from None
    if not isinstance(c, dict):
        raise ValueError(f"{path} must hold a JSON object of config fields, got {type(c).__name__}")
    return c


# architectures users ask for that no family implements yet, and what is missing
NOT_YET: dict[str, str] = {}


def from_hf_config(cfg: dict[str, Any] | str | Path) -> ModelSpec:
    """Build a spec from a HF ``config.json`` (dict, file, or checkpoint directory) through the family that
    reads its ``model_type``; each family refuses the fields it does not implement."""
    c = read_hf_config(cfg)
    fam = family_for_model_type(c.get("model_type"))
    if fam is None:
        why = NOT_YET.get(str(c.get("model_type")), "")
        raise ValueError(f"unsupported architecture: model_type {c.get('model_type')!r}{why}. megaseq supports "
                         f"{', '.join(hf_model_types())} (families {', '.join(FAMILY_PACKAGES)})")
    return family_module(fam.name, "spec").from_hf(c)


def to_hf_config(spec: ModelSpec) -> dict[str, Any]:
    """The HF ``config.json`` for a spec: the inverse of ``from_hf_config``."""
    return family_module(spec.family, "spec").to_hf(spec)
