"""The chunked-replay engine: run a computation over chunks without a graph, replay each chunk with one in
backward. Every recomputing memory scheme is a user of it.

Shapes: T rows along the chunked dimension ``dim`` (tokens), a chunk ``[start, end)`` reading ``halo``
earlier rows too (``lo = start - halo``); n chunks.

    forward   for each chunk in order, under no_grad:  outs[start:end], carry = step(ins[lo:end], carry)
              saved: the inputs (or what ``InputStore`` keeps for them) and, with a carry, the carry into
              every chunk; nothing else proportional to T.
    backward  each chunk again, with a graph, under the forward's autocast (``ops.amp``): its inputs and
              the carry into it are leaves; its outputs' gradient slices (and the gradient the later chunk
              sent to its carry out) are backpropagated together; input gradients are written (halo rows:
              added) into full-size buffers, parameter gradients summed over the chunks, the carry's
              gradient handed to the chunk before. With a carry the chunks run in reverse, else in order.

Side state (``SideState``): a forward may leave per-forward values behind (``MoE.last_tokens_per_expert``)
or update buffers. Over the chunks of one forward the attributes in ``SUMMED_ATTRS`` (or a module's
``_tile_summed_attrs``) are summed, so they hold the whole sequence's value as an unchunked forward would;
the backward's replay must not count twice, so every tensor attribute and buffer of the modules is
snapshotted before it and put back after.

Users: ``tiling`` (token-separable modules and the token-separable parts of a layer: many inputs and
outputs, no carry), ``kda_segments`` (a recurrent mixer: halo rows and a carried state), ``offload`` (full
recompute: one chunk, its input stashed on the host by SCO), and ``model_segments`` (the whole model over
sequence segments: it drives ``run_chunks`` / ``SideState`` itself, its carries being keyed caches that
accumulate gradient instead of a chained tensor).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from megaseq.ops.amp import autocast_as, autocast_state

# attributes (per submodule) that hold a per-forward count: summed over the chunks of one forward
SUMMED_ATTRS: tuple[str, ...] = ("last_tokens_per_expert",)
# buffers up to this size are cloned before a replay and restored after; larger ones (caches) must not be
# mutated in place by the forward, which the restore checks
_SNAPSHOT_BUFFER_BYTES = 16 << 20


@dataclass(frozen=True)
class Chunk:
    """Rows ``[start, end)`` of the output, computed from input rows ``[start - halo, end)``."""

    start: int
    end: int
    halo: int = 0

    @property
    def lo(self) -> int:
        return self.start - self.halo


def chunk_bounds(total: int, size: int, halo: int = 0, setting: str = "chunk size") -> list[Chunk]:
    """Chunks of ``size`` rows (the last may be shorter), each reading up to ``halo`` rows before it (none
    before row 0); ``setting`` names the config key a bad size came from."""
    if size < 1:
        raise ValueError(f"{setting} must be >= 1, got {size}")
    return [Chunk(s, min(s + size, total), min(halo, s)) for s in range(0, total, size)]


# ---- side state ---------------------------------------------------------------------------------
Snapshot = list[tuple[nn.Module, dict[str, Any], dict[str, Any]]]


def snapshot_side_state(module: nn.Module) -> Snapshot:
    """References to every submodule's tensor attributes, and buffers (cloned when small)."""
    snap = []
    for m in module.modules():
        attrs = {k: v for k, v in m.__dict__.items() if isinstance(v, torch.Tensor)}
        bufs = {}
        for k, b in m._buffers.items():
            if b is None:
                continue
            small = b.numel() * b.element_size() <= _SNAPSHOT_BUFFER_BYTES
            bufs[k] = (b, b._version, b.clone() if small else None)
        snap.append((m, attrs, bufs))
    return snap


def restore_side_state(snap: Snapshot) -> None:
    """Undo what a replay did to tensor attributes and buffers (see ``snapshot_side_state``)."""
    for m, attrs, bufs in snap:
        for k, v in attrs.items():
            m.__dict__[k] = v
        for k, (b, version, copy) in bufs.items():
            m._buffers[k] = b
            if b._version != version:
                assert copy is not None, (
                    f"{type(m).__name__}.{k}: a large buffer was modified in place by a replayed forward; "
                    "a replay cannot restore it"
                )
                with torch.no_grad():
                    b.copy_(copy)


