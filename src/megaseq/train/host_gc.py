"""Python's garbage collector kept out of the training steps.

A step creates and drops tens of thousands of Python objects (tensors, autograd nodes, the dispatcher's
records). Python's automatic collector runs whenever enough of them have piled up, in the middle of whatever
the host is doing: launching kernels, so the GPU waits. Its full collections walk every live object of the
process (torch, transformers, Triton's compiled kernels: millions), which takes tens to hundreds of
milliseconds. Short steps (8K tokens of glm5-flash-1gpu: 0.2 s) feel each one.

``steps()`` (entered around a run's steps by ``train.loop`` and by ``megaseq bench``) does what torchtitan and
Megatron-LM do instead: the objects alive when the steps start (the model, the optimizer, the imported
modules) are frozen out of every later collection (``gc.freeze``), automatic collection is off, and
``between_steps()`` (called by ``train.step.train_step`` once the optimizer's update is launched, while the GPU
runs it) collects the young generations, and every ``FULL_EVERY`` steps all of them. Leaving the context undoes
both (what it froze is collectable again) and collects. Nested contexts leave it to the outermost.

``MEGASEQ_GC=auto`` leaves Python's collector as it is (``ops.switches.host_gc``).
"""

from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import Iterator
from dataclasses import dataclass

from megaseq.ops import switches

FULL_EVERY = 100  # steps between collections of every generation (the others: the young ones)


@dataclass
class GcStats:
    """What ``between_steps`` did in the current (or last) ``steps()`` context."""

    steps: int = 0
    full: int = 0
    seconds: float = 0.0  # host time spent collecting, all of it while the GPU ran the update
    longest_s: float = 0.0


STATS = GcStats()
_depth = 0


@contextlib.contextmanager
def steps(full_every: int = FULL_EVERY) -> Iterator[GcStats]:
    """The steps run inside this without automatic collection (see the module); yields the counters."""
    global _depth, STATS, _full_every
    if _depth or not switches.host_gc_manual():  # an outer context holds the collector, or MEGASEQ_GC=auto
        yield STATS
        return
    was_enabled = gc.isenabled()
    gc.collect()  # what the build left behind goes now, not frozen with the rest
    gc.freeze()
    gc.disable()
    STATS, _full_every = GcStats(), max(1, int(full_every))
    _depth = 1
    try:
        yield STATS
    finally:
        _depth = 0
        gc.unfreeze()
        if was_enabled:
            gc.enable()
        gc.collect()  # cycles of the steps' objects (a model dropped after them) go now, with their GPU memory


_full_every = FULL_EVERY


def between_steps() -> None:
    """Inside ``steps()``: collect the young generations (every ``full_every``-th call, all of them); else
    nothing. Called once a step, after the update is launched and before its loss is read back."""
    if not _depth:
        return
    STATS.steps += 1
    full = STATS.steps % _full_every == 0
    t0 = time.perf_counter()
    gc.collect(2 if full else 1)
    dt = time.perf_counter() - t0
    STATS.full += int(full)
    STATS.seconds += dt
    STATS.longest_s = max(STATS.longest_s, dt)


def active() -> bool:
    """Whether a ``steps()`` context holds the collector now."""
    return _depth > 0
