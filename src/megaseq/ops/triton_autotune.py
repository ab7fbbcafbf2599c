"""Triton's ``Autotuner`` (megaseq's kernels and fla's) reading megaseq's tuned tables and pruning its spaces.

``install()`` (called before the first Triton kernel runs: ``_triton_util.kernels``, the fla ops, the sparse MLA
and indexer launchers) sets the persistent cache directory (``autotune.use_persistent_cache``) and patches two
methods of ``triton.runtime.autotuner.Autotuner`` once per process:

- ``prune_configs`` (Triton calls it only when a key is not tuned yet in this process): the tuned table's
  config for (kernel, key fields, dtype, length bucket) when it has one; else ``autotune.prune`` of the space
  (``MEGASEQ_AUTOTUNE``), timed on the mode's clock (``autotune.BENCH_MS``; a kernel that brings its own
  ``do_bench`` keeps it). Where one config is left (a table's, or a space pruned to one), it is taken untimed:
  Triton 3.6 times even a lone config (its benchmarker's 25 ms warm-up and 100 ms of launches) before it runs it.
- ``run``: after Triton timed a new key, the winner goes into the user's table under its length bucket
  (``autotune.TunedTable.record``), which the next process reads; inside ``recording_tunings()`` the kernel and
  the seconds its timing took are also listed (what a first step spent tuning, for ``megaseq bench``).

The length of a launch is the kernel argument ``LENGTH_ARGS`` names (``T`` when unnamed: fla's and the mHC
kernels' token count). Triton's own in-process key leaves the length out (one tuning per shape in a process);
the tables keep one per length bucket across processes. Per launch the patch adds a length check of
``self.cache``; the lookups run only on Triton's cache misses.
"""

from __future__ import annotations

import contextlib
import os
import weakref
from collections.abc import Iterator
from typing import Any

from megaseq.ops import autotune

# the kernel argument that carries a launch's length (tokens or routed rows), by kernel name; default "T"
LENGTH_ARGS = {"gather_rows_kernel": "M", "row_dot_kernel": "M", "sum_rows_kernel": "N",
               "swiglu_fwd_kernel": "R", "swiglu_bwd_kernel": "R", "_index_scores_kernel": "N"}


_tuners: weakref.WeakSet = weakref.WeakSet()  # the autotuners that had a cache miss in this process
_recorders: list[list[tuple[str, float]]] = []  # the open ``recording_tunings`` lists


@contextlib.contextmanager
def recording_tunings() -> Iterator[list[tuple[str, float]]]:
    """The tunings Triton timed inside the block, as ``(kernel, seconds)`` in launch order: a key the tables did
    not have, its pruned (or full) space timed; a table's config or Triton's on-disk result is no timing."""
    timed: list[tuple[str, float]] = []
    _recorders.append(timed)
    try:
        yield timed
    finally:
        _recorders.remove(timed)


def forget_tunings() -> int:
    """Make every autotuner that tuned in this process tune again at its next launch (``megaseq tune``: one
    tuning per length bucket, where Triton's own key leaves the length out); Triton's on-disk autotune results
    are not read for them either. Returns how many autotuners it reset."""
    for tuner in _tuners:
        tuner.cache.clear()
        tuner.cache_results = False
    return len(_tuners)


def kernel_name(tuner: Any) -> str:
    fn = getattr(tuner, "base_fn", None) or tuner.fn
    return f"{getattr(fn, '__module__', '?')}.{fn.__name__}"


def config_dict(config: Any) -> dict[str, Any]:
    """A Triton config as the tables store it (without ``tuned``, how it was chosen)."""
    return {"kwargs": dict(config.kwargs), "num_warps": config.num_warps, "num_stages": config.num_stages}


def _same(config: Any, entry: dict[str, Any]) -> bool:
    return config_dict(config) == {k: entry.get(k) for k in ("kwargs", "num_warps", "num_stages")}


def describe(tuner: Any, kwargs: dict[str, Any]) -> tuple[str, dict[str, Any], int | None]:
    """(kernel, key fields, length) of the launch being tuned: the autotuner's key arguments and the first
    tensor's dtype; the length from ``LENGTH_ARGS``."""
    args = {**(tuner.nargs or {}), **kwargs}
    fields = {k: args[k] for k in tuner.keys if k in args}
    dtype = next((str(v.dtype) for v in args.values() if hasattr(v, "dtype")), None)
    if dtype is not None:
        fields["dtype"] = dtype
    name = kernel_name(tuner)
    length = args.get(LENGTH_ARGS.get(name.rpartition(".")[2], "T"))
    return name, fields, length if isinstance(length, int) and not isinstance(length, bool) else None


