"""Sequence-segmented recurrent token mixers (KDA): forward without a graph, backward per segment.

Shapes: B batch, S tokens, H hidden, T tokens per segment (the last may be shorter), n = ceil(S / T)
segments, Hh heads, Dk / Dv key / value head dims, K conv kernel size.

A linear-attention layer is a recurrence: its output for tokens ``[s, e)`` is a function of those tokens,
the ``halo`` tokens before them (KDA's causal conv looks ``K - 1`` back) and the recurrent state at ``s``
(KDA: ``[B, Hh, Dk, Dv]``). So the sequence can run in segments:

- forward (no graph): segment by segment, the state carried from one to the next, the outputs written
  into one preallocated ``[B, S, H]`` tensor. Saved: the layer input ``x`` (the tensor passed in, no copy)
  and the state at the start of every segment ``[n, B, Hh, Dk, Dv]`` (compute dtype), nothing else
  proportional to S.
- backward: segments in reverse; each is recomputed with grad from its saved initial state (a leaf),
  then backpropagated with its slice of the output gradient plus, for every segment but the last, the
  gradient of its final state that the later segment passed back. It yields the segment's input gradient
  (its halo's part adds into the previous segment's tokens), its parameter gradients (summed over the
  segments) and the gradient of its initial state, which goes on to the previous segment.

Exact: the same computation, in a different order of sums (the conv is recomputed over the halo, the
recurrence continues from the carried state). The working set is one segment's activations (KDA: about
137 KB per token in bf16 for GLM-5.3-Flash) instead of the whole sequence's; the backward recomputes the
layer once (plus ``K - 1`` halo tokens per segment for the projections and conv).

The scheme is generic over a module that provides ``segment_halo`` (an int) and
``segment_step(x_BLH, halo, state) -> (y_BTH, final_state)`` (state None: the zero state at the sequence
start); ``KimiDeltaAttention`` does, and routes through ``segmented_kda`` when its ``segment_tokens`` is
set. The backward re-enters the forward's autocast state (``megaseq.ops.amp``) and restores the module's
side state after the recompute, as ``megaseq.memory.tiling`` does.

First version: one rank (cp 1) and no document boundaries (``ctx.full_doc_ids()`` None); otherwise
``segmented_kda`` raises.
"""

from __future__ import annotations

import torch
from torch import nn

from megaseq.memory.tiling import restore_side_state, snapshot_side_state
from megaseq.models.context import SeqContext
from megaseq.ops.amp import autocast_as, autocast_state

SETTING = "memory.kda_segment_tokens"


def segment_bounds(S: int, segment_tokens: int, setting: str = SETTING) -> list[tuple[int, int]]:
    """``[start, end)`` of each segment of ``segment_tokens`` tokens (the last may be shorter); ``setting``
    names the config key a bad size came from."""
    if segment_tokens < 1:
        raise ValueError(f"{setting} must be >= 1, got {segment_tokens}")
    return [(s, min(s + segment_tokens, S)) for s in range(0, S, segment_tokens)]


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


