"""The ``MEGASEQ_*`` environment switches of the kernels: the one module that reads them.

Three are user settings with a config field that wins over the variable (``configured``, entered by a run):

- ``MEGASEQ_AUTOTUNE`` (``model.autotune``): how Triton autotunes megaseq's and fla's kernels where no tuned
  table has the key (``ops.autotune``): ``pruned`` (the default) times a few configs of each space, ``full``
  times them all (``megaseq tune``), ``one`` runs the most conservative config untimed.
- ``MEGASEQ_CACHE_DIR`` (``model.kernel_cache``): the root of the per-user cache of compiled kernels and tuned
  tables; default ``~/.cache/megaseq``.
- ``MEGASEQ_PRECOMPILE`` (``model.precompile``): ``1`` (the default) seeds Triton's cache with the package's
  compiled kernels for the run (``ops.kernel_pack``) and compiles the rest of the run's kernel manifests on several
  threads before the first step on a GPU (``ops.precompile``); ``compile`` compiles them all, seeding nothing;
  ``0`` does neither.

The others are debugging and tuning switches, live for benchmarks and for comparing kernel variants:

- ``MEGASEQ_FLA_AUTOTUNE``: ``one`` (or ``full``) is read as ``MEGASEQ_AUTOTUNE`` where that is unset, and
  ``one`` also limits fla's autotuners to one conservative config (the GPU suite's quick runs).
- ``MEGASEQ_MLA_AUTOTUNE``: ``1`` times the sparse MLA launcher's configs once per key (``megaseq tune``);
  else the tuned table's or the default.
- ``MEGASEQ_MLA_DC``: the sparse MLA backward's latent gradient, ``saved`` (the default), ``pool`` or
  ``atomic`` (``ops.sparse_mla.kernels``).
- ``MEGASEQ_ADAMW``: ``torch`` declines the one-pass Triton AdamW step of the master weights
  (``ops.adamw``) for torch's fused AdamW; default ``triton``.
- ``MEGASEQ_FAST_OFF``: ops (comma-separated, e.g. ``rope,swiglu``) whose fast kernel ``model.kernels fast`` leaves
  out, so they run their reference or base implementation: one kernel's share of a step, measured in its step.
- ``MEGASEQ_GROW_POOL``: ``1`` grows the CUDA caching allocator's pool toward the plan's tensor peak before the
  first step, while the precompile finishes (``train.build.grow_pool``); default ``0``.
- ``MEGASEQ_GC``: ``step`` (the default) keeps Python's garbage collector out of the training steps (the objects
  alive when they start frozen, automatic collection off, the young generations collected once a step while the
  GPU runs the update: ``train.host_gc``); ``auto`` leaves Python's collector as it is.
- ``MEGASEQ_PIN_AHEAD``: ``1`` (the default) page-locks the plan's pinned host bytes on a background thread from
  the run's start, for the memory schemes' host pools to take (``memory.host_memory``); ``0`` leaves each pool to
  lock its own when the first step makes it.
- ``MEGASEQ_WARM_OPS``: ``1`` (the default) replays the torch ops the run's first step calls, once each on zeros,
  while the precompile finishes, and records them where no manifest has them (``ops.op_warmup``); ``0`` turns
  that off.

A value outside a switch's choices is a ValueError naming the variable and the choices.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

from megaseq.ops.workspace import DC_DEFAULT as MLA_DC_DEFAULT

AUTOTUNE_MODES = ("pruned", "full", "one")
MLA_DC_MODES = ("pool", "saved", "atomic")
ADAMW_KERNELS = ("triton", "torch")
PRECOMPILE_VALUES = ("1", "0", "compile")

_config: dict[str, str] = {}  # variable -> the value a run's config sets (``configured``)


def _read(name: str) -> str | None:
    """The config's value of ``name`` in a run that sets it, else the environment's (None: unset or empty)."""
    return _config.get(name) or os.environ.get(name) or None


def _choice(name: str, value: str, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}, got {value!r}")
    return value


@contextlib.contextmanager
def configured(autotune: str | None = None, cache_dir: str | None = None,
               precompile: bool | None = None) -> Iterator[None]:
    """The run's ``model.autotune``, ``model.kernel_cache`` and ``model.precompile`` in place of
    ``MEGASEQ_AUTOTUNE``, ``MEGASEQ_CACHE_DIR`` and ``MEGASEQ_PRECOMPILE`` for its duration (None: the variable,
    else the default)."""
    before = dict(_config)
    if autotune is not None:
        _config["MEGASEQ_AUTOTUNE"] = _choice("model.autotune", autotune, AUTOTUNE_MODES)
    if cache_dir is not None:
        _config["MEGASEQ_CACHE_DIR"] = cache_dir
    if precompile is not None:
        _config["MEGASEQ_PRECOMPILE"] = "1" if precompile else "0"
    try:
        yield
    finally:
        _config.clear()
        _config.update(before)


def autotune_mode() -> str:
    """``MEGASEQ_AUTOTUNE`` (pruned, full or one); unset, ``MEGASEQ_FLA_AUTOTUNE`` ``one`` or ``full`` is read as
    the same; else ``pruned``."""
    fla = _read("MEGASEQ_FLA_AUTOTUNE")
    return _choice("MEGASEQ_AUTOTUNE", _read("MEGASEQ_AUTOTUNE") or (fla if fla in ("one", "full") else "pruned"),
                   AUTOTUNE_MODES)


def cache_root() -> Path:
    """megaseq's per-user cache: ``MEGASEQ_CACHE_DIR``, else ``~/.cache/megaseq``."""
    return Path(_read("MEGASEQ_CACHE_DIR") or "~/.cache/megaseq").expanduser()


