"""``parallelize(model, settings, env)``: Qwen3-MoE's memory schemes applied from outside the model.

The one module of the family that may import ``megaseq.memory`` and ``megaseq.parallel``. Its layers are
``h + attn(norm(h))`` then ``h + mlp(norm(h))``: ``tiled_mlp`` tiles each layer's MLP/MoE
(``memory.tiling.enable_tiling``); ``recompute`` (+ ``checkpoint_offload``) recomputes every layer.
Softmax attention does not carry its state across sequence segments, so ``model_segment_tokens`` is
refused; there is no indexer and no KDA. Applying again replaces the previous schemes.
"""

from __future__ import annotations

from typing import Any

from megaseq.config import AdapterSettings, MemorySettings
from megaseq.memory import apply, tiling
from megaseq.memory.apply import AppliedMemory
from megaseq.models.common.lora import apply_adapters
from megaseq.models.qwen3_moe.model import Qwen3MoeModel


def parallelize(model: Qwen3MoeModel, settings: MemorySettings, env: Any = None,
                adapters: AdapterSettings | None = None) -> AppliedMemory:
    """Install ``settings``' schemes on ``model`` in place, after ``adapters``' freezing and LoRA adapters (the
    schemes then replay the adapted modules); returns what was applied (release it at the end)."""
    adapted = apply_adapters(model, adapters) if adapters is not None else []
    layers = list(model.layers)
    done = apply.begin(layers, settings)
    done.adapters = [p.name for p in adapted]
    for i, layer in enumerate(layers):
        tiling.disable_tiling(layer.mlp)
        if settings.tiled_mlp:
            tiling.enable_tiling(layer.mlp, settings.mlp_tile_tokens)
            done.tiled.append(f"layers.{i}.mlp")
    apply.check_segments(model.spec.family, settings, done, apply.env_cp(env))
    apply.recompute_layers(layers, settings, done)
    return done
