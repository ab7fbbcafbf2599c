"""The choice of the cheapest set of fixes that fits: every set of ``fixes.FIXES`` the run can use, tried in
order of its least step-time cost (a tiled MLP's at its largest tile; the sets with a fix of
``fixes.LAST_RESORT`` after every set without one). A set that fits has its chunk sizes grown, in powers of two,
as far as the budget allows, and is costed at those sizes; the search stops at the first set whose least cost
is no lower than the cheapest grown set so far, which wins.

Pure Python. ``base_settings`` is the planner's starting point, ``with_fixes`` a set's settings, ``choose``
the search.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from megaseq.config import MemorySettings
from megaseq.plan import fixes as registry  # LAST_RESORT read through the module (a test swaps it)
from megaseq.plan import segments
from megaseq.plan.fixes import (
    FIXES,
    KEEP_SELECTION_MARGIN,
    KEPT_KINDS,
    LADDER,
    SEGMENT_EXCLUDES,
    TILE_CHUNKS,
    Budgets,
    CostTerms,
    indexer_chunk_cap,
    kept_host_excess,
)
from megaseq.plan.flops import step_seconds
from megaseq.plan.mesh import Mesh
from megaseq.plan.phases import evaluate
from megaseq.plan.run import Evaluation, Run


# ---- settings and their costs -----------------------------------------------------------------------
def base_settings(memory_cfg: Any | None, n_local: int) -> MemorySettings:
    """The settings with no fix enabled (chunk sizes from the config where it has them; the indexer scores
    all ``n_local`` queries at once)."""
    get = (lambda k, d: getattr(memory_cfg, k, d)) if memory_cfg is not None else (lambda k, d: d)
    return MemorySettings(
        chunked_loss=False, loss_chunk_tokens=int(get("loss_chunk_tokens", 8192)), tiled_mlp=False,
        mlp_tile_tokens=int(get("mlp_tile_tokens", 16384)), indexer_query_chunk=n_local, recompute=False,
        checkpoint_offload=False, offload_host_budget=0, optimizer_offload=False,
        optimizer_bucket_params=int(get("optimizer_bucket_params", 100_000_000)),
        # 0: off; a configured size is where the planner starts when it chooses the scheme
        kda_segment_tokens=int(get("kda_segment_tokens", 0)), model_segment_tokens=int(get("model_segment_tokens", 0)),
        segment_keep_selection=False,  # the planner turns it on where it fits (_grow)
        keep_attention_layers=0,  # the planner keeps as many as fit under recompute (_grow)
        keep_attention_host_layers=0,  # and more in host memory where those leave layers unkept (_grow)
        segment_kv_host=False,  # the planner turns it on where the GPU-resident store does not fit (choose)
    )


def fix_costs(run: Run) -> dict[str, float]:
    """Estimated step-time cost of each fix, as a fraction of the step (FLOPs shares + transfer time)."""
    terms = CostTerms.of(run)
    return {name: fix.cost(run, terms) for name, fix in FIXES.items()}


def usable_fix(run: Run, name: str) -> bool:
    """Whether fix ``name`` applies to this model and run (``Fix.usable``)."""
    return FIXES[name].usable(run)


def enabled_fixes(run: Run, memory: MemorySettings) -> tuple[str, ...]:
    """The fixes of the ladder that ``memory`` switches on for this run."""
    return tuple(name for name, f in FIXES.items() if f.usable(run) and f.enabled(run, memory))


def with_fixes(base: MemorySettings, fixes: tuple[str, ...], run: Run, host_room: int) -> MemorySettings:
    """Settings with ``fixes`` enabled at their smallest chunk sizes (the feasibility test)."""
    changes: dict[str, Any] = {}
    for name in fixes:
        changes.update(FIXES[name].enable(base, run, fixes, host_room))
    return base.replace(**changes)


def _candidates(run: Run, costs: dict[str, float]) -> list[tuple[str, ...]]:
    """Every valid fix set (requirements met, exclusions respected), cheapest first; ties go to fewer
    fixes, then the ladder."""
    usable = [f for f in LADDER if usable_fix(run, f)]
    sets = []
    for r in range(len(usable) + 1):
        for combo in itertools.combinations(usable, r):
            if any(req not in combo for f in combo for req in FIXES[f].requires):
                continue
            if any(x in combo for f in combo for x in FIXES[f].excludes):
                continue
            sets.append(combo)
    last = registry.LAST_RESORT
    return sorted(sets, key=lambda s: (any(f in last for f in s), round(sum(costs[f] for f in s), 6), len(s),
                                       [LADDER.index(f) for f in s]))


def _fits(ev: Evaluation, budgets: Budgets, mesh: Mesh) -> bool:
    return ev.peak_gpu <= budgets.gpu_bytes and ev.peak_host <= budgets.host(mesh)


def _grow(run: Run, m: MemorySettings, budgets: Budgets, keep_selection: bool = False) -> MemorySettings:
    """Each enabled chunk size as large as still fits (powers of two, in ``Growth.rank`` order)."""
    for g in sorted((f.growth for f in FIXES.values() if f.growth is not None), key=lambda g: g.rank):
        if not g.active(run, m):
            continue
        lo, hi = g.bounds(run)
        # a sequence segment grows first (fewer, longer segments; one as long as the sequence is none);
        # the chunks inside it then follow the segment's length
        top = min(hi, run.n_seq - 1) if g.setting == "model_segment_tokens" else min(hi, replace(run, memory=m).n)
        size = lo
        while size * 2 <= top:
            trial = m.replace(**{g.setting: size * 2})
            if not _fits(evaluate(replace(run, memory=trial)), budgets, run.mesh):
                break
            size *= 2
        m = m.replace(**{g.setting: size})
    # sequence segments, if asked (``memory.segment_keep_selection``, not yet measured on a GPU): keep the
    # forward pass's DSA selections (no second scoring) where that fits with KEEP_SELECTION_MARGIN to
    # spare: a speed-up is not worth a run at the edge of the planner's accuracy
    if keep_selection and m.model_segment_tokens and "dsa" in run.spec.layer_types:
        trial = m.replace(segment_keep_selection=True)
        room = replace(budgets, gpu_bytes=int(budgets.gpu_bytes * (1 - KEEP_SELECTION_MARGIN)))
        if _fits(evaluate(replace(run, memory=trial)), room, run.mesh):
            m = trial
    if m.recompute:
        m = _keep_attention(run, m, budgets)
    return m


def _keep_attention(run: Run, m: MemorySettings, budgets: Budgets) -> MemorySettings:
    """Under recompute, the most of the last layers that keep attention's output (``memory.keep_attention_layers``:
    the rerun skips attention's kernel) with ``KEEP_SELECTION_MARGIN`` of the GPU to spare, as a speed-up is not
    worth a run at the edge of the planner's accuracy; then, where that leaves SDPA layers unkept, those before
    them in host memory (``_keep_on_host``)."""
    L = run.spec.num_layers
    if not any(k in KEPT_KINDS for k in run.spec.layer_types):
        return m
    room = replace(budgets, gpu_bytes=int(budgets.gpu_bytes * (1 - KEEP_SELECTION_MARGIN)))

    def fits(k: int) -> bool:
        return _fits(evaluate(replace(run, memory=m.replace(keep_attention_layers=k))), room, run.mesh)

    k = _most(0, L, fits)  # keeping none is the set as grown, which fits
    if k == L:
        return m.replace(keep_attention_layers=L)
    return _keep_on_host(run, m.replace(keep_attention_layers=k, keep_attention_host_layers=0), budgets)


def _most(lo: int, hi: int, ok: Callable[[int], bool]) -> int:
    """The largest ``k`` in ``[lo, hi]`` with ``ok(k)``, by bisection: ``ok`` holds at ``lo`` (not tested) and,
    once false, stays false for larger ``k``."""
    if ok(hi):
        return hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo


def _keep_on_host(run: Run, m: MemorySettings, budgets: Budgets) -> MemorySettings:
    """With the last ``m.keep_attention_layers`` layers keeping attention's output on the GPU, the most of the
    layers before them that keep it in pinned host memory (``memory.keep_attention_host_layers``): as many as the
    host budget holds and whose copies hide behind the compute (``fixes.kept_host_excess`` zero: out in the
    forward's third of the step, in in the backward's two thirds, beside SCO's boundaries). They put at most two
    layers' worth on the GPU at once, whatever their number: bounded like a chunk size's growth step, they need the
    GPU budget, not ``KEEP_SELECTION_MARGIN`` of it to spare. Where that does not fit, one or two layers fewer keep
    on the GPU (one of theirs makes room for the two in flight)."""
    L, on_gpu = run.spec.num_layers, m.keep_attention_layers
    if not any(k in KEPT_KINDS for k in run.spec.layer_types[:L - on_gpu]):
        return m
    step_s = step_seconds(run.spec, run.seq_len, run.batch, run.mesh)

    def trial(g: int, h: int) -> MemorySettings:
        return m.replace(keep_attention_layers=g + h, keep_attention_host_layers=h)

    def hides(g: int, h: int) -> bool:
        return kept_host_excess(replace(run, memory=trial(g, h)), step_s) == 0.0

    def fits(g: int, h: int) -> bool:
        return _fits(evaluate(replace(run, memory=trial(g, h))), budgets, run.mesh)

    for g in range(on_gpu, max(-1, on_gpu - 3), -1):
        most = 0  # the most host-kept layers whose copies hide
        while most < L - g and hides(g, most + 1):
            most += 1
        if most == 0 or not fits(g, 1):
            continue
        return trial(g, _most(1, most, lambda h, g=g: fits(g, h)))
    return m


def least_costs(run: Run, terms: CostTerms) -> dict[str, float]:
    """Each fix's least step-time cost, the search's order and bound: a tiled MLP's at the largest tile it may grow
    to (its tiles' fixed cost the least) and beside recompute (where its replay may be free); sequence segments'
    at the longest segment (``run`` carries none: ``fixes.segment_tokens``)."""
    least = fix_costs(replace(run, memory=run.memory.replace(mlp_tile_tokens=TILE_CHUNKS[1],
                                                             keep_attention_layers=run.spec.num_layers)))
    least["tiled_mlp"] = FIXES["tiled_mlp"].cost(
        replace(run, memory=run.memory.replace(mlp_tile_tokens=TILE_CHUNKS[1], recompute=True)), terms)
    return least


def grown_cost(run: Run, fixes: tuple[str, ...], m: MemorySettings, least: dict[str, float],
               terms: CostTerms) -> float:
    """The step-time cost of ``fixes`` at their grown settings ``m``: the fixes' least costs, a tiled MLP's at the
    tile it grew to, beside recompute or not, sequence segments' at the length they grew to, and recompute's with
    the layers that keep attention's output."""
    cost = sum(least[f] for f in fixes)
    for f in ("tiled_mlp", "model_segments", "recompute"):
        if f in fixes:
            cost += FIXES[f].cost(replace(run, memory=m), terms) - least[f]
    return cost


def fitting_settings(run: Run, base: MemorySettings, fixes: tuple[str, ...], budgets: Budgets,
                     host_room: int) -> MemorySettings | None:
    """``fixes``' settings at their smallest chunk sizes where they fit (sequence segments' K/V store moved to host
    memory only where the GPU-resident one does not fit), else None."""
    m = with_fixes(base, fixes, run, host_room)
    if _fits(evaluate(replace(run, memory=m)), budgets, run.mesh):
        return m
    if "model_segments" in fixes and segments.segment_kv_rows(run):
        m = m.replace(segment_kv_host=True)
        if _fits(evaluate(replace(run, memory=m)), budgets, run.mesh):
            return m
    return None


def choose(run: Run, budgets: Budgets, memory_cfg: Any | None) -> tuple[MemorySettings, tuple[str, ...], bool]:
    """(settings, enabled fixes, fits): the cheapest fix set that fits, chunk sizes grown to the budget."""
    # the choice must not depend on the settings ``run`` carries (its ``n`` would be a segment's)
    run = replace(run, memory=run.memory.replace(model_segment_tokens=0))
    base = base_settings(memory_cfg, run.n).replace(indexer_query_chunk=indexer_chunk_cap(run))
    terms = CostTerms.of(run)
    least = least_costs(run, terms)
    host_room = budgets.host(run.mesh) // run.mesh.gpus_on_host - run.cal.process_host_bytes
    best: tuple[float, bool, MemorySettings, tuple[str, ...]] | None = None
    for fixes in _candidates(run, least):
        last = any(f in registry.LAST_RESORT for f in fixes)
        bound = round(sum(least[f] for f in fixes), 6)
        if best is not None and (last > best[1] or bound >= best[0]):
            break
        m = fitting_settings(run, base, fixes, budgets, host_room)
        if m is None:
            continue
        m = _grow(run, m, budgets, bool(getattr(memory_cfg, "segment_keep_selection", False)))
        if m.indexer_query_chunk < run.n and "indexer_query_chunk" not in fixes:  # the 2 GiB bound
            fixes = tuple(f for f in LADDER if f in fixes or f == "indexer_query_chunk")
        cost = round(grown_cost(run, fixes, m, least, terms), 6)
        if best is None or cost < best[0]:
            best = (cost, last, m, fixes)
    if best is not None:
        return best[2], best[3], True
    # nothing fits: every usable fix, as one valid set; sequence segments replace the fixes they exclude, so
    # with segments usable the two largest sets are compared and the one nearer the GPU budget is reported
    usable = tuple(f for f in LADDER if usable_fix(run, f))
    sets = [tuple(f for f in usable if f != "model_segments")]
    if "model_segments" in usable:
        sets.append(tuple(f for f in usable if f not in SEGMENT_EXCLUDES))

    def gpu_peak(fixes: tuple[str, ...]) -> int:
        return evaluate(replace(run, memory=with_fixes(base, fixes, run, host_room))).peak_gpu

    every = min(sets, key=gpu_peak)
    return with_fixes(base, every, run, host_room), every, False
