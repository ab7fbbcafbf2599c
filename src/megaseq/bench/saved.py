"""What autograd keeps for backward, measured: each distinct storage once (the parameters' own left out), by
the label the caller sets (a layer's name) and the dispatcher op whose call packed it.

The planner's saved sets are checked against it (``tests/plan``: whole layers on the CPU, the Triton kernels
under the interpreter) and ``benchmarks/memory/saved_by_layer.py`` reads a GPU step with it.

    saved = SavedStorages(model.parameters())
    with saved.recording():
        loss = model(batch)
    saved.total(), saved.by_op(), saved.by_label()
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Iterable, Iterator

import torch

from megaseq.ops import dispatch

OUTSIDE = "torch"  # the op of a storage packed outside any dispatcher call


class SavedStorages:
    """Autograd's saved storages (see the module docstring); ``label`` names what runs (default ``""``)."""

    def __init__(self, params: Iterable[torch.Tensor] = ()) -> None:
        self.skip = {p.untyped_storage().data_ptr() for p in params}
        self.seen: dict[int, tuple[str, str, int, str, tuple[int, ...]]] = {}  # ptr -> label, op, bytes, dtype, shape
        self.label = ""
        self._local = threading.local()

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        ptr = st.data_ptr()
        if ptr not in self.skip and ptr not in self.seen:
            op = getattr(self._local, "op", None) or OUTSIDE
            self.seen[ptr] = (self.label, op, st.nbytes(), str(t.dtype), tuple(t.shape))
        return t

    @contextlib.contextmanager
    def recording(self) -> Iterator[SavedStorages]:
        """Autograd's saved tensors packed through ``pack``, and the outermost dispatcher op running noted: the
        implementation ``dispatch.select`` returns runs under its op, whether ``dispatch.call`` runs it or the
        caller keeps it and runs its ``fn`` (the indexer objective's chunks)."""
        original, local = dispatch.select, self._local

        def under(op: str, fn):
            def run(*args, **kwargs):
                outer = getattr(local, "op", None)
                local.op = outer or op
                try:
                    return fn(*args, **kwargs)
                finally:
                    local.op = outer
            return run

        def select(op, layer, *args, **kwargs):
            impl = original(op, layer, *args, **kwargs)
            return dataclasses.replace(impl, fn=under(op, impl.fn))

        dispatch.select = select
        try:
            with torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t):
                yield self
        finally:
            dispatch.select = original

    def total(self) -> int:
        return sum(nbytes for _, _, nbytes, _, _ in self.seen.values())

    def by_op(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for _, op, nbytes, _, _ in self.seen.values():
            out[op] = out.get(op, 0) + nbytes
        return out

    def by_label(self, largest: int = 8) -> dict[str, dict]:
        """Per label: ``total`` bytes, ``by_op`` bytes and the ``largest`` storages (bytes, op, dtype, shape)."""
        out: dict[str, dict] = {}
        for label, op, nbytes, dtype, shape in self.seen.values():
            row = out.setdefault(label, {"total": 0, "by_op": {}, "largest": []})
            row["total"] += nbytes
            row["by_op"][op] = row["by_op"].get(op, 0) + nbytes
            row["largest"].append((nbytes, op, dtype, list(shape)))
        for row in out.values():
            row["largest"] = sorted(row["largest"], reverse=True)[:largest]
        return out
