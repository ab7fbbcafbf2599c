"""``parallelize(model, settings, env)``: DeepSeek-V3.2's memory schemes applied from outside the model.

``models.common.prenorm`` layers (``memory.apply.apply_prenorm``: tiled MLP/MoE, recompute + SCO) whose
indexers score ``indexer_query_chunk`` queries at a time (the op's working-set bound, from the plan).
With ``parallel.ep > 1`` the routed experts are sharded over ep, and ``parallel.fsdp`` shards every layer
(``parallel.shard.shard_layers``).
"""

from __future__ import annotations

from typing import Any

from megaseq.config import AdapterSettings, MemorySettings
from megaseq.memory.apply import AppliedMemory, apply_prenorm
from megaseq.models.common.lora import apply_adapters
from megaseq.parallel.shard import shard_layers


def parallelize(model: Any, settings: MemorySettings, env: Any = None,
                adapters: AdapterSettings | None = None) -> AppliedMemory:
    """Install ``settings``' schemes on ``model`` in place, after ``adapters``' freezing and LoRA adapters;
    returns what was applied (release it at the end)."""
    adapted = apply_adapters(model, adapters) if adapters is not None else []

    def indexer_chunk(i: int, mixer: Any, done: AppliedMemory) -> None:
        if mixer.indexer is not None:
            mixer.indexer.query_chunk = settings.indexer_query_chunk
            done.query_chunked.append(f"layers.{i}.self_attn.indexer")

    done = apply_prenorm(model, settings, env, indexer_chunk)
    done.adapters = [p.name for p in adapted]
    return shard_layers(model, done, env)
