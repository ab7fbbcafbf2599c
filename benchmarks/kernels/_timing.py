"""What the kernels' launch-configuration scripts share: a kernel call timed on the GPU by CUDA events."""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch


def median_ms(fn: Callable[[], object], reps: int) -> float:
    """Median milliseconds of ``reps`` calls of ``fn``, each between two CUDA events (warm it up first)."""
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)
