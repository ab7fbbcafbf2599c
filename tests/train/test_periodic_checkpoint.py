"""Periodic checkpoints by wall-clock time (``train.save_every_minutes``, on by default): a run killed after its
first interval resumes from the checkpoint that interval wrote, with the uninterrupted run's loss curve, and a
schedule that ignores the interval is caught."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml
from test_faults import _curve, _train  # the run helpers of the kill tests

from megaseq.config import TrainConfig
from megaseq.train.checkpoint import latest_resumable
from megaseq.train.periodic import SaveSchedule

STEPS, KILL_AT = 6, 4  # the child is killed as step KILL_AT starts: steps 1..3 are done


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_schedule_saves_on_the_interval_and_on_steps():
    clock = FakeClock()
    s = SaveSchedule(0, 30.0, clock=clock)
    clock.t += 29.9 * 60
    assert not s.due(1)
    clock.t += 0.1 * 60
    assert s.due(2)
    s.saved()
    assert not s.due(3)
    assert SaveSchedule(5, 0.0, clock=clock).due(10) and not SaveSchedule(5, 0.0, clock=clock).due(11)
    assert not SaveSchedule(0, 0.0, clock=clock).due(1)  # both off: only the end and signals save


def test_the_default_saves_every_30_minutes():
    assert TrainConfig().save_every_minutes == 30.0 and TrainConfig().save_every == 0


def _recipe(root: Path) -> Path:
    genome = root / "g.fa"
    genome.write_text(">chr\n" + "".join(np.random.default_rng(3).choice(list("ACGT"), 1500)) + "\n")
    raw = {"model": {"name": "qwen3-moe-tiny", "dtype": "fp32"},
           "data": {"train": [str(genome)], "seq_len": 32, "heldout_tail": 0},
           "train": {"steps": STEPS, "run_dir": str(root / "run"), "export_hf": False, "eval_after": False},
           "optim": {"lr": 5e-3, "warmup_steps": 2}, "log": {"progress": False, "tensorboard": False}}
    path = root / "r.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


CHILD = """
import os, signal, sys, torch
from megaseq.train import periodic
from megaseq.train import step as train_step_module
torch.set_num_threads(1)
if {broken}:  # the interval ignored: only the step rule
    periodic.SaveSchedule.due = lambda self, step: bool(self.every_steps and step % self.every_steps == 0)
real, calls = train_step_module.train_step, [0]
def step(*a, **k):
    calls[0] += 1
    if calls[0] == {kill_at}:
        os.kill(os.getpid(), signal.SIGKILL)
    return real(*a, **k)
train_step_module.train_step = step
from megaseq.cli.main import main
sys.exit(main(["train", {recipe!r}, "--train.save_every_minutes", "1e-9"]))
"""


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    root = tmp_path_factory.mktemp("ref")
    assert _train(str(_recipe(root))) == 0
    return _curve(root / "run")


def _kill_after_first_interval_then_resume(root: Path, want: list[float], capsys, broken: bool = False) -> None:
    recipe = _recipe(root)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2] / "src"), "OMP_NUM_THREADS": "1"}
    child = subprocess.run([sys.executable, "-c", CHILD.format(broken=broken, kill_at=KILL_AT, recipe=str(recipe))],
                           env=env, capture_output=True, text=True, timeout=300)
    assert child.returncode == -signal.SIGKILL, child.stderr
    run_dir = root / "run"
    newest = latest_resumable(run_dir)
    assert newest is not None and newest.name == f"step_{KILL_AT - 1:06d}", newest  # at most one step lost
    capsys.readouterr()
    assert _train(str(recipe), "--train.resume", "true") == 0  # default settings otherwise
    said = capsys.readouterr()
    assert f"at step {KILL_AT - 1}" in said.out + said.err
    assert _curve(run_dir) == want  # bitwise: the same floats


def test_a_run_killed_after_its_first_interval_resumes(uninterrupted, tmp_path, capsys):
    _kill_after_first_interval_then_resume(tmp_path, uninterrupted, capsys)


def test_a_schedule_that_ignores_the_interval_fails_the_check(uninterrupted, tmp_path, capsys):
    with pytest.raises(AssertionError, match="None|step_"):
        _kill_after_first_interval_then_resume(tmp_path, uninterrupted, capsys, broken=True)
