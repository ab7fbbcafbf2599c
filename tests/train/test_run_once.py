"""What a run does once: resolve its model spec (the planner and the parallel environment reuse it)."""

from __future__ import annotations

import torch
from test_train import _cfg

from megaseq.models import presets
from megaseq.train.trainer import run_training

torch.set_num_threads(2)


def test_a_run_resolves_its_spec_once(tmp_path, monkeypatch):
    calls = []
    real = presets.resolve_spec
    monkeypatch.setattr(presets, "resolve_spec", lambda name: calls.append(name) or real(name))
    result = run_training(_cfg(tmp_path, "r", train={"steps": 1}))
    assert result.losses and calls == ["glm5-flash-tiny"]
