"""``parallelize(model, settings, env)``: GLM-5.3-Flash's memory schemes applied from outside the model.

The one module of the family that may import ``megaseq.memory`` and ``megaseq.parallel`` (import-linter
keeps the rest of ``models`` from it). It knows the family's layers, so nothing here probes attributes:

- ``tiled_mlp``: every layer's token-separable parts (the mHC maps, norms, merges and the MLP/MoE) in tiles
  (``memory.tiling.tile_layer`` over ``Glm5DecoderLayer.parts()``): only the token mixer sees the whole
  sequence; tiling the MLP inside it again would run the MoE forward three times;
- ``indexer_query_chunk``: every full DSA indexer's scoring chunk;
- ``kda_segment_tokens``: every KDA mixer in segments (``memory.kda_segments.segment``);
- ``model_segment_tokens``: checked here, run by the trainer's step;
- ``recompute`` (+ ``checkpoint_offload``): every layer recomputed, SCO offloading its input;
- ``parallel.fsdp`` (``env.fsdp``): FSDP2 per layer with the next layer's all-gather prefetched
  (``parallel.fsdp.apply_fsdp``), after the memory schemes.

Context parallelism reaches the blocks through the ``SeqContext`` the environment builds per batch
(``parallel.env``), so with one rank ``env`` may be None. With ``parallel.ep > 1`` every MoE's experts are
sharded over the ep group and its ``expert_dispatch`` becomes the expert-parallel one
(``env.shard_moe``). Applying again replaces the previous schemes (the sharding stays).
"""

from __future__ import annotations

from typing import Any

from megaseq.config import AdapterSettings, MemorySettings
from megaseq.memory import apply, kda_segments, tiling
from megaseq.memory.apply import AppliedMemory
from megaseq.models.common.lora import apply_adapters
from megaseq.models.glm5.model import Glm5Model
from megaseq.parallel.fsdp import apply_fsdp


def parallelize(model: Glm5Model, settings: MemorySettings, env: Any = None,
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
    tile = settings.mlp_tile_tokens if settings.tiled_mlp else None
    segment = settings.kda_segment_tokens or None
    for i, layer in enumerate(layers):
        tiling.tile_layer(layer, tile)
        tiling.disable_tiling(layer.mlp)  # the layer's tiles cover it: tiling it inside again reruns the MoE
        if tile is not None:
            done.tiled.append(f"layers.{i}")
        mixer = layer.self_attn
        if layer.layer_type == "dsa" and mixer.indexer is not None:
            mixer.indexer.query_chunk = settings.indexer_query_chunk
            done.query_chunked.append(f"layers.{i}.self_attn.indexer")
        if layer.layer_type == "kda":
            kda_segments.segment(mixer, segment)
            done.kda_segmented = segment or 0
    apply.check_segments(model.spec.family, settings, done, apply.env_cp(env))
    apply.stream_base(layers, settings, done, env)
    apply.recompute_layers(layers, settings, done)
    # last: its hooks surround the wrapped forwards
    done.sharded = apply_fsdp(model, layers, env, stream_base=settings.stream_base)
    return done
