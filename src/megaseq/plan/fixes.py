"""The registry of fixes: each exact memory scheme as the planner sees it (``choice.py`` chooses the cheapest set).

Pure Python. A ``Fix`` is one object: the setting it switches or sizes (a ``MemorySettings`` field), where
it can be used, its estimated step-time cost (from the FLOPs model), the settings its smallest form
enables, the range its chunk size grows through, the schemes it excludes or requires, and the byte
formula it changes. Its runtime wrapper lives in ``megaseq.memory`` (named in ``runtime``). The ladder
(``LADDER``), the candidate sets, the chunk growth and the reports all loop over ``FIXES``.

The ladder, cheapest first in the usual case: chunked loss (+5% of the loss time), indexer query chunking
(free), MLP/MoE tiling (one more forward of the tiled module, none beside recompute where only the MLP is
tiled, plus each tile's fixed cost where its tile is too short to hide it: ``tile_excess_seconds``),
segmented KDA, full recompute (one more
forward of every layer), sequence segments (the same, plus a cost that falls with the segments' length:
``segment_join_seconds``; they bound each
layer's memory by the segment instead of the sequence and replace recompute, SCO and segmented KDA), SCO
(1.9% + any copy time the compute cannot hide), OffloadStreamAdamW (the host<->device traffic of the
optimizer step), and last the frozen base streamed from host memory (the copy time the compute cannot
hide, ``plan.stream``). ``choice.choose`` tries the sets of fixes in order of their least cost (a tiled MLP's
at its largest tile), the sets with a fix of ``LAST_RESORT`` after every set without one; each that fits has
its chunk sizes grown, in powers of two, as far as the budget allows, and the cheapest at its grown sizes wins.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from megaseq.config import MemorySettings
from megaseq.memory.rules import (
    check_model_segments,  # noqa: F401  (re-exported)
    kept_attention_layers,
)
from megaseq.models.registry import family
from megaseq.plan import components as C
from megaseq.plan import layers, segments, stream
from megaseq.plan.flops import (
    DEVICE_BYTES_PER_S,
    PINNED_BYTES_PER_S,
    StepFlops,
    fsdp_traffic,
    layer_flops,
    segment_attention_rerun,
    segment_ends,
    step_flops,
    step_seconds,
)
from megaseq.plan.mesh import GB, GIB, Mesh
from megaseq.plan.run import Run
from megaseq.schemes import SCHEMES

H200_GPU_BYTES = int(139.8 * GIB)  # usable memory of one H200
HOST_BYTES_PER_GPU = 128 * GB  # the 1-GPU host; per GPU of a larger host by default
# chunk-size ranges (powers of two) the planner chooses from, (smallest, largest worth having): past
# 8K-token loss chunks and 16K-token tiles the launches are amortised, so growing further would only spend
# headroom; the indexer's ceiling is INDEXER_SCORING_MAX
LOSS_CHUNKS, TILE_CHUNKS, INDEXER_CHUNKS = (512, 8192), (1024, 16384), (64, None)
SEGMENT_CHUNKS = (4096, 65536)  # KDA segments: fla's chunk is 64 tokens; past 64K the saving is spent
# sequence segments: below 8K tokens a segment's kernels are short (launch-bound); past 64K the saving is spent
MODEL_SEGMENT_CHUNKS = (8192, 65536)
# sequence segments' own cost beyond the rerun of their forward, in seconds per token of the sequence up to each
# segment's end, summed over the segments: each segment's forward, rerun and backward join the earlier tokens'
# latents and rebuild the indexer's pools over them, and launch every layer's kernels for its own tokens, so fewer,
# longer segments cost less. Set so that the planner's estimates of glm5-flash-1gpu at 1M on an H100 with segments
# of 8K (optimizer on the GPU) and of 16K (optimizer in host memory) differ as the measured steps do, 39.60 s
# against 37.34 s (benchmarks/results/speed/glm5-flash-1gpu/2026-12-07_1m_segments_h100.json)
SEGMENT_JOIN_S = 9.5e-8
# the kept DSA selections and kept attention outputs (speed-ups, not fixes) only where the plan then has this much
# of the GPU spare
KEEP_SELECTION_MARGIN = 0.05
# a segmented KDA layer reruns its forward in backward: one KDA forward, about half its layer's forward
# (docs/planner.md, "Choosing fixes")
KDA_MIXER_SHARE = 0.5
# one indexer scoring chunk stays under this (a few hundred queries at a time); chunking is free, and one huge
# scoring tensor can fail to allocate with memory reserved but free (fragmentation: docs/planner.md, "Choosing
# fixes"), so the bound applies whether or not memory is short
INDEXER_SCORING_MAX = 2 * GIB
SCO_BASE_COST = 0.019  # SCO throughput within 1.9%
# a tile's fixed cost in one tiled layer, a step (seconds): its forward without a graph, again in the layer's
# recompute, and its replay with the backward each launch the module's kernels and run the replay's host work,
# whatever the tile's size; a tile whose own GPU work is shorter leaves the GPU waiting. Measured on an H100,
# Qwen3-30B-A3B LoRA at 32K, recompute on (benchmarks/results/speed/qwen3-30b-a3b-lora/2026-12-06_32k_h100.md):
# MoE tiles of 2048 tokens took 9.5 s a step more than tiles of 16,384 (16 against 2 tiles in each of 48
# layers, about 1.4 against 11 ms of MoE GPU work a tile)
TILE_FIXED_S = 0.014
LOSS_CHUNK_COST = 0.05  # +4-5% of the loss time


@dataclass(frozen=True)
class Budgets:
    """What one GPU and one host may use. ``host_bytes`` is per host (shared by its GPUs)."""

    gpu_bytes: int = H200_GPU_BYTES
    host_bytes: int | None = None

    def host(self, mesh: Mesh) -> int:
        return self.host_bytes if self.host_bytes is not None else HOST_BYTES_PER_GPU * mesh.gpus_on_host


@dataclass(frozen=True)
class CostTerms:
    """What the fixes' costs are computed from, once per run."""

    sf: StepFlops
    step_s: float  # the step's estimated seconds on one GPU
    sco_excess_s: float  # SCO copy time the compute cannot hide
    optimizer_s: float  # OffloadStreamAdamW's transfer time beyond an on-GPU step
    segment_regather_s: float = 0.0  # FSDP: what sequence segments' re-gathers add (0 without FSDP)
    segment_kv_host_s: float = 0.0  # memory.segment_kv_host: the K/V copies the compute cannot hide
    stream_excess_s: float = 0.0  # the streamed base's copy time the compute cannot hide (plan.stream)

    @classmethod
    def of(cls, run: Run) -> CostTerms:
        sf = step_flops(run.spec, run.seq_len)
        T = step_seconds(run.spec, run.seq_len, run.batch, run.mesh)
        P = run.counts.trainable / C.state_shard(run.counts, run.mesh)
        excess = copy_excess(C.boundary_bytes(run.spec, run.n, run.prec) * run.spec.num_layers, T)
        opt = max(0.0, P * 30 / PINNED_BYTES_PER_S - P * 32 / DEVICE_BYTES_PER_S)  # up 16 B, down 14 B
        streamed = replace(run, memory=run.memory.replace(stream_base=True))
        stream_s = stream.excess_seconds(streamed, segments_of(run) if run.segment else 1)
        return cls(sf, T, excess, opt, segment_regather_seconds(run),
                   segment_kv_host_excess(run, T), stream_s)


