"""``parallelize(model, settings, env)``: gpt-oss's memory schemes applied from outside the model.

Its layers are ``models.common.prenorm`` layers: ``tiled_mlp`` tiles each MoE, ``recompute`` (+ SCO)
recomputes every layer, ``parallel.fsdp`` shards every layer (``parallel.shard.parallelize_prenorm``).
Softmax attention carries no state across sequence segments (``FAMILY.segmentable`` is False). Expert
parallelism is refused: the experts' biases do not travel with the expert-parallel dispatch.
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
    if env is not None and getattr(env, "ep_size", 1) > 1:
        raise ValueError("gpt_oss with parallel.ep > 1 is not supported (the experts' biases stay with every "
                         "expert in each process): set --parallel.ep 1 and shard with parallel.fsdp instead")
    return parallelize_prenorm(model, settings, env, adapters)
