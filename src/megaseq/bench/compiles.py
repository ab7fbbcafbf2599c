"""The Triton kernels a step compiles, and the wall time each took: what a first step spends beyond a warm one.

Triton calls ``triton.knobs.runtime.jit_cache_hook`` before it builds a kernel for a new specialisation and
``jit_post_compile_hook`` once it has it (compiled, or loaded from Triton's disk cache: the seconds tell which).
``compile_record()`` installs both for the duration of a ``with`` block, each calling on to the hook that was there
before it, and restores them after; without Triton it records nothing. Compiles run one at a time on the calling
thread, so a compile's seconds are those between its two hooks.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from megaseq.ops.precompile import hook_kernel_name

SLOWEST = 5  # kernels named in the summary


@dataclass
class CompileRecord:
    """``(kernel, seconds)`` of each compile seen, in order; ``pending``: started, not yet finished."""

    done: list[tuple[str, float]] = field(default_factory=list)
    pending: dict[Any, tuple[str, float]] = field(default_factory=dict)

    def start(self, key: Any, name: str) -> None:
        self.pending[key] = (name, time.perf_counter())

    def finish(self, key: Any) -> None:
        if key in self.pending:
            name, t0 = self.pending.pop(key)
            self.done.append((name, time.perf_counter() - t0))

    def cancel(self, key: Any) -> None:
        self.pending.pop(key, None)

    def summary(self) -> dict[str, Any]:
        """The compiles seen, for a result row (``timed_summary``)."""
        return timed_summary(self.done)


def timed_summary(timed: list[tuple[str, float]]) -> dict[str, Any]:
    """``(kernel, seconds)`` pairs (a step's compiles, or its autotuner timings from
    ``ops.triton_autotune.recording_tunings``) for a result row: ``count``, ``seconds`` (their sum) and the
    ``slowest`` kernels as ``[name, seconds]``."""
    slowest = sorted(timed, key=lambda d: -d[1])[:SLOWEST]
    return {"count": len(timed), "seconds": round(sum(s for _, s in timed), 3),
            "slowest": [[n, round(s, 3)] for n, s in slowest]}


def _name(fn: Any) -> str:
    return hook_kernel_name(fn) or str(fn)


@contextmanager
def compile_record() -> Iterator[CompileRecord]:
    """Record the Triton compiles inside the block (``CompileRecord``); the hooks that were installed keep running."""
    rec = CompileRecord()
    try:
        from triton import knobs
    except ImportError:  # no Triton: nothing compiles
        yield rec
        return
    rt = knobs.runtime
    before, after = rt.jit_cache_hook, rt.jit_post_compile_hook

    def pre(**kw: Any) -> Any:
        ident = (_name(kw.get("fn")), str(kw.get("key")))  # each hook call gets a new fn object: pair by name
        rec.start(ident, ident[0])
        out = before(**kw) if before is not None else None
        if out:  # the earlier hook skipped the compile: there is nothing to time
            rec.cancel(ident)
        return out

    def post(**kw: Any) -> Any:
        rec.finish((_name(kw.get("fn")), str(kw.get("key"))))
        return after(**kw) if after is not None else None

    rt.jit_cache_hook, rt.jit_post_compile_hook = pre, post
    try:
        yield rec
    finally:
        rt.jit_cache_hook, rt.jit_post_compile_hook = before, after