UNTIMED = "untimed"  # ``time_with``'s clock for a lone config: nothing launched, nothing timed


def untimed(kernel_call: Any, quantiles: tuple[float, ...]) -> list[float]:
    """The clock of a tuning with one config: the choice is made, so the kernel is not launched to time it (it
    compiles at its real launch). Zero for each quantile; no real timing reads zero."""
    return [0.0] * len(quantiles)


def time_with(tuner: Any, ms: tuple[int, int] | str | None) -> None:
    """Time ``tuner``'s next tuning with ``ms`` (warm-up, repetitions; milliseconds) on Triton's benchmarker,
    ``UNTIMED`` (one config: ``untimed``), or (None) on Triton's own clock. Triton reads ``tuner.do_bench``, a
    cached property: the instance's value set here wins over it, and removing it gives Triton's back. A kernel
    that passed its own ``do_bench`` to ``triton.autotune`` keeps it, except for a lone config."""
    if tuner.__dict__.get("_megaseq_clock") == ms and ms is not None:
        return
    if tuner.__dict__.pop("_megaseq_clock", None) is not None:
        tuner.__dict__.pop("do_bench", None)
    if ms is None:
        return
    if ms == UNTIMED:
        tuner.__dict__["do_bench"] = untimed
    elif getattr(tuner, "_do_bench", None) is not None:
        return
    else:
        warmup, rep = ms
        tuner.__dict__["do_bench"] = lambda kernel_call, quantiles: benchmarker()(
            kernel_call, warmup=warmup, rep=rep, quantiles=quantiles)
    tuner.__dict__["_megaseq_clock"] = ms


def benchmarker() -> Any:
    """Triton's benchmarker for the active GPU driver (``triton.testing.do_bench`` on CUDA), looked up when a
    tuning times its first config."""
    from triton.runtime import driver

    return driver.active.get_benchmarker()


def patch(autotuner_cls: type) -> None:
    """Patch ``prune_configs`` and ``run`` of ``autotuner_cls`` (Triton's ``Autotuner``) as the module says."""
    if getattr(autotuner_cls, "_megaseq_patched", False):
        return
    original_prune, original_run = autotuner_cls.prune_configs, autotuner_cls.run

    def prune_configs(self, kwargs: dict[str, Any], *rest: Any) -> list:
        configs = original_prune(self, kwargs, *rest)
        if os.environ.get("TRITON_INTERPRET", "0") == "1":  # the CPU interpreter: nothing timed for real
            return configs
        _tuners.add(self)
        name, fields, length = describe(self, kwargs)
        how = autotune.mode()
        hit = None if how == "full" else autotune.table().lookup(name, fields, length)  # full: tune afresh
        table = [c for c in self.configs if _same(c, hit)][:1] if hit is not None else []
        pruned = table or autotune.prune(configs, how)
        if len(pruned) > 1:  # a timed choice: worth keeping
            self._megaseq_tuning = (name, fields, length, how)
        time_with(self, autotune.BENCH_MS.get(how) if len(pruned) > 1 else UNTIMED)
        return pruned

    def run(self, *args, **kwargs):
        before = len(self.cache)
        self._megaseq_tuning = None
        self.bench_time = None  # Triton sets it when it times the configs (not for its on-disk result)
        out = original_run(self, *args, **kwargs)
        tuning = self._megaseq_tuning
        if tuning is not None and len(self.cache) > before:
            self._megaseq_tuning = None
            name, fields, length, how = tuning
            autotune.table().record(name, fields, length, {**config_dict(self.best_config), "tuned": how})
            if self.bench_time is not None:
                for timed in _recorders:
                    timed.append((name, float(self.bench_time)))
        return out

    autotuner_cls.prune_configs, autotuner_cls.run = prune_configs, run
    autotuner_cls._megaseq_patched = True


_installed = False


def install() -> None:
    """The persistent cache directory, and Triton's ``Autotuner`` patched (once per process; cheap after).
    Under Triton's CPU interpreter (the CPU tests) nothing is timed for real: the autotuner is left as it is."""
    global _installed
    if _installed or os.environ.get("TRITON_INTERPRET", "0") == "1":
        return
    autotune.use_persistent_cache()
    from triton.runtime.autotuner import Autotuner

    patch(Autotuner)
    _installed = True
