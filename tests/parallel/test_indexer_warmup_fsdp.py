"""The indexer's dense warm-up under FSDP2 over 2 gloo ranks with a frozen base (LoRA on the attention),
float64, through ``megaseq train``: in the warm-up only the indexers' parameters change (the adapters and the
sharded base bitwise as built), after it the adapters train too; a run resumed on 2 ranks from a checkpoint
written inside its warm-up has the uninterrupted run's losses and final parameters, bit for bit.

The optimizer here is ``master_adam.SplitAdamW`` (the indexers are sharded, the adapters whole): a subclass of
torch's AdamW, whose state for what the warm-up froze ``indexer_training.initial_adam_state`` completes before
the checkpoint. Broken variants that must fail: that completion for torch's exact AdamW only (the checkpoint
lacks the adapters' optimizer state: the resume is refused); the checkpoint written without what the warm-up
froze (``indexer_training.thawed`` skipped).
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import run_as_of_step
from megaseq.parallel.launch import spawn_local

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.slow]


def _overrides(tmp: Path, run: str, **extra) -> dict:
    return {"model.name": "glm5-flash-tiny", "model.dtype": "fp64", "model.train_indexer": True,
            "model.dsa_warmup_steps": 2, "data.train": [str(tmp / "g.fa")], "data.seq_len": 32,
            "data.heldout_tail": 0, "train.steps": 3, "train.batch_size": 1, "train.save_every": 1,
            "train.keep_checkpoints": 10, "train.run_dir": str(tmp / run), "train.eval_after": False,
            "train.export_hf": False, "train.device": "cpu", "optim.lr": 1e-2, "optim.warmup_steps": 1,
            "log.progress": False, "log.tensorboard": False, "parallel.dp": 2, "parallel.fsdp": "dp",
            "parallel.backend": "gloo", "lora.rank": 4, "lora.targets": ["attention"], **extra}


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def _exact_type_only(real):
    """Broken: the state completed for ``torch.optim.Adam`` / ``AdamW`` themselves, not their subclasses."""
    def complete(optimizer, params):
        if type(optimizer) in (torch.optim.Adam, torch.optim.AdamW):
            real(optimizer, params)
    return complete


def _rank(rank: int, overrides: dict, out: str, broken: str) -> None:
    """One rank of the run; rank 0 writes the whole parameters at each step's start and at the end to ``out``."""
    from megaseq.config import build_config
    from megaseq.train import indexer_training, trainer

    torch.set_num_threads(1)
    seen: dict = {"shots": []}
    real_begin, real_metrics = indexer_training.begin_step, indexer_training.metrics
    real_build = trainer.build_planned_model

    def spy_build(*a, **kw):
        built = real_build(*a, **kw)
        seen["optimizer"] = type(built[2]).__name__
        return built

    def spy_begin(model, step):
        seen["shots"].append({n: _full(p) for n, p in model.named_parameters()})  # every rank gathers
        return real_begin(model, step)

    def spy_metrics(model, env=None):  # after each step, while the ranks' group is up
        seen["end"] = {n: _full(p) for n, p in model.named_parameters()}
        return real_metrics(model, env)

    indexer_training.begin_step, indexer_training.metrics = spy_begin, spy_metrics
    trainer.build_planned_model = spy_build
    if broken == "thawed":
        indexer_training.thawed = lambda model, optimizer=None: contextlib.nullcontext()
    if broken == "exact_type":
        indexer_training.initial_adam_state = _exact_type_only(indexer_training.initial_adam_state)
    trainer.run_training(build_config(overrides=overrides))
    seen["shots"].append(seen["end"])
    if rank == 0:
        torch.save({"shots": seen["shots"], "optimizer": seen["optimizer"]}, out)


def _run(tmp: Path, run: str, broken: str = "", **extra) -> tuple[list[float], list[dict]]:
    out = tmp / f"{run}.pt"
    spawn_local(_rank, 2, args=(_overrides(tmp, run, **extra), str(out), broken))
    losses = [json.loads(line)["loss"] for line in (tmp / run / "metrics.jsonl").read_text().splitlines()]
    saved = torch.load(out)
    assert saved["optimizer"] == "SplitAdamW"
    return losses, saved["shots"]


def _changed(a: dict, b: dict) -> set[str]:
    return {n for n in a if not torch.equal(a[n], b[n])}


def _resume(tmp: Path, broken: str = "") -> tuple[list[float], list[dict], list[float], list[dict]]:
    rng = np.random.default_rng(3)
    (tmp / "g.fa").write_text(">rec\n" + "".join(rng.choice(list("ACGT"), 2000)) + "\n")
    want_losses, want = _run(tmp, "full", broken)
    run_as_of_step(tmp / "full", tmp / "part", 1)  # the step-1 checkpoint: inside the 2-step warm-up
    got_losses, got = _run(tmp, "part", broken, **{"train.resume": True})
    return want_losses, want, got_losses, got


def test_fsdp_lora_warmup_trains_the_indexers_alone_and_resumes_exactly(tmp_path) -> None:
    from megaseq.models.common.lora import is_adapter

    want_losses, want, got_losses, got = _resume(tmp_path)
    warm = _changed(want[0], want[2])  # steps 1 and 2: the warm-up
    assert warm and all(".indexer." in n for n in warm), sorted(warm)[:5]
    after = _changed(want[2], want[3])  # step 3: the sparse stage
    assert any(".indexer." in n for n in after) and any(is_adapter(n) for n in after)
    assert all(".indexer." in n or is_adapter(n) for n in after), sorted(after)[:5]
    assert got_losses == want_losses
    differ = sorted(n for n in want[-1] if not torch.equal(want[-1][n], got[-1][n]))
    assert not differ, differ[:5]


@pytest.mark.parametrize("broken, match", [
    ("exact_type", "Missing key in checkpoint state_dict: optim.state.*lora_A"),
    ("thawed", "trained other parameters than this run does"),
], ids=["completion-for-exact-AdamW-only", "thawed-skipped"])
def test_fsdp_warmup_checkpoint_without_the_frozen_parameters_state_fails(tmp_path, broken, match) -> None:
    with pytest.raises(Exception, match=match):
        _resume(tmp_path, broken=broken)
