"""``parallelize(model, settings, env)``: Qwen3-MoE's memory schemes applied from outside the model.

The one module of the family that may import ``megaseq.memory`` and ``megaseq.parallel``. Its layers are
``h + attn(norm(h))`` then ``h + mlp(norm(h))``: ``tiled_mlp`` tiles each layer's MLP/MoE
(``memory.tiling.enable_tiling``); ``recompute`` (+ ``checkpoint_offload``) recomputes every layer;
``parallel.fsdp`` shards every layer (``parallel.fsdp.apply_fsdp``, the next layer's all-gather prefetched).
Sequence segments (``model_segment_tokens``) run in the trainer's step (attention carries its K/V); there is
no indexer and no KDA. With ``parallel.ep > 1`` every MoE's experts are sharded over the ep group
(``env.shard_moe``). Applying again replaces the previous schemes (the sharding stays).
"""

from __future__ import annotations

from typing import Any

from megaseq.config import AdapterSettings, MemorySettings
from megaseq.memory import apply, tiling
from megaseq.memory.apply import AppliedMemory
from megaseq.models.common.lora import apply_adapters
from megaseq.models.qwen3_moe.model import Qwen3MoeModel
from megaseq.parallel.fsdp import apply_fsdp


def parallelize(model: Qwen3MoeModel, settings: MemorySettings, env: Any = None,
                adapters: AdapterSettings | None = None) -> AppliedMemory:
    """Install ``settings``' schemes on ``model`` in place, after ``adapters``' freezing and LoRA adapters (the
    schemes then replay the adapted modules); returns what was applied (release it at the end)."""
    adapted = apply_adapters(model, adapters) if adapters is not None else []
    layers = list(model.layers)
    done = apply.begin(layers, settings)
    done.adapters = [p.name for p in adapted]
    if env is not None and env.ep_size > 1:  # routed experts sharded over ep (FSDP of the rest plugs in after)
        for layer, kind in zip(layers, model.spec.mlp_types):
            if kind == "moe":
                env.shard_moe(layer.mlp)
    for i, layer in enumerate(layers):
        tiling.disable_tiling(layer.mlp)
        if settings.tiled_mlp:
            tiling.enable_tiling(layer.mlp, settings.mlp_tile_tokens)
            done.tiled.append(f"layers.{i}.mlp")
    apply.check_segments(model.spec.family, settings, done, apply.env_cp(env))
    apply.recompute_layers(layers, settings, done)
    done.sharded = apply_fsdp(model, layers, env)  # last: its hooks surround the wrapped forwards
    return done
