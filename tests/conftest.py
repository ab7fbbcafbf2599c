"""Shared test helpers."""

from __future__ import annotations

import contextlib
import gc
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from megaseq.console import show_logs

show_logs()  # as the CLI does: library log lines reach stdout / stderr (tests read them with capsys)

if not torch.cuda.is_available():
    # Triton kernels are tested on the CPU through Triton's interpreter, which must be chosen before triton is
    # first imported (by any module): here, before every test module. The dispatcher never picks a Triton
    # kernel for CPU tensors, so no other test runs through it.
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items) -> None:
    """One meaning for the ``gpu`` mark, so ``pytest -m "gpu or triton" tests`` (``make test-gpu``) runs every test that
    needs CUDA: a test skipped for want of CUDA or a GPU carries the mark, and a gpu-marked test skips where
    CUDA is absent."""
    no_cuda = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if _runs_triton_kernels(item):
            item.add_marker(pytest.mark.triton)
        reasons = " ".join(str(m.kwargs.get("reason", "")) for m in item.iter_markers("skipif")).lower()
        if "cuda" in reasons or "gpu" in reasons:
            item.add_marker(pytest.mark.gpu)
        if item.get_closest_marker("gpu") is not None and not torch.cuda.is_available():
            item.add_marker(no_cuda)


def _runs_triton_kernels(item) -> bool:
    """The test takes a fixture that picks ``triton_compile.interpreter_device``: its Triton kernels run under the
    interpreter on the CPU and on the GPU where there is one, so ``make test-gpu`` (``-m "gpu or triton"``) runs it."""
    info = getattr(item, "_fixtureinfo", None)
    for defs in (info.name2fixturedefs.values() if info is not None else ()):
        for d in defs:
            code = getattr(d.func, "__code__", None)
            if code is not None and "interpreter_device" in code.co_names:
                return True
    return False


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """A training run's steps end with nothing frozen (``train.host_gc``): after such a test (its fixtures torn
    down) what lives is frozen again, as after collection."""
    yield
    if gc.get_freeze_count() == 0:
        gc.collect()
        gc.freeze()


def pytest_collection_finish(session) -> None:
    """Every test module is imported: what exists now (torch, transformers, the modules' globals) lives as long
    as the session, so it is frozen out of the garbage collector. Its full collections then scan only what the
    tests make, in this process and in the ranks forked from it (whose scans would also copy every page of the
    inherited heap). Nothing a test makes is collected differently."""
    gc.collect()
    gc.freeze()
    share_the_cores()


def share_the_cores() -> None:
    """Under pytest-xdist, each worker's torch threads capped at its share of the cores. A test module's own
    ``torch.set_num_threads`` runs when it is imported, and every worker imports every module, so whatever
    the last module imported asked for held for every test of the worker (2 threads, in ``tests/train``): with
    a worker per core, the workers' OpenMP threads then outnumbered the cores, and each parallel op waited for
    a thread the other worker's threads had descheduled (the float64 model tests ran 10-20 times slower than
    alone). A test that sets its own count inside (``torch_threads``) still does. The processes a test starts
    (``megaseq`` runs, a nested pytest, benchmarks) get the same cap through ``OMP_NUM_THREADS``; ranks forked
    by ``spawn_local`` set their own share."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        share = max(1, cores // workers)
        torch.set_num_threads(min(torch.get_num_threads(), share))
        given = os.environ.get("OMP_NUM_THREADS", "").split(",")[0]
        os.environ["OMP_NUM_THREADS"] = str(min(int(given) if given.isdigit() else cores, share))


def cuda_backward_peak(y: torch.Tensor, grad: torch.Tensor) -> int:
    """Peak CUDA bytes ``y.backward(grad)`` allocates above what exists before it (the graph's saved tensors,
    ``y`` and ``grad``)."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    y.backward(grad)
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """torch's intra-op threads set to ``n`` inside, restored after (tiny ops in multi-rank tests: a
    second thread only contends with the ranks, and other tests, for the cores)."""
    prev = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(prev)


def glm5_tiny4():
    """glm5-flash-tiny cut to its first 4 layers: KDA, KDA, KDA, DSA (its own indexer), the dense MLP then 3
    MoE layers, mHC throughout: every layer and MLP kind of the 8-layer preset, at half its cost. For
    multi-rank tests whose checks hold per layer or per step (bytes read, loads, losses, SGD or one AdamW
    step), where every rank runs every layer's ops on the same 2 cores. Not for a second AdamW step compared to
    1e-10 (test_fsdp_train_step stays on the preset): the first update divides by |g| + eps, so at an entry
    with |g| near eps 1e-17 of reduction order becomes 1e-12 of weight, and the next gradients differ by
    ~1e-7 relative; at 4 layers 2 of 4 seeds have such an entry, at 8 layers none of 4."""
    from megaseq.models.glm5.spec import glm5_flash_tiny

    s, n = glm5_flash_tiny(), 4
    return s.replace(num_layers=n, layer_types=s.layer_types[:n], mlp_types=s.mlp_types[:n],
                     indexer_types=s.indexer_types[:n])


@pytest.fixture
def one_thread() -> Iterator[None]:
    with torch_threads(1):
        yield


@pytest.fixture
def exact_attention() -> Iterator[None]:
    """Softmax attention through its exact reference (``torch_exact``), as the float64 segment tests compare."""
    from megaseq.ops import dispatch

    with dispatch.configured(preferred={"attention": ["torch_exact"]}):
        yield


def agent_trace_checkpoint(folder: Path) -> Path:
    """The agent-trace recipe's tiny checkpoint written into ``folder`` by the recipe's own ``make_checkpoint.py``,
    with the recipe copied beside it (``folder / "recipe.yaml"``); returns the checkpoint's directory."""
    import importlib.util

    recipe = Path(__file__).resolve().parents[1] / "recipes" / "agent-traces-tiny"
    spec = importlib.util.spec_from_file_location("make_checkpoint", recipe / "make_checkpoint.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    shutil.copy(recipe / "recipe.yaml", folder / "recipe.yaml")
    return module.main(folder)


def run_as_of_step(src: Path, dst: Path, step: int, drop: tuple[str, ...] = ("hf",)) -> Path:
    """A copy of the run directory ``src`` at ``dst`` as it stood after ``step``, to resume from: the
    checkpoints of later steps removed, the end-of-run outputs ``drop`` (the HF export, the adapter)
    removed where present, metrics.jsonl cut to its first ``step`` lines (one per step)."""
    from megaseq.train import checkpoint as ckpt

    shutil.copytree(src, dst)
    for d in (dst / ckpt.CKPT_DIR).glob("step_*"):
        if int(d.name.removeprefix("step_")) > step:
            shutil.rmtree(d)
    for name in drop:
        if (dst / name).exists():
            shutil.rmtree(dst / name)
    metrics = dst / "metrics.jsonl"
    metrics.write_text("\n".join(metrics.read_text().splitlines()[:step]) + "\n")
    return dst
