"""The bytes of the tensors a computation creates, live at each moment: what a planner's formula for a working set
is measured against where ``torch.cuda.max_memory_allocated`` is not available (the CPU) or counts too much (the
allocator's rounding, tensors made before).

``CreatedStorages`` is a dispatch mode: every storage an op creates inside it (not a view of its inputs, not an
in-place result) is counted from its creation until it is freed; storages made before it are not counted, on any
device. ``peak`` is the most at once; ``mark(name)`` records ``(peak so far, live now)``.

    with CreatedStorages() as live:
        loss = f(x)
        live.mark("forward")
        loss.backward()
    live.peak, live.marks["forward"]
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class CreatedStorages(TorchDispatchMode):
    """Live and peak bytes of the storages created inside the mode (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0
        self.marks: dict[str, tuple[int, int]] = {}
        self._alive: set[tuple[str, int]] = set()

    def mark(self, name: str) -> None:
        self.marks[name] = (self.peak, self.live)

    def _freed(self, key: tuple[str, int], nbytes: int) -> None:
        self._alive.discard(key)
        self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func._schema.is_mutable or func.is_view:
            return out
        inputs = {(str(t.device), t.untyped_storage().data_ptr()) for t in tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            st = t.untyped_storage()
            key, nbytes = (str(t.device), st.data_ptr()), st.nbytes()
            if nbytes == 0 or key in inputs or key in self._alive:
                continue
            self._alive.add(key)
            self.live += nbytes
            self.peak = max(self.peak, self.live)
            weakref.finalize(st, self._freed, key, nbytes)
        return out
