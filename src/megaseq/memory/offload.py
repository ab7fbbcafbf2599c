"""Full recompute per layer, and SCO: selective checkpoint offload of the layer boundaries.

Shapes: B batch, S tokens, hc residual streams (4 for mHC, else 1), H hidden, L layers.

Recompute. ``checkpoint_layers(model.layers)`` makes each decoder layer keep only its input ``h``
(the boundary, ``[B, S, hc, H]``) and rerun its forward in backward. A layer is ``layer(h, ctx)`` and may
read or write ``ctx.carry`` (the DSA selection a ``shared`` indexer layer reuses). Backward runs the layers
in reverse, when ``ctx.carry`` holds the last layer's entries, so each layer keeps the carry it saw at
forward time (a shallow copy: carry tensors are replaced, never written in place; checked) and its
recompute runs against that copy. Per-forward side state (MoE load counts, buffers) is put back after
the recompute (``tiling.restore_side_state``), so metrics are not counted twice.

SCO. With a ``BoundaryOffloader``, boundaries are copied to host memory on a side CUDA stream while the
layer computes, up to a host byte budget (the remaining layers keep theirs on the GPU), and freed on the
GPU once copied. In backward each layer prefetches the next offloaded boundary (one layer ahead), so at
most two offloaded boundaries are on the GPU at once. The host memory is one buffer of exactly the
planned bytes (pinned with ``cudaHostRegister``: no power-of-two rounding by the caching host allocator),
carved into boundary slots, reused every step and released with ``release()``. On a CPU-only run the
same code runs: the host copy is a plain copy into the pool and the streams are no-ops.

Kept attention (``keep_attention``, ``ops.kept_attention``): the last layers may keep attention's output and
log-sum-exp from their forward, so their rerun builds attention's graph node without running its kernel again
(the last ones: their backward comes first, so what they keep is freed before the first layers' gradients
exist). The first of those (``keep_attention_host``) may hold theirs in pinned host memory instead
(``KeptHostStore``): copied out on the side stream after the layer's forward, back one layer ahead of its rerun.

Offloaded layers are the first in forward order: their boundaries wait longest for the backward.
Recompute composes with tiling (the layer recompute reruns the tiled MLP) and with sequence parallelism
(each rank offloads its own shard). RNG state is not replayed: the layers have no dropout.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any

import torch
from torch import nn

from megaseq.memory import forwards
from megaseq.memory.host_memory import HostBuffer
from megaseq.memory.replay import Chunk, InputStore, Replay, layer_rerun, replay
from megaseq.memory.rules import (  # the planner's slot sizing and kept layers too (one formula each)
    kept_attention_layers,
    round_up,
)
from megaseq.ops import kept_attention


# ---- what SCO and the host-kept attention outputs share ----------------------------------------------
class _PinnedStore:
    """One model's store of tensors waiting in pinned host memory for the backward: the pool, the copy stream,
    the records still pending (forward order; backward takes from the end), each fetched back one ahead
    (``prefetch_next``; a subclass's ``_start_fetch``)."""

    def __init__(self) -> None:
        self.pool: HostBuffer | None = None
        self.pending: list[weakref.ref[Any]] = []
        self.stream: Any = None

    @property
    def host_bytes(self) -> int:
        """Host bytes held by the pool (pinned on CUDA)."""
        return self.pool.nbytes if self.pool is not None else 0

    def _free_pool(self) -> None:
        """Drop the pool (the next offload plans a new one), freeing it unless pending records hold views of it."""
        if self.pool is not None and not self._live():
            self.pool.release()
        self.pool = None

    def _live(self) -> list[Any]:
        return [r for ref in self.pending if (r := ref()) is not None]

    def _copy_ctx(self) -> contextlib.AbstractContextManager:
        return torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()

    def _start_fetch(self, rec: Any) -> None:
        raise NotImplementedError

    def prefetch_next(self) -> None:
        """Start bringing back the most recent pending record (the next one backward needs)."""
        live = self._live()
        if live and live[-1].gpu is None:
            self._start_fetch(live[-1])


# ---- the offloader ------------------------------------------------------------------------------
class _Boundary:
    """One offloaded boundary: its host slot, and its GPU copy once fetched. Returns its slot when freed."""

    def __init__(self, offloader: BoundaryOffloader, slot: int, host: torch.Tensor,
                 device: torch.device) -> None:
        self.slot, self.host, self.device = slot, host, device
        self.gpu: torch.Tensor | None = None
        self.ready: Any = None  # CUDA event: the last copy of this boundary has finished
        weakref.finalize(self, offloader._free_slot, offloader.generation, slot)


class BoundaryOffloader(_PinnedStore):
    """SCO state shared by the layers of one model: the host pool (``num_slots x slot_bytes``), the copy stream,
    the pending boundaries."""

    def __init__(self, host_budget: int, max_slots: int | None = None) -> None:
        if host_budget < 0:
            raise ValueError(f"memory.offload_host_budget must be >= 0, got {host_budget}")
        super().__init__()
        self.host_budget = host_budget
        self.max_slots = max_slots  # set to the number of layers by checkpoint_layers
        self.slot_bytes = 0
        self.free: list[int] = []
        self.generation = 0  # bumped with every new pool, so a late slot return cannot reach the wrong pool
        self.num_offloaded = 0  # boundaries offloaded since the last reset of this counter

    # -- pool --
    def _plan_pool(self, nbytes: int, on_cuda: bool) -> None:
        self.release()
        self.generation += 1
        self.slot_bytes = round_up(nbytes)
        n = self.host_budget // self.slot_bytes
        if self.max_slots is not None:
            n = min(n, self.max_slots)
        self.pool = HostBuffer(n * self.slot_bytes, pin=on_cuda)
        self.free = list(range(n - 1, -1, -1))
        if on_cuda and self.stream is None:
            self.stream = torch.cuda.Stream()

    def release(self) -> None:
        """Free the host pool (the next offload plans a new one). Boundaries still pending keep theirs."""
        self._free_pool()
        self.free, self.slot_bytes = [], 0

    def _free_slot(self, generation: int, slot: int) -> None:
        if generation == self.generation and self.pool is not None:
            self.free.append(slot)

    # -- forward: offload --
    def offload(self, h: torch.Tensor) -> _Boundary | None:
        """Start copying ``h`` to a host slot; None when the budget is used up (``h`` stays on the GPU)."""
        nbytes = h.numel() * h.element_size()
        if self.pool is None or nbytes > self.slot_bytes:
            if self._live():  # a larger boundary while others are pending: keep it on the GPU
                return None
            self._plan_pool(nbytes, h.is_cuda)
        if not self.free:
            return None
        slot = self.free.pop()
        host = self.pool.view(slot * self.slot_bytes, tuple(h.shape), h.dtype)
        rec = _Boundary(self, slot, host, h.device)
        if h.is_cuda:
            self.stream.wait_stream(torch.cuda.current_stream())
            with self._copy_ctx():
                host.copy_(h, non_blocking=True)
                rec.ready = torch.cuda.Event()
                rec.ready.record()
            h.record_stream(self.stream)  # the allocator may reuse h only after the copy
        else:
            host.copy_(h)
        self.pending.append(weakref.ref(rec))
        self.num_offloaded += 1
        return rec

    # -- backward: fetch + prefetch one ahead --
    def _start_fetch(self, rec: _Boundary) -> None:
        rec.gpu = torch.empty(rec.host.shape, dtype=rec.host.dtype, device=rec.device)
        if rec.gpu.is_cuda:
            # the copy stream must not write the new block before the compute stream's last use of it
            self.stream.wait_stream(torch.cuda.current_stream())
            with self._copy_ctx():
                rec.gpu.copy_(rec.host, non_blocking=True)
                rec.ready = torch.cuda.Event()
                rec.ready.record()
        else:
            rec.gpu.copy_(rec.host)

    def fetch(self, rec: _Boundary) -> torch.Tensor:
        """The boundary on the GPU, ready for the compute stream; then prefetch the next one."""
        if rec.gpu is None:
            self._start_fetch(rec)
        if rec.ready is not None:
            torch.cuda.current_stream().wait_event(rec.ready)
        h, rec.gpu = rec.gpu, None
        self.pending = [ref for ref in self.pending if ref() is not None and ref() is not rec]
        # the slot may be reused at once: a later copy into it is queued behind this one on the copy stream
        self.prefetch_next()
        return h


# ---- kept attention in host memory ---------------------------------------------------------------
class _HostKept:
    """One layer call's kept tensors in host memory: per tensor its place in the keeper's calls and its host
    view; their GPU copies once fetched."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.entries: list[tuple[int, int, torch.Tensor]] = []  # (call, output index, host view)
        self.spill: list[HostBuffer] = []  # buffers of the tensors the pool had no room for
        self.gpu: list[torch.Tensor] | None = None
        self.ready: Any = None  # CUDA event: the fetch has finished


class KeptHostStore(_PinnedStore):
    """Kept attention outputs in pinned host memory (``memory.keep_attention_host_layers``) for the layers of one
    model: the pool, the copy stream, the layer calls whose tensors wait in host memory.

    After a host-kept layer's forward (``offload``) its kept tensors larger than one element are copied into the
    pool on the copy stream (after the compute stream's work so far; ``record_stream`` keeps the allocator from
    reusing their GPU memory before the copy ends) and the keeper's references are dropped. When the layer's rerun
    starts (``fetch``) they are back on the GPU, the compute stream waits for the copy, and the next host-kept
    layer's (the one before it in forward order) start coming back (``prefetch_next``). The pool is one
    ``HostBuffer`` carved at ``SLOT_ALIGN``-aligned offsets in forward order from its start whenever no layer's
    tensors are pending (a new step), reused every step: planned from the first host-kept layer as that layer's
    bytes times ``layers``, re-planned to a step's whole need at the next step after one needed more (its
    excess went to buffers of its own meanwhile); ``release()`` frees it. On a CPU-only run the same code runs:
    the copies are plain copies and the streams are no-ops."""

    def __init__(self, layers: int) -> None:
        super().__init__()
        self.layers = layers  # host-kept layers of the model: the first pool's size is the first one's times this
        self.offset = 0  # the next free byte of the pool this step
        self.need = 0  # bytes this step has carved (pool and spill)
        self.last_need = 0  # the need of the step before, when it exceeded the pool
        self.copies_out = 0  # tensors copied to host memory since the counters were reset
        self.copies_in = 0  # tensors copied back
        self.bytes_out = 0
        self.spilled = 0  # tensors that went to a buffer of their own

    def release(self) -> None:
        """Free the pool (the next offload plans a new one). Layers still pending keep their views."""
        self._free_pool()
        self.offset = 0

    def _carve(self, nbytes: int, on_cuda: bool, rec: _HostKept) -> tuple[HostBuffer, int]:
        """(buffer, offset) for ``nbytes``: the pool's next aligned place, else a buffer of its own."""
        size = round_up(nbytes)
        self.need += size
        if self.pool is not None and self.offset + size <= self.pool.nbytes:
            self.offset += size
            return self.pool, self.offset - size
        self.spilled += 1
        rec.spill.append(HostBuffer(size, pin=on_cuda))
        return rec.spill[-1], 0

    # -- forward: out --
    def offload(self, keeper: kept_attention.Keeper) -> _HostKept | None:
        """Copy ``keeper``'s large kept tensors to host memory and drop its references to them; the record to
        ``fetch`` them back with (None when nothing was kept)."""
        moved = [(c, j, t) for c, (_, outs) in enumerate(keeper.calls)
                 for j, t in enumerate(outs if isinstance(outs, (tuple, list)) else (outs,)) if kept_attention.large(t)]
        if not moved:
            return None
        on_cuda = moved[0][2].is_cuda
        if not self._live():  # a new step: carve from the pool's start, re-planned to the last step's need
            if self.need > self.host_bytes:
                self.last_need = self.need
            self.offset, self.need = 0, 0
            if self.pool is not None and self.last_need > self.pool.nbytes:
                self.release()
            if self.pool is None:
                first = sum(round_up(t.numel() * t.element_size()) for _, _, t in moved)
                self.pool = HostBuffer(max(self.last_need, first * self.layers), pin=on_cuda)
        if on_cuda and self.stream is None:
            self.stream = torch.cuda.Stream()
        rec = _HostKept(moved[0][2].device)
        for c, j, t in moved:
            buf, offset = self._carve(t.numel() * t.element_size(), on_cuda, rec)
            # the tensor's own layout where it is dense (SDPA's output is a transposed view), so each copy is one
            # block of bytes and the rerun gets the strides the forward made
            stride = torch.empty_like(t, device="meta").stride()
            rec.entries.append((c, j, buf.view(offset, tuple(t.shape), t.dtype, stride)))
        if on_cuda:
            self.stream.wait_stream(torch.cuda.current_stream())
            with self._copy_ctx():
                for (_, _, host), (_, _, t) in zip(rec.entries, moved):
                    host.copy_(t, non_blocking=True)
            for _, _, t in moved:
                t.record_stream(self.stream)  # the allocator may reuse t only after the copy
        else:
            for (_, _, host), (_, _, t) in zip(rec.entries, moved):
                host.copy_(t)
        _replace(keeper, [(c, j, None) for c, j, _ in moved])
        self.pending.append(weakref.ref(rec))
        self.copies_out += len(moved)
        self.bytes_out += sum(t.numel() * t.element_size() for _, _, t in moved)
        return rec

    # -- backward: in, one layer ahead --
    def _start_fetch(self, rec: _HostKept) -> None:
        rec.gpu = [torch.empty_strided(h.shape, h.stride(), dtype=h.dtype, device=rec.device)
                   for _, _, h in rec.entries]
        if rec.device.type == "cuda":
            # the copy stream must not write the new blocks before the compute stream's last use of them
            self.stream.wait_stream(torch.cuda.current_stream())
            with self._copy_ctx():
                for g, (_, _, h) in zip(rec.gpu, rec.entries):
                    g.copy_(h, non_blocking=True)
                rec.ready = torch.cuda.Event()
                rec.ready.record()
            for g in rec.gpu:
                g.record_stream(self.stream)  # freed unused (a graph dropped after the prefetch): after the copy
        else:
            for g, (_, _, h) in zip(rec.gpu, rec.entries):
                g.copy_(h)
        self.copies_in += len(rec.entries)

    def fetch(self, rec: _HostKept, keeper: kept_attention.Keeper) -> None:
        """``rec``'s tensors back in ``keeper``'s calls, on the GPU and ready for the compute stream; then
        prefetch the next layer's."""
        if rec.gpu is None:
            self._start_fetch(rec)
        if rec.ready is not None:
            torch.cuda.current_stream().wait_event(rec.ready)
        _replace(keeper, [(c, j, g) for (c, j, _), g in zip(rec.entries, rec.gpu)])
        rec.gpu = None
        self.pending = [ref for ref in self.pending if ref() is not None and ref() is not rec]
        # the pool's bytes may be carved again at once: a later copy into them is queued behind this one on the
        # copy stream
        self.prefetch_next()