def _run_segments(module: nn.Module, x_BSH: torch.Tensor, bounds: list[tuple[int, int]],
                  keep_states: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """All segments without a graph: the output ``[B, S, H']`` and, with ``keep_states``, the state at
    the start of every segment ``[n, B, Hh, Dk, Dv]`` (the first all zero)."""
    y_BSH: torch.Tensor | None = None
    states: torch.Tensor | None = None
    state = None
    with torch.no_grad():
        for i, (s, e) in enumerate(bounds):
            halo = min(module.segment_halo, s)
            y_BTH, new_state = module.segment_step(x_BSH[:, s - halo:e], halo, state)
            if y_BSH is None:  # one output buffer, written segment by segment
                y_BSH = y_BTH.new_empty((x_BSH.shape[0], x_BSH.shape[1]) + tuple(y_BTH.shape[2:]))
                if keep_states:
                    states = new_state.new_zeros((len(bounds),) + tuple(new_state.shape))
            y_BSH[:, s:e] = y_BTH
            del y_BTH
            if states is not None and i + 1 < len(bounds):
                states[i + 1] = new_state
            state = new_state
    assert y_BSH is not None, "segmented forward needs at least one token"
    return y_BSH, states


def _module_params(module: nn.Module) -> list[torch.Tensor]:
    """The parameters the Function takes as inputs (so autograd routes their gradients through it)."""
    return list(module.parameters())


class SegmentedKDA(torch.autograd.Function):
    """``module`` over ``x_BSH`` in segments of ``segment_tokens``; saves ``x_BSH`` and the segment
    initial states only, recomputes each segment in backward (see the module docstring)."""

    @staticmethod
    def forward(actx, module, segment_tokens, x_BSH, *params):
        bounds = segment_bounds(x_BSH.shape[1], segment_tokens)
        actx.module, actx.bounds = module, bounds
        actx.autocast = autocast_state()
        y_BSH, states = _run_segments(module, x_BSH, bounds, keep_states=True)
        actx.save_for_backward(x_BSH, states)
        return y_BSH

    @staticmethod
    def backward(actx, grad_y_BSH):
        x_BSH, states = actx.saved_tensors
        module, bounds = actx.module, actx.bounds
        need_x, need_p = actx.needs_input_grad[2], actx.needs_input_grad[3:]
        params = _module_params(module)
        assert len(params) == len(need_p), "the module's parameters changed between forward and backward"
        wanted = [i for i, need in enumerate(need_p) if need]
        grad_x = torch.zeros_like(x_BSH) if need_x else None
        grad_p: list[torch.Tensor | None] = [None] * len(params)
        d_state = None  # gradient of the current segment's final state (from the segment after it)
        snap = snapshot_side_state(module)
        for i in reversed(range(len(bounds))):
            s, e = bounds[i]
            halo = min(module.segment_halo, s)
            x_seg = x_BSH[:, s - halo:e].detach().requires_grad_(need_x)
            h0 = None if i == 0 else states[i].detach().requires_grad_(True)
            with torch.enable_grad(), autocast_as(actx.autocast):
                y_seg, final = module.segment_step(x_seg, halo, h0)
            outs, grads_out = [y_seg], [grad_y_BSH[:, s:e]]
            if d_state is not None:
                outs.append(final)
                grads_out.append(d_state)
            wrt = ([x_seg] if need_x else []) + ([h0] if h0 is not None else []) + [params[j] for j in wanted]
            grads = list(torch.autograd.grad(outs, wrt, grads_out, allow_unused=True))
            del y_seg, final, outs, grads_out
            if need_x:
                g_x = grads.pop(0)
                if g_x is not None:
                    grad_x[:, s - halo:e] += g_x
            d_state = grads.pop(0) if h0 is not None else None
            for j, g in zip(wanted, grads):
                if g is None:
                    continue
                if grad_p[j] is None:  # the running sum is updated in place: own it
                    grad_p[j] = g.clone() if g.untyped_storage().data_ptr() == \
                        grad_y_BSH.untyped_storage().data_ptr() else g
                else:
                    grad_p[j].add_(g)
            grads = g = None  # a segment's gradients must not outlive it into the next one
        restore_side_state(snap)
        return (None, None, grad_x, *grad_p)


def segmented_kda(module: nn.Module, x_BSH: torch.Tensor, ctx: SeqContext, segment_tokens: int) -> torch.Tensor:
    """``module(x_BSH, ctx)`` for a KDA-like module (``segment_step`` / ``segment_halo``), in segments of
    ``segment_tokens`` tokens with the recurrent state carried. Raises ValueError for cp > 1, documents or
    ``segment_tokens < 1``. Without a graph to build (no grad, or nothing requires grad) the segments just
    run."""
    check_segmentable(ctx, segment_tokens)
    params = _module_params(module)
    if torch.is_grad_enabled() and (x_BSH.requires_grad or any(p.requires_grad for p in params)):
        return SegmentedKDA.apply(module, segment_tokens, x_BSH, *params)
    return _run_segments(module, x_BSH, segment_bounds(x_BSH.shape[1], segment_tokens), keep_states=False)[0]


def enable_kda_segments(model: nn.Module, segment_tokens: int | None) -> int:
    """Set ``segment_tokens`` on every module of ``model`` that has the attribute (None turns it off);
    returns how many modules were set."""
    if segment_tokens is not None and segment_tokens < 1:
        raise ValueError(f"{SETTING} must be >= 1, got {segment_tokens}")
    n = 0
    for m in model.modules():
        if hasattr(m, "segment_tokens") and hasattr(m, "segment_step"):
            m.segment_tokens = segment_tokens
            n += 1
    return n


# ---- memory formula ------------------------------------------------------------------------------
def segmented_saved_bytes(B: int, S: int, H: int, Hh: int, Dk: int, Dv: int, segment_tokens: int,
                          x_bytes: int, state_bytes: int = 4) -> int:
    """Bytes the segmented layer keeps for backward: its input ``B*S*H`` and ``n`` initial states
    ``[B, Hh, Dk, Dv]`` (``state_bytes``: 4 for the fp32 compute dtype of a bf16 run). The backward's
    working set on top is one segment's (``segment_tokens`` + K - 1 tokens) autograd graph."""
    n = -(-S // segment_tokens)
    return B * S * H * x_bytes + n * B * Hh * Dk * Dv * state_bytes
