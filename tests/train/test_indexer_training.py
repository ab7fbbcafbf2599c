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
    ({"train_indexer": True, "dsa_warmup_steps": 2, "lora": {"rank": 4}}, "frozen base"),
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
