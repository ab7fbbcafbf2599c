"""The indexer's dense warm-up (``model.dsa_warmup_steps``) with the optimizers other than torch's AdamW:
OffloadStreamAdamW (``memory.optimizer_offload``, full fine-tune and LoRA) and MasterAdamW (``model.weights bf16``,
fp32 masters; FSDP2 with a frozen base: tests/parallel/test_indexer_warmup_fsdp.py). For each, through the
trainer:

- in the warm-up only the indexers' parameters change (everything else bitwise as built), after it the rest
  train too;
- a run resumed from a checkpoint written inside its warm-up has the uninterrupted run's losses and final
  trained parameters, bit for bit.

Both optimizers make every parameter's state when they are built (step 0, zero moments, the master equal to the
weight): a checkpoint of the warm-up holds what the first update after it needs, with no completion.

MasterAdamW beside a frozen base (LoRA with ``model.weights bf16``) is refused by the config: the test holds its
message to naming the settings and the fix.

Broken variants that must fail: the warm-up freezing nothing (other parameters change in it); a checkpoint
written without what the warm-up froze (``indexer_training.thawed`` skipped: with LoRA the resume is
refused); the optimizer's step counts lost on resume (it diverges).
"""

from __future__ import annotations

import contextlib
import json

import pytest
import torch
from test_train import _cfg

from conftest import run_as_of_step
from megaseq.train.trainer import run_training

torch.set_num_threads(2)

WARMUP = {"dtype": "fp32", "train_indexer": True, "dsa_warmup_steps": 2}
LORA = {"rank": 4, "targets": ["attention"]}
CASES = {  # model, memory and LoRA settings of each optimizer's run
    "offload-full": ({}, {"auto": False, "optimizer_offload": True}, {}),
    "offload-lora": ({}, {"auto": False, "optimizer_offload": True}, LORA),
    "master-full": ({"weights": "bf16", "dtype": "bf16"}, {}, {}),
}


