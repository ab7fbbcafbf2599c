"""``model.train_indexer`` through the trainer: the warm-up's steps then the sparse stage, the indexers' metrics
in metrics.jsonl, the main model frozen during the warm-up; and the settings' validation."""

from __future__ import annotations

import json

import pytest
import torch
from test_train import _cfg

from megaseq.config import build_config
from megaseq.train.trainer import run_training

torch.set_num_threads(2)


def test_warmup_then_sparse_through_the_trainer(tmp_path) -> None:
    cfg = _cfg(tmp_path, "r", model={"dtype": "fp32", "train_indexer": True, "dsa_warmup_steps": 2},
               train={"steps": 4})
    run_training(cfg)
    records = [json.loads(line) for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    assert [r["indexer_dense"] for r in records] == [1.0, 1.0, 0.0, 0.0]
    kls = [k for k in records[0] if k.startswith("indexer_kl/")]
    assert kls and all(r[k] >= 0 for r in records for k in kls)


@pytest.mark.parametrize("model, match", [
    ({"dsa_warmup_steps": 3}, "model.train_indexer"),
    ({"train_indexer": True, "indexer_loss_coef": 0.0}, "indexer_loss_coef 0"),
    ({"indexer_loss_coef": -1.0}, "model.indexer_loss_coef must be >= 0"),
    ({"train_indexer": True, "dsa_warmup_steps": 2, "name": "qwen3-moe-tiny"}, "no DSA indexer to train"),
])
def test_settings_are_checked(tmp_path, model, match) -> None:
    lora = model.pop("lora", {})
    with pytest.raises(ValueError, match=match):
        run_training(_cfg(tmp_path, "r", model={"dtype": "fp32", **model}, train={"steps": 1}, lora=lora))
    assert not (tmp_path / "r").exists()  # refused before the run directory was claimed


def test_default_leaves_the_indexer_as_loaded() -> None:
    cfg = build_config({})
    assert not cfg.model.train_indexer and cfg.model.indexer_loss_coef == 0.001


def test_indexer_trains_beside_lora_adapters(tmp_path) -> None:
    """LoRA on the attention, the indexer in full: the adapters and the indexers change, the frozen base not."""
    from megaseq.models.common.lora import is_adapter
    from megaseq.train import trainer

    seen = {}
    real = trainer.build_planned_model

    def spy(*a, **kw):
        out = real(*a, **kw)
        seen["model"] = out[0]
        seen["before"] = {n: p.detach().clone() for n, p in out[0].named_parameters()}
        return out

    cfg = _cfg(tmp_path, "r", model={"dtype": "fp32", "train_indexer": True}, train={"steps": 2},
               lora={"rank": 4, "targets": ["attention"]})
    trainer.build_planned_model = spy
    try:
        run_training(cfg)
    finally:
        trainer.build_planned_model = real
    model, before = seen["model"], seen["before"]
    changed = {n for n, p in model.named_parameters() if not torch.equal(p.detach(), before[n])}
    assert any(".indexer." in n for n in changed) and any(is_adapter(n) for n in changed)
    assert all(".indexer." in n or is_adapter(n) for n in changed), sorted(changed)[:5]


# ---- the warm-up beside LoRA: the adapters frozen in it, trained after; a stop inside it resumes exactly -------
WARMUP_LORA = {"model": {"dtype": "fp32", "train_indexer": True, "dsa_warmup_steps": 2},
               "lora": {"rank": 4, "targets": ["attention"]}}


def _snapshots(tmp_path, name: str, steps: int = 4) -> list[dict[str, torch.Tensor]]:
    """The trained parameters at the start of every step and at the end, through the trainer."""
    from megaseq.train import indexer_training

    shots, real = [], indexer_training.begin_step
    seen = {}

    def spy(model, step):
        seen["model"] = model
        shots.append({n: p.detach().clone() for n, p in model.named_parameters()})
        return real(model, step)

    indexer_training.begin_step = spy
    try:
        run_training(_cfg(tmp_path, name, model=WARMUP_LORA["model"], train={"steps": steps},
                          lora=WARMUP_LORA["lora"]))
    finally:
        indexer_training.begin_step = real
    shots.append({n: p.detach().clone() for n, p in seen["model"].named_parameters()})
    return shots


def test_the_warmup_freezes_the_adapters_then_they_train(tmp_path) -> None:
    from megaseq.models.common.lora import is_adapter

    shots = _snapshots(tmp_path, "r")  # [start of step 1, 2, 3, 4, end]

    def changed(a, b):
        return {n for n in a if not torch.equal(a[n], b[n])}

    warm = changed(shots[0], shots[2])  # steps 1 and 2: the warm-up
    assert warm and all(".indexer." in n for n in warm), sorted(warm)[:5]
    after = changed(shots[2], shots[4])  # steps 3 and 4: the sparse stage
    assert any(is_adapter(n) for n in after) and any(".indexer." in n for n in after)
    assert all(".indexer." in n or is_adapter(n) for n in after), sorted(after)[:5]


def _stop_in_warmup_then_resume(tmp_path, monkeypatch, capsys, lora: dict) -> list[float]:
    """SIGTERM in step 1 (inside the 2-step warm-up): a checkpoint of step 1, then the resume to step 4."""
    import os
    import signal

    import yaml

    from megaseq.cli.main import main
    from megaseq.train import step as trainer  # the module the loop calls train_step from

    raw = _cfg(tmp_path, "s", model=WARMUP_LORA["model"], train={"steps": 4}, lora=lora).to_dict()
    recipe = tmp_path / "s.yaml"
    recipe.write_text(yaml.safe_dump(raw))
    real, calls = trainer.train_step, [0]

    def step(*a, **kw):
        calls[0] += 1
        if calls[0] == 1:
            os.kill(os.getpid(), signal.SIGTERM)  # the trainer's handler: this step finishes, then it saves
        return real(*a, **kw)

    monkeypatch.setattr(trainer, "train_step", step)
    assert main(["train", str(recipe)]) == 128 + signal.SIGTERM
    monkeypatch.setattr(trainer, "train_step", real)
    capsys.readouterr()
    assert main(["train", str(recipe), "--train.resume", "true"]) == 0, capsys.readouterr().err
    return [json.loads(line)["loss"] for line in (tmp_path / "s" / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("lora", [WARMUP_LORA["lora"], {}], ids=["lora", "full"])
def test_a_run_stopped_in_its_warmup_resumes_exactly(tmp_path, monkeypatch, capsys, lora) -> None:
    """Bitwise the uninterrupted run's losses, with LoRA and in a full fine-tune (whose main model the warm-up
    freezes the same way)."""
    run_training(_cfg(tmp_path, "r", model=WARMUP_LORA["model"], train={"steps": 4}, lora=lora))
    want = [json.loads(line)["loss"] for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    assert _stop_in_warmup_then_resume(tmp_path, monkeypatch, capsys, lora) == want


@pytest.mark.parametrize("lora", [WARMUP_LORA["lora"], {}], ids=["lora", "full"])
def test_a_warmup_checkpoint_without_the_adapters_fails_the_check(tmp_path, monkeypatch, capsys, lora) -> None:
    """The checkpoint as the warm-up's frozen set would write it (what the warm-up froze left out, and their
    optimizer state): the resume is refused."""
    import contextlib

    from megaseq.train import indexer_training

    monkeypatch.setattr(indexer_training, "thawed", lambda model, optimizer=None: contextlib.nullcontext())
    with pytest.raises(AssertionError):
        _stop_in_warmup_then_resume(tmp_path, monkeypatch, capsys, lora)


# ---- FSDP2 (dp over 2 gloo ranks): the indexers train as in one process -------------------------------------
def _trained_model():
    from megaseq.models.build import build_model
    from megaseq.models.presets import get_preset

    return build_model(get_preset("glm5-flash-tiny"), dtype=torch.float64, seed=0)


def _fsdp_rank(rank: int, ref_grads: dict) -> None:
    from test_fsdp_train_step import TOL, _cfg, run_steps

    from megaseq.config import MemorySettings
    from megaseq.models.registry import parallelize
    from megaseq.parallel.env import DistributedEnv
    from megaseq.train import indexer_training

    cfg = _cfg(2, 1, "dp")
    env = DistributedEnv(cfg)
    model = _trained_model()
    parallelize(model, MemorySettings(), env)
    indexer_training.enable(model, 0.5)
    _, grads, _ = run_steps(model, env, MemorySettings(), cfg, steps=1)
    assert grads[0].keys() == ref_grads.keys()
    for n, g in grads[0].items():
        torch.testing.assert_close(g, ref_grads[n], **TOL, msg=lambda m, n=n: f"{n}: {m}")
    env.shutdown()


def test_indexer_trains_under_fsdp() -> None:
    from test_fsdp_train_step import _cfg, run_steps

    from megaseq.config import MemorySettings
    from megaseq.parallel.env import ParallelEnv
    from megaseq.parallel.launch import spawn_local
    from megaseq.train import indexer_training

    model = _trained_model()
    indexer_training.enable(model, 0.5)
    _, grads, _ = run_steps(model, ParallelEnv(), MemorySettings(), _cfg(), steps=1)
    assert any(".indexer." in n for n in grads[0])
    spawn_local(_fsdp_rank, 2, args=(grads[0],))
