"""``megaseq bench``: measured peak memory, tokens/s and MFU per sequence length, next to the plan.

For each length the planner chooses the fixes (as ``megaseq train`` would), the model runs real
training steps (forward, backward, optimizer) on random tokens and/or real genome windows
(``bench.measure``), and the result records predicted vs measured peak GPU and host memory, tokens/s,
model FLOPs utilization, the fixes used, the MoE routing and the load imbalance seen. ``--routing``
(``resolve_routing``): on random weights and random tokens an MoE is timed with balanced routing (each token's
top-k spread evenly over the experts, ``models.common.routing``), since a random router sends almost every token
to the same experts; genome windows and loaded checkpoints keep the router's own choice. ``--find-max`` searches the
longest length that trains; ``--baseline`` runs the transformers reference of the same architecture and
weights (``bench.reference``) so every table carries the megaseq / reference ratios.

Outputs (``bench.report``): ``OUT.json``, ``OUT.md`` and ``OUT.png`` (memory and throughput against length).
"""

from __future__ import annotations

import platform
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from megaseq.bench.measure import cfg_for, measure_megaseq
from megaseq.bench.report import write_outputs
from megaseq.config import Config


def find_max(measure, start: int, granularity: int, limit: int = 4 << 20) -> tuple[int | None, list[dict[str, Any]]]:
    """Double from ``start`` until a length fails (or passes ``limit``: then ``limit`` is the answer),
    then bisect to ``granularity``; returns (max ok, rows)."""
    rows, ok, bad, L = [], None, None, start
    while bad is None:
        if L > limit:
            return ok, rows
        r = measure(L)
        rows.append(r)
        if r["status"] == "ok":
            ok, L = L, L * 2
        else:
            bad = L
        if ok is None and bad is not None and L <= granularity:
            return None, rows
    lo = ok or 0
    while bad - lo > granularity:
        mid = (lo + bad) // 2 // granularity * granularity
        if mid <= lo:
            break
        r = measure(mid)
        rows.append(r)
        lo, bad = (mid, bad) if r["status"] == "ok" else (lo, mid)
    return (lo or None), rows


def resolve_routing(cfg: Config, requested: str, source: str) -> str:
    """The routing of one source's rows: ``auto`` is ``balanced`` for an MoE on random weights and random tokens,
    else ``natural``; genome windows always route naturally (they measure the memory of uneven routing)."""
    from megaseq.models.common.routing import check_routing
    from megaseq.models.presets import resolve_spec

    if requested != "auto":
        check_routing(requested)
    if source == "genome":
        if requested == "balanced":
            raise ValueError("--routing balanced with --source genome: genome windows measure the router's own "
                             "(uneven) routing; use --source random, or --routing auto / natural")
        return "natural"
    if requested != "auto":
        return requested
    moe = "moe" in resolve_spec(cfg.model.name).mlp_types
    return "balanced" if moe and cfg.model.init_from is None else "natural"


def longest_ok(rows) -> int | None:
    """The longest length among ``rows`` whose step ran (None: none did)."""
    return max((r["seq_len"] for r in rows if r.get("status") == "ok"), default=None)


def _direct(fn, *args) -> dict[str, Any]:
    return fn(*args)


def isolated(fn, *args) -> dict[str, Any]:
    """``fn(*args)`` in a fresh spawned process: each length starts from an empty GPU, an empty pinned-memory
    cache and its own peak RSS (one length's offload buffers must not count against the next)."""
    import multiprocessing as mp

    with mp.get_context("spawn").Pool(1) as pool:
        try:
            return pool.apply(fn, args)
        except Exception as e:  # noqa: BLE001  (a crashed length is a result, the next still runs)
            return {"status": "error", "error": f"{type(e).__name__}: {e}"[:300]}


