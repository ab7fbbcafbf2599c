"""The memory schemes, each declared once: its settings, what it needs and excludes, whether it replays, where
the planner counts it and where the runtime applies it.

Pure data, no torch and no other megaseq import: the lowest layer, so that the config (``MemorySettings``'s
size parsing and combination check), the planner (``plan.fixes.FIXES``: its costs and growth beside these
facts), the runtime (``memory.apply.AppliedMemory``) and the adapter rules (``models.adapters``) all read
the same records. Derived from them: ``SIZE_SETTINGS``, ``SEGMENT_EXCLUDED``, ``REPLAYING``;
``check_combination`` is the one statement of the rules between schemes.

Adding a scheme: one ``Scheme`` here (and its ``MemorySettings`` fields), its runtime module under
``memory/``, its ``Fix`` costs in ``plan/fixes.py``, and its float64 test against the plain computation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Scheme:
    """One exact memory scheme."""

    name: str  # what plans and reports call it (the planner's fix)
    switch: str  # the MemorySettings field that turns it on (a size where 0 means off)
    sizes: tuple[str, ...]  # its size settings (bytes or tokens; "64G" / "8K" accepted)
    runtime: str  # the runtime applier, module.function under megaseq.memory (or the block attribute set)
    formula: str  # the planner's byte formula it changes (under megaseq.plan)
    applied: str = ""  # the memory.apply.AppliedMemory field that records it ("" when the trainer builds it)
    requires: tuple[str, ...] = ()  # schemes that must be on with it
    excludes: tuple[str, ...] = ()  # schemes that cannot be on with it
    replays: bool = False  # its forward runs again in backward (dropout masks would be drawn again)
    options: tuple[str, ...] = ()  # its other settings (not sizes)


# in the planner's ladder order: the order candidate sets tie-break in and reports list fixes in
SCHEMES: dict[str, Scheme] = {s.name: s for s in (
    Scheme("chunked_loss", "chunked_loss", ("loss_chunk_tokens",),
           "memory.vocab_loss.chunked_linear_cross_entropy", "components.loss_bytes (chunked)"),
    Scheme("indexer_query_chunk", "indexer_query_chunk", ("indexer_query_chunk",),
           "the DSA indexer's query_chunk (parallelize)", "layers.indexer_scoring_bytes", applied="query_chunked"),
    Scheme("tiled_mlp", "tiled_mlp", ("mlp_tile_tokens",), "memory.tiling (tile_layer / enable_tiling)",
           "phases.layer_terms (tiled)", applied="tiled", replays=True),
    Scheme("kda_segments", "kda_segment_tokens", ("kda_segment_tokens",), "memory.kda_segments.segment",
           "layers.kda_segmented", applied="kda_segmented", replays=True),
    Scheme("recompute", "recompute", (), "memory.offload.checkpoint_layers", "phases._phases (recompute)",
           applied="checkpointed", replays=True, options=("keep_attention_layers", "keep_attention_host_layers")),
    Scheme("model_segments", "model_segment_tokens", ("model_segment_tokens",),
           "memory.model_segments.segmented_loss_backward", "phases.segment_store_bytes", applied="model_segmented",
           excludes=("recompute", "checkpoint_offload", "kda_segments"), replays=True,
           options=("segment_keep_selection", "segment_kv_host")),
    Scheme("checkpoint_offload", "checkpoint_offload", ("offload_host_budget",),
           "memory.offload.BoundaryOffloader (SCO)", "components.sco_slots", applied="offloader",
           requires=("recompute",)),
    Scheme("optimizer_offload", "optimizer_offload", ("optimizer_bucket_params",),
           "memory.offload_adam.OffloadStreamAdamW", "components.optimizer_gpu_bytes / optimizer_host_bytes"),
    # last in the ladder: the planner tries it only when no set without it fits (plan.fixes.LAST_RESORT)
    Scheme("stream_base", "stream_base", (), "memory.stream_base.stream_layers (one process); FSDP2's "
           "CPUOffloadPolicy on the blocks (parallel.fsdp)", "plan.stream.stream_terms", applied="streamed"),
)}

# every size setting (parsed from "8K" / "64G" by MemorySettings)
SIZE_SETTINGS: tuple[str, ...] = tuple(dict.fromkeys(k for s in SCHEMES.values() for k in s.sizes))
SEGMENT_SETTING = "memory." + SCHEMES["model_segments"].switch
# the per-layer schemes sequence segments replace (each layer's memory is already bounded by the segment)
SEGMENT_EXCLUDED: tuple[str, ...] = tuple(SCHEMES[x].switch for x in SCHEMES["model_segments"].excludes)
# settings whose forward is replayed in backward (``memory.replay``'s users)
REPLAYING: tuple[str, ...] = tuple(s.switch for s in SCHEMES.values() if s.replays)


def is_on(settings: Any, name: str) -> bool:
    """Whether scheme ``name``'s switch is set in ``settings`` (a ``MemorySettings``)."""
    return bool(getattr(settings, SCHEMES[name].switch))


def off_value(name: str) -> str:
    """What turns scheme ``name`` off on the command line (``0`` for a size that switches it)."""
    return "0" if SCHEMES[name].switch in SCHEMES[name].sizes else "false"


def segment_conflict(segment_tokens: int, on: list[str]) -> str:
    """The message for sequence segments with the per-layer schemes they replace (``on``: those settings)."""
    turn_off = ", ".join(f"--memory.{SCHEMES[x].switch} {off_value(x)}" for x in SCHEMES["model_segments"].excludes)
    return (f"{SEGMENT_SETTING}={segment_tokens} with {', '.join(on)}: sequence segments already bound each "
            f"layer's memory by the segment; turn those off ({turn_off})")


def check_combination(settings: Any) -> None:
    """ValueError naming the settings when the schemes ``settings`` turns on cannot run together: a scheme
    without one it requires (checked first), or with one it excludes."""
    on = [s for s in SCHEMES.values() if is_on(settings, s.name)]
    for s in on:
        for r in s.requires:
            if not is_on(settings, r):
                need = SCHEMES[r].switch
                raise ValueError(f"memory.{s.switch} needs memory.{need}: set --memory.{need} true")
    for s in on:
        both = [f"memory.{SCHEMES[x].switch}" for x in s.excludes if is_on(settings, x)]
        if both and s.name == "model_segments":
            raise ValueError(segment_conflict(getattr(settings, s.switch), both))
        if both:
            raise ValueError(f"memory.{s.switch} with {', '.join(both)}: turn one of them off")
