"""Attention's output kept from a layer's forward for its recompute: the rerun builds attention's graph node from
it instead of running the attention kernel again.

Under full recompute (``memory.offload.checkpoint_layers``) a layer's forward runs twice: once without a graph,
once in its backward to build one. At long lengths attention's forward is most of that rerun (its cost grows
as S^2, the rest as S), and its backward reads only q, k and v (rerun, cheap: projections, norms, RoPE) and the
forward's output and log-sum-exp. A ``Keeper`` per layer call holds those:

- ``keeping()`` around the layer's first forward: every fused attention op SDPA calls (``ATTENTION_OPS``:
  flash, cuDNN, memory-efficient, and the CPU flash kernel) runs asking for its log-sum-exp (a call without a
  graph skips it) and its outputs are kept, in call order, with its inputs' shapes;
- ``reusing()`` around the rerun: each such call, the same op on inputs of the same shapes in the same order,
  returns the kept outputs without running; autograd records the op's node over them, so its backward runs as
  it would have. A call that differs runs the kernel (``misses``) and the kept outputs left are dropped.

The interception is a ``TorchDispatchMode`` entered only around the ops ``attention`` and ``sink_attention``
(``ops.dispatch.call``), so nothing else in the layer pays for it. q, k and v are computed again from the same
inputs by the same kernels, so the kept output is the one the rerun would compute (float64 on the CPU: equal).
Dropout is not supported (the models have none: ``dropout_p`` must be 0, else the call is not kept).

Costs and gains (planner, ``memory.keep_attention_layers``): per kept layer, the op's output ``c * Hq * D`` and
log-sum-exp ``f * Hq`` bytes per token, held from its forward to its backward; saved, one attention forward.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megaseq.ops.dispatch import KEPT_OPS

aten = torch.ops.aten

# the fused attention ops SDPA dispatches to, and the name of the flag that asks for the log-sum-exp (None:
# always computed)
_LSE_FLAG = "compute_log_sumexp"


def _index(func: Any, name: str) -> int | None:
    """The position of argument ``name`` in the op's schema (None: it has none)."""
    return next((i for i, a in enumerate(func._schema.arguments) if a.name == name), None)


def _ops() -> dict[Any, str | None]:
    names = ("_scaled_dot_product_flash_attention", "_scaled_dot_product_cudnn_attention",
             "_scaled_dot_product_efficient_attention", "_scaled_dot_product_flash_attention_for_cpu",
             "_efficient_attention_forward", "_flash_attention_forward")
    out: dict[Any, str | None] = {}
    for name in names:
        packet = getattr(aten, name, None)
        if packet is None:
            continue
        op = packet.default
        out[op] = _LSE_FLAG if _index(op, _LSE_FLAG) is not None else None
    return out


ATTENTION_OPS: dict[Any, str | None] = _ops()


def _dropout(func: Any, args: tuple, kwargs: dict) -> float:
    i = _index(func, "dropout_p")
    if i is None:
        return 0.0
    return float(kwargs.get("dropout_p", args[i] if i < len(args) else 0.0))


