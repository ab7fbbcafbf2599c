"""Each memory scheme is declared once (``megaseq.schemes``): the settings, the planner's fixes, the runtime's
record of what it applied and the rules between schemes all read the same records."""

from __future__ import annotations

import dataclasses
import importlib

import pytest

from megaseq import schemes
from megaseq.config import MemorySettings
from megaseq.memory.apply import AppliedMemory
from megaseq.plan.fixes import FIXES, LADDER


def test_every_setting_belongs_to_one_scheme():
    owned = [k for s in schemes.SCHEMES.values() for k in dict.fromkeys((s.switch, *s.sizes, *s.options))]
    assert sorted(owned) == sorted(f.name for f in dataclasses.fields(MemorySettings))
    assert len(owned) == len(set(owned))


def test_the_planner_reads_the_records():
    assert LADDER == tuple(schemes.SCHEMES)
    for name, fix in FIXES.items():
        s = schemes.SCHEMES[name]
        assert (fix.setting, fix.runtime, fix.formula, fix.requires, fix.excludes) == (
            s.switch, s.runtime, s.formula, s.requires, s.excludes)


def test_records_name_what_exists():
    """Every runtime applier under ``memory.`` imports, every ``applied`` is an ``AppliedMemory`` field, every
    requirement or exclusion is a scheme."""
    fields = {f.name for f in dataclasses.fields(AppliedMemory)}
    for s in schemes.SCHEMES.values():
        assert not s.applied or s.applied in fields, s
        assert set(s.requires) | set(s.excludes) <= set(schemes.SCHEMES), s
        target = s.runtime.split(" ")[0]
        if target.startswith("memory."):
            try:
                importlib.import_module(f"megaseq.{target}")
            except ModuleNotFoundError:
                module, attr = target.rsplit(".", 1)
                assert hasattr(importlib.import_module(f"megaseq.{module}"), attr), s


def test_derived_tables():
    assert set(schemes.SIZE_SETTINGS) == {"loss_chunk_tokens", "mlp_tile_tokens", "indexer_query_chunk",
                                          "offload_host_budget", "optimizer_bucket_params", "kda_segment_tokens",
                                          "model_segment_tokens"}
    assert schemes.SEGMENT_EXCLUDED == ("recompute", "checkpoint_offload", "kda_segment_tokens")
    assert set(schemes.REPLAYING) == {"tiled_mlp", "recompute", "kda_segment_tokens", "model_segment_tokens"}


@pytest.mark.parametrize(("settings", "message"), [
    (dict(checkpoint_offload=True), "memory.checkpoint_offload needs memory.recompute: set --memory.recompute true"),
    (dict(model_segment_tokens=64, recompute=True, kda_segment_tokens=32),
     r"memory.model_segment_tokens=64 with memory.recompute, memory.kda_segment_tokens: .*"
     r"\(--memory.recompute false, --memory.checkpoint_offload false, --memory.kda_segment_tokens 0\)"),
])
def test_the_rules_come_from_the_records(settings, message, monkeypatch):
    """The combination check refuses what the records forbid, and only from them: with the requirement or
    the exclusion taken out of the record (a broken declaration), the same settings pass."""
    m = MemorySettings(**settings)
    with pytest.raises(ValueError, match=message):
        m.check_combination()
    name = "checkpoint_offload" if "checkpoint_offload" in settings else "model_segments"
    broken = dataclasses.replace(schemes.SCHEMES[name], requires=(), excludes=())
    monkeypatch.setitem(schemes.SCHEMES, name, broken)
    m.check_combination()