def _replace(keeper: kept_attention.Keeper, values: list[tuple[int, int, Any]]) -> None:
    """Set output ``j`` of kept call ``c`` to ``v`` for each ``(c, j, v)``."""
    for c, j, v in values:
        sig, outs = keeper.calls[c]
        if isinstance(outs, (tuple, list)):
            outs = type(outs)(v if k == j else o for k, o in enumerate(outs))
        else:
            outs = v
        keeper.calls[c] = (sig, outs)


# ---- recompute ----------------------------------------------------------------------------------
class _ReadTracker(dict):
    """``ctx.carry`` during a layer's first forward: a dict that notes which keys the layer read, so
    only those entries are kept for its recompute (a DSA selection is large at 1M tokens)."""

    def __init__(self, items: dict[str, Any]) -> None:
        super().__init__(items)
        self.read: set[str] = set()

    def __getitem__(self, key: str) -> Any:
        self.read.add(key)
        return super().__getitem__(key)

    def get(self, key: str, default: Any = None) -> Any:
        self.read.add(key)
        return super().get(key, default)

    def __contains__(self, key: object) -> bool:
        self.read.add(key)  # type: ignore[arg-type]
        return super().__contains__(key)

    def setdefault(self, key: str, default: Any = None) -> Any:
        self.read.add(key)
        return super().setdefault(key, default)

    def pop(self, key: str, *default: Any) -> Any:
        self.read.add(key)
        return super().pop(key, *default)

    def __iter__(self):  # iterating (keys(), items(), values() too) reads everything
        self.read.update(super().keys())
        return super().__iter__()

    def keys(self):
        self.read.update(super().keys())
        return super().keys()

    def items(self):
        self.read.update(super().keys())
        return super().items()

    def values(self):
        self.read.update(super().keys())
        return super().values()