@dataclass(frozen=True)
class Growth:
    """A chunk size the planner grows in powers of two from ``lo`` while the plan still fits."""

    setting: str  # the MemorySettings field
    rank: int  # the order sizes grow in (a sequence segment first: the chunks inside it follow its length)
    bounds: Callable[[Run], tuple[int, int]]  # (lo, hi) for this run
    active: Callable[[Run, MemorySettings], bool]  # whether the size is in use (else it is left alone)


@dataclass(frozen=True)
class Fix:
    """One exact memory scheme, as the planner chooses it (see the module docstring)."""

    name: str  # what plans and reports call it
    setting: str  # the MemorySettings field that switches it on (or sizes it)
    runtime: str  # where the runtime applies it
    formula: str  # the byte formula it changes (plan/...)
    cost: Callable[[Run, CostTerms], float]  # estimated step-time cost, a fraction of the step
    usable: Callable[[Run], bool]
    enable: Callable[[MemorySettings, Run, tuple[str, ...], int], dict[str, Any]]  # (base, run, set, host room)
    enabled: Callable[[Run, MemorySettings], bool]
    why: Callable[[MemorySettings], str]
    growth: Growth | None = None
    excludes: tuple[str, ...] = ()
    requires: tuple[str, ...] = ()


def segment_tokens(run: Run) -> int:
    """Tokens per sequence segment of this run's step (the growth cap while the planner has not sized them)."""
    return run.segment or min(MODEL_SEGMENT_CHUNKS[1], run.seq_len)


