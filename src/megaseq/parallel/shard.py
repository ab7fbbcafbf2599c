"""The parallel schemes a family's ``parallelize`` applies after its memory schemes: expert parallelism
(``env.shard_moe`` on every MoE layer when ``parallel.ep > 1``) and FSDP2 per layer (``parallel.fsdp``).

``parallelize`` is the shared one: ``models.registry.parallelize`` falls back to it for every family without
its own ``parallelize.py`` (the families of ``models.common.prenorm`` layers: adapters,
``memory.apply.apply_prenorm``, then ``shard_layers``). A family with mixer settings of its own (an indexer's
query chunk, KDA segments) supplies only that hook to ``parallelize_prenorm``; GLM-5, which tiles whole
layers, does the same steps around its own layers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from megaseq.config import AdapterSettings, MemorySettings
from megaseq.memory.apply import AppliedMemory, apply_prenorm
from megaseq.models.common.lora import apply_adapters
from megaseq.parallel.fsdp import apply_fsdp


def shard_layers(model: nn.Module, done: AppliedMemory, env: Any = None) -> AppliedMemory:
    """Shard ``model.layers``' routed experts over ep and then every layer with FSDP, as ``env`` says (both
    no-ops with one rank; FSDP leaves the ep-sharded experts out and shards the rest over dp x ep); returns
    ``done`` with what was sharded. Applying again keeps the sharding."""
    layers = list(model.layers)
    if env is not None and getattr(env, "ep_size", 1) > 1:
        for layer, kind in zip(layers, model.spec.mlp_types):
            if kind == "moe":
                env.shard_moe(layer.mlp)
    # last: its hooks surround the wrapped forwards
    done.sharded = apply_fsdp(model, layers, env, stream_base=done.settings.stream_base)
    return done


def parallelize_prenorm(model: nn.Module, settings: MemorySettings, env: Any = None,
                        adapters: AdapterSettings | None = None,
                        mixer_schemes: Callable[[int, nn.Module, AppliedMemory], None] | None = None) -> AppliedMemory:
    """A prenorm family's ``parallelize``: ``adapters``' freezing and LoRA adapters first, then the memory
    schemes (``mixer_schemes(i, mixer, done)``: the family's own mixer settings), then EP and FSDP; returns
    what was applied (release it at the end)."""
    adapted = apply_adapters(model, adapters) if adapters is not None else []
    done = apply_prenorm(model, settings, env, mixer_schemes)
    done.adapters = [p.name for p in adapted]
    return shard_layers(model, done, env)


def parallelize(model: nn.Module, settings: MemorySettings, env: Any = None,
                adapters: AdapterSettings | None = None) -> AppliedMemory:
    """The shared ``parallelize(model, settings, env, adapters)`` of a prenorm family without hooks of its own:
    ``tiled_mlp`` tiles each MLP/MoE, ``recompute`` (+ SCO) recomputes every layer, ``model_segment_tokens``
    is refused unless the family is segmentable, then EP and FSDP; returns what was applied."""
    return parallelize_prenorm(model, settings, env, adapters)
