"""One dispatcher for every compute op, with a record of which implementation ran and why.

Each op (``kda``, ``sparse_attention``, ``attention``, ``grouped_mm``, ``causal_conv``...) has a
pure-torch reference implementation and optional fast ones. A fast implementation declares a
``supports(*args, **kwargs) -> str | None`` check that returns ``None`` when it can run, or the
reason it cannot (shape, dtype, device, missing package). The dispatcher tries the preferred
implementations in order, records per layer what ran and why the others did not, and with
``strict`` raises when the planned implementation could not run (the dense-attention trap of
the reference system becomes an error naming the layer and the reason).

Usage in a block::

    out = dispatch.call("kda", layer="layers.3.self_attn", q=q, k=k, ...)

The implementations are the rows of ``ops.table``: the first call of an op imports its rows' modules. ``register``
adds one outside the table (tests, experiments).
"""

from __future__ import annotations

import contextlib
import importlib
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from megaseq.ops import table


class KernelFallbackError(ValueError):
    """A layer could not run the implementation the plan asked for (``strict_kernels``): a user-facing error
    (the CLI prints its message), naming the layer, the kernel and the reason."""


@dataclass
class Impl:
    name: str
    fn: Callable[..., Any]
    supports: Callable[..., str | None] | None = None
    reference: bool = False
    opt_in: bool = False  # tried only when preferred or planned (a kernel not yet in the calibrated plan)


@dataclass
class Record:
    op: str
    impl: str
    reason: str  # why this implementation (and not a preferred one) ran
    calls: int = 1


@dataclass
class _State:
    registry: dict[str, dict[str, Impl]] = field(default_factory=dict)
    preferred: dict[str, list[str]] = field(default_factory=dict)  # op -> impl names, in order
    planned: dict[str, str] = field(default_factory=dict)  # op -> impl the plan requires
    strict: bool = False
    records: dict[tuple[str, str, str], Record] = field(default_factory=dict)  # (layer, op, impl) -> record
    loaded: set[str] = field(default_factory=set)  # ops whose ``ops.table`` rows are imported


_state = _State()
# the ops a layer's kept attention intercepts (``ops.kept_attention``, imported only when one of them runs)
KEPT_OPS = ("attention", "sink_attention")
_lock = threading.Lock()


def resolve(row: table.Impl) -> Impl:
    """The implementation a table row names: its module imported, its callables looked up."""
    module = importlib.import_module(row.module)
    supports = getattr(module, row.supports) if row.supports else None
    return Impl(row.name, getattr(module, row.fn), supports, row.reference, row.opt_in)


def _impls(op: str) -> dict[str, Impl]:
    """The implementations of ``op``: its ``ops.table`` rows (imported on the first call) and any registered."""
    impls = _state.registry.get(op)
    if op in _state.loaded or op not in table.BY_NAME:
        return impls or {}
    rows = {row.name: resolve(row) for row in table.BY_NAME[op].impls}
    with _lock:
        extra = _state.registry.get(op, {})
        _state.registry[op] = {**rows, **{n: i for n, i in extra.items() if n not in rows}}
        _state.loaded.add(op)
    return _state.registry[op]


