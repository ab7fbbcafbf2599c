"""Launchers: a 2-worker Ray run (local cluster) and 2 torchrun-style processes give the same loss as
one process; a cluster too small for the workers, or a missing Ray, is refused with one message."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from conftest import torch_threads
from megaseq.config import build_config
from megaseq.parallel import launch
from megaseq.parallel.launch import check_ray_resources, spawn_local

S = 32


def _batch() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(1, 16, (1, S), generator=g)
    doc = (torch.arange(S) >= 13).long()[None]  # a document boundary inside rank 0's half
    return {"input_ids": ids, "doc_ids": doc}


def _cfg(launcher: str = "none", num_workers: int = 1, cp: int = 2):
    return build_config(overrides={"parallel.cp": cp, "parallel.backend": "gloo",
                                   "parallel.launcher": launcher, "parallel.num_workers": num_workers,
                                   "data.seq_len": S, "train.device": "cpu"})


def eval_loss(cfg) -> float:
    """The per-process body both launchers run: mean next-token loss of glm5-flash-tiny (float64)."""
    from megaseq.models.build import build_model
    from megaseq.models.presets import get_preset
    from megaseq.parallel.env import DistributedEnv

    torch.set_num_threads(1)
    env = DistributedEnv(cfg)
    model = build_model(get_preset("glm5-flash-tiny"), dtype=torch.float64, seed=0)
    batch = env.shard_batch(_batch() if env.reads_data else None)
    with torch.no_grad():
        hidden = model(batch["input_ids"], ctx=env.context(batch))
        loss_sum = float(env.loss_sum(hidden, model.lm_head.weight, batch["labels"]))
    total = env.all_reduce_count(int((batch["labels"] != -100).sum()))
    loss = env.all_reduce_sum(loss_sum) / total
    env.shutdown()
    return loss


def one_process_loss() -> float:
    from megaseq.models.build import build_model
    from megaseq.models.presets import get_preset
    from megaseq.ops.vocab_loss.reference import plain_linear_cross_entropy
    from megaseq.parallel.mesh import complete_batch

    model = build_model(get_preset("glm5-flash-tiny"), dtype=torch.float64, seed=0)
    b = complete_batch(_batch())
    with torch.no_grad():
        hidden = model(b["input_ids"], doc_ids=b["doc_ids"])
        return float(plain_linear_cross_entropy(hidden[0], model.lm_head.weight, b["labels"][0]))


def _torchrun_style(rank: int, out: str) -> None:
    loss = eval_loss(_cfg(launcher="torchrun"))
    Path(out, f"rank{rank}").write_text(repr(loss))


@pytest.fixture(scope="module")
def reference_losses(tmp_path_factory) -> tuple[float, float]:
    """(one process, two torchrun-style processes)."""
    with torch_threads(1):
        ref = one_process_loss()
    out = tmp_path_factory.mktemp("torchrun")
    spawn_local(_torchrun_style, 2, args=(str(out),))
    losses = [float((out / f"rank{r}").read_text()) for r in range(2)]
    assert losses[0] == losses[1]
    return ref, losses[0]


def test_two_processes_match_one(reference_losses):
    ref, two = reference_losses
    assert abs(two - ref) < 1e-12 * ref


@pytest.fixture(scope="module")
def ray_cluster():
    ray = pytest.importorskip("ray", reason="Ray is an optional extra: pip install 'megaseq[ray]'")
    from ray import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the workers cannot import tests/
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


def test_ray_two_workers_match_torchrun(reference_losses, ray_cluster):  # fork before Ray starts threads
    ref, two = reference_losses
    loss = launch.launch(_cfg(launcher="ray", num_workers=2), train_fn=eval_loss)
    assert loss == two, (loss, two)  # the same computation in the same order: bitwise equal
    assert abs(loss - ref) < 1e-12 * ref


def test_ray_refuses_more_workers_than_the_cluster_has(ray_cluster):
    with pytest.raises(ValueError, match=r"parallel.num_workers = 3 needs 3 CPUs .* has 2 CPUs"):
        launch.launch(_cfg(launcher="ray", num_workers=3), train_fn=eval_loss)


def test_resource_check_counts_gpus():
    check_ray_resources({"CPU": 16, "GPU": 8}, 8, 1, 1)
    with pytest.raises(ValueError, match="needs 8 CPUs and 8 GPUs .* 4 GPUs"):
        check_ray_resources({"CPU": 16, "GPU": 4}, 8, 1, 1)


def test_missing_ray_is_one_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray now raises ImportError
    with pytest.raises(ValueError, match=r"pip install 'megaseq\[ray\]'"):
        launch.launch(_cfg(launcher="ray", num_workers=2), train_fn=eval_loss)
