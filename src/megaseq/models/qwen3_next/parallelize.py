"""``parallelize(model, settings, env)``: Qwen3-Next's memory schemes applied from outside the model.

Its layers are ``models.common.prenorm`` layers: ``tiled_mlp`` tiles each MLP/MoE, ``recompute`` (+ SCO)
recomputes every layer (``memory.apply.apply_prenorm``). Sequence segments (``model_segment_tokens``) run in
the trainer's step; every mixer carries its state. With ``parallel.ep > 1`` the routed experts are sharded
over ep, and ``parallel.fsdp`` shards every layer (``parallel.shard.parallelize_prenorm``).
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
    return parallelize_prenorm(model, settings, env, adapters)