def segments_of(run: Run) -> int:
    """Sequence segments of this run's step (the growth cap's count while the planner has not sized them)."""
    return -(-run.seq_len // segment_tokens(run))


def segment_join_seconds(run: Run) -> float:
    """What sequence segments of ``segment_tokens`` add to a step beyond their rerun (``SEGMENT_JOIN_S``): per
    sequence, the sum of the segments' ends."""
    return SEGMENT_JOIN_S * run.batch * segment_ends(run.seq_len, segment_tokens(run))


def fsdp_step_traffic(run: Run, num_segments: int = 1) -> dict[str, float]:
    """``flops.fsdp_traffic`` of this run's layers (what FSDP gathers; nothing without FSDP)."""
    from megaseq.plan.phases import fsdp_per_layer

    layers, embed, head = fsdp_per_layer(run)
    if run.counts.trained is not None:  # a frozen base: gathered in its storage dtype, nothing reduce-scattered
        return fsdp_traffic(sum(layers) + embed, C.frozen_bytes(run.prec), 0, run.mesh, num_segments,
                            run.grad_accum)
    return fsdp_traffic(sum(layers) + embed, run.prec.param, run.reduce_bytes, run.mesh, num_segments,
                        run.grad_accum)


def segment_regather_seconds(run: Run) -> float:
    """FSDP: the extra all-gathers and reduce-scatters of a segmented step over a plain one, in seconds."""
    if not run.mesh.sharded:
        return 0.0
    return fsdp_step_traffic(run, max(2, segments_of(run)))["seconds"] - fsdp_step_traffic(run)["seconds"]


def segment_kv_host_copies(run: Run) -> tuple[float, float, float]:
    """``memory.segment_kv_host``: the bytes copied between host and device in the forward pass, the backward's
    reruns and its backward (``memory/segment_host.py``). Per layer and segment ``[s, e)``, of ``r`` row bytes in
    the compute dtype and ``a`` in fp32: the forward reads rows ``[0, s)`` and writes ``[s, e)``; the rerun reads
    ``[0, s)`` and the accumulated gradient of ``[s, e)``; the backward reads ``[0, s)`` and their accumulator
    and writes the accumulator back."""
    rows = sum(segments.segment_kv_rows(run)) * run.batch
    if not (run.segment and rows):
        return 0.0, 0.0, 0.0
    c, f = run.prec.compute, run.prec.f32
    earlier = sum(range(0, run.seq_len, run.segment))  # rows [0, s) summed over the segments
    return (rows * (earlier * c + run.seq_len * c), rows * (earlier * c + run.seq_len * f),
            rows * earlier * (c + 2 * f))


def segment_kv_host_excess(run: Run, step_s: float) -> float:
    """Seconds the host-kept K/V's copies add to a step: each pass's copies (one copy stream, both directions,
    ``PINNED_BYTES_PER_S`` = 55 GB/s, the planner's pinned-copy rate: an assumption) overlap that pass's compute (the
    forward and the reruns a quarter of the step each, the backward half); what exceeds it is added."""
    if not run.memory.segment_kv_host:
        return 0.0
    share = (0.25, 0.25, 0.5)
    return sum(max(0.0, b / PINNED_BYTES_PER_S - s * step_s) for b, s in zip(segment_kv_host_copies(run), share,
                                                                             strict=True))


def tile_rerun_share(run: Run, t: CostTerms) -> float:
    """The step share a tiled MLP adds by replaying its tiles' forward in the backward: one more forward of the
    MLPs (a third of their share), except beside recompute in a family that tiles only its MLP/MoE, whose
    layer rerun then skips the tiles (``memory.tiling``'s ``residual_only``): the replay stands in for it."""
    if run.memory.recompute and not family(run.spec.family).tiles_whole_layer:
        return 0.0
    return t.sf.mlp / 3 / t.sf.total


def tile_excess_seconds(run: Run, t: CostTerms) -> float:
    """What tiles of ``memory.mlp_tile_tokens`` tokens add to the step beyond the rerun of their forward: in
    every layer, each tile's fixed cost (``TILE_FIXED_S``) less the tile's own share of the layer's MLP seconds,
    where that share is shorter (the MLP's seconds: its share of the step's FLOPs at the step's estimated rate)."""
    layers = max(run.spec.num_layers, 1)
    tiles = -(-run.n // max(1, min(run.memory.mlp_tile_tokens, run.n))) * (segments_of(run) if run.segment else 1)
    tile_s = t.step_s * t.sf.mlp / t.sf.total / layers / tiles
    return layers * tiles * max(0.0, TILE_FIXED_S - tile_s)


KEPT_KINDS = ("attention", "mla")  # the layer kinds whose attention is SDPA's (what kept attention keeps)


def kept_attention_flops(run: Run, layers_kept: int) -> float:
    """The attention forward FLOPs the rerun of the last ``layers_kept`` layers does not run when they keep
    attention's output (``memory.keep_attention_layers``): their SDPA cores' (``flops.mixer_core_flops``)."""
    spec = run.spec
    kept = kept_attention_layers(spec.num_layers, layers_kept, 0)[1]
    return sum(layer_flops(spec, run.seq_len, i).core for i in kept if spec.layer_types[i] in KEPT_KINDS)


def copy_excess(nbytes: float, step_s: float) -> float:
    """Seconds ``nbytes`` copied each way in a step add to it: out in the forward (a third of the step), in in the
    backward (two thirds), at ``PINNED_BYTES_PER_S``; what the pass's compute cannot hide (as SCO's,
    ``CostTerms.of``)."""
    copy = nbytes / PINNED_BYTES_PER_S
    return max(0.0, copy - step_s / 3) + max(0.0, copy - 2 * step_s / 3)


def kept_host_bytes(run: Run) -> int:
    """Bytes the host-kept attention outputs (``memory.keep_attention_host_layers``) move each way in a step: their
    layers' kept bytes, out after each one's forward, in before its rerun."""
    from megaseq.plan.phases import kept_layers

    spec = run.spec
    return 0 if run.segment else sum(layers.kept_attention_bytes(spec, spec.layer_types[i], run.n, run.prec)
                                     for i in kept_layers(run)[0])


def kept_host_excess(run: Run, step_s: float) -> float:
    """Seconds the host-kept attention outputs' copies add to a step: they share the copy stream with SCO's
    boundaries (when on), so what the two together cannot hide, less what SCO's alone cannot (SCO's cost)."""
    sco = C.boundary_bytes(run.spec, run.n, run.prec) * run.spec.num_layers if run.memory.checkpoint_offload else 0
    return copy_excess(sco + kept_host_bytes(run), step_s) - copy_excess(sco, step_s)


def recompute_share(run: Run, t: CostTerms) -> float:
    """Full recompute's cost: one more forward of every layer, less the attention forwards of the layers that
    keep attention's output, plus what the host-kept ones' copies cannot hide (none where the planner chose
    them)."""
    return ((t.sf.layers_forward - kept_attention_flops(run, run.memory.keep_attention_layers)) / t.sf.total
            + kept_host_excess(run, t.step_s) / t.step_s)


def _on(name: str) -> Callable[[Run, MemorySettings], bool]:
    return lambda run, m: bool(getattr(m, name))


def _kda_layer_share(run: Run) -> float:
    return run.spec.layer_types.count("kda") / max(run.spec.num_layers, 1)


def _sco_enable(base: MemorySettings, run: Run, fixes: tuple[str, ...], host_room: int) -> dict[str, Any]:
    bnd = C.boundary_bytes(run.spec, run.n, run.prec)
    opt_host = C.optimizer_host_bytes(run.counts, run.mesh, "optimizer_offload" in fixes)
    if "stream_base" in fixes:  # the streamed base's pinned bytes come first
        opt_host += sum(stream.streamed_layer_bytes(replace(run, memory=run.memory.replace(stream_base=True))))
    return {"checkpoint_offload": True,
            "offload_host_budget": max(0, min(run.spec.num_layers * bnd, host_room - opt_host))}


def _fix(name: str, **planner: Any) -> Fix:
    """The planner's side of scheme ``name``: its setting, runtime, formula, requires and excludes from the
    scheme's record (``megaseq.schemes``), its costs and growth given here."""
    s = SCHEMES[name]
    return Fix(name, s.switch, s.runtime, s.formula, excludes=s.excludes, requires=s.requires, **planner)


FIXES: dict[str, Fix] = {f.name: f for f in (
    _fix("chunked_loss",
        cost=lambda run, t: LOSS_CHUNK_COST * t.sf.loss / t.sf.total,
        usable=lambda run: True,
        enable=lambda b, run, s, h: {"chunked_loss": True, "loss_chunk_tokens": LOSS_CHUNKS[0]},
        enabled=_on("chunked_loss"),
        why=lambda m: f"vocabulary projection in chunks of {m.loss_chunk_tokens} tokens",
        growth=Growth("loss_chunk_tokens", 2, lambda run: LOSS_CHUNKS, _on("chunked_loss"))),
    _fix("indexer_query_chunk",
        cost=lambda run, t: 0.0,
        usable=lambda run: "dsa" in run.spec.layer_types,
        enable=lambda b, run, s, h: {"indexer_query_chunk": INDEXER_CHUNKS[0]},
        enabled=lambda run, m: m.indexer_query_chunk < run.n,
        why=lambda m: f"indexer scores {m.indexer_query_chunk} queries at a time (one scoring chunk under 2 GiB "
                      "or as the budget needs)",
        growth=Growth("indexer_query_chunk", 1, lambda run: (INDEXER_CHUNKS[0], indexer_chunk_cap(run)),
                      lambda run, m: m.indexer_query_chunk < run.n)),
    _fix("tiled_mlp",  # the tiles' forward replayed in backward (free beside recompute: tile_rerun_share); each
        # tile's fixed cost at the settings' tile size
        cost=lambda run, t: tile_rerun_share(run, t) + tile_excess_seconds(run, t) / t.step_s,
        usable=lambda run: True,
        enable=lambda b, run, s, h: {"tiled_mlp": True, "mlp_tile_tokens": TILE_CHUNKS[0]},
        enabled=_on("tiled_mlp"),
        why=lambda m: f"MLP/MoE in tiles of {m.mlp_tile_tokens} tokens, recomputed in backward",
        growth=Growth("mlp_tile_tokens", 3, lambda run: TILE_CHUNKS, _on("tiled_mlp"))),
    _fix("kda_segments",
        cost=lambda run, t: KDA_MIXER_SHARE * t.sf.layers_forward / t.sf.total * _kda_layer_share(run),
        usable=lambda run: "kda" in run.spec.layer_types and run.mesh.cp == 1 and not run.packed_documents,
        enable=lambda b, run, s, h: {"kda_segment_tokens": b.kda_segment_tokens or SEGMENT_CHUNKS[0]},
        enabled=lambda run, m: 0 < m.kda_segment_tokens < run.n,
        why=lambda m: f"KDA layers in segments of {m.kda_segment_tokens} tokens, the state carried, each segment "
                      "recomputed in backward",
        growth=Growth("kda_segment_tokens", 4, lambda run: SEGMENT_CHUNKS, _on("kda_segment_tokens"))),
    _fix("recompute",  # less the attention forwards of the layers that keep attention's output
        cost=recompute_share,
        usable=lambda run: True,
        enable=lambda b, run, s, h: {"recompute": True},
        enabled=_on("recompute"),
        why=lambda m: "each layer keeps only its input; its forward is rerun in backward"
                      + (f" (the last {m.keep_attention_layers} keep attention's output: the rerun skips its kernel"
                         + (f"; the first {m.keep_attention_host_layers} of them in pinned host memory"
                            if m.keep_attention_host_layers else "") + ")"
                         if m.keep_attention_layers else "")),
    _fix("model_segments",  # at the settings' segment length (the least: the longest, segments_of)
        cost=lambda run, t: (t.sf.layers_forward + segment_attention_rerun(
            run.spec, run.seq_len, segment_tokens(run))) / t.sf.total
        + (segment_join_seconds(run) + t.segment_regather_s + t.segment_kv_host_s) / t.step_s,
        usable=lambda run: family(run.spec.family).segmentable and MODEL_SEGMENT_CHUNKS[0] % run.mesh.cp == 0,
        enable=lambda b, run, s, h: {"model_segment_tokens": b.model_segment_tokens or MODEL_SEGMENT_CHUNKS[0]},
        enabled=lambda run, m: bool(replace(run, memory=m).segment),
        why=lambda m: f"the whole model over the sequence {m.model_segment_tokens} tokens at a time (KDA state, "
                      "DSA latents and keys carried), each segment rerun in backward"
                      + (", the forward's DSA selections kept for it" if m.segment_keep_selection else "")
                      + (", the K/V (latents) and their fp32 gradients in host memory" if m.segment_kv_host else ""),
        growth=Growth("model_segment_tokens", 0, lambda run: MODEL_SEGMENT_CHUNKS, _on("model_segment_tokens"))),
    _fix("checkpoint_offload",
        cost=lambda run, t: SCO_BASE_COST + t.sco_excess_s / t.step_s,
        usable=lambda run: True,
        enable=_sco_enable,
        enabled=_on("checkpoint_offload"),
        why=lambda m: f"layer inputs to pinned host memory, {m.offload_host_budget / GB:.1f} GB"),
    _fix("optimizer_offload",
        cost=lambda run, t: t.optimizer_s / t.step_s,
        usable=lambda run: True,
        enable=lambda b, run, s, h: {"optimizer_offload": True},
        enabled=_on("optimizer_offload"),
        why=lambda m: "fp32 master weights, moments and gradients in host memory, streamed"),
    _fix("stream_base",
        cost=lambda run, t: t.stream_excess_s / t.step_s,
        usable=lambda run: run.counts.trained is not None and run.mesh.ep == 1,
        enable=lambda b, run, s, h: {"stream_base": True},
        enabled=_on("stream_base"),
        why=lambda m: "the frozen base's layers in pinned host memory, each copied to the GPU a layer ahead of use "
                      f"(forward, rerun, backward; {stream.STREAM_BYTES_PER_S / 1e9:.0f} GB/s assumed)"),
)}
# tried only when no set without them fits (the frozen base streamed: chosen where the resident base does not fit)
LAST_RESORT: tuple[str, ...] = ("stream_base",)
LADDER: tuple[str, ...] = tuple(FIXES)
# sequence segments replace these (each layer's memory is already bounded by the segment)
SEGMENT_EXCLUDES = FIXES["model_segments"].excludes


def indexer_chunk_cap(run: Run) -> int:
    """The largest query chunk (a power of two, or every local query) whose scoring chunk stays under
    ``INDEXER_SCORING_MAX``; ``n`` when the model has no DSA layer or all queries fit at once."""
    spec = run.spec
    if "dsa" not in spec.layer_types:
        return run.n
    def scoring(q: int) -> int:
        return layers.indexer_scoring(spec, q, run.seq_len, fast="indexer_topk" in run.fast_ops)

    if scoring(run.n // run.batch) <= INDEXER_SCORING_MAX:
        return run.n
    q = 1
    while q * 2 <= run.n and scoring(q * 2) <= INDEXER_SCORING_MAX:
        q *= 2
    return q


