"""What a run does once: resolve its model spec (the planner and the parallel environment reuse it), check its
sequence segments once per purpose (the plan, the runtime applying them), never per step."""

from __future__ import annotations

import pytest
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


def _count_segment_checks(monkeypatch) -> list[str]:
    """Record each ``check_model_segments`` call by the module that made it (the planner, the runtime)."""
    from megaseq.memory import apply
    from megaseq.plan import planner

    calls: list[str] = []
    for mod in (apply, planner):
        real = mod.check_model_segments
        monkeypatch.setattr(mod, "check_model_segments",
                            lambda *a, _real=real, _who=mod.__name__: calls.append(_who) or _real(*a))
    return calls


def _segmented_run(tmp_path, name: str):
    return run_training(_cfg(tmp_path, name, data={"seq_len": 96}, train={"steps": 3},
                             memory={"auto": False, "model_segment_tokens": 40}))


def test_a_run_checks_its_sequence_segments_once_per_purpose(tmp_path, monkeypatch):
    """Forced sequence segments are checked once by the planner (before anything runs) and once when the runtime
    applies them (its own guard); never per step."""
    calls = _count_segment_checks(monkeypatch)
    assert len(_segmented_run(tmp_path, "r").losses) == 3
    assert sorted(calls) == ["megaseq.memory.apply", "megaseq.plan.planner"], calls


def test_a_check_per_step_fails_the_count(tmp_path, monkeypatch):
    """The broken variant: the step checks the segments again each time; the count above catches it."""
    from megaseq.memory import apply
    from megaseq.train import step

    real_step = step.train_step

    def checking_step(state, *a, **k):
        apply.check_model_segments("glm5_next", state.memory.model_segment_tokens, 1)
        return real_step(state, *a, **k)

    monkeypatch.setattr(step, "train_step", checking_step)
    with pytest.raises(AssertionError, match="megaseq.memory.apply"):
        test_a_run_checks_its_sequence_segments_once_per_purpose(tmp_path, monkeypatch)
