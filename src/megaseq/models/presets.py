"""Named architectures, gathered from the families (``models/<family>/spec.py: PRESETS``).

A recipe says ``model.name: glm5-flash-tiny`` or a path to a HF checkpoint directory or config.json.
Torch-free: the planner reads it.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable
from pathlib import Path

from megaseq.models.registry import FAMILY_PACKAGES, family_module
from megaseq.models.spec import DNA_VOCAB_SIZE, ModelSpec, from_hf_config

__all__ = ["DNA_VOCAB_SIZE", "PRESETS", "get_preset", "resolve_spec"]

PRESETS: dict[str, Callable[[], ModelSpec]] = {
    name: make for fam in FAMILY_PACKAGES for name, make in family_module(fam, "spec").PRESETS.items()
}


def get_preset(name: str) -> ModelSpec:
    try:
        return PRESETS[name]()
    except KeyError:
        close = difflib.get_close_matches(name, PRESETS, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ValueError(
            f"unknown model preset {name!r}.{hint} Presets: {', '.join(PRESETS)}; "
            "or give a path to a Hugging Face checkpoint directory or config.json"
        ) from None


def resolve_spec(name_or_path: str) -> ModelSpec:
    """A preset name, or a HF checkpoint directory / config.json path."""
    if name_or_path in PRESETS:
        return get_preset(name_or_path)
    if Path(name_or_path).exists():
        return from_hf_config(name_or_path)
    return get_preset(name_or_path)  # raises with the list of presets
