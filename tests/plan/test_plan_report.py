"""Rendering a plan: the component table, fixes with their costs, the no-fit message, JSON."""

from __future__ import annotations

import pytest

from megaseq.config import MemoryConfig
from megaseq.models.presets import get_preset
from megaseq.plan import Mesh, format_plan, plan, plan_json
from megaseq.plan.report import plan_from_json

SPEC = get_preset("glm5-flash-1gpu")


@pytest.fixture(scope="module")
def fits():
    return plan(SPEC, 64 * 1024)


@pytest.fixture(scope="module")
def too_long():
    # two GPUs of context parallelism and the per-layer fixes only (forced): 1M needs more GPUs
    forced = MemoryConfig(auto=False, recompute=True, chunked_loss=True, tiled_mlp=True, checkpoint_offload=True)
    return plan(SPEC, 1 << 20, Mesh(cp=2, gpus_per_host=2), memory_cfg=forced)


@pytest.mark.parametrize("rich", [False, True])
def test_table_lists_components_and_fixes(fits, rich):
    text = format_plan(fits, rich=rich)
    for name, *_ in fits.components:
        assert name in text
    for name, cost, _ in fits.fixes:
        assert name in text and f"{cost * 100:5.1f}%" in text
    assert "headroom" in text and "Fits" in text and "64K tokens" in text


def test_no_fit_message(too_long):
    text = format_plan(too_long, rich=False)
    assert "Does not fit" in text and too_long.binding in text and "--parallel.cp" in text


def test_json_round_trip(too_long):
    again = plan_from_json(plan_json(too_long))
    assert again == too_long
