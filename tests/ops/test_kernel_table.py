"""Every kernel ``ops.kernels`` names (the fast set, the planned base set) is an implementation the dispatcher
finds (a row of ``ops.table`` whose module and callables import): a name without one would never run."""

from __future__ import annotations

import pytest

from megaseq.ops import dispatch, kernels, table


def _registered() -> dict[str, set[str]]:
    return {op: set(dispatch.implementations(op)) for op in table.BY_NAME}


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
