"""Nothing non-finite reaches the disk, even when the divergence guard does not fire: an update whose loss and
gradient norm were finite can still overflow a weight (a large learning rate, an fp16 moment). Then the next
checkpoint is refused before a byte is written and the run stops naming the step and the tensor; the HF export
refuses a non-finite tensor leaving the previous export as it was; a checkpoint with a non-finite weight (written
by something else) is not loaded. The overflow is injected: after the real update of step ``BAD``, one weight is
set to inf. Broken variant: with ``check_finite`` a no-op the same run writes an infinite checkpoint, which the
first test's checks would catch.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from megaseq.cli.main import main
from megaseq.train import checkpoint as ckpt
from megaseq.train import safe_checkpoint
from megaseq.train import step as train_step_module

torch.set_num_threads(2)
BAD = 3  # the step whose update overflows


def _recipe(tmp: Path, **train) -> Path:
    genome = tmp / "g.fa"
    genome.write_text(">chr\n" + "".join(np.random.default_rng(0).choice(list("ACGT"), 600)) + "\n")
    raw = {"model": {"name": "qwen3-moe-tiny", "dtype": "fp32"},
           "data": {"train": [str(genome)], "seq_len": 32, "heldout_tail": 0},
           "train": {"steps": 5, "run_dir": str(tmp / "r"), "save_every": 1, "export_hf": True,
                     "eval_after": False, "keep_checkpoints": 10, **train},
           "log": {"progress": False, "tensorboard": False}}
    path = tmp / "recipe.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


@pytest.fixture
def overflow_at_bad_step(monkeypatch):
    """After step BAD's real update, one weight holds inf (its loss and gradient norm were finite)."""
    real, calls = train_step_module.train_step, [0]

    def step(state, *a, **k):
        out = real(state, *a, **k)
        calls[0] += 1
        if calls[0] == BAD:
            with torch.no_grad():
                next(state.model.parameters()).view(-1)[0] = float("inf")
        return out
    monkeypatch.setattr(train_step_module, "train_step", step)


def _finite(path: Path) -> bool:
    from megaseq.train.convert import load_megaseq_checkpoint

    model, _, _ = load_megaseq_checkpoint(path)
    return all(bool(torch.isfinite(t).all()) for t in model.state_dict().values())


def test_an_overflowing_update_stops_the_run_naming_the_step(overflow_at_bad_step, tmp_path, capsys):
    capsys.readouterr()
    rc = main(["train", str(_recipe(tmp_path))])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err, err
    lines = [ln for ln in err.splitlines() if ln.startswith("megaseq train:")]
    assert len(lines) == 1, err
    run = tmp_path / "r"
    assert re.search(rf"training diverged at step {BAD}: its loss and gradient norm were finite but the update made "
                     rf"the weights non-finite \(\S+ holds NaN or infinite values, so checkpoint "
                     rf"{re.escape(str(run / 'checkpoints' / f'step_{BAD:06d}'))} was not written\)\. The newest "
                     rf"resumable checkpoint is {re.escape(str(run / 'checkpoints' / f'step_{BAD - 1:06d}'))}\. "
                     r"Lower --optim\.lr \(it was \S+ at this step\)", lines[0]), lines[0]
    assert [s for s, _ in ckpt.list_complete(run)] == list(range(1, BAD))
    assert all(_finite(p) for _, p in ckpt.list_complete(run))
    assert not list(run.rglob("*.tmp-*")) and not (run / "hf").exists() and not list(run.glob(".hf*"))


def test_without_the_check_an_infinite_checkpoint_is_written(overflow_at_bad_step, tmp_path, capsys, monkeypatch):
    """The broken variant: no check before the write. The run goes on and step BAD's checkpoint holds inf, so
    the first test's assertions (no checkpoint from step BAD, every checkpoint finite) would fail."""
    monkeypatch.setattr(safe_checkpoint, "check_finite", lambda model, what: None)
    main(["train", str(_recipe(tmp_path, steps=BAD, export_hf=False))])
    found = dict(ckpt.list_complete(tmp_path / "r"))
    assert BAD in found
    monkeypatch.undo()
    with pytest.raises(ValueError, match=r"holds NaN or infinite values; it is not loaded"):
        _finite(found[BAD])  # and the reader refuses it: the last line of defence


def test_a_non_finite_checkpoint_is_not_resumed(overflow_at_bad_step, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(safe_checkpoint, "check_finite", lambda model, what: None)
    main(["train", str(_recipe(tmp_path, steps=BAD, export_hf=False))])  # step BAD's checkpoint holds inf
    monkeypatch.undo()
    capsys.readouterr()
    rc = main(["train", str(_recipe(tmp_path, steps=BAD + 2, export_hf=False)), "--train.resume", "true"])
    err = capsys.readouterr().err
    bad = tmp_path / "r" / "checkpoints" / f"step_{BAD:06d}"
    assert rc == 2 and "Traceback" not in err, err
    assert f"checkpoint {bad}: " in err and "holds NaN or infinite values; it is not loaded" in err, err


def test_the_export_refuses_a_non_finite_tensor_and_keeps_the_old_one(tmp_path):
    from megaseq.models.build import build_model
    from megaseq.models.hf_io import export_hf_checkpoint
    from megaseq.models.presets import get_preset

    spec = get_preset("qwen3-moe-tiny")
    model = build_model(spec, dtype=torch.float32, seed=0)
    out = export_hf_checkpoint(model, spec, tmp_path / "hf")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    name, param = next(iter(model.named_parameters()))
    with torch.no_grad():
        param.view(-1)[-1] = float("nan")
    with pytest.raises(ValueError, match=r"holds NaN or infinite values: the HF export was not written"):
        export_hf_checkpoint(model, spec, tmp_path / "hf")
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]  # no temporary directory left
