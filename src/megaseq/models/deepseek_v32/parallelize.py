"""``parallelize(model, settings, env)``: DeepSeek-V3.2's memory schemes applied from outside the model.

``models.common.prenorm`` layers (``memory.apply.apply_prenorm``: tiled MLP/MoE, recompute + SCO) whose
indexers score ``indexer_query_chunk`` queries at a time (the op's working-set bound, from the plan).
With ``parallel.ep > 1`` the routed experts are sharded over ep, and ``parallel.fsdp`` shards every layer
(``parallel.shard.parallelize_prenorm``).
"""

from __future__ import annotations

from typing import Any

from megaseq.config import AdapterSettings, MemorySettings
from megaseq.memory.apply import AppliedMemory
from megaseq.parallel.shard import parallelize_prenorm


def parallelize(model: Any, settings: MemorySettings, env: Any = None,
                adapters: AdapterSettings | None = None) -> AppliedMemory:
    """Install ``settings``' schemes on ``model`` in place, after ``adapters``' freezing and LoRA adapters;
    returns what was applied (release it at the end)."""

    def indexer_chunk(i: int, mixer: Any, done: AppliedMemory) -> None:
        if mixer.indexer is not None:
            mixer.indexer.query_chunk = settings.indexer_query_chunk
            done.query_chunked.append(f"layers.{i}.self_attn.indexer")

    return parallelize_prenorm(model, settings, env, adapters, indexer_chunk)