class SideState:
    """``with SideState(modules):`` a replay whose side effects on ``modules`` are undone at the end."""

    def __init__(self, modules: Iterable[nn.Module]) -> None:
        self.modules = tuple(modules)

    def __enter__(self) -> SideState:
        self.snaps = [snapshot_side_state(m) for m in self.modules]
        return self

    def __exit__(self, *exc: Any) -> None:
        for snap in self.snaps:
            restore_side_state(snap)


SummedTotals = dict[tuple[int, str], tuple[nn.Module, torch.Tensor]]


def collect_summed(module: nn.Module, totals: SummedTotals) -> None:
    """Add this chunk's value of every summed attribute of ``module``'s submodules to ``totals`` (looked up
    after each forward, since a module may create the attribute in its first)."""
    for m in module.modules():
        for name in dict.fromkeys(tuple(getattr(m, "_tile_summed_attrs", ())) + SUMMED_ATTRS):
            v = getattr(m, name, None)
            if isinstance(v, torch.Tensor):
                key = (id(m), name)
                prev = totals.get(key)
                totals[key] = (m, v.detach().clone() if prev is None else prev[1] + v.detach())


def set_summed(totals: SummedTotals) -> None:
    """Leave every summed attribute at its total (the whole sequence's value)."""
    for (_, name), (m, total) in totals.items():
        setattr(m, name, total)


def run_chunks(chunks: Sequence[Chunk], run: Callable[[int, Chunk], None], modules: Iterable[nn.Module]) -> None:
    """``run(j, chunk)`` for every chunk in order; the modules' per-forward counts summed over the chunks."""
    modules, totals = tuple(modules), {}
    for j, c in enumerate(chunks):
        run(j, c)
        if len(chunks) > 1:
            for m in modules:
                collect_summed(m, totals)
    set_summed(totals)


# ---- a layer's rerun -----------------------------------------------------------------------------------
# set while a whole layer's forward runs again in its backward (``offload``'s recompute) to rebuild its graph:
# a module whose output only feeds the layer's residual sum (its value read by nothing that backpropagates)
# may then build its graph node without computing that value (``Replay.outputs_like``)
_LAYER_RERUN: contextvars.ContextVar[bool] = contextvars.ContextVar("megaseq_layer_rerun", default=False)


@contextlib.contextmanager
def layer_rerun() -> Iterator[None]:
    """``with layer_rerun():`` a layer's forward run again in its backward, to rebuild its graph."""
    token = _LAYER_RERUN.set(True)
    try:
        yield
    finally:
        _LAYER_RERUN.reset(token)


def in_layer_rerun() -> bool:
    """Whether a layer's forward is being run again in its backward (``layer_rerun``)."""
    return _LAYER_RERUN.get()


# ---- what one scheme replays ----------------------------------------------------------------------
# (input slices [lo, end), carry into the chunk, the chunk) -> (output slices [start, end), carry out)
Step = Callable[[list[torch.Tensor], Any, Chunk], tuple[tuple[torch.Tensor, ...], Any]]


