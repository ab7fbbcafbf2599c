"""``train.build.grow_pool`` (``MEGASEQ_GROW_POOL=1``): the caching allocator's pool grown toward the plan's tensor
peak before the first step, by one block freed at once; nothing without the switch, on the CPU, or without
expandable segments; never past the GPU's free memory less a reserve; an allocation that fails given up."""

from __future__ import annotations

import pytest
import torch

from megaseq.train import build

GIB = 1 << 30


@pytest.fixture
def fake_gpu(monkeypatch):
    """A CUDA device's memory calls on the CPU: ``free`` bytes free, ``reserved`` in the pool; the blocks asked
    of ``torch.empty`` recorded (``fail``: it runs out of memory)."""
    state = {"free": 200 * GIB, "reserved": 10 * GIB, "fail": False, "asked": []}

    def empty(n, dtype=None, device=None):
        assert dtype == torch.uint8 and torch.device(device).type == "cuda"
        if state["fail"]:
            raise torch.OutOfMemoryError("CUDA out of memory")
        state["asked"].append(n)
        return object()

    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (state["free"], 80 * GIB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: state["reserved"])
    monkeypatch.setattr(torch, "empty", empty)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    monkeypatch.setenv("MEGASEQ_GROW_POOL", "1")
    return state


def test_grows_to_the_plans_share_less_what_the_pool_holds(fake_gpu):
    cuda = torch.device("cuda", 0)
    assert build.grow_pool(cuda, 100 * GIB) == 80 * GIB  # 0.9 of the plan, less the 10 GiB reserved
    fake_gpu["free"] = 50 * GIB
    assert build.grow_pool(cuda, 100 * GIB) == 49 * GIB  # the free memory less 1 GiB
    assert fake_gpu["asked"] == [80 * GIB, 49 * GIB]
    fake_gpu["reserved"] = 95 * GIB
    assert build.grow_pool(cuda, 100 * GIB) == 0 and len(fake_gpu["asked"]) == 2  # the pool holds enough


def test_nothing_without_the_switch_on_the_cpu_or_without_expandable_segments(fake_gpu, monkeypatch):
    cuda = torch.device("cuda", 0)
    assert build.grow_pool(torch.device("cpu"), 100 * GIB) == 0
    monkeypatch.setenv("MEGASEQ_GROW_POOL", "0")
    assert build.grow_pool(cuda, 100 * GIB) == 0
    monkeypatch.delenv("MEGASEQ_GROW_POOL")
    assert build.grow_pool(cuda, 100 * GIB) == 0  # off by default
    monkeypatch.setenv("MEGASEQ_GROW_POOL", "1")
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:512")
    assert build.grow_pool(cuda, 100 * GIB) == 0
    assert fake_gpu["asked"] == []
    monkeypatch.setenv("MEGASEQ_GROW_POOL", "yes")
    with pytest.raises(ValueError, match="MEGASEQ_GROW_POOL must be one of 0, 1, got 'yes'"):
        build.grow_pool(cuda, 100 * GIB)


def test_an_allocation_that_fails_is_given_up(fake_gpu):
    fake_gpu["fail"] = True
    assert build.grow_pool(torch.device("cuda", 0), 100 * GIB) == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_a_gpu_the_pool_keeps_the_grown_block_and_nothing_stays_allocated(monkeypatch):
    """On a GPU under expandable segments (the process's allocator setting decides; skipped otherwise): the pool
    grows by the bytes returned, and the allocated memory is what it was."""
    import os

    if "expandable_segments:True" not in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""):
        pytest.skip("the allocator of this process runs without expandable segments")
    monkeypatch.setenv("MEGASEQ_GROW_POOL", "1")
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    grown = build.grow_pool(torch.device("cuda"), before[1] + 4 * GIB)
    assert grown > 2 * GIB
    assert torch.cuda.memory_allocated() == before[0] and torch.cuda.memory_reserved() >= before[1] + grown


def test_a_run_grows_the_pool_once_before_its_first_step(monkeypatch, tmp_path):
    """``megaseq train``: ``grow_pool`` called once, before the first step, with the run's device and its plan's
    tensor peak; a resumed run's first step is its first here too."""
    from megaseq.config import build_config
    from megaseq.train import loop, trainer

    calls = []
    monkeypatch.setattr(loop, "grow_pool", lambda device, peak: calls.append((device.type, peak)) or 0)
    cfg = build_config(None, ["model.name=qwen3-moe-tiny", "data.kind=random", "model.dtype=fp32",
                              "train.device=cpu", "data.seq_len=64", "train.steps=2",
                              f"train.run_dir={tmp_path / 'run'}", "train.eval_after=false",
                              "train.export_hf=false"])
    trainer.run_training(cfg)
    plan = __import__("json").loads((tmp_path / "run" / "plan.json").read_text())
    assert calls == [("cpu", plan["peak_gpu_tensors"])] and plan["peak_gpu_tensors"] > 0
