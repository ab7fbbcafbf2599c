"""Python's garbage collector kept out of the steps (``train/host_gc.py``): inside ``steps()`` nothing is collected
automatically, ``between_steps`` collects what the steps left in cycles, leaving the context gives back what it
froze and collects; ``MEGASEQ_GC=auto`` changes nothing; a run calls ``between_steps`` once per step."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from test_train import _cfg

from megaseq.train import host_gc
from megaseq.train.trainer import run_training

torch.set_num_threads(2)


class _Node:
    def __init__(self) -> None:
        self.me = self  # a cycle: reference counting alone never frees it


def _cycle() -> weakref.ref:
    return weakref.ref(_Node())


@pytest.fixture(autouse=True)
def _collector_restored():
    """Each test starts with nothing frozen (the session's conftest freezes what collection made) and leaves the
    collector as it found it."""
    enabled, frozen = gc.isenabled(), gc.get_freeze_count() > 0
    gc.unfreeze()
    yield
    assert not host_gc.active()
    gc.unfreeze()
    if enabled:
        gc.enable()
    if frozen:
        gc.freeze()


def test_inside_the_steps_only_between_steps_collects(monkeypatch):
    monkeypatch.delenv("MEGASEQ_GC", raising=False)
    with host_gc.steps() as stats:
        assert host_gc.active() and not gc.isenabled()
        frozen = gc.get_freeze_count()
        assert frozen > 0  # the objects alive when the steps start are out of every collection
        first_steps = _cycle()
        kept = [_Node() for _ in range(10)]  # made by the first step, alive after it
        host_gc.between_steps()  # after the first step: what it made is frozen, not walked
        assert first_steps() is not None and gc.get_freeze_count() >= frozen + len(kept)
        dead = _cycle()
        for _ in range(5000):  # enough allocations to start an automatic collection if it were on
            _Node()
        assert dead() is not None
        again = gc.get_freeze_count()
        host_gc.between_steps()
        assert dead() is None and stats.steps == 2 and stats.full == 0 and stats.seconds > 0
        assert gc.get_freeze_count() == again  # only the first step's objects are frozen
    assert gc.isenabled() and gc.get_freeze_count() == 0
    assert first_steps() is None  # leaving the steps collects what the first one left


def test_leaving_the_steps_collects_their_cycles(monkeypatch):
    monkeypatch.delenv("MEGASEQ_GC", raising=False)
    with host_gc.steps():
        dead = _cycle()
    assert dead() is None
    host_gc.between_steps()  # outside the context: nothing, no count
    assert host_gc.STATS.steps == 0


def test_every_full_every_th_step_collects_all_generations(monkeypatch):
    monkeypatch.delenv("MEGASEQ_GC", raising=False)
    generations = []
    real = gc.collect
    monkeypatch.setattr(gc, "collect", lambda generation=2: generations.append(generation) or real(generation))
    with host_gc.steps(full_every=3) as stats:
        generations.clear()
        for _ in range(7):
            host_gc.between_steps()
        assert generations == [1, 2, 1, 1, 2, 1] and stats.full == 2  # the first step's objects: frozen
    with host_gc.steps(full_every=1) as stats:
        generations.clear()
        for _ in range(3):
            host_gc.between_steps()
        assert generations == [2, 2] and stats.full == 2


def test_leaving_the_steps_leaves_nothing_frozen(monkeypatch):
    """What the caller had frozen is collectable again too: the objects the steps ran with (a bench row's model
    and optimizer) are dropped right after them, and must not stay frozen with their GPU memory."""
    monkeypatch.delenv("MEGASEQ_GC", raising=False)
    gc.freeze()
    with host_gc.steps():
        kept = _Node()
        host_gc.between_steps()  # the first step's objects frozen, this one among them
    ref = weakref.ref(kept)
    del kept
    gc.collect()
    assert gc.get_freeze_count() == 0 and ref() is None


def test_a_nested_context_leaves_the_collector_to_the_outer_one(monkeypatch):
    monkeypatch.delenv("MEGASEQ_GC", raising=False)
    with host_gc.steps():
        with host_gc.steps():
            pass
        assert host_gc.active() and not gc.isenabled()


def test_gc_auto_leaves_python_s_collector_alone(monkeypatch):
    monkeypatch.delenv("MEGASEQ_GC", raising=False)
    with host_gc.steps():
        host_gc.between_steps()  # the counters of an earlier context, not this one's
    monkeypatch.setenv("MEGASEQ_GC", "auto")
    gc.enable()
    with host_gc.steps() as stats:
        assert gc.isenabled() and gc.get_freeze_count() == 0 and not host_gc.active()
        host_gc.between_steps()
        assert stats.steps == 0


def test_a_bad_setting_is_refused(monkeypatch):
    monkeypatch.setenv("MEGASEQ_GC", "never")
    with pytest.raises(ValueError, match="MEGASEQ_GC"):
        with host_gc.steps():
            pass


def test_a_run_collects_once_per_step(tmp_path, monkeypatch):
    monkeypatch.delenv("MEGASEQ_GC", raising=False)
    seen = []
    real = host_gc.between_steps
    monkeypatch.setattr(host_gc, "between_steps", lambda: seen.append(host_gc.active()) or real())
    result = run_training(_cfg(tmp_path, "gc", train={"steps": 3}))
    assert len(result.losses) == 3 and seen == [True, True, True]
    assert gc.isenabled() and gc.get_freeze_count() == 0


def test_collect_all_reaches_frozen_garbage_and_keeps_the_rest_frozen():
    """``collect_all`` (before a CUDA graph's capture): a garbage cycle frozen inside the steps goes; what lives
    stays frozen."""
    with host_gc.steps():
        alive = _Node()
        probe = _cycle()
        gc.freeze()
        gc.collect()
        assert probe() is not None  # frozen: a plain collection does not reach it
        host_gc.collect_all()
        assert probe() is None and gc.get_freeze_count() > 0
    assert alive is not None
