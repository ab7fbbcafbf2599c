"""Choosing the fixes: their estimated time costs, the cheapest set that fits, and chunk sizes.

Pure Python. The ladder, cheapest first in the usual case (costs are computed per run from the FLOPs
model, ``fix_costs``): chunked loss (+5% of the loss time), indexer query chunking (free), MLP/MoE
tiling (one more forward of the tiled module), segmented KDA, full recompute (one more forward of every
layer), sequence segments (the same, plus a small per-segment cost; they bound each layer's memory by
the segment instead of the sequence and replace recompute, SCO and segmented KDA), SCO (1.9% + any copy
time the compute cannot hide), OffloadStreamAdamW (the host<->device traffic of the optimizer step).
Every set of fixes is tried in order of total cost (SCO only with recompute); the first that fits wins
and its chunk sizes then grow, in powers of two, as far as the budget allows.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace
from typing import Any

from megaseq.plan import components as C
from megaseq.plan import layers
from megaseq.plan.components import GB, GIB, Mesh
from megaseq.plan.flops import DEVICE_BYTES_PER_S, PINNED_BYTES_PER_S, step_flops, step_seconds
from megaseq.plan.phases import Evaluation, Run, evaluate

H200_GPU_BYTES = int(139.8 * GIB)  # BRIEF section 6: usable memory of one H200
HOST_BYTES_PER_GPU = 128 * GB  # BRIEF section 6: the 1-GPU host; per GPU of a larger host by default
LADDER = (
    "chunked_loss",
    "indexer_query_chunk",
    "tiled_mlp",
    "kda_segments",
    "recompute",
    "model_segments",
    "checkpoint_offload",
    "optimizer_offload",
)
# sequence segments replace these (each layer's memory is already bounded by the segment)
SEGMENT_EXCLUDES = ("kda_segments", "recompute", "checkpoint_offload")
SEGMENT_SETTING = "memory.model_segment_tokens"
# the families whose token mixers implement the segment hooks (KDA, MLA/DSA); softmax attention does not
SEGMENTABLE_FAMILIES = ("glm5_next",)
# chunk-size ranges (powers of two) the planner chooses from, (smallest, largest worth having): past
# 8K-token loss chunks and 16K-token tiles the launches are amortised, so growing further would only spend
# headroom; the indexer's ceiling is INDEXER_SCORING_MAX
LOSS_CHUNKS, TILE_CHUNKS, INDEXER_CHUNKS = (512, 8192), (1024, 16384), (64, None)
SEGMENT_CHUNKS = (4096, 65536)  # KDA segments: fla's chunk is 64 tokens; past 64K the saving is spent
# sequence segments: below 8K tokens a segment's kernels are short (launch-bound); past 64K the saving is spent
MODEL_SEGMENT_CHUNKS = (8192, 65536)
# a sequence segment's overhead over full recompute: per segment, the earlier tokens' latents are joined
# and the indexer's pools rebuilt (O(S) each) -- an estimate until measured
MODEL_SEGMENT_OVERHEAD = 0.03
# the kept DSA selections (a speed-up, not a fix) only where the plan then has this much of the GPU spare
KEEP_SELECTION_MARGIN = 0.05
# a segmented KDA layer reruns its forward in backward: one KDA forward, about half its layer's forward
# (measured on the H200: the segmented layer's forward + backward 1.31x / 1.43x the plain one at 128K / 256K)
KDA_MIXER_SHARE = 0.5
# one indexer scoring chunk stays under this (BRIEF: "a few hundred queries at a time keeps that under
# 2 GiB"); chunking is free, and an unchunked 32 GiB scoring tensor failed at 64K tokens on an H200 with
# 58 GiB reserved but free (allocator fragmentation), so the bound applies whether or not memory is short
INDEXER_SCORING_MAX = 2 * GIB
SCO_BASE_COST = 0.019  # BRIEF section 4: SCO throughput within 1.9%
LOSS_CHUNK_COST = 0.05  # BRIEF section 4: +4-5% of the loss time


@dataclass(frozen=True)
class Budgets:
    """What one GPU and one host may use. ``host_bytes`` is per host (shared by its GPUs)."""

    gpu_bytes: int = H200_GPU_BYTES
    host_bytes: int | None = None

    def host(self, mesh: Mesh) -> int:
        return self.host_bytes if self.host_bytes is not None else HOST_BYTES_PER_GPU * mesh.gpus_on_host


# ---- settings and their costs -----------------------------------------------------------------------
def default_memory(memory_cfg: Any | None, n_local: int) -> dict[str, Any]:
    """The settings with no fix enabled (chunk sizes from the config where it has them)."""
    get = (lambda k, d: getattr(memory_cfg, k, d)) if memory_cfg is not None else (lambda k, d: d)
    return {
        "chunked_loss": False,
        "loss_chunk_tokens": int(get("loss_chunk_tokens", 8192)),
        "tiled_mlp": False,
        "mlp_tile_tokens": int(get("mlp_tile_tokens", 16384)),
        "indexer_query_chunk": n_local,
        "recompute": False,
        "checkpoint_offload": False,
        "offload_host_budget": 0,
        "optimizer_offload": False,
        "optimizer_bucket_params": int(get("optimizer_bucket_params", 100_000_000)),
        # 0: off; a configured size is where the planner starts when it chooses segmented KDA
        "kda_segment_tokens": int(get("kda_segment_tokens", 0)),
        "model_segment_tokens": int(get("model_segment_tokens", 0)),
        "segment_keep_selection": False,  # the planner turns it on where it fits (_grow)
    }


def fix_costs(run: Run) -> dict[str, float]:
    """Estimated step-time cost of each fix, as a fraction of the step (FLOPs shares + transfer time)."""
    sf = step_flops(run.spec, run.seq_len)
    T = step_seconds(run.spec, run.seq_len, run.batch, run.mesh)
    P = run.counts.trainable / run.mesh.shard
    k = C.boundary_bytes(run.spec, run.n, run.prec) * run.spec.num_layers
    copy = k / PINNED_BYTES_PER_S  # each direction; hidden behind the forward (1/3) and backward (2/3)
    sco_excess = max(0.0, copy - T / 3) + max(0.0, copy - 2 * T / 3)
    opt = max(0.0, P * 30 / PINNED_BYTES_PER_S - P * 32 / DEVICE_BYTES_PER_S)  # up 16 B, down 14 B vs on GPU
    return {
        "chunked_loss": LOSS_CHUNK_COST * sf.loss / sf.total,
        "indexer_query_chunk": 0.0,
        "tiled_mlp": sf.mlp / 3 / sf.total,  # the tile's forward is rerun in backward
        "recompute": sf.layers_forward / sf.total,
        "kda_segments": KDA_MIXER_SHARE * sf.layers_forward / sf.total
        * run.spec.layer_types.count("kda") / max(run.spec.num_layers, 1),
        "model_segments": sf.layers_forward / sf.total + MODEL_SEGMENT_OVERHEAD,
        "checkpoint_offload": SCO_BASE_COST + sco_excess / T,
        "optimizer_offload": opt / T,
    }


def _with_fixes(base: dict[str, Any], fixes: tuple[str, ...], run: Run, host_room: int) -> dict[str, Any]:
    """Settings with ``fixes`` enabled at their smallest chunk sizes (the feasibility test)."""
    m = dict(base)
    if "chunked_loss" in fixes:
        m["chunked_loss"], m["loss_chunk_tokens"] = True, LOSS_CHUNKS[0]
    if "indexer_query_chunk" in fixes:
        m["indexer_query_chunk"] = INDEXER_CHUNKS[0]
    if "tiled_mlp" in fixes:
        m["tiled_mlp"], m["mlp_tile_tokens"] = True, TILE_CHUNKS[0]
    if "kda_segments" in fixes:
        m["kda_segment_tokens"] = base["kda_segment_tokens"] or SEGMENT_CHUNKS[0]
    if "model_segments" in fixes:
        m["model_segment_tokens"] = base["model_segment_tokens"] or MODEL_SEGMENT_CHUNKS[0]
    m["recompute"] = "recompute" in fixes
    m["optimizer_offload"] = "optimizer_offload" in fixes
    if "checkpoint_offload" in fixes:
        bnd = C.boundary_bytes(run.spec, run.n, run.prec)
        opt_host = C.optimizer_host_bytes(run.counts, run.mesh, m["optimizer_offload"])
        m["checkpoint_offload"] = True
        m["offload_host_budget"] = max(0, min(run.spec.num_layers * bnd, host_room - opt_host))
    return m


def check_model_segments(family: str, segment_tokens: int, cp: int = 1,
                         layer_schemes: tuple[str, ...] = ()) -> None:
    """ValueError naming ``memory.model_segment_tokens`` and the fix for what sequence segments
    (``memory/model_segments.py``) cannot run; the planner checks forced settings with it, the trainer its
    step."""
    name = SEGMENT_SETTING
    if segment_tokens < 1:
        raise ValueError(f"{name} must be >= 1 (0: off), got {segment_tokens}")
    if family not in SEGMENTABLE_FAMILIES:
        raise ValueError(f"{name}={segment_tokens}: the {family} family's token mixers do not carry their state "
                         f"across segments (supported: {', '.join(SEGMENTABLE_FAMILIES)}); unset {name}")
    if cp != 1:
        raise ValueError(f"{name}={segment_tokens} with context parallelism cp={cp}: sequence segments run on one "
                         f"rank for now; unset {name} or use --parallel.cp 1")
    if layer_schemes:
        raise ValueError(f"{name}={segment_tokens} with {', '.join(layer_schemes)}: sequence segments already "
                         "bound each layer's memory by the segment; turn those off (--memory.recompute false, "
                         "--memory.checkpoint_offload false, --memory.kda_segment_tokens 0)")


def usable_fix(run: Run, fix: str) -> bool:
    """Fixes that apply to this model and run: the indexer chunk needs DSA layers; segmented KDA needs
    KDA layers, one rank of context (cp 1) and no packed documents (its first version's limits); sequence
    segments a glm5_next model and one rank of context."""
    if fix == "indexer_query_chunk":
        return "dsa" in run.spec.layer_types
    if fix == "kda_segments":
        return "kda" in run.spec.layer_types and run.mesh.cp == 1 and not run.packed_documents
    if fix == "model_segments":  # the rules of check_model_segments
        return run.spec.family in SEGMENTABLE_FAMILIES and run.mesh.cp == 1
    return True


def _candidates(run: Run, costs: dict[str, float]) -> list[tuple[str, ...]]:
    """Every fix set (SCO needs recompute), cheapest first; ties go to fewer fixes, then the ladder."""
    usable = [f for f in LADDER if usable_fix(run, f)]
    sets = []
    for r in range(len(usable) + 1):
        for combo in itertools.combinations(usable, r):
            if "checkpoint_offload" in combo and "recompute" not in combo:
                continue
            if "model_segments" in combo and any(f in combo for f in SEGMENT_EXCLUDES):
                continue
            sets.append(combo)
    return sorted(
        sets, key=lambda s: (round(sum(costs[f] for f in s), 6), len(s), [LADDER.index(f) for f in s])
    )


def _fits(ev: Evaluation, budgets: Budgets, mesh: Mesh) -> bool:
    return ev.peak_gpu <= budgets.gpu_bytes and ev.peak_host <= budgets.host(mesh)


def indexer_chunk_cap(run: Run) -> int:
    """The largest query chunk (a power of two, or every local query) whose scoring chunk stays under
    ``INDEXER_SCORING_MAX``; ``n`` when the model has no DSA layer or all queries fit at once."""
    spec = run.spec
    if "dsa" not in spec.layer_types:
        return run.n
    kp = max(spec.index_kpool, 1)
    pools, select = run.seq_len // kp, spec.index_topk // kp

    def scoring(q: int) -> int:
        return layers.indexer_scoring_bytes(q, pools, spec.index_n_heads, select)

    if scoring(run.n // run.batch) <= INDEXER_SCORING_MAX:
        return run.n
    q = 1
    while q * 2 <= run.n and scoring(q * 2) <= INDEXER_SCORING_MAX:
        q *= 2
    return q


def _grow(run: Run, m: dict[str, Any], budgets: Budgets, keep_selection: bool = False) -> dict[str, Any]:
    """Each enabled chunk size as large as still fits (powers of two, ladder order)."""
    cap = indexer_chunk_cap(run)
    for key, flag, (lo, hi) in (
        ("model_segment_tokens", "model_segment_tokens", MODEL_SEGMENT_CHUNKS),
        ("indexer_query_chunk", None, (INDEXER_CHUNKS[0], cap)),
        ("loss_chunk_tokens", "chunked_loss", LOSS_CHUNKS),
        ("mlp_tile_tokens", "tiled_mlp", TILE_CHUNKS),
        ("kda_segment_tokens", "kda_segment_tokens", SEGMENT_CHUNKS),
    ):
        if (flag is None and m[key] >= run.n) or (flag is not None and not m[flag]):
            continue
        size = lo
        # a sequence segment grows first (fewer, longer segments; one as long as the sequence is none);
        # the chunks inside it then follow the segment's length
        if key == "model_segment_tokens":
            top = min(hi, run.n_seq - 1)
        else:
            top = min(hi, replace(run, memory=m).n)
        while size * 2 <= top:
            trial = dict(m, **{key: size * 2})
            if not _fits(evaluate(replace(run, memory=trial)), budgets, run.mesh):
                break
            size *= 2
        m[key] = size
    # sequence segments, if asked (``memory.segment_keep_selection``, not yet measured on a GPU): keep the
    # forward pass's DSA selections (no second scoring) where that fits with KEEP_SELECTION_MARGIN to
    # spare: a speed-up is not worth a run at the edge of the planner's accuracy
    if keep_selection and m.get("model_segment_tokens") and "dsa" in run.spec.layer_types:
        trial = dict(m, segment_keep_selection=True)
        room = replace(budgets, gpu_bytes=int(budgets.gpu_bytes * (1 - KEEP_SELECTION_MARGIN)))
        if _fits(evaluate(replace(run, memory=trial)), room, run.mesh):
            m = trial
    return m


def choose(
    run: Run, budgets: Budgets, memory_cfg: Any | None
) -> tuple[dict[str, Any], tuple[str, ...], bool]:
    """(settings, enabled fixes, fits): the cheapest fix set that fits, chunk sizes grown to the budget."""
    # the choice must not depend on the settings ``run`` carries (its ``n`` would be a segment's)
    run = replace(run, memory=dict(run.memory, model_segment_tokens=0))
    base = dict(default_memory(memory_cfg, run.n), indexer_query_chunk=indexer_chunk_cap(run))
    costs = fix_costs(run)
    host_room = budgets.host(run.mesh) // run.mesh.gpus_on_host - run.cal.process_host_bytes
    for fixes in _candidates(run, costs):
        m = _with_fixes(base, fixes, run, host_room)
        if _fits(evaluate(replace(run, memory=m)), budgets, run.mesh):
            m = _grow(run, m, budgets, bool(getattr(memory_cfg, "segment_keep_selection", False)))
            if m["indexer_query_chunk"] < run.n and "indexer_query_chunk" not in fixes:  # the 2 GiB bound
                fixes = tuple(f for f in LADDER if f in fixes or f == "indexer_query_chunk")
            return m, fixes, True
    # nothing fits: every usable fix, as one valid set (sequence segments replace the fixes they exclude)
    segments = usable_fix(run, "model_segments")
    every = tuple(f for f in LADDER if usable_fix(run, f) and not (segments and f in SEGMENT_EXCLUDES))
    return _with_fixes(base, every, run, host_room), every, False