def precompile() -> bool:
    """``MEGASEQ_PRECOMPILE``: ``1`` (the default) precompiles the run's kernel manifests before the first step
    on a GPU, the package's compiled kernels seeded into Triton's cache first; ``compile`` compiles them all
    without the seeding; ``0`` does neither."""
    return _precompile_value() != "0"


def kernel_pack() -> bool:
    """Whether the precompile first seeds Triton's cache from the package's compiled kernels
    (``MEGASEQ_PRECOMPILE`` ``1``, the default; ``ops.kernel_pack``)."""
    return _precompile_value() == "1"


def _precompile_value() -> str:
    return _choice("MEGASEQ_PRECOMPILE", _read("MEGASEQ_PRECOMPILE") or "1", PRECOMPILE_VALUES)


def grow_pool() -> bool:
    """``MEGASEQ_GROW_POOL=1``: grow the caching allocator's pool before the first step (``train.build.grow_pool``)."""
    return _choice("MEGASEQ_GROW_POOL", _read("MEGASEQ_GROW_POOL") or "0", ("0", "1")) == "1"


def pin_ahead() -> bool:
    """``MEGASEQ_PIN_AHEAD`` (default ``1``): lock the plan's pinned host bytes from the run's start
    (``train.build.reserve_pinned``)."""
    return _choice("MEGASEQ_PIN_AHEAD", _read("MEGASEQ_PIN_AHEAD") or "1", ("0", "1")) == "1"


def host_gc_manual() -> bool:
    """``MEGASEQ_GC``: ``step`` (the default) collects between steps (``train.host_gc``), ``auto`` leaves Python's
    collector on."""
    return _choice("MEGASEQ_GC", _read("MEGASEQ_GC") or "step", ("step", "auto")) == "step"


def fla_one_config() -> bool:
    """``MEGASEQ_FLA_AUTOTUNE=one``: fla's autotuners run one conservative config each, untimed."""
    return (_read("MEGASEQ_FLA_AUTOTUNE") or "full") == "one"


def mla_autotune() -> bool:
    """``MEGASEQ_MLA_AUTOTUNE=1``: the sparse MLA launcher times its configs once per key."""
    return (_read("MEGASEQ_MLA_AUTOTUNE") or "0") == "1"


def mla_dc() -> str:
    """``MEGASEQ_MLA_DC``: how the sparse MLA backward sums the latent gradient (``MLA_DC_MODES``)."""
    return _choice("MEGASEQ_MLA_DC", _read("MEGASEQ_MLA_DC") or MLA_DC_DEFAULT, MLA_DC_MODES)


def adamw_kernel() -> str:
    """``MEGASEQ_ADAMW``: ``triton`` (the default) or ``torch`` for the master weights' AdamW step."""
    return _choice("MEGASEQ_ADAMW", _read("MEGASEQ_ADAMW") or "triton", ADAMW_KERNELS)


def warm_ops() -> bool:
    """``MEGASEQ_WARM_OPS``: ``1`` (the default) replays the run's op manifest before the first step on a GPU and
    records it where none exists (``ops.op_warmup``); ``0`` does neither."""
    return _choice("MEGASEQ_WARM_OPS", _read("MEGASEQ_WARM_OPS") or "1", ("1", "0")) == "1"


def fast_off() -> frozenset[str]:
    """``MEGASEQ_FAST_OFF``: the ops the fast set leaves out (each must be an op of ``ops.table``)."""
    from megaseq.ops.table import BY_NAME

    ops = frozenset(o.strip() for o in (_read("MEGASEQ_FAST_OFF") or "").split(",") if o.strip())
    unknown = sorted(ops - set(BY_NAME))
    if unknown:
        raise ValueError(f"MEGASEQ_FAST_OFF names {', '.join(unknown)}, not ops; the ops: {', '.join(sorted(BY_NAME))}")
    return ops
