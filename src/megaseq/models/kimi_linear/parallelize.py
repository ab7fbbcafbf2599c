"""``parallelize(model, settings, env)``: Kimi-Linear's memory schemes applied from outside the model.

``models.common.prenorm`` layers (``memory.apply.apply_prenorm``: tiled MLP/MoE, recompute + SCO); the KDA
mixers run in segments of ``kda_segment_tokens`` when the plan says so (``memory.kda_segments``). Sequence
segments (``model_segment_tokens``) run in the trainer's step; KDA and MLA carry their state. With
``parallel.ep > 1`` the routed experts are sharded over ep, and ``parallel.fsdp`` shards every layer
(``parallel.shard.parallelize_prenorm``).
"""

from __future__ import annotations

from typing import Any

from megaseq.config import AdapterSettings, MemorySettings
from megaseq.memory import kda_segments
from megaseq.memory.apply import AppliedMemory
from megaseq.parallel.shard import parallelize_prenorm


def parallelize(model: Any, settings: MemorySettings, env: Any = None,
                adapters: AdapterSettings | None = None) -> AppliedMemory:
    """Install ``settings``' schemes on ``model`` in place, after ``adapters``' freezing and LoRA adapters;
    returns what was applied (release it at the end)."""
    segment = settings.kda_segment_tokens or None

    def kda(i: int, mixer: Any, done: AppliedMemory) -> None:
        if model.spec.layer_types[i] == "kda":
            kda_segments.segment(mixer, segment)
            done.kda_segmented = segment or 0

    return parallelize_prenorm(model, settings, env, adapters, kda)
