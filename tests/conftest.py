"""Shared test helpers."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch


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
