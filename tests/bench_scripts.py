"""The scripts of ``benchmarks/`` as modules, for the tests that run or read them (they are not a package)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load(script: str, name: str | None = None) -> ModuleType:
    """``benchmarks/<script>.py`` imported as module ``name`` (default ``<script>_bench``), registered in
    ``sys.modules`` (dataclasses and pickling look their module up there)."""
    name = name or f"{script}_bench"
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{script}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod
