"""Page-locked host memory of exact sizes: ``HostBuffer``, and the plan's pinned bytes locked before the first step.

Every host pool of the memory schemes is a ``HostBuffer`` of exactly its bytes (``pin_memory=True``'s caching
allocator rounds up to a power of two): SCO's layer boundaries, the host-kept attention outputs, the offloaded
optimizer's state, a streamed frozen base, the segments' K/V. On a CUDA device its memory is page-locked with
``cudaHostRegister``, and locking is what costs: every page is faulted in, zeroed and locked, seconds for the tens
of GiB a long run plans (``benchmarks/results/speed/first_step/``). Two things keep that off the steps:

- a buffer's pages are faulted in by the process's intra-op threads (``torch``'s parallel fill) before one
  ``cudaHostRegister`` locks them, as torch's caching host allocator does with ``pinned_num_register_threads``;
- ``reserve(nbytes, device)`` (``train.build.reserve_pinned``, from the plan's pinned host terms) starts locking one
  ``PinnedArena`` of those bytes on a background thread when the run starts, so it overlaps the model's build. A
  ``HostBuffer`` takes its bytes from the arena (first fit, at ``SLOT_ALIGN``; given back when it is released, so a
  pool made again every step, as the segments' K/V, reuses them), waiting for the thread if it is still locking,
  and locks its own memory only where the arena has no room. ``drop_reserve()`` ends the arena; its memory is
  unlocked and freed once the last buffer taken from it is released.

Off CUDA, or where locking fails (a memlock limit), the same code runs on plain host memory (a buffer falls back to
``pin_memory=True``, as before).
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from dataclasses import dataclass

import torch

from megaseq.memory.rules import SLOT_ALIGN, round_up

logger = logging.getLogger("megaseq")


# ---- page-locking ---------------------------------------------------------------------------------------
def _register(ptr: int, nbytes: int) -> bool:
    """Lock ``nbytes`` at ``ptr`` for the current device's context (torch's binding releases the GIL)."""
    return int(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 0)) == 0


def _unregister(ptr: int) -> None:
    torch.cuda.cudart().cudaHostUnregister(ptr)


def _locked(nbytes: int) -> tuple[torch.Tensor, bool]:
    """``nbytes`` of host memory, its pages faulted in on the intra-op threads, then locked: (memory, locked)."""
    base = torch.empty(nbytes, dtype=torch.uint8)
    base.fill_(0)  # parallel page faults: the lock below then only pins pages already present
    return base, _register(base.data_ptr(), nbytes)


# ---- the arena: the plan's pinned bytes, locked on a background thread ---------------------------------------------
@dataclass
class ArenaStats:
    """What the run's buffers took: from the arena, and locked on their own (where the arena had no room)."""

    reserved: int = 0  # the arena's bytes (0: none, or its locking failed)
    lock_s: float = 0.0  # the thread's seconds to fault in and lock them
    taken: int = 0  # bytes buffers took from the arena (a range taken again after a release counts again)
    own: int = 0  # bytes buffers locked on their own on CUDA


STATS = ArenaStats()


class PinnedArena:
    """``nbytes`` of host memory locked on a background thread for ``device`` (``start``), from which ``take`` hands
    out exact, ``SLOT_ALIGN``-aligned ranges (first fit) and ``give`` takes them back (merged with free neighbours).
    Unlocked (``_unregister``) when the arena is collected: no longer the run's reserve, no range still out."""

    def __init__(self, nbytes: int, device: torch.device) -> None:
        self.nbytes = round_up(nbytes)
        # the thread's device: the run's, fixed here (a new thread's current device is the first GPU)
        self.index = (device.index if device.index is not None else torch.cuda.current_device()) \
            if device.type == "cuda" else None
        self.base: torch.Tensor | None = None
        self.locked = False
        self.free: list[tuple[int, int]] = [(0, self.nbytes)]  # (offset, bytes), by offset
        self.error: BaseException | None = None
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._lock_pages, name="megaseq-pin-host", daemon=True)

    def start(self) -> PinnedArena:
        self._thread.start()
        return self

    def _lock_pages(self) -> None:
        t0 = time.perf_counter()
        try:
            if self.index is not None:
                torch.cuda.set_device(self.index)  # this thread's context is the run's device's
            base, locked = _locked(self.nbytes)
            self.base, self.locked = base, locked
            if locked:
                weakref.finalize(self, _unregister, base.data_ptr())
        except BaseException as e:  # a failed reserve leaves every buffer to lock its own
            self.error = e
            logger.warning(f"megaseq: page-locking {self.nbytes / (1 << 30):.1f} GiB of host memory ahead of the first "
                           f"step failed ({type(e).__name__}: {e}); the memory schemes' host pools lock their own")
        STATS.lock_s = time.perf_counter() - t0
        STATS.reserved = self.nbytes if self.locked else 0

    def wait(self) -> PinnedArena:
        """Wait for the locking thread (locked or failed)."""
        if self._thread.ident is not None:
            self._thread.join()
        return self

    def take(self, nbytes: int) -> tuple[torch.Tensor, int] | None:
        """(the arena's memory, the offset of ``nbytes`` of it), or None where it has no room or is not locked;
        waits for the locking thread."""
        self.wait()
        if not self.locked or self.base is None:
            return None
        size = round_up(nbytes)
        with self._lock:
            for i, (off, n) in enumerate(self.free):
                if n >= size:
                    if n == size:
                        del self.free[i]
                    else:
                        self.free[i] = (off + size, n - size)
                    STATS.taken += size
                    return self.base, off
        return None

    def give(self, offset: int, nbytes: int) -> None:
        """Take back the range ``take`` handed out at ``offset`` for ``nbytes``."""
        size = round_up(nbytes)
        with self._lock:
            free = sorted(self.free + [(offset, size)])
            merged: list[tuple[int, int]] = []
            for off, n in free:
                if merged and merged[-1][0] + merged[-1][1] == off:
                    merged[-1] = (merged[-1][0], merged[-1][1] + n)
                else:
                    merged.append((off, n))
            self.free = merged

    def free_bytes(self) -> int:
        with self._lock:
            return sum(n for _, n in self.free)


_RESERVE: PinnedArena | None = None


def reserve(nbytes: int, device: torch.device) -> PinnedArena | None:
    """Start locking ``nbytes`` of host memory for the run's buffers on ``device`` (a CUDA device, ``nbytes`` > 0;
    else nothing), in place of any earlier reserve. Returns the arena."""
    global _RESERVE
    drop_reserve()
    STATS.__init__()
    if device.type != "cuda" or nbytes <= 0:
        return None
    _RESERVE = PinnedArena(nbytes, device).start()
    return _RESERVE


def drop_reserve() -> None:
    """End the run's reserve: buffers lock their own again; the arena is freed once the last of its ranges is back."""
    global _RESERVE
    arena, _RESERVE = _RESERVE, None
    if arena is not None:
        arena.wait()  # its memory is the thread's until it ends


def current_reserve() -> PinnedArena | None:
    return _RESERVE


# ---- the buffer ------------------------------------------------------------------------------------------------
class HostBuffer:
    """``nbytes`` of host memory, page-locked when ``pin`` (on CUDA): a range of the run's reserve where it has room,
    else its own, locked with ``cudaHostRegister`` (exact size, unlike ``pin_memory=True`` whose caching allocator
    rounds up to a power of two). Views carve it up."""

    def __init__(self, nbytes: int, pin: bool) -> None:
        self.nbytes = nbytes
        self.pinned = False
        self._arena: PinnedArena | None = None
        self._offset = 0
        got = _RESERVE.take(nbytes) if pin and nbytes > 0 and _RESERVE is not None else None
        if got is not None:
            base, self._offset = got
            self.base = base[self._offset:self._offset + nbytes]
            self._arena, self.pinned = _RESERVE, True
            return
        if pin and nbytes > 0:
            STATS.own += nbytes
            self.base, locked = _locked(nbytes)
            if not locked:  # fall back to the caching allocator rather than to pageable copies
                self.base = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
            else:
                self.pinned = True
                self._finalizer = weakref.finalize(self, _unregister, self.base.data_ptr())
        else:
            self.base = torch.empty(nbytes, dtype=torch.uint8)

    @property
    def from_reserve(self) -> bool:
        return self._arena is not None

    def view(self, offset: int, shape: tuple[int, ...], dtype: torch.dtype,
             stride: tuple[int, ...] | None = None) -> torch.Tensor:
        """``shape`` of ``dtype`` at ``offset``: contiguous, or with ``stride`` (a dense layout of the same bytes)."""
        numel = 1
        for n in shape:
            numel *= n
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        assert offset % SLOT_ALIGN == 0 and offset + nbytes <= self.nbytes
        flat = self.base[offset:offset + nbytes].view(dtype)
        return flat.view(shape) if stride is None else flat.as_strided(shape, stride)

    def release(self) -> None:
        if self._arena is not None:
            self._arena.give(self._offset, self.nbytes)
            self._arena = None
        elif self.pinned:
            self._finalizer()
        self.pinned = False
        self.base = torch.empty(0, dtype=torch.uint8)
        self.nbytes = 0


def describe(stats: ArenaStats | None = None) -> dict[str, float]:
    """The run's pinned host memory (``STATS`` unless given) in GiB and seconds, for a bench row or a log line."""
    stats = stats if stats is not None else STATS
    gib = 1 << 30
    return {"reserved_gib": stats.reserved / gib, "lock_s": stats.lock_s, "taken_gib": stats.taken / gib,
            "own_gib": stats.own / gib}


def summary_line(stats: ArenaStats | None = None) -> str | None:
    """One line on the run's page-locked host memory for the log after the first step (None: nothing pinned)."""
    d = describe(stats)
    if not d["reserved_gib"] and not d["own_gib"]:
        return None
    ahead = (f"{d['reserved_gib']:.1f} GiB locked ahead of the first step in {d['lock_s']:.1f} s, "
             f"{d['taken_gib']:.1f} GiB of it taken by the memory schemes' host pools"
             if d["reserved_gib"] else "none locked ahead")
    own = f"; {d['own_gib']:.1f} GiB locked by the pools themselves" if d["own_gib"] else ""
    return f"pinned host memory: {ahead}{own}"
