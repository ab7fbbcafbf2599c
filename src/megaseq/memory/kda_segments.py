"""Segmented KDA: a recurrent token mixer over the sequence in segments, the state carried, each segment
recomputed in backward.

Shapes: B batch, S tokens, H hidden, T tokens per segment (the last may be shorter), n = ceil(S / T)
segments, Hh heads, Dk / Dv key / value head dims, K conv kernel size.

A linear-attention layer is a recurrence: its output for tokens ``[s, e)`` is a function of those tokens,
the ``halo`` tokens before them (KDA's causal conv looks ``K - 1`` back) and the recurrent state at ``s``
(KDA: ``[B, Hh, Dk, Dv]``). So it runs on the chunked-replay engine (``memory.replay``) with chunks of T
tokens along the sequence, a halo of ``K - 1`` and the state as the carry:

- forward (no graph): segment by segment, the state carried from one to the next, the outputs written
  into one ``[B, S, H]`` tensor. Saved: the layer input (the tensor passed in, no copy) and the state at
  the start of every segment ``[n, B, Hh, Dk, Dv]`` (compute dtype), nothing else proportional to S.
- backward: segments in reverse; each is recomputed with grad from its saved initial state (a leaf), then
  backpropagated with its slice of the output gradient plus the gradient of its final state that the
  later segment passed back (the halo's input gradient adds into the previous segment's tokens).

Exact: the same computation, the sums in a different order. The working set is one segment's
activations (about 137 KB per token in bf16 for GLM-5.3-Flash) instead of the whole sequence's.

The mixer provides ``segment_halo`` and ``segment_step(x_BLH, halo, state) -> (y_BTH, final_state)``
(``models.common.kda.KimiDeltaAttention``); ``segment(module, T)`` (applied by a family's
``parallelize``) installs the segmented forward on it from outside. First version: one rank (cp 1) and no
document boundaries; otherwise ``segmented_kda`` raises naming the setting.
"""

from __future__ import annotations

import torch
from torch import nn

from megaseq.memory import forwards
from megaseq.memory.replay import Chunk, Replay, chunk_bounds, replay
from megaseq.models.common.context import SeqContext

SETTING = "memory.kda_segment_tokens"


def segment_bounds(S: int, segment_tokens: int, halo: int = 0, setting: str = SETTING) -> list[Chunk]:
    """The segments of ``segment_tokens`` tokens (the last may be shorter), each reading up to ``halo``
    tokens before it; ``setting`` names the config key a bad size came from."""
    return chunk_bounds(S, segment_tokens, halo, setting)


def check_segmentable(ctx: SeqContext, segment_tokens: int) -> None:
    """Raise a ValueError naming ``memory.kda_segment_tokens`` for what the segmented layer cannot run."""
    if segment_tokens < 1:
        raise ValueError(f"{SETTING} must be >= 1, got {segment_tokens}")
    if ctx.cp_size != 1:
        raise ValueError(
            f"{SETTING}={segment_tokens} with context parallelism cp={ctx.cp_size}: segmented KDA runs on one "
            "rank only for now (its segments would have to follow the Ulysses all-to-all over the whole "
            f"sequence); unset {SETTING} or use cp=1")
    if ctx.full_doc_ids() is not None:
        raise ValueError(
            f"{SETTING}={segment_tokens} with document boundaries (doc_ids): segmented KDA does not support "
            "them yet (the conv and the recurrence restart at every document, which the carried state and "
            f"the conv halo do not model); unset {SETTING} or train without packed documents")


def segmented_kda(module: nn.Module, x_BSH: torch.Tensor, ctx: SeqContext, segment_tokens: int) -> torch.Tensor:
    """``module(x_BSH, ctx)`` for a KDA-like module (``segment_step`` / ``segment_halo``), in segments of
    ``segment_tokens`` tokens with the recurrent state carried. Raises ValueError for cp > 1, documents or
    ``segment_tokens < 1``."""
    check_segmentable(ctx, segment_tokens)

    def step(xs: list[torch.Tensor], state, c: Chunk):
        y, final = module.segment_step(xs[0], c.halo, state)
        return (y,), final

    chunks = segment_bounds(x_BSH.shape[1], segment_tokens, module.segment_halo)
    return replay(Replay(step=step, chunks=chunks, modules=(module,), dim=1, carry=True), x_BSH)[0]


class _SegmentedForward(forwards.InstanceForward):
    """The forward ``segment`` installs on a mixer instance: a sequence longer than ``segment_tokens`` runs
    in segments (under sequence segments the mixer's own forward carries its state itself)."""

    def __init__(self, module: nn.Module, segment_tokens: int) -> None:
        super().__init__(module)
        self.module_ref = module
        self.segment_tokens = segment_tokens

    def __call__(self, x_BSH: torch.Tensor, ctx: SeqContext) -> torch.Tensor:
        m = self.module_ref
        if not ctx.segmented and x_BSH.shape[1] * ctx.cp_size > self.segment_tokens:
            return segmented_kda(m, x_BSH, ctx, self.segment_tokens)
        return self.inner(x_BSH, ctx)


def segment(module: nn.Module, segment_tokens: int | None) -> nn.Module:
    """Run ``module`` (a KDA mixer) in segments of ``segment_tokens`` tokens when the sequence is longer
    (None: off again; calling again changes the size). Returns the module."""
    forwards.remove(module, _SegmentedForward)
    if segment_tokens is not None:
        if segment_tokens < 1:
            raise ValueError(f"{SETTING} must be >= 1, got {segment_tokens}")
        module.forward = _SegmentedForward(module, segment_tokens)
    return module


def segment_tokens_of(module: nn.Module) -> int | None:
    """The segment size ``segment`` installed on ``module`` (None: not segmented)."""
    current = forwards.installed(module, _SegmentedForward)
    return None if current is None else current.segment_tokens