def run_bench(cfg: Config, lengths: list[int], steps: int = 3, source: str = "random", find_max_len: bool = False,
              baseline: bool = False, out: str = "benchmarks/results/bench",
              logprob_lengths: list[int] | None = None, max_limit: int = 4 << 20,
              isolate: bool | None = None, routing: str = "auto", recipe: str | None = None,
              overrides: list[str] | None = None, profile: bool = False,
              profile_first: bool = False) -> dict[str, Any]:
    """Every measurement in order; the outputs are rewritten after each, so a run stopped early keeps
    what it measured. ``isolate`` (default: on a GPU) runs each measurement in its own process. ``routing``:
    auto, balanced or natural (``resolve_routing``), the reference's the same as megaseq's random rows.
    ``profile``: after each length's timed steps, one more step under ``torch.profiler``, its table of ops by
    device time in ``<out>_profile_<source>_<tokens>.txt`` (``measure.profiled_step``). ``profile_first``: each
    length's first step under the profiler, its ops by host time in ``<out>_first_profile_<source>_<tokens>.txt``."""
    from megaseq.train.build import use_expandable_segments

    use_expandable_segments()  # the allocator as `megaseq train` sets it
    call = isolated if (torch.cuda.is_available() if isolate is None else isolate) else _direct
    sources = ["random", "genome"] if source == "both" else [source]
    if source not in ("random", "genome", "both"):
        raise ValueError(f"--source must be random, genome or both, got {source!r}")
    routes = {s: resolve_routing(cfg, routing, s) for s in sources}
    if baseline and "random" not in routes:
        routes["random"] = resolve_routing(cfg, routing, "random")
    if "genome" in sources:  # one clear message before any model is built: is the genome long enough?
        from megaseq.data import build_data

        build_data(cfg_for(cfg, max(lengths), "genome").data, None)
    rows: list[dict[str, Any]] = []
    result: dict[str, Any] = {"meta": _meta(cfg, lengths, steps, source, routing), "rows": rows}
    if recipe is not None:  # what re-plans the rows (benchmarks/memory/planner_error.py)
        result["meta"].update(recipe=recipe, overrides=list(overrides or []))
    path = Path(out)

    def keep(row: dict[str, Any], into: list[dict[str, Any]]) -> dict[str, Any]:
        into.append(row)
        write_outputs(result, path)
        return row

    for s in sources:
        for L in lengths:
            prof = Path(f"{out}_profile_{s}_{L}.txt") if profile else None
            first = Path(f"{out}_first_profile_{s}_{L}.txt") if profile_first else None
            keep(call(measure_megaseq, cfg, L, steps, s, routes[s], prof, first), rows)
    if find_max_len:
        result["max_len"] = mx = {"megaseq": None, "search": []}
        mx["megaseq"], _ = find_max(lambda L: keep(call(measure_megaseq, cfg, L, 1, sources[0], routes[sources[0]]),
                                                   mx["search"]),
                                    max(lengths), max(lengths) // 8, max_limit)
        write_outputs(result, path)
    if baseline:
        from megaseq.bench.reference import measure_reference

        result["reference_rows"] = ref_rows = []
        for L in lengths:
            keep(call(measure_reference, cfg, L, steps, routes["random"]), ref_rows)
        result["longest"] = {"megaseq": longest_ok(r for r in rows if r["source"] == "random"),
                             "reference": longest_ok(ref_rows)}
        if find_max_len:
            mx = result["max_len"]
            mx["reference_search"] = []
            mx["reference"], _ = find_max(lambda L: keep(call(measure_reference, cfg, L, 1, routes["random"]),
                                                         mx["reference_search"]),
                                          min(lengths), max(min(lengths) // 4, 1), max_limit)
    if logprob_lengths:
        from megaseq.bench.reference import logprob_check

        result["logprob_check"] = logprob_check(cfg, logprob_lengths)
    write_outputs(result, path)
    return result


def _meta(cfg: Config, lengths: list[int], steps: int, source: str, routing: str) -> dict[str, Any]:
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return {"model": cfg.model.name, "gpu": gpu, "torch": torch.__version__, "python": platform.python_version(),
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "lengths": lengths, "steps": steps,
            "source": source, "dtype": cfg.model.dtype, "kernels": cfg.model.kernels, "weights": cfg.model.weights,
            "routing": routing}
