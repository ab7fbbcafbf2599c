"""Sharded checkpoints end to end through the trainer (``megaseq train`` in gloo processes, float64; the model
glm5-flash-tiny's first 4 layers, every kind once: ``conftest.glm5_tiny4``, given as its config.json): a run
on 4 ranks (dp 2 x cp 2, fully sharded) checkpoints every 2 steps; its step-2 checkpoint resumes on 2 ranks
(dp 2, FSDP over dp) and on 1 (no FSDP, the same 2 sequences per step) and continues the same loss curve;
the 4-rank run's HF export loads in transformers and gives the logits of its final weights."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import glm5_tiny4, run_as_of_step
from megaseq.config import build_config
from megaseq.parallel.launch import spawn_local
from megaseq.train import checkpoint as ckpt

STEPS = 4


def _fasta(path: Path) -> Path:
    rng = np.random.default_rng(4)
    path.write_text(">rec\n" + "".join(rng.choice(list("ACGT"), 4000)) + "\n")
    return path


def _model_config(tmp: Path) -> Path:
    """glm5_tiny4's config.json: ``megaseq train`` builds that architecture from random (``model.name``)."""
    from megaseq.models.spec import to_hf_config

    path = tmp / "glm5_tiny4" / "config.json"
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps(to_hf_config(glm5_tiny4())))
    return path


def _overrides(tmp: Path, run: str, dp: int, cp: int, fsdp: str, batch: int, **extra) -> dict:
    return {"model.name": str(tmp / "glm5_tiny4" / "config.json"), "model.dtype": "fp64",
            "data.train": [str(tmp / "g.fa")], "data.seq_len": 32, "data.heldout_tail": 0,
            "train.steps": STEPS, "train.batch_size": batch, "train.save_every": 2,
            "train.keep_checkpoints": 10, "train.run_dir": str(tmp / run),
            "train.eval_after": False, "train.export_hf": False, "train.device": "cpu",
            "optim.lr": 3e-3, "optim.warmup_steps": 1, "log.progress": False, "log.tensorboard": False,
            "parallel.dp": dp, "parallel.cp": cp, "parallel.fsdp": fsdp, "parallel.backend": "gloo", **extra}


def _train_rank(rank: int, overrides: dict) -> None:
    from megaseq.train.trainer import run_training

    torch.set_num_threads(1)
    run_training(build_config(overrides=overrides))


def _losses(run_dir: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def four_rank_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fsdp_ckpt")
    _fasta(tmp / "g.fa")
    _model_config(tmp)
    spawn_local(_train_rank, 4, args=(_overrides(tmp, "four", 2, 2, "dp_cp", 1, **{"train.export_hf": True}),))
    return tmp


def _resume_from_step_2(tmp: Path, name: str) -> Path:
    """A copy of the 4-rank run with its step-4 checkpoint, its export and the metrics after step 2 removed."""
    return run_as_of_step(tmp / "four", tmp / name, 2)


def test_four_rank_checkpoint_is_sharded_and_complete(four_rank_run):
    step2 = four_rank_run / "four" / ckpt.CKPT_DIR / "step_000002"
    assert ckpt.read_meta(step2)["step"] == 2
    assert len(list(step2.glob("*.distcp"))) == 4  # every rank wrote its own shards
    assert not list((four_rank_run / "four" / ckpt.CKPT_DIR).glob("*.tmp-*"))


@pytest.mark.parametrize("dp, fsdp, batch, world", [(2, "dp", 1, 2), (1, "off", 2, 1)])
def test_resume_on_another_mesh_continues_the_loss_curve(four_rank_run, dp, fsdp, batch, world):
    tmp = four_rank_run
    run = _resume_from_step_2(tmp, f"resumed_{world}")
    overrides = _overrides(tmp, run.name, dp, 1, fsdp, batch, **{"train.resume": True})
    if world == 1:
        _train_rank(0, overrides)
    else:
        spawn_local(_train_rank, world, args=(overrides,))
    want, got = _losses(tmp / "four"), _losses(run)
    assert len(got) == STEPS
    np.testing.assert_allclose(got[2:], want[2:], rtol=1e-6, atol=0)
    print(f"\nresumed on {world} rank(s): loss steps 3-4 {got[2:]} vs {want[2:]} "
          f"(max rel {max(abs(g - w) / abs(w) for g, w in zip(got[2:], want[2:])):.1e})")


def test_hf_export_of_the_four_rank_run_matches_transformers(four_rank_run):
    transformers = pytest.importorskip("transformers")
    from megaseq.models.hf_io import load_hf_checkpoint
    from megaseq.train.convert import load_megaseq_checkpoint

    ours, _, _ = load_megaseq_checkpoint(four_rank_run / "four", dtype=torch.float64)  # step 4, one process
    hf_dir = four_rank_run / "four" / "hf"
    exported = load_hf_checkpoint(hf_dir, dtype=torch.float64).state_dict()
    for name, t in ours.state_dict().items():
        assert torch.equal(exported[name], t), name  # the exported weights are the final ones, bit for bit
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf = transformers.AutoModelForImageTextToText.from_pretrained(hf_dir, dtype=torch.float64)
    hf.model.language_model.config._experts_implementation = "eager"
    hf.model.language_model.config._attn_implementation = "eager"
    theirs = {k.removeprefix("model.language_model."): v for k, v in hf.state_dict().items() if "visual" not in k}
    for name, t in ours.state_dict().items():  # (transformers keeps mHC base/scale in fp32)
        assert torch.equal(theirs[name], t.to(theirs[name].dtype)), name
    ids = torch.randint(1, 5, (1, 29), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        want = hf.eval()(input_ids=ids).logits
        got = ours.logits(ours(ids))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
