"""The scripts of ``benchmarks/<topic>/`` as modules, for the tests that run or read them (they are not a package)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load(script: str, name: str | None = None) -> ModuleType:
    """``benchmarks/<topic>/<script>.py`` (``script`` as ``"topic/script"``) imported as module ``name`` (default
    ``<script>_bench``), registered in ``sys.modules`` (dataclasses and pickling look their module up there); its
    own directory is on ``sys.path`` while it loads, as when it runs as a script."""
    name = name or f"{Path(script).name}_bench"
    path = BENCHMARKS / f"{script}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    sys.path.insert(0, str(path.parent))
    try:
        spec.loader.exec_module(mod)
    finally:
        sys.path.remove(str(path.parent))
    return mod