def _versions(carry: dict[str, Any]) -> dict[str, int]:
    return {k: v._version for k, v in carry.items() if isinstance(v, torch.Tensor)}


def _forward_tracking_carry(fwd: Any, h: torch.Tensor, seq_ctx: Any) -> tuple[torch.Tensor, dict | None]:
    """Run the layer once; return its output and the carry entries it read, as they were before it ran."""
    carry = getattr(seq_ctx, "carry", None)
    if carry is None:
        return fwd(h, seq_ctx), None
    before = dict(carry)
    tracker = _ReadTracker(carry)
    seq_ctx.carry = tracker
    try:
        out = fwd(h, seq_ctx)
    finally:
        seq_ctx.carry = carry
    carry.clear()  # the layer's writes (and deletions) reach the caller's dict
    carry.update(dict.items(tracker))
    return out, {k: before[k] for k in tracker.read if k in before}


class _LayerStep:
    """One layer's forward as the replay engine's step: the forward notes the ``ctx.carry`` entries it read
    (as they were before it ran); the backward's rerun runs against those, not against what later layers
    left in the carry."""

    def __init__(self, fwd: Any, seq_ctx: Any, keeper: kept_attention.Keeper | None = None,
                 host: KeptHostStore | None = None, keeps_on_host: bool = False) -> None:
        self.fwd, self.seq_ctx, self.keeper = fwd, seq_ctx, keeper
        self.host, self.keeps_on_host = host, keeps_on_host  # the model's host store; whether this layer uses it
        self.host_rec: _HostKept | None = None
        self.carry: dict[str, Any] | None = None
        self.versions: dict[str, int] = {}

    def forward(self, xs: list[torch.Tensor], _carry: Any, _chunk: Any) -> tuple[tuple[torch.Tensor], None]:
        with self.keeper.keeping() if self.keeper is not None else contextlib.nullcontext():
            out, self.carry = _forward_tracking_carry(self.fwd, xs[0], self.seq_ctx)
        if self.keeps_on_host and self.keeper is not None:
            self.host_rec = self.host.offload(self.keeper)
        self.versions = _versions(self.carry or {})
        return (out,), None

    def _kept_back(self) -> None:
        """Before the rerun: a host-kept layer's tensors back in its keeper; any layer prefetches the next
        host-kept layer's."""
        if self.host is None:
            return
        if self.host_rec is not None:
            self.host.fetch(self.host_rec, self.keeper)
            self.host_rec = None
        else:
            self.host.prefetch_next()

    def rerun(self, xs: list[torch.Tensor], _carry: Any, _chunk: Any) -> tuple[tuple[torch.Tensor], None]:
        seq_ctx, saved_carry = self.seq_ctx, getattr(self.seq_ctx, "carry", None)
        if self.carry is not None:
            for k, v in _versions(self.carry).items():
                assert v == self.versions[k], (
                    f"ctx.carry[{k!r}] was modified in place after the forward; recompute needs carry entries "
                    "to be replaced, not written"
                )
            seq_ctx.carry = dict(self.carry)
        self._kept_back()
        reuse = self.keeper.reusing() if self.keeper is not None else contextlib.nullcontext()
        try:
            with layer_rerun(), reuse:  # a module whose output only feeds the residual sum may skip computing it
                return (self.fwd(xs[0], seq_ctx),), None
        finally:
            if self.carry is not None:
                seq_ctx.carry = saved_carry


