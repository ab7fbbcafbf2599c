"""Python's garbage collector kept out of the training steps.

A step creates and drops tens of thousands of Python objects (tensors, autograd nodes, the dispatcher's
records). Python's automatic collector runs whenever enough of them have piled up, in the middle of whatever
the host is doing: launching kernels, so the GPU waits. Its full collections walk every live object of the
process (torch, transformers, Triton's compiled kernels: millions). Of 50 timed 8K steps of glm5-flash-1gpu on
an H100 with Python's collector on, one took 0.57 s against a median of 0.25 s; of 50 with this module's
collection, none took over 0.28 s (``benchmarks/results/speed/runs/2026-12-07_host-gc/``).

``steps()`` (entered around a run's steps by ``train.loop`` and by ``megaseq bench``) turns automatic collection
off and collects between steps, as torchtitan and Megatron-LM do: ``between_steps()`` (called by
``train.step.train_step`` once the optimizer's update is launched, while the GPU runs it) collects the young
generations, and every ``FULL_EVERY`` steps all of them. The objects alive when the steps start (the model, the
optimizer, the imported modules) are frozen out of every later collection (``gc.freeze``), and so is what the
first step makes (compiled kernels, autotuner caches, memory pools), unwalked, so a collection walks only what
the steps made since. Leaving the context undoes both and collects: what it froze, and whatever a caller had
frozen before, is collectable again (a model the caller drops next must not stay frozen). Nested contexts leave
it to the outermost.

``MEGASEQ_GC=auto`` leaves Python's collector as it is (``ops.switches.host_gc_manual``).
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
_full_every = FULL_EVERY


@contextlib.contextmanager
def steps(full_every: int = FULL_EVERY) -> Iterator[GcStats]:
    """The steps run inside this without automatic collection (see the module); yields the counters."""
    global _depth, STATS, _full_every
    if _depth:  # an outer context holds the collector: its counters
        yield STATS
        return
    if not switches.host_gc_manual():  # MEGASEQ_GC=auto: nothing collected here, nothing counted
        yield GcStats()
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


def between_steps() -> None:
    """Inside ``steps()``: after the first step, freeze what it made; after every later one, collect the young
    generations (every ``full_every``-th, all of them); outside, nothing. Called once a step, after the update
    is launched and before its loss is read back."""
    if not _depth:
        return
    STATS.steps += 1
    full = STATS.steps > 1 and STATS.steps % _full_every == 0
    t0 = time.perf_counter()
    if STATS.steps == 1:
        # the first step makes what the run keeps (compiled kernels, autotuner and op records, pools). Walking it
        # took 0.23 s after an 8K glm5-flash-1gpu first step on an H100, which then took 0.70 s against 0.44 s
        # with Python's collector on (benchmarks/results/speed/runs/2026-12-07_host-gc/): frozen unwalked
        # instead; what of it is garbage goes when the steps end
        gc.freeze()
    else:
        gc.collect(2 if full else 1)
    dt = time.perf_counter() - t0
    STATS.full += int(full)
    STATS.seconds += dt
    STATS.longest_s = max(STATS.longest_s, dt)


def collect_all() -> None:
    """A full collection in which the frozen objects (``steps()``'s, a caller's) take part too; what survives is
    frozen again where anything was. For work that must not meet garbage the earlier steps left alive, such as a
    CUDA graph's capture (``train.layer_graphs``)."""
    frozen = gc.get_freeze_count() > 0
    gc.unfreeze()
    gc.collect()
    if frozen:
        gc.freeze()


def active() -> bool:
    """Whether a ``steps()`` context holds the collector now."""
    return _depth > 0