def _with_lse(func: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The call with its log-sum-exp flag set (where the op has one)."""
    flag = ATTENTION_OPS[func]
    if flag is None:
        return args, kwargs
    i = _index(func, flag)
    if i < len(args):
        args = args[:i] + (True,) + args[i + 1:]
    else:
        kwargs = {**kwargs, flag: True}
    return args, kwargs


def _describe(a: Any) -> Any:
    if isinstance(a, torch.Tensor):
        return tuple(a.shape), a.dtype, str(a.device)
    return a if isinstance(a, (bool, int, float, str, type(None))) else type(a).__name__


def _signature(func: Any, args: tuple, kwargs: dict) -> tuple:
    """The op and its arguments as the kept call is matched: tensors by shape, dtype and device; the
    log-sum-exp flag set as the kept call had it."""
    args, kwargs = _with_lse(func, args, kwargs)
    return (func, tuple(_describe(a) for a in args), tuple(sorted((k, _describe(v)) for k, v in kwargs.items())))


def large(t: Any) -> bool:
    """A kept output that counts (and that host-kept layers move to host memory): a tensor of more than one element
    (O, the log-sum-exp); the 0-dim and one-element ones (seeds, offsets, sizes) stay where they are."""
    return isinstance(t, torch.Tensor) and t.numel() > 1


def _detach(out: Any) -> Any:
    if isinstance(out, torch.Tensor):
        return out.detach()
    if isinstance(out, (tuple, list)):
        return type(out)(_detach(o) for o in out)
    return out


@dataclass
class KeptStats:
    """Counts over a run's kept layers: calls kept, calls the rerun took from them, calls it ran again."""

    kept: int = 0
    hits: int = 0
    misses: int = 0
    bytes_kept: int = 0  # bytes kept by ``kept`` calls

    def reset(self) -> None:
        """Start counting again (a bench row's steps, a test's step)."""
        self.kept = self.hits = self.misses = self.bytes_kept = 0


STATS = KeptStats()


@dataclass
class Keeper:
    """One layer call's kept attention outputs (``keeping`` fills them, ``reusing`` returns them once)."""

    calls: list[tuple[tuple, Any]] = field(default_factory=list)  # (signature, outputs) in call order
    phase: str = ""  # "keep" | "reuse" while a phase is active

    @contextlib.contextmanager
    def keeping(self) -> Iterator[None]:
        self.calls.clear()
        with _active(self, "keep"):
            yield

    @contextlib.contextmanager
    def reusing(self) -> Iterator[None]:
        try:
            with _active(self, "reuse"):
                yield
        finally:
            self.calls.clear()  # a rerun that missed leaves nothing behind

    def mode(self) -> TorchDispatchMode:
        return _Mode(self)

    def handle(self, func: Any, args: tuple, kwargs: dict) -> Any:
        if _dropout(func, args, kwargs) != 0.0:
            return func(*args, **kwargs)
        if self.phase == "keep":
            args, kwargs = _with_lse(func, args, kwargs)
            out = func(*args, **kwargs)
            self.calls.append((_signature(func, args, kwargs), _detach(out)))
            STATS.kept += 1
            STATS.bytes_kept += sum(t.numel() * t.element_size() for t in out if large(t))
            return out
        if self.calls and self.calls[0][0] == _signature(func, args, kwargs):
            STATS.hits += 1
            return _detach(self.calls.pop(0)[1])
        STATS.misses += 1
        self.calls.clear()
        return func(*args, **kwargs)


class _Mode(TorchDispatchMode):
    def __init__(self, keeper: Keeper) -> None:
        super().__init__()
        self.keeper = keeper

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in ATTENTION_OPS:
            return self.keeper.handle(func, args, kwargs)
        return func(*args, **kwargs)


_ACTIVE: contextvars.ContextVar[Keeper | None] = contextvars.ContextVar("megaseq_kept_attention", default=None)


@contextlib.contextmanager
def _active(keeper: Keeper, phase: str) -> Iterator[None]:
    keeper.phase = phase
    token = _ACTIVE.set(keeper)
    try:
        yield
    finally:
        _ACTIVE.reset(token)
        keeper.phase = ""


def active() -> Keeper | None:
    """The keeper of the layer call running now (``keeping`` / ``reusing``), else None."""
    return _ACTIVE.get()


def wrap(op: str) -> contextlib.AbstractContextManager:
    """What ``ops.dispatch.call`` runs op ``op`` under: the active keeper's mode for the attention ops, else
    nothing."""
    keeper = _ACTIVE.get() if op in KEPT_OPS else None
    if keeper is None:
        return contextlib.nullcontext()
    # the keeper is not active inside its own mode (an op nested in the mode would see it again)
    return _inside(keeper)


@contextlib.contextmanager
def _inside(keeper: Keeper) -> Iterator[None]:
    token = _ACTIVE.set(None)
    try:
        with keeper.mode():
            yield
    finally:
        _ACTIVE.reset(token)