class _BoundaryStore(InputStore):
    """SCO as the replay engine's input store: the layer input goes to a pinned host slot when the budget
    has one (else it is saved on the GPU as plain recompute does), and comes back one layer ahead."""

    def __init__(self, offloader: BoundaryOffloader) -> None:
        self.offloader = offloader

    def stash(self, actx: Any, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        actx.rec = self.offloader.offload(inputs[0])
        return [] if actx.rec is not None else inputs

    def unstash(self, actx: Any, saved: list[torch.Tensor]) -> list[torch.Tensor]:
        if actx.rec is not None:
            h = self.offloader.fetch(actx.rec)
            actx.rec = None  # frees the host slot
            return [h]
        self.offloader.prefetch_next()
        return saved


class _CheckpointedForward(forwards.InstanceForward):
    """The forward ``checkpoint_layers`` installs on a layer instance (state-dict names unchanged)."""

    def __init__(self, layer: nn.Module, offloader: BoundaryOffloader | None, keep_attention: bool = False,
                 kept_host: KeptHostStore | None = None, keep_on_host: bool = False) -> None:
        super().__init__(layer)
        self.layer_ref = weakref.ref(layer)
        self.offloader = offloader
        self.keep_attention = keep_attention
        self.kept_host = kept_host  # the model's store of host-kept attention outputs (None: no layer uses one)
        self.keep_on_host = keep_on_host  # this layer's kept outputs wait in it

    def __call__(self, h: torch.Tensor, ctx: Any = None) -> torch.Tensor:
        layer = self.layer_ref()
        params = list(layer.parameters())
        if not torch.is_grad_enabled() or not (h.requires_grad or any(p.requires_grad for p in params)):
            return self.inner(h, ctx)
        step = _LayerStep(self.inner, ctx, kept_attention.Keeper() if self.keep_attention else None,
                          self.kept_host, self.keep_on_host)
        store = _BoundaryStore(self.offloader) if self.offloader is not None else None
        r = Replay(step=step.forward, rerun=step.rerun, chunks=[Chunk(0, h.shape[0])], modules=(layer,),
                   store=store)
        return replay(r, h)[0]


def checkpoint_layers(layers: Any, offloader: BoundaryOffloader | None = None, keep_attention: int = 0,
                      keep_attention_host: int = 0) -> BoundaryOffloader | None:
    """Full recompute for every layer of ``layers`` (an iterable of ``layer(h, ctx)`` modules), with
    boundaries offloaded by ``offloader`` (SCO) when given, and the last ``keep_attention`` layers keeping
    attention's output for their rerun (``ops.kept_attention``), the first ``keep_attention_host`` of those in
    pinned host memory (``KeptHostStore``, found with ``kept_host_store(layers)``). Calling again replaces the
    settings."""
    layers = list(layers)
    if keep_attention < 0 or keep_attention_host < 0:
        raise ValueError(f"memory.keep_attention_layers and memory.keep_attention_host_layers must be >= 0, got "
                         f"{keep_attention} and {keep_attention_host}")
    if keep_attention_host > keep_attention:
        raise ValueError(f"memory.keep_attention_host_layers={keep_attention_host} exceeds "
                         f"memory.keep_attention_layers={keep_attention}: set --memory.keep_attention_host_layers "
                         f"{keep_attention} (or fewer)")
    if offloader is not None and offloader.max_slots is None:
        offloader.max_slots = len(layers)
    on_host, on_gpu = kept_attention_layers(len(layers), keep_attention, keep_attention_host)
    store = KeptHostStore(len(on_host)) if on_host else None
    for i, layer in enumerate(layers):
        uncheckpoint_layer(layer)
        layer.forward = _CheckpointedForward(layer, offloader, keep_attention=i in on_host or i in on_gpu,
                                             kept_host=store, keep_on_host=i in on_host)
    return offloader


def kept_host_store(layers: Any) -> KeptHostStore | None:
    """The host store ``checkpoint_layers`` gave ``layers`` (None when no layer keeps in host memory)."""
    for layer in layers:
        fwd = forwards.installed(layer, _CheckpointedForward)
        if fwd is not None and fwd.kept_host is not None:
            return fwd.kept_host
    return None


def uncheckpoint_layer(layer: nn.Module) -> None:
    """Undo ``checkpoint_layers`` on ``layer`` (the forwards around it as they were)."""
    forwards.remove(layer, _CheckpointedForward)
