"""The registration table (``ops.table``): every row resolves, the dispatcher runs exactly its rows, and nothing in
the product registers an implementation any other way."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import torch

from megaseq.ops import dispatch, kernels, table

SRC = Path(__file__).resolve().parents[2] / "src" / "megaseq"


def test_every_row_resolves():
    assert table.problems() == []


def test_a_row_pointing_at_a_missing_callable_is_caught():
    op = table.BY_NAME["swiglu"]
    broken = dataclasses.replace(op.impls[1], fn="no_such_kernel")
    found = table.problems((dataclasses.replace(op, impls=(op.impls[0], broken)),))
    assert found == ["swiglu=triton: megaseq.ops.swiglu.fused has no callable 'no_such_kernel'"]


def test_a_removed_row_is_caught():
    op = table.BY_NAME["hc_mix"]
    without_fused = tuple(i for i in op.impls if i.name != "torch_fused")
    found = table.problems((dataclasses.replace(op, impls=without_fused),))
    assert len(found) == 1 and "'torch_fused' is named but has no row" in found[0]


def test_a_missing_module_and_a_second_reference_are_caught():
    op = table.BY_NAME["rms_norm"]
    rows = (op.impls[0], dataclasses.replace(op.impls[1], reference=True, module="megaseq.ops.no_such_module"))
    found = table.problems((dataclasses.replace(op, impls=rows),))
    assert any("exactly one reference" in f for f in found) and any("does not import" in f for f in found)


def test_the_dispatcher_runs_the_rows():
    """Per op, the dispatcher's implementations are the table's rows, the callables the rows name."""
    for op in table.OPS:
        impls = dispatch.implementations(op.name)
        rows = {i.name: i for i in op.impls}
        assert set(rows) <= set(impls), op.name
        for name, row in rows.items():
            assert impls[name].fn is dispatch.resolve(row).fn
            assert (impls[name].reference, impls[name].opt_in) == (row.reference, row.opt_in)


def test_a_row_is_imported_when_its_op_is_first_called(monkeypatch):
    """An op the table holds but nothing imported runs through its row: no import registers it."""
    row = table.Impl("torch", "megaseq.ops.swiglu.reference", "clamped_swiglu", reference=True)
    monkeypatch.setitem(table.BY_NAME, "table_test_op", table.Op("table_test_op", (row,)))
    gate, up = torch.randn(3, 4), torch.randn(3, 4)
    from megaseq.ops.swiglu.reference import clamped_swiglu

    torch.testing.assert_close(dispatch.call("table_test_op", gate, up, 1.7, 7.0), clamped_swiglu(gate, up, 1.7, 7.0))
    dispatch._state.registry.pop("table_test_op")
    dispatch._state.loaded.discard("table_test_op")


def test_kernel_sets_are_views_of_the_table():
    assert kernels.FAST_GPU == {op.name: op.fast for op in table.OPS if op.fast}
    assert kernels.GPU_BF16 == {op.name: op.gpu_bf16 for op in table.OPS if op.gpu_bf16}
    assert kernels.PLANNED_FAST_OPS == {op.name for op in table.OPS if op.plan_counts_fast}


@pytest.mark.parametrize("pattern", [r"dispatch\.register\(", r"^@register\("])
def test_no_module_registers_outside_the_table(pattern):
    """``dispatch.register`` is for tests and experiments: a product module that registers would run only where
    something happened to import it."""
    hits = [f"{p.relative_to(SRC)}:{n}" for p in SRC.rglob("*.py") if p.name != "dispatch.py"
            for n, line in enumerate(p.read_text().splitlines(), 1) if re.search(pattern, line.strip())]
    assert hits == []
