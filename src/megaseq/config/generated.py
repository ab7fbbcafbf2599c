"""Files a recipe's own script writes: a recipe directory may hold a ``make_*.py`` that writes what the recipe
trains on (a checkpoint, generated data). When the recipe names such a file and it is not there yet, the error
names the setting, the path looked for and the command that writes it, before anything else runs (instead of,
for ``model.name``, an unknown preset). No torch import here.
"""

from __future__ import annotations

import os
import shlex
from pathlib import Path
from typing import Any

# Settings naming files or a checkpoint (recipe-relative in a recipe), in the order they are checked.
SETTINGS = (("model", "name"), ("model", "init_from"), ("data", "tokenizer"), ("data", "train"), ("data", "heldout"))
BUILTIN_TOKENIZERS = ("dna", "protein")


def _writer(scripts: list[Path], name: str) -> Path | None:
    """The first script that spells ``name`` as a quoted string (``ckpt = out / "checkpoint"``)."""
    for script in scripts:
        text = script.read_text(errors="replace")
        if f'"{name}"' in text or f"'{name}'" in text:
            return script
    return None


def _values(raw: dict[str, Any], section: str, key: str) -> list[str]:
    value = raw.get(section, {}).get(key) if isinstance(raw.get(section), dict) else None
    values = value if isinstance(value, list) else [value]
    return [v for v in values if isinstance(v, str) and v]


def unwritten(raw: dict[str, Any], recipe: Path) -> dict[tuple[str, str, str], tuple[Path, Path]]:
    """``(section, key, value) -> (path looked for, script that writes it)`` for each recipe value that names
    a missing recipe-relative file a ``make_*.py`` beside the recipe writes (``raw``: the recipe as read)."""
    base = recipe.resolve().parent
    scripts = sorted(base.glob("make_*.py"))
    out: dict[tuple[str, str, str], tuple[Path, Path]] = {}
    if not scripts:
        return out
    for section, key in SETTINGS:
        for value in _values(raw, section, key):
            if (section, key) == ("data", "tokenizer") and value in BUILTIN_TOKENIZERS:
                continue
            path = Path(os.path.normpath(base / Path(value).expanduser()))
            if path.exists() or Path(value).expanduser().exists():
                continue
            script = _writer(scripts, path.name)
            if script is not None:
                out[(section, key, value)] = (path, script)
    return out


def check_written(cfg: Any, raw: dict[str, Any], recipe: Path) -> None:
    """ValueError for the first setting of ``cfg`` (the recipe with its overrides) that still holds a recipe value
    naming a file the recipe's script has not written yet; an override that replaces it is not checked."""
    missing = unwritten(raw, recipe)
    for (section, key, value), (path, script) in missing.items():
        current = getattr(getattr(cfg, section), key)
        if value not in (current if isinstance(current, list) else [current]):
            continue
        command = f"python {shlex.quote(str(recipe.parent / script.name))}"
        setting = f"{section}.{key}" if value == str(path) else f"{section}.{key} {value!r}"
        raise ValueError(f"{setting} of {recipe}: {path} does not exist; the recipe's {script.name} writes it: "
                         f"run `{command}` first, then this command again")
