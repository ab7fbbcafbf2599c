"""Every kernel ``ops.kernels`` names (the fast set, the planned base set) is registered with the dispatcher
once the model code and the loss are imported: a registration that no module imports would never run."""

from __future__ import annotations

import importlib

import pytest

from megaseq.models.registry import FAMILY_PACKAGES
from megaseq.ops import dispatch, kernels


def _registered() -> dict[str, set[str]]:
    for pkg in FAMILY_PACKAGES.values():
        importlib.import_module(f"{pkg}.model")
    importlib.import_module("megaseq.memory.vocab_loss")
    return {op: set(impls) for op, impls in dispatch._state.registry.items()}


def _missing(named: dict[str, list[str]]) -> list[str]:
    have = _registered()
    return [f"{op}={impl}" for op, impls in named.items() for impl in impls if impl not in have.get(op, set())]


@pytest.mark.parametrize("table", ["FAST", "GPU_BF16"])
def test_every_named_kernel_is_registered(table):
    named = {op: [f.impl, *f.fallbacks] for op, f in kernels.FAST.items()} if table == "FAST" else {
        op: [impl] for op, impl in kernels.GPU_BF16.items()}
    missing = _missing(named)
    assert not missing, f"named in ops.kernels.{table} but never registered: {missing}"


def test_a_missing_registration_is_caught():
    assert _missing({"swiglu": ["triton", "no_such_kernel"]}) == ["swiglu=no_such_kernel"]
