"""``parallelize(model, settings, env)``: Qwen3-Next's memory schemes applied from outside the model.

Its layers are ``models.common.prenorm`` layers: ``tiled_mlp`` tiles each MLP/MoE, ``recompute`` (+ SCO)
recomputes every layer (``memory.apply.apply_prenorm``). Its mixers carry no state across sequence
segments (``FAMILY.segmentable`` is False), so ``model_segment_tokens`` is refused.
With ``parallel.ep > 1`` the routed experts are sharded over ep, and ``parallel.fsdp`` shards every layer
(``parallel.shard.shard_layers``).
"""

from __future__ import annotations

from typing import Any

from megaseq.config import MemorySettings
from megaseq.memory.apply import AppliedMemory, apply_prenorm
from megaseq.parallel.shard import shard_layers


def parallelize(model: Any, settings: MemorySettings, env: Any = None) -> AppliedMemory:
    """Install ``settings``' schemes on ``model`` in place; returns what was applied (release it at the end)."""
    return shard_layers(model, apply_prenorm(model, settings, env), env)
