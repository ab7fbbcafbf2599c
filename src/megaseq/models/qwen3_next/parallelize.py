"""``parallelize(model, settings, env)``: Qwen3-Next's memory schemes applied from outside the model.

Its layers are ``models.common.prenorm`` layers: ``tiled_mlp`` tiles each MLP/MoE, ``recompute`` (+ SCO)
recomputes every layer (``memory.apply.apply_prenorm``). Its mixers carry no state across sequence
segments (``FAMILY.segmentable`` is False), so ``model_segment_tokens`` is refused.
"""

from __future__ import annotations

from typing import Any

from megaseq.config import MemorySettings
from megaseq.memory.apply import AppliedMemory, apply_prenorm


def parallelize(model: Any, settings: MemorySettings, env: Any = None) -> AppliedMemory:
    """Install ``settings``' schemes on ``model`` in place; returns what was applied (release it at the end)."""
    return apply_prenorm(model, settings, env)