class InputStore:
    """Where the inputs wait for the backward: saved for backward (the default); SCO stashes them on the host."""

    def stash(self, actx: Any, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        return inputs

    def unstash(self, actx: Any, saved: list[torch.Tensor]) -> list[torch.Tensor]:
        return saved


@dataclass
class Replay:
    """``step(inputs, carry, chunk) -> (outputs, carry_out)`` over ``chunks`` of every input along ``dim``; the
    parameters and side state are those of ``modules``. ``carry``: a tensor flows from each chunk into the
    next (None into the first). ``rerun`` is the backward's step (default ``step``). ``outputs_like(inputs)``
    (no carry): uninitialised outputs of the right shapes in place of the forward's chunks, for a forward whose
    outputs' values nothing reads (a layer's rerun, ``in_layer_rerun``); the backward replays the chunks as
    always."""

    step: Step
    chunks: list[Chunk]
    modules: tuple[nn.Module, ...]
    dim: int = 0
    carry: bool = False
    rerun: Step | None = None
    store: InputStore | None = None
    outputs_like: Callable[[Sequence[torch.Tensor]], tuple[torch.Tensor, ...]] | None = None

    def params(self) -> list[torch.Tensor]:
        return [p for m in self.modules for p in m.parameters()]

    def slices(self, tensors: Sequence[torch.Tensor], c: Chunk) -> list[torch.Tensor]:
        return [t.narrow(self.dim, c.lo, c.end - c.lo) for t in tensors]


def _forward(r: Replay, inputs: Sequence[torch.Tensor], keep_carries: bool) -> tuple[tuple, list]:
    """Every chunk without a graph: the outputs (one buffer each, written chunk by chunk; a single chunk's
    own outputs) and, with ``keep_carries``, ``[carries]``: the carry into every chunk stacked ``[n, ...]``
    (the first, into chunk 0, zero: it is never read), or ``[None]``."""
    outs: list[torch.Tensor] | None = None
    carries: list[torch.Tensor | None] = [None]  # with a carry, one stacked [n, ...] tensor, the first zero
    state: dict[str, Any] = {"carry": None}

    def one(j: int, c: Chunk) -> None:
        nonlocal outs
        ys, carry_out = r.step(r.slices(inputs, c), state["carry"], c)
        if len(r.chunks) == 1:
            outs = list(ys)
        else:
            if outs is None:
                outs = [y.new_empty(y.shape[:r.dim] + (inputs[0].shape[r.dim],) + y.shape[r.dim + 1:]) for y in ys]
            for o, y in zip(outs, ys):
                o.narrow(r.dim, c.start, c.end - c.start).copy_(y)
        del ys
        if r.carry:
            if keep_carries and j + 1 < len(r.chunks):
                if carries[0] is None:
                    carries[0] = carry_out.new_zeros((len(r.chunks),) + tuple(carry_out.shape))
                carries[0][j + 1] = carry_out
            state["carry"] = carry_out

    with torch.no_grad():
        run_chunks(r.chunks, one, r.modules)
    assert outs is not None, "a replayed computation needs at least one row"
    return tuple(outs), carries


class _ParamGrads:
    """Parameter gradients summed over the chunks; the running sum is updated in place, so it must own its
    storage (a chunk's gradient may alias the output gradient or an input)."""

    def __init__(self, n: int, foreign: Sequence[torch.Tensor]) -> None:
        self.sums: list[torch.Tensor | None] = [None] * n
        self.foreign = {_storage(t) for t in foreign if t is not None}

    def add(self, i: int, g: torch.Tensor | None) -> None:
        if g is None:
            return
        if self.sums[i] is None:
            self.sums[i] = g.clone() if _storage(g) in self.foreign else g
        else:
            self.sums[i].add_(g)


def _storage(t: torch.Tensor) -> int:
    """The address of ``t``'s storage (a DTensor's, an expert-parallel parameter's gradient: its local
    tensor's)."""
    from torch.distributed.tensor import DTensor

    return (t.to_local() if isinstance(t, DTensor) else t).untyped_storage().data_ptr()


class _ReplayFn(torch.autograd.Function):
    @staticmethod
    def forward(actx, r: Replay, num_inputs: int, *tensors):
        inputs = list(tensors[:num_inputs])
        actx.r, actx.num_inputs, actx.autocast = r, num_inputs, autocast_state()
        saved = (r.store or InputStore()).stash(actx, inputs)  # first: an offload copy overlaps the forward
        if r.outputs_like is not None:
            assert not r.carry, "outputs_like is for replays without a carry"
            outs, carries = r.outputs_like(inputs), [None]
        else:
            outs, carries = _forward(r, inputs, keep_carries=True)
        actx.num_saved = len(saved)
        actx.save_for_backward(*saved, *[c for c in carries if c is not None])
        return outs

    @staticmethod
    def backward(actx, *grad_outs):
        r, k = actx.r, actx.num_inputs
        saved = list(actx.saved_tensors)
        inputs = (r.store or InputStore()).unstash(actx, saved[:actx.num_saved])
        stacked = saved[actx.num_saved:]
        carries = [None] + list(stacked[0][1:]) if r.carry and stacked else [None] * len(r.chunks)
        need_x, need_p = actx.needs_input_grad[2:2 + k], actx.needs_input_grad[2 + k:]
        params = r.params()
        assert len(params) == len(need_p), "the replayed modules' parameters changed since the forward"
        grad_x: list[torch.Tensor | None] = [None] * k  # made at the first gradient (one chunk: that one)
        grad_p = _ParamGrads(len(params), list(grad_outs) + inputs)
        d_carry = None
        order = _backward_order(r)
        with SideState(r.modules):
            for j in order:
                d_carry = _backward_chunk(actx, r, j, inputs, carries[j], d_carry, grad_outs, params, need_x,
                                          need_p, grad_x, grad_p)
        return (None, None, *grad_x, *grad_p.sums)


def _backward_chunk(actx, r: Replay, j: int, inputs, carry_in, d_carry, grad_outs, params, need_x, need_p,
                    grad_x: list, grad_p: _ParamGrads) -> torch.Tensor | None:
    """Chunk j replayed with a graph and backpropagated; returns the gradient of the carry into it."""
    c = r.chunks[j]
    xs = [x.detach().requires_grad_(need) for x, need in zip(r.slices(inputs, c), need_x)]
    h0 = carry_in.detach().requires_grad_(True) if carry_in is not None else None
    with torch.enable_grad(), autocast_as(actx.autocast):
        ys, carry_out = (r.rerun or r.step)(xs, h0, c)
    pairs = [(y, g.narrow(r.dim, c.start, c.end - c.start)) for y, g in zip(ys, grad_outs)
             if y.requires_grad and g is not None]
    if d_carry is not None:
        pairs.append((carry_out, d_carry))
    wrt = [x for x, need in zip(xs, need_x) if need] + ([h0] if h0 is not None else [])
    wrt += [p for p, need in zip(params, need_p) if need]
    grads = iter(torch.autograd.grad([y for y, _ in pairs], wrt, [g for _, g in pairs], allow_unused=True))
    del ys, carry_out, pairs
    # without halos the chunks' input rows are disjoint and cover the input: each chunk's gradient is copied into
    # an uninitialised buffer (a chunk without one zeroes its rows), not added into zeros (a fill and a read less)
    no_halo = all(ch.halo == 0 for ch in r.chunks)
    for i, need in enumerate(need_x):
        g = next(grads) if need else None
        disjoint = no_halo and _covers(r, inputs[i].shape[r.dim])
        if g is None and not (need and disjoint and grad_x[i] is not None):
            continue
        if len(r.chunks) == 1:  # the chunk is the whole input: its gradient is the input's, no buffer
            grad_x[i] = g
            continue
        if grad_x[i] is None:
            grad_x[i] = torch.empty_like(inputs[i]) if disjoint else torch.zeros_like(inputs[i])
            if disjoint:
                _zero_rows_before(grad_x[i], r, j)
        rows = grad_x[i].narrow(r.dim, c.lo, c.end - c.lo)
        if not disjoint:
            rows.add_(g)
        elif g is None:
            rows.zero_()
        else:
            rows.copy_(g)
    d_carry = next(grads) if h0 is not None else None
    for i, need in enumerate(need_p):
        grad_p.add(i, next(grads) if need else None)
    return d_carry


def _covers(r: Replay, rows: int) -> bool:
    """Whether the chunks, in order, tile rows ``[0, rows)`` exactly."""
    ends = [0] + [ch.end for ch in r.chunks]
    return all(ch.start == e for ch, e in zip(r.chunks, ends)) and ends[-1] == rows


def _backward_order(r: Replay) -> list[int]:
    """The order the backward replays the chunks in: with a carry from the last back, else from the first."""
    order = list(range(len(r.chunks)))
    return order[::-1] if r.carry else order


def _zero_rows_before(buf: torch.Tensor, r: Replay, j: int) -> None:
    """A disjoint replay's gradient buffer made at chunk j: zero the rows of the chunks already backpropagated
    (they had no gradient for this input); the later chunks write theirs."""
    order = _backward_order(r)
    for k in order[:order.index(j)]:
        ch = r.chunks[k]
        buf.narrow(r.dim, ch.start, ch.end - ch.start).zero_()


def replay(r: Replay, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``r.step`` over its chunks of ``inputs``: with a graph to build, only the inputs (and the carries)
    are saved and each chunk is replayed in backward; otherwise the chunks just run."""
    params = r.params()
    if torch.is_grad_enabled() and any(t.requires_grad for t in (*inputs, *params)):
        return _ReplayFn.apply(r, len(inputs), *inputs, *params)
    return _forward(r, inputs, keep_carries=False)[0]
