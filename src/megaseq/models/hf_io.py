"""Hugging Face checkpoints in and out: safetensors (single or sharded), per-expert or fused experts.

Loading streams one tensor at a time (``safe_open``) into the parameters of an already-built model,
so host memory never holds a second copy of the weights. A checkpoint key becomes a megaseq name by

1. dropping the text-model prefix: ``model.language_model.`` (the GLM-5.3-Flash multimodal layout),
   ``model.`` (Qwen3-MoE); ``lm_head.weight`` stays as it is;
2. skipping what megaseq does not model: vision tower keys, the multi-token-prediction layer
   (``layers.{num_layers}``) and ``shared_head`` (as transformers does), rotary ``inv_freq`` buffers;
3. the renames of transformers' GLM-5 conversion mapping (on disk ``self_attn.f_a_proj`` and
   ``hc_attn_fn``, in memory ``self_attn.forget_gate.f_a_proj`` and ``attn_hc.fn``);
4. fusing per-expert keys ``experts.{j}.gate_proj/up_proj/down_proj.weight`` into slices of
   ``experts.gate_up_proj [E, 2I, H]`` (gate rows first) and ``experts.down_proj [E, H, I]``, and GLM's
   ``q/k/v_conv1d.weight`` into thirds of ``conv1d.weight``. Fused keys load as they are.

Export writes what ``save_pretrained`` of transformers writes (the on-disk format, per-expert keys):
``config.json`` from ``spec_to_hf_config`` plus shards of at most ``max_shard_bytes`` and, when there is
more than one, ``model.safetensors.index.json``; all into a temporary directory renamed into place.

GLM-5 layout choice: transformers has no text-only causal LM for ``glm5_next``: ``glm5_next_text``
maps to ``Glm5NextTextModel``, which has no ``lm_head``, so it cannot give logits. The export
therefore writes the multimodal ``glm5_next`` config (``architectures: Glm5NextForConditionalGeneration``)
with ``model.language_model.*`` keys, ``lm_head.weight`` and a tiny ``vision_config`` (or the one in
``spec.hf_extra["vision_config"]``). transformers loads it with the vision tower freshly initialised
(a missing-keys warning for ``model.visual.*``); on text input that tower never runs, so hidden states
and logits equal megaseq's. That is also the layout of the released GLM-5.3-Flash checkpoints.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from megaseq.models.spec import ModelSpec, from_hf_config

DEFAULT_MAX_SHARD_BYTES = 5 * 2**30
_PREFIXES = ("model.language_model.", "language_model.model.", "language_model.", "model.")
_SKIP = re.compile(r"(^|\.)(visual|vision_tower|vision_model|multi_modal_projector)\."
                   r"|shared_head\.|rotary_emb\.")
# transformers' glm5_next conversion mapping: (on-disk name, in-memory name)
_GLM5_RENAMES = (
    ("self_attn.f_a_proj.", "self_attn.forget_gate.f_a_proj."),
    ("self_attn.f_b_proj.", "self_attn.forget_gate.f_b_proj."),
    ("self_attn.dt_bias", "self_attn.forget_gate.dt_bias"),
    ("self_attn.A_log", "self_attn.forget_gate.A_log"),
    ("hc_attn_fn", "attn_hc.fn"), ("hc_attn_base", "attn_hc.base"), ("hc_attn_scale", "attn_hc.scale"),
    ("hc_ffn_fn", "ffn_hc.fn"), ("hc_ffn_base", "ffn_hc.base"), ("hc_ffn_scale", "ffn_hc.scale"),
)
_EXPERT = re.compile(r"^(?P<base>.+\.experts)\.(?P<j>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")
_CONV = re.compile(r"^(?P<base>.+\.self_attn)\.(?P<part>[qkv])_conv1d\.weight$")
_ARCH = {"qwen3_moe": "Qwen3MoeForCausalLM", "glm5_next": "Glm5NextForConditionalGeneration"}
_TEXT_PREFIX = {"qwen3_moe": "model.", "glm5_next": "model.language_model."}


# ---- key mapping ------------------------------------------------------------------------------
def _model_name(key: str, num_layers: int) -> str | None:
    """Checkpoint key -> megaseq name (before fusion); None for keys megaseq deliberately skips."""
    if _SKIP.search(key):
        return None
    name = key
    for prefix in _PREFIXES:
        if key.startswith(prefix):
            name = key[len(prefix):]
            break
    if name.startswith(f"layers.{num_layers}."):  # the MTP layer after the last decoder layer
        return None
    for disk, memory in _GLM5_RENAMES:
        if disk in name:
            name = name.replace(disk, memory)
    return name


def _route(name: str, targets: dict[str, torch.Tensor]) -> tuple[str, tuple, str] | None:
    """A per-expert or per-part key -> (fused target, index into it, slice id); None if not fused."""
    if m := _EXPERT.match(name):
        j, proj = int(m["j"]), m["proj"]
        target = f"{m['base']}.{'down_proj' if proj == 'down_proj' else 'gate_up_proj'}"
        if target not in targets:
            return None
        E, rows = targets[target].shape[:2]
        if j >= E:
            raise ValueError(f"checkpoint tensor {name}: expert {j} does not exist (the model has {E})")
        if proj == "down_proj":
            return target, (j,), f"{j}"
        half = rows // 2
        part = slice(0, half) if proj == "gate_proj" else slice(half, rows)
        return target, (j, part), f"{j}.{proj}"
    if m := _CONV.match(name):
        target = f"{m['base']}.conv1d.weight"
        if target not in targets:
            return None
        third, i = targets[target].shape[0] // 3, "qkv".index(m["part"])
        return target, (slice(i * third, (i + 1) * third),), m["part"]
    return None


def _slices_needed(target: str, t: torch.Tensor) -> int:
    if target.endswith(".experts.gate_up_proj"):
        return 2 * t.shape[0]
    if target.endswith(".experts.down_proj"):
        return t.shape[0]
    return 3  # conv1d q/k/v


# ---- loading ----------------------------------------------------------------------------------
def _checkpoint_files(path: Path) -> dict[Path, list[str] | None]:
    """Safetensors files of a checkpoint and, for a sharded one, the keys each holds."""
    index = path / "model.safetensors.index.json"
    single = path / "model.safetensors"
    if index.is_file():
        files: dict[Path, list[str] | None] = {}
        for key, fname in json.loads(index.read_text())["weight_map"].items():
            files.setdefault(path / fname, []).append(key)  # type: ignore[union-attr]
        absent = [str(f) for f in files if not f.is_file()]
        if absent:
            raise ValueError(f"{index} names shard files that do not exist: {absent[:3]}")
        return files
    if single.is_file():
        return {single: None}
    raise ValueError(f"no model.safetensors or model.safetensors.index.json in {path}: "
                     "pass a Hugging Face checkpoint directory")


def load_hf_checkpoint(path: str | Path, model: nn.Module | None = None, spec: ModelSpec | None = None,
                       dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> nn.Module:
    """Copy a HF checkpoint into ``model`` (built from ``config.json`` when None) and return the model.

    Raises ValueError for an unsupported architecture, missing tensors (first few and the count),
    tensors of the wrong shape (name, expected, got) or a directory that is not a checkpoint.
    """
    from safetensors import safe_open

    path = Path(path)
    if spec is None:
        spec = from_hf_config(path)  # ValueError for an unsupported model_type
    if model is None:
        from megaseq.models.build import build_model

        model = build_model(spec, dtype=dtype, device=device, seed=0)
    targets = dict(model.state_dict(keep_vars=True))
    filled: set[int] = set()  # ids of tensors written whole
    sliced: dict[str, set[str]] = {}
    unexpected: list[str] = []
    with torch.no_grad():
        for file, keys in _checkpoint_files(path).items():
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for key in keys if keys is not None else f.keys():
                    name = _model_name(key, spec.num_layers)
                    if name is None:
                        continue
                    if name in targets:
                        _copy(targets[name], f.get_tensor(key), key)
                        filled.add(id(targets[name]))
                    elif (routed := _route(name, targets)) is not None:
                        target, index, slice_id = routed
                        _copy(targets[target][index], f.get_tensor(key), key)
                        sliced.setdefault(target, set()).add(slice_id)
                    else:
                        unexpected.append(key)
    _check_complete(targets, filled, sliced)
    if unexpected:
        warnings.warn(f"{len(unexpected)} checkpoint tensors have no place in the {spec.family} model and "
                      f"were ignored, e.g. {unexpected[:5]}", stacklevel=2)
    return model


def _copy(dst: torch.Tensor, src: torch.Tensor, key: str) -> None:
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(f"checkpoint tensor {key} has shape {tuple(src.shape)}, the model expects "
                         f"{tuple(dst.shape)}: config.json and the weights disagree, or the spec is wrong")
    dst.copy_(src)


def _check_complete(targets: dict[str, torch.Tensor], filled: set[int], sliced: dict[str, set[str]]) -> None:
    missing = []
    for name, t in targets.items():
        if id(t) in filled:  # tied weights count once
            continue
        if name not in sliced:
            missing.append(name)
        elif len(sliced[name]) < (need := _slices_needed(name, t)):
            missing.append(f"{name} ({len(sliced[name])} of {need} parts)")
    if missing:
        raise ValueError(f"checkpoint is missing {len(missing)} tensors the model needs, e.g. {missing[:5]}; "
                         "check that config.json matches the weights")


# ---- export -----------------------------------------------------------------------------------
def _hf_items(model: nn.Module, spec: ModelSpec,
              dtype: torch.dtype | None) -> Iterator[tuple[str, torch.Tensor]]:
    """(checkpoint key, CPU tensor) in on-disk format; yields one expert slice at a time."""
    prefix = _TEXT_PREFIX[spec.family]
    renames = _GLM5_RENAMES if spec.family == "glm5_next" else ()
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and spec.tie_word_embeddings:
            continue  # transformers re-ties it from embed_tokens
        t = t.full_tensor() if hasattr(t, "full_tensor") else t
        for memory_name, part in _split(name, t.detach()):
            key = memory_name
            for disk, memory in renames:
                key = key.replace(memory, disk)
            key = key if key == "lm_head.weight" else prefix + key
            yield key, part.to("cpu", dtype or part.dtype).contiguous().clone()


def _split(name: str, t: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    if name.endswith(".experts.gate_up_proj"):
        base, half = name[: -len(".gate_up_proj")], t.shape[1] // 2
        for j in range(t.shape[0]):
            yield f"{base}.{j}.gate_proj.weight", t[j, :half]
            yield f"{base}.{j}.up_proj.weight", t[j, half:]
    elif name.endswith(".experts.down_proj"):
        base = name[: -len(".down_proj")]
        for j in range(t.shape[0]):
            yield f"{base}.{j}.down_proj.weight", t[j]
    elif name.endswith(".self_attn.conv1d.weight"):
        base, third = name[: -len(".conv1d.weight")], t.shape[0] // 3
        for i, part in enumerate("qkv"):
            yield f"{base}.{part}_conv1d.weight", t[i * third:(i + 1) * third]
    else:
        yield name, t


def export_hf_checkpoint(model: nn.Module, spec: ModelSpec, out_dir: str | Path,
                         max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
                         dtype: torch.dtype | None = None) -> Path:
    """Write ``model`` as a HF checkpoint transformers loads (``from_pretrained``); returns ``out_dir``.

    ``dtype`` casts every tensor (None keeps each tensor's dtype). At most one shard is held in host
    memory at a time. The directory appears complete or not at all.
    """
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    config = spec_to_hf_config(spec)
    tmp = out_dir.parent / f".{out_dir.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    shards: list[dict[str, torch.Tensor]] = [{}]
    names: list[str] = []
    size = total = 0

    def flush() -> None:
        names.append(f"shard-{len(names):05d}.safetensors")
        save_file(shards[-1], str(tmp / names[-1]), metadata={"format": "pt"})
        shards[-1] = {}

    first_dtype = None
    for key, t in _hf_items(model, spec, dtype):
        first_dtype = first_dtype or t.dtype
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            flush()
            size = 0
        shards[-1][key] = t
        size, total = size + nbytes, total + nbytes
    if shards[-1] or not names:
        flush()
    weight_map = _name_shards(tmp, names)
    config["dtype"] = str(first_dtype).removeprefix("torch.")
    (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    if len(names) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    _replace_dir(tmp, out_dir)
    return out_dir


def _name_shards(tmp: Path, names: list[str]) -> dict[str, str]:
    """Rename shards to transformers' names now that their count is known; key -> file name."""
    from safetensors import safe_open

    weight_map = {}
    for i, name in enumerate(names):
        n = len(names)
        final = "model.safetensors" if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        os.replace(tmp / name, tmp / final)
        with safe_open(str(tmp / final), framework="pt") as f:
            weight_map.update({k: final for k in f.keys()})
    return weight_map


def _replace_dir(tmp: Path, out_dir: Path) -> None:
    """Move the finished ``tmp`` to ``out_dir``; an old ``out_dir`` is removed only after the rename."""
    old = None
    if out_dir.exists():
        old = out_dir.parent / f".{out_dir.name}.old-{os.getpid()}"
        os.replace(out_dir, old)
    os.replace(tmp, out_dir)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


# ---- config.json ------------------------------------------------------------------------------
def spec_to_hf_config(spec: ModelSpec) -> dict[str, Any]:
    """The HF ``config.json`` for a spec: the inverse of ``models.spec.from_hf_config``."""
    if spec.family == "qwen3_moe":
        return _qwen3_moe_config(spec)
    if spec.family == "glm5_next":
        return _glm5_config(spec)
    raise ValueError(f"no Hugging Face export for family {spec.family!r}")


def _qwen3_moe_config(s: ModelSpec) -> dict[str, Any]:
    if s.router != "softmax" or s.num_shared_experts or s.swiglu_limit is not None or not s.qk_norm:
        raise ValueError("this qwen3_moe spec cannot be written as a Qwen3MoeConfig: it needs router "
                         "'softmax', no shared experts, no swiglu_limit and qk_norm true")
    extra = {k: v for k, v in s.hf_extra.items() if k != "vision_config"}
    return {
        "architectures": [_ARCH["qwen3_moe"]], "model_type": "qwen3_moe",
        "vocab_size": s.vocab_size, "hidden_size": s.hidden_size, "num_hidden_layers": s.num_layers,
        "intermediate_size": s.intermediate_size, "rms_norm_eps": s.rms_norm_eps,
        "tie_word_embeddings": s.tie_word_embeddings, "pad_token_id": s.pad_token_id, "hidden_act": "silu",
        "num_attention_heads": s.num_attention_heads, "num_key_value_heads": s.num_key_value_heads,
        "head_dim": s.head_dim or s.hidden_size // s.num_attention_heads, "attention_bias": s.attention_bias,
        "rope_parameters": {"rope_type": "default", "rope_theta": s.rope_theta}, "rope_theta": s.rope_theta,
        "use_sliding_window": False, "sliding_window": None,
        "num_experts": s.num_experts, "num_experts_per_tok": s.num_experts_per_tok,
        "moe_intermediate_size": s.moe_intermediate_size, "norm_topk_prob": s.norm_topk_prob,
        "decoder_sparse_step": 1, "mlp_only_layers": [i for i, m in enumerate(s.mlp_types) if m == "dense"],
        **extra,
    }


# a vision tower small enough to cost nothing; it never runs on text input
_TINY_VISION = {"model_type": "glm5_next_vision", "depth": 1, "hidden_size": 16, "num_heads": 2,
                "intermediate_size": 16, "projection_intermediate_size": 16, "patch_size": 14,
                "image_size": 28}


def _glm5_config(s: ModelSpec) -> dict[str, Any]:
    kinds = {"kda": "linear_attention", "dsa": "indexed_attention"}  # transformers >= 5.24 spelling
    if any(k not in kinds for k in s.layer_types):
        raise ValueError(f"glm5_next layers must be 'kda' or 'dsa', got {sorted(set(s.layer_types))}")
    extra = {k: v for k, v in s.hf_extra.items() if k != "vision_config"}
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
        "hc_sinkhorn_iters": s.hc_sinkhorn_iters, "hc_eps": s.hc_eps, **extra,
    }
    vision = dict(s.hf_extra.get("vision_config") or {**_TINY_VISION, "out_hidden_size": s.hidden_size})
    return {"architectures": [_ARCH["glm5_next"]], "model_type": "glm5_next", "text_config": text,
            "vision_config": vision, "tie_word_embeddings": s.tie_word_embeddings}
