"""Every family reaches a ``parallelize``: its own where it supplies hooks, else the shared one."""

from __future__ import annotations

import pytest
import torch

from megaseq.config import MemorySettings
from megaseq.models import registry
from megaseq.models.build import build_model
from megaseq.models.presets import get_preset
from megaseq.parallel import shard


@pytest.mark.parametrize("family", sorted(registry.FAMILY_PACKAGES))
def test_every_family_has_a_parallelize(family):
    module = registry.parallelize_module(family)
    assert callable(module.parallelize)
    own = family in ("glm5_next", "deepseek_v32", "kimi_linear")  # the families with hooks of their own
    assert (module is shard) != own, module.__name__


def test_the_shared_parallelize_applies_the_schemes():
    spec = get_preset("qwen3-moe-tiny")
    model = build_model(spec, dtype=torch.float64, seed=0)
    done = registry.parallelize(model, MemorySettings(tiled_mlp=True, mlp_tile_tokens=8, recompute=True))
    assert done.tiled == [f"layers.{i}.mlp" for i in range(spec.num_layers)]
    assert done.checkpointed == spec.num_layers


def test_an_unknown_family_is_named(monkeypatch):
    with pytest.raises(ValueError, match="not supported; supported: glm5_next"):
        registry.parallelize_module("nope")
    monkeypatch.setattr(registry, "SHARED_PARALLELIZE", "megaseq.parallel.no_such_module")
    with pytest.raises(ModuleNotFoundError):  # a family without its own module depends on the shared one
        registry.parallelize_module("mixtral")
