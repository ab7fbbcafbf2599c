"""Shared test helpers."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

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