def _run(tmp_path, name: str, case: str, steps: int = 3, resume: bool = False):
    """The run of ``case`` (a checkpoint after every step); returns (losses, the model at each step's start and
    at the end: named trained-or-not parameters, cloned, or only the end when ``resume``, optimizer type)."""
    from megaseq.train import indexer_training, trainer

    model_over, memory, lora = CASES[case]
    seen: dict = {"shots": []}
    real_build, real_begin = trainer.build_planned_model, indexer_training.begin_step

    def spy_build(*a, **kw):
        out = real_build(*a, **kw)
        seen["model"], seen["optimizer"] = out[0], out[2]
        return out

    def spy_begin(model, step):
        seen["shots"].append({n: p.detach().clone() for n, p in model.named_parameters()})
        return real_begin(model, step)

    cfg = _cfg(tmp_path, name, model={**WARMUP, **model_over}, memory=memory, lora=lora,
               train={"steps": steps, "save_every": 1, "keep_checkpoints": 10, "resume": resume})
    trainer.build_planned_model, indexer_training.begin_step = spy_build, spy_begin
    try:
        run_training(cfg)
    finally:
        trainer.build_planned_model, indexer_training.begin_step = real_build, real_begin
    seen["shots"].append({n: p.detach().clone() for n, p in seen["model"].named_parameters()})
    losses = [json.loads(line)["loss"] for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    return losses, seen["shots"], type(seen["optimizer"]).__name__


def _changed(a: dict, b: dict) -> set[str]:
    return {n for n in a if not torch.equal(a[n], b[n])}


def _assert_stages(shots: list[dict], lora: bool) -> None:
    """Steps 1-2 (the warm-up) change only indexer parameters; step 3 (the sparse stage) the rest too."""
    from megaseq.models.common.lora import is_adapter

    warm = _changed(shots[0], shots[2])
    assert warm and all(".indexer." in n for n in warm), sorted(warm)[:5]
    after = _changed(shots[2], shots[3])
    assert any(".indexer." in n for n in after)
    others = {n for n in after if ".indexer." not in n}
    assert others, "nothing but the indexers trained after the warm-up"
    if lora:
        assert all(is_adapter(n) for n in others), sorted(others)[:5]


def _assert_resumes(tmp_path, case: str, want_losses: list[float], want: dict) -> None:
    """The run resumed from its step-1 checkpoint (inside the 2-step warm-up) has the uninterrupted run's losses
    and final parameters, bit for bit."""
    run_as_of_step(tmp_path / "full", tmp_path / "part", 1)
    got_losses, got_shots, _ = _run(tmp_path, "part", case, resume=True)
    assert got_losses == want_losses
    got = got_shots[-1]
    assert want.keys() == got.keys()
    differ = sorted(n for n in want if not torch.equal(want[n], got[n]))
    assert not differ, differ[:5]


OPTIMIZER = {"offload": "OffloadStreamAdamW", "master": "MasterAdamW"}
SLOW = pytest.mark.slow


@pytest.mark.parametrize("case", [c if c == "offload-full" else pytest.param(c, marks=SLOW) for c in CASES])
def test_the_warmup_trains_the_indexers_alone_and_resumes_exactly(tmp_path, case) -> None:
    losses, shots, opt = _run(tmp_path, "full", case)
    assert opt == OPTIMIZER[case.split("-")[0]]
    _assert_stages(shots, lora=case.endswith("lora"))
    _assert_resumes(tmp_path, case, losses, shots[-1])


@pytest.mark.slow
def test_a_warmup_that_freezes_nothing_fails_the_check(tmp_path, monkeypatch) -> None:
    """Broken: the warm-up leaves the main model trainable (its freezing undone)."""
    from megaseq.train import indexer_training

    real = indexer_training.begin_step

    def no_freeze(model, step):
        real(model, step)
        state = indexer_training._state(model)
        for p in state.frozen_by_warmup:
            p.requires_grad_(True)
        state.frozen_by_warmup = []

    monkeypatch.setattr(indexer_training, "begin_step", no_freeze)
    _, shots, _ = _run(tmp_path, "r", "offload-full", steps=3)
    with pytest.raises(AssertionError):
        _assert_stages(shots, lora=False)


@pytest.mark.slow
def test_a_warmup_checkpoint_without_what_it_froze_fails_the_check(tmp_path, monkeypatch) -> None:
    """Broken: the checkpoint written as the warm-up's frozen set would write it (``thawed`` skipped): the
    adapters left out, the resume refused. (A full fine-tune's checkpoint holds every weight and these optimizers'
    state for every parameter either way: there it resumes exactly without ``thawed``.)"""
    from megaseq.train import indexer_training

    monkeypatch.setattr(indexer_training, "thawed", lambda model, optimizer=None: contextlib.nullcontext())
    losses, shots, _ = _run(tmp_path, "full", "offload-lora")
    with pytest.raises(ValueError, match="trained other parameters than this run does"):
        _assert_resumes(tmp_path, "offload-lora", losses, shots[-1])


@pytest.mark.slow
@pytest.mark.parametrize("case", ["offload-full", "master-full"])
def test_a_resume_that_loses_the_optimizer_steps_diverges(tmp_path, monkeypatch, case) -> None:
    """Broken: the optimizer's step counts not restored (the indexers' bias correction starts again)."""
    from megaseq.memory.master_adam import MasterAdamW
    from megaseq.memory.offload_adam import OffloadStreamAdamW

    losses, shots, _ = _run(tmp_path, "full", case)
    cls = OffloadStreamAdamW if case.startswith("offload") else MasterAdamW
    real = cls.load_state_dict

    def lose_steps(self, state_dict):
        real(self, state_dict)
        for st in self.state.values():
            st["step"].zero_()

    monkeypatch.setattr(cls, "load_state_dict", lose_steps)
    with pytest.raises(AssertionError):
        _assert_resumes(tmp_path, case, losses, shots[-1])


def test_bf16_weights_beside_lora_are_refused_naming_the_fix(tmp_path) -> None:
    """MasterAdamW with a frozen base: refused before the run directory is claimed, naming both settings."""
    with pytest.raises(ValueError, match=r"lora.rank 4 .*model.weights bf16.*set --model.weights fp32"):
        run_training(_cfg(tmp_path, "r", model={**WARMUP, "weights": "bf16", "dtype": "bf16"}, lora=LORA,
                          train={"steps": 1}))
    assert not (tmp_path / "r").exists()
