"""Shared test helpers."""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    # Triton kernels are tested on the CPU through Triton's interpreter, which must be chosen before triton is
    # first imported (by any module): here, before every test module. The dispatcher never picks a Triton
    # kernel for CPU tensors, so no other test runs through it.
    os.environ.setdefault("TRITON_INTERPRET", "1")


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


@pytest.fixture
def one_thread() -> Iterator[None]:
    with torch_threads(1):
        yield


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