def register(op: str, name: str, *, reference: bool = False, supports: Callable[..., str | None] | None = None,
             opt_in: bool = False) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator: register ``fn`` as implementation ``name`` of ``op`` outside ``ops.table`` (tests and
    experiments; the product's implementations are the table's rows). ``opt_in``: tried only where a run
    prefers or plans it (``model.kernels fast``), not by default."""

    def deco(fn: Callable[..., Any]) -> Callable[..., Any]:
        impls = _impls(op) if op in table.BY_NAME else _state.registry.setdefault(op, {})
        impls[name] = Impl(name, fn, supports, reference, opt_in)
        _state.registry[op] = impls
        return fn

    return deco


def implementations(op: str) -> dict[str, Impl]:
    return dict(_impls(op))


def configure(preferred: dict[str, list[str]] | None = None, planned: dict[str, str] | None = None,
              strict: bool = False) -> None:
    """Set the preference order per op, the implementations the plan requires, and strictness."""
    _state.preferred = dict(preferred or {})
    _state.planned = dict(planned or {})
    _state.strict = strict


@contextlib.contextmanager
def configured(preferred: dict[str, list[str]] | None = None, planned: dict[str, str] | None = None,
               strict: bool = False) -> Iterator[None]:
    """``configure`` for the duration of a run; the previous configuration comes back after it."""
    before = (_state.preferred, _state.planned, _state.strict)
    configure(preferred, planned, strict)
    try:
        yield
    finally:
        _state.preferred, _state.planned, _state.strict = before


@contextlib.contextmanager
def override(op: str, name: str, fn: Callable[..., Any]) -> Iterator[Callable[..., Any]]:
    """Run ``fn`` in place of implementation ``name`` of ``op`` for the duration (instrumentation and tests:
    ``fn`` may wrap the original, which the context yields)."""
    impl = _impls(op)[name]
    original = impl.fn
    impl.fn = fn
    try:
        yield original
    finally:
        impl.fn = original


def reset_records() -> None:
    with _lock:
        _state.records.clear()


def records() -> list[tuple[str, Record]]:
    """(layer, record) for every (layer, op, implementation) seen since the last reset, in first-call order."""
    with _lock:
        return [(layer, rec) for (layer, _, _), rec in _state.records.items()]


def fallbacks(preferred: dict[str, list[str]]) -> list[tuple[str, Record]]:
    """The records of calls that ran another implementation than their op's first ``preferred`` one
    (``model.kernels fast`` silently falling back: what a run reports once after its first step)."""
    return [(layer, r) for layer, r in records() if preferred.get(r.op) and r.impl != preferred[r.op][0]]


def fallback_summary(preferred: dict[str, list[str]]) -> list[dict[str, Any]]:
    """``fallbacks`` grouped by (op, implementation, reason): the layers (first 3 named) and calls of each."""
    groups: dict[tuple[str, str, str], dict[str, Any]] = {}
    for layer, r in fallbacks(preferred):
        g = groups.setdefault((r.op, r.impl, r.reason), {"op": r.op, "preferred": preferred[r.op][0], "ran": r.impl,
                                                         "reason": r.reason, "layers": [], "calls": 0})
        g["layers"].append(layer)
        g["calls"] += r.calls
    return list(groups.values())


def describe_fallback(g: dict[str, Any]) -> str:
    """One line of ``fallback_summary``: op, what ran instead, where, why."""
    where = ", ".join(g["layers"][:3]) + (f" and {len(g['layers']) - 3} more" if len(g["layers"]) > 3 else "")
    return f"{g['op']} ran {g['ran']}, not {g['preferred']}, in {where} ({g['calls']} calls): {g['reason']}"


def _order(op: str) -> list[Impl]:
    impls = _impls(op)
    if not impls:
        known = sorted(set(_state.registry) | set(table.BY_NAME))
        raise KeyError(f"no implementation registered for op {op!r}; known ops: {known}")
    names = list(_state.preferred.get(op, []))
    if op in _state.planned and _state.planned[op] not in names:
        names.append(_state.planned[op])
    fast = [n for n, i in impls.items() if not i.reference and not i.opt_in and n not in names]
    refs = [n for n, i in impls.items() if i.reference and n not in names]
    return [impls[n] for n in names + fast + refs if n in impls]


def select(op: str, layer: str, *args: Any, **kwargs: Any) -> Impl:
    """Choose the implementation for this call and record the choice."""
    skipped: list[str] = []
    chosen: Impl | None = None
    for impl in _order(op):
        why = impl.supports(*args, **kwargs) if impl.supports is not None else None
        if why is None:
            chosen = impl
            break
        skipped.append(f"{impl.name}: {why}")
    if chosen is None:
        raise RuntimeError(f"{layer}: no implementation of {op} can run ({'; '.join(skipped)})")
    planned = _state.planned.get(op)
    reason = "; ".join(skipped) if skipped else "first choice"
    if planned is not None and chosen.name != planned and _state.strict:
        raise KernelFallbackError(
            f"{layer}: planned kernel {op}={planned} did not run, {chosen.name} would ({reason}). "
            "Fix the cause or set --model.strict_kernels false to allow the fallback."
        )
    with _lock:  # one record per implementation: a layer whose calls ran two keeps both rows (and the fallback)
        key = (layer, op, chosen.name)
        rec = _state.records.get(key)
        if rec is not None:
            rec.calls += 1
        else:
            _state.records[key] = Record(op, chosen.name, reason)
    return chosen


def call(op: str, *args: Any, layer: str = "?", **kwargs: Any) -> Any:
    """Run ``op`` with the best implementation that supports these arguments (the attention ops under a layer's
    kept attention, ``ops.kept_attention``, where one is active)."""
    fn = select(op, layer, *args, **kwargs).fn
    if op not in KEPT_OPS:
        return fn(*args, **kwargs)
    from megaseq.ops import kept_attention

    with kept_attention.wrap(op):
        return fn(*args, **kwargs)


def format_table() -> str:
    """The per-layer table that ``megaseq verify`` prints."""
    rows = records()
    if not rows:
        return "(no op calls recorded)"
    w = max(len(layer) for layer, _ in rows)
    lines = [f"{'layer':<{w}}  {'op':<18} {'implementation':<16} calls  why"]
    for layer, r in rows:
        lines.append(f"{layer:<{w}}  {r.op:<18} {r.impl:<16} {r.calls:>5}  {r.reason}")
    return "\n".join(lines)
