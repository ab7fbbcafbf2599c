"""Sequence segments: the whole model over the sequence a segment at a time, with exact gradients.

Shapes: B batch, S tokens, T tokens per segment (the last may be shorter), n = ceil(S / T) segments,
R the DSA latent width, Hh / D KDA heads / head dim, K the KDA conv kernel.

Tokens of a GLM-5.3-Flash sequence meet in the token mixers only: everything else (embedding, mHC,
norms, MLP/MoE, the loss) is per token. And what a mixer needs from the tokens before a segment is
small and known:

- a KDA layer: its recurrent state ``[B, Hh, D, D]`` and its last ``K - 1`` inputs (the conv halo);
- a DSA layer: the latent ``c [B, s, R]`` of every earlier token (with gradient) and the indexer's keys
  and pool gates (no gradient: the indexer runs under ``no_grad``).

So a training step can run as an inference engine runs a prompt in chunks, and then backwards:

1. forward without a graph, segment by segment: each layer reads the carried state through the context
   hooks (``SeqContext.carried_in`` / ``gather_seq(x, key)``) and writes its own. Kept for pass 2: the
   DSA caches ``[B, S, ...]`` and, per KDA layer, the state and halo at every segment start.
2. segments in reverse: segment j is recomputed with a graph from its carried inputs, which are leaves
   (the state and halo at its start, the latents of tokens ``< s``); its loss (``/ total`` tokens) and the
   gradients that later segments sent back to what it carried out (its final state and halo, its
   latents ``[s, e)``) are backpropagated together. Parameter gradients accumulate in ``.grad``; the
   leaves' gradients go to the earlier segments (the latent gradient into one fp32 ``[B, S, R]``
   accumulator per DSA layer).

Exact: the same computation with the sums in another order. The working set is one segment's graph
plus the caches, so peak memory grows with S only through the DSA latents and keys (about
``S * (2 R + 8 Di + 4 R)`` bytes per DSA layer under bf16 autocast: the latent, the fp32 indexer keys and
gates, the latent's fp32 gradient; ``plan.segments.segment_store_bytes``) instead of the ``S * N * H``
layer boundaries: it replaces recompute, checkpoint offload and segmented KDA for long sequences, at
the cost of one more forward (as recompute). ``segmented_forward`` is the forward alone (evaluation).

Documents (``doc_ids``, packed text): the context gives the mixers the documents of all tokens so far;
a KDA layer restarts its conv and state at each document start and carries only a document that goes
on past the segment's end; the indexer selects within each query's document, as in the plain step.

Context parallelism (cp > 1): a segment ``[s, e)`` is split over the cp ranks like a sequence: rank r holds
the r-th of its cp equal pieces (``parallel.mesh.segment_stripes`` lays the batch out so, rows
``[s / cp, e / cp)`` of every rank's shard), and the segment's context wraps the cp group's context for that
piece (``inner``): Ulysses' all-to-alls within the segment, and ``gather_seq`` gathers the segment's
latents over the group before they join the cache of the earlier ones (every rank keeps the whole
``[B, S, R]`` cache, as gather-KV does). A cache's gradient is each rank's partial sum (its own queries');
fed back as the gradient of the gathered segment, the gather's backward (a reduce-scatter) sums the ranks'
parts. A KDA layer carries its own heads' state and halo (``KimiDeltaAttention._mix_carried``).

Host memory (``kv_host``, ``memory.segment_kv_host``): the softmax-attention and dense-MLA layers' rows and their
fp32 accumulators live in pinned host memory and reach the device a layer ahead (``memory/segment_host.py``),
the same step bitwise.

No other layer scheme (recompute, SCO, segmented KDA) at the same time; models whose token mixers all
implement the hooks (``glm5_next``). ``check_model_segments`` says so with the setting to change before
anything runs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from megaseq.memory.replay import Chunk, SideState, chunk_bounds, run_chunks
from megaseq.memory.rules import check_model_segments  # noqa: F401  (re-exported: the planner's rules too)
from megaseq.memory.segment_host import HostKV, host_attend, join_rows, joined_vjp
from megaseq.models.common.context import SeqContext
from megaseq.ops.amp import autocast_as, autocast_state, lowered
from megaseq.schemes import SEGMENT_SETTING

SETTING = SEGMENT_SETTING


def segment_bounds(S: int, segment_tokens: int) -> list[tuple[int, int]]:
    """``[start, end)`` of each segment of ``segment_tokens`` tokens (the last may be shorter)."""
    return [(c.start, c.end) for c in chunk_bounds(S, segment_tokens, setting=SETTING)]


class SegmentStore:
    """What the segments carry, by layer key: the DSA caches of every token so far (and their gradient
    accumulators in the backward pass), and each KDA layer's (halo, state) at every segment start."""

    def __init__(self, num_segments: int, keep_selection: bool = False, host: HostKV | None = None) -> None:
        self.n = num_segments
        self.keep_selection = keep_selection  # keep the DSA selections of the forward pass for the backward
        self.host = host  # memory.segment_kv_host: the attention layers' K/V (or latents) in host memory
        self.kept: dict[tuple[str, int], torch.Tensor] = {}
        self.cache: dict[str, torch.Tensor] = {}  # [B, S, ...] written segment by segment
        self.cache_grad: dict[str, torch.Tensor] = {}  # fp32 [B, S, ...] gradient from later segments
        self.carried: dict[str, list[tuple[torch.Tensor, torch.Tensor] | None]] = {}  # per segment start
        self.carried_grad: dict[str, tuple[torch.Tensor | None, torch.Tensor | None]] = {}
        self.docs: torch.Tensor | None = None  # [B, S] the documents of every token (gathered over cp)

    def nbytes(self) -> int:
        tensors = list(self.cache.values()) + list(self.cache_grad.values()) + list(self.kept.values())
        tensors += [t for per in self.carried.values() for c in per if c is not None for t in c]
        return sum(t.numel() * t.element_size() for t in tensors)


class _JoinedAttend(torch.autograd.Function):
    """``attend(q, *(prefixes joined to kv), *params)`` for an ``attend`` with a ``vjp`` (dense MLA's head
    groups): keeps its inputs (the prefixes are views of the cache) and its backward hands the rows joined again
    to ``attend.vjp``, which runs the forward it needs itself, where a checkpoint would first rerun the whole
    attention to rebuild a graph."""

    @staticmethod
    def forward(ctx: Any, attend: Callable[..., torch.Tensor], m: int, q: torch.Tensor,
                *rest: torch.Tensor) -> torch.Tensor:
        ctx.attend, ctx.m, ctx.autocast = attend, m, autocast_state()
        ctx.save_for_backward(q, *rest)
        return attend(q, *join_rows(rest[:m], rest[m:2 * m]), *rest[2 * m:])

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        m = ctx.m
        q, *rest = ctx.saved_tensors
        with autocast_as(ctx.autocast):
            d_q, d_pre, d_kv, d_params = joined_vjp(ctx.attend.vjp, q, rest[:m], rest[m:2 * m], rest[2 * m:], g,
                                                    ctx.needs_input_grad[2:])
        return (None, None, d_q, *d_pre, *d_kv, *d_params)


class SegmentContext(SeqContext):
    """The context of segment ``j = [s, e)``: in the forward pass (``grad`` False) it fills the store;
    in the backward pass it hands out leaves for what the earlier segments carried and collects what
    this one carried out together with the gradients the later segments sent back. ``inner`` is the
    context of this rank's tokens of the segment (the cp group's, or a plain one): the head/sequence
    all-to-alls and the gathers within the segment are its."""

    segmented: ClassVar[bool] = True

    def __init__(self, store: SegmentStore, j: int, s: int, e: int, S: int, grad: bool, inner: SeqContext) -> None:
        super().__init__(doc_ids=inner.doc_ids, position_ids=inner.position_ids, cp_size=inner.cp_size,
                         cp_rank=inner.cp_rank)
        self.store, self.j, self.s, self.e, self.S, self.grad, self.inner = store, j, s, e, S, grad, inner
        self.outputs: list[torch.Tensor] = []  # carried-out tensors with a gradient from later segments
        self.output_grads: list[torch.Tensor] = []
        self.leaves: list[tuple[str, str, torch.Tensor]] = []  # (kind, key, leaf)
        if not grad and inner.doc_ids is not None:  # the forward pass keeps the documents of every segment
            docs = inner.full_doc_ids()  # [B, e - s] (gathered over the cp group)
            if store.docs is None:
                store.docs = docs.new_empty((docs.shape[0], S))
            store.docs[:, s:e] = docs

    def seq_offset(self) -> int:
        return self.s + self.inner.seq_offset()

    def full_doc_ids(self) -> torch.Tensor | None:
        """The documents of every token up to this segment's end ``[B, e]`` (what the mixers see)."""
        return None if self.store.docs is None else self.store.docs[:, :self.e]

    def seq_to_heads(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner.seq_to_heads(x)

    def heads_to_seq(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner.heads_to_seq(x)

    def head_slice(self, num_heads: int) -> slice:
        return self.inner.head_slice(num_heads)

    # ---- DSA: latents and indexer keys of every token up to this segment's end --------------
    def gather_seq(self, x: torch.Tensor, key: str | None = None) -> torch.Tensor:
        if key is None:
            raise ValueError("a token mixer under sequence segments must name what it gathers (gather_seq key)")
        st = self.store
        if not self.grad:
            x = self.inner.gather_seq(x, key)  # [B, e - s, ...] the whole segment
            if key not in st.cache:
                st.cache[key] = x.new_empty((x.shape[0], self.S) + tuple(x.shape[2:]))
            st.cache[key][:, self.s:self.e] = x
            return st.cache[key][:, :self.e]
        cache = st.cache[key]
        if not x.requires_grad:  # no gradient to carry (the indexer's keys): the forward pass's values
            return cache[:, :self.e]
        x = self.inner.gather_seq(x, key)  # its backward sums the ranks' partial gradients (a reduce-scatter)
        if self.j + 1 < st.n and key in st.cache_grad:
            self.outputs.append(x)
            self.output_grads.append(st.cache_grad[key][:, self.s:self.e].to(x.dtype))
        if self.s == 0:
            return x
        prefix = cache[:, :self.s].detach().requires_grad_(True)
        self.leaves.append(("cache", key, prefix))
        return torch.cat([prefix, x], dim=1)

    # ---- softmax attention and dense MLA: the keys of every token up to this segment's end ---------
    def attend_seq(self, q: torch.Tensor, kv: tuple[torch.Tensor, ...], key: str,
                   attend: Callable[..., torch.Tensor], gathered: bool = True,
                   params: tuple[torch.Tensor, ...] = ()) -> torch.Tensor:
        """``attend(q, *kv_all, *params)`` over the keys ``[0, e)``: the forward pass writes this segment's ``kv`` into
        the layer's caches ``[B, S, ...]`` and attends over a view of them. The backward pass joins leaves of
        the earlier segments' cached rows (views, no copy) to the recomputed ``kv`` inside a checkpoint (or, for
        an ``attend`` with a ``vjp``, ``_JoinedAttend``), so the segment's graph keeps only its own rows (the
        joined ``[B, e, ...]`` keys are rebuilt in its backward, one layer at a time); each leaf's gradient goes
        straight into the layer's fp32 accumulator (``_accumulate``) and the accumulated gradient of this
        segment's rows is sent back. ``params`` (tensors ``attend`` reads besides) get their gradients too."""
        st, names = self.store, [f"{key}.{i}" for i in range(len(kv))]
        if not gathered:  # this rank's shard of the segment: the whole segment's rows (gather-KV)
            kv = tuple(x if self.grad and not x.requires_grad else self.inner.gather_seq(x, n)
                       for x, n in zip(kv, names, strict=True))
        if st.host is not None:
            return host_attend(self, q, kv, key, names, attend, params)
        if not self.grad:
            for x, n in zip(kv, names, strict=True):
                if n not in st.cache:  # in the dtype the attention reads them in (bf16 under autocast)
                    st.cache[n] = x.new_empty((x.shape[0], self.S) + tuple(x.shape[2:]), dtype=lowered(x))
                st.cache[n][:, self.s:self.e] = x
            return attend(q, *(st.cache[n][:, :self.e] for n in names), *params)
        if not any(x.requires_grad for x in kv):  # a frozen projection: the forward pass's values
            return attend(q, *(st.cache[n][:, :self.e] for n in names), *params)
        for x, n in zip(kv, names, strict=True):
            if x.requires_grad and self.j + 1 < st.n and n in st.cache_grad:
                self.outputs.append(x)
                self.output_grads.append(st.cache_grad[n][:, self.s:self.e].to(x.dtype))
        if self.s == 0:
            return attend(q, *kv, *params)
        prefixes = []
        for x, n in zip(kv, names, strict=True):
            prefix = st.cache[n][:, :self.s].detach().requires_grad_(x.requires_grad)
            if x.requires_grad:
                prefix.register_post_accumulate_grad_hook(lambda leaf, n=n: self._accumulate(n, leaf))
            prefixes.append(prefix)
        m = len(kv)

        if getattr(attend, "vjp", None) is not None:
            return _JoinedAttend.apply(attend, m, q, *prefixes, *kv, *params)

        def joined(q_: torch.Tensor, *parts: torch.Tensor) -> torch.Tensor:
            return attend(q_, *join_rows(parts[:m], parts[m:2 * m]), *parts[2 * m:])

        return checkpoint(joined, q, *prefixes, *kv, *params, use_reentrant=False)

    def _accumulate(self, key: str, leaf: torch.Tensor) -> None:
        """The gradient of the earlier segments' cached rows ``[0, s)`` of ``key`` into its fp32 accumulator
        (``[B, S, ...]``, made on first use); the leaf's own gradient is freed."""
        g, leaf.grad = leaf.grad, None
        if g is None:
            return
        st = self.store
        if key not in st.cache_grad:
            acc = torch.promote_types(g.dtype, torch.float32)
            st.cache_grad[key] = torch.zeros(st.cache[key].shape, dtype=acc, device=g.device)
        st.cache_grad[key][:, :self.s] += g

    # ---- DSA: the selection of the forward pass, reused by the backward's rerun ------------------
    def reuse(self, key: str, make: Callable[[], torch.Tensor]) -> torch.Tensor:
        st = self.store
        if not self.grad:
            value = make()
            if st.keep_selection:
                st.kept[(key, self.j)] = value
            return value
        kept = st.kept.pop((key, self.j), None)  # the rerun computes the same tokens from the same inputs
        return kept if kept is not None else make()

    # ---- KDA: the recurrent state and conv halo at this segment's start ----------------------
    def carried_in(self, key: str, x: torch.Tensor, halo: int) -> tuple[torch.Tensor, int, torch.Tensor | None]:
        per = self.store.carried.setdefault(key, [None] * self.store.n)
        if self.j == 0:
            return x, 0, None
        got = per[self.j]
        if got is None:
            raise RuntimeError(f"segment {self.j}: no state carried into {key} (run the segments in order)")
        halo_x, state = got
        if self.grad:
            halo_x = halo_x.detach().requires_grad_(x.requires_grad)
            state = state.detach().requires_grad_(True)
            self.leaves += [("halo", key, halo_x), ("state", key, state)]
        return torch.cat([halo_x.to(x.dtype), x], dim=1), halo_x.shape[1], state

    def carried_out(self, key: str, tail: torch.Tensor, state: torch.Tensor | None) -> None:
        st = self.store
        if self.j + 1 >= st.n or state is None:
            return
        if not self.grad:
            st.carried[key][self.j + 1] = (tail.detach().clone(), state.detach())
            return
        d_halo, d_state = st.carried_grad.get(key, (None, None))
        for t, g in ((tail, d_halo), (state, d_state)):
            if g is not None and t.requires_grad:
                self.outputs.append(t)
                self.output_grads.append(g.to(t.dtype))

    def collect(self) -> None:
        """After this segment's backward: the leaves' gradients to the earlier segments."""
        st = self.store
        halo_state: dict[str, dict[str, torch.Tensor | None]] = {}
        for kind, key, leaf in self.leaves:
            g = leaf.grad
            if kind == "cache":
                self._accumulate(key, leaf)
            else:
                halo_state.setdefault(key, {"halo": None, "state": None})[kind] = g
        for key, d in halo_state.items():
            st.carried_grad[key] = (d["halo"], d["state"])
            st.carried[key][self.j] = None  # the state at this segment's start is spent
        self.leaves.clear()


# ---- the step -------------------------------------------------------------------------------------
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (hidden [B, T, H], labels [B, T]) -> sum
Progress = Callable[[str, int, int], None]  # (pass: "forward" | "backward", segments done, segments)


Contexts = Callable[[int, int], SeqContext]  # (first, end) rows of this rank's shard -> their context


def plain_contexts(doc_ids: torch.Tensor | None) -> Contexts:
    """One rank: the context of rows ``[lo, hi)`` of the sequence holds their documents."""
    return lambda lo, hi: SeqContext(doc_ids=None if doc_ids is None else doc_ids[:, lo:hi])


def _forward_pass(model: nn.Module, input_ids: torch.Tensor, bounds: list[tuple[int, int]], store: SegmentStore,
                  contexts: Contexts, cp: int = 1,
                  on_hidden: Callable[[torch.Tensor, int, int], None] | None = None,
                  progress: Progress | None = None) -> None:
    """Every segment in order without a graph, filling ``store``; ``on_hidden(hidden, s, e)`` sees each
    segment's final hidden states. The per-forward counts end summed over the segments (``run_chunks``)."""
    S = input_ids.shape[1] * cp

    def one(j: int, c) -> None:
        if progress is not None:
            progress("forward", j, len(bounds))
        lo, hi = c.start // cp, c.end // cp
        ctx = SegmentContext(store, j, c.start, c.end, S, grad=False, inner=contexts(lo, hi))
        hidden = model(input_ids[:, lo:hi], ctx=ctx)
        if on_hidden is not None:
            on_hidden(hidden, c.start, c.end)

    with torch.no_grad():
        run_chunks([Chunk(s, e) for s, e in bounds], one, (model,))


def segmented_forward(model: nn.Module, input_ids: torch.Tensor, segment_tokens: int,
                      on_hidden: Callable[[torch.Tensor, int, int], None],
                      doc_ids: torch.Tensor | None = None, kv_host: bool = False) -> None:
    """The model's forward over ``input_ids [B, S]`` in segments, without a graph (evaluation, one rank):
    ``on_hidden(hidden [B, T, H], s, e)`` is called for each segment ``[s, e)`` in order. Memory: the
    caches and one segment's no-grad forward, as in ``segmented_loss_backward`` (``kv_host`` as there)."""
    bounds = segment_bounds(input_ids.shape[1], segment_tokens)
    store = SegmentStore(len(bounds), host=HostKV(bounds) if kv_host else None)
    try:
        _forward_pass(model, input_ids, bounds, store, plain_contexts(doc_ids), on_hidden=on_hidden)
    finally:
        if store.host is not None:
            store.host.release()


def segmented_loss_backward(model: nn.Module, input_ids: torch.Tensor, labels: torch.Tensor, loss_fn: LossFn,
                            scale: float, segment_tokens: int, progress: Progress | None = None,
                            doc_ids: torch.Tensor | None = None, keep_selection: bool = False, cp: int = 1,
                            contexts: Contexts | None = None,
                            after_forward: Callable[[], None] | None = None, kv_host: bool = False) -> torch.Tensor:
    """Forward and backward of ``loss_fn(model(input_ids), labels) * scale`` over segments of
    ``segment_tokens`` tokens (see the module docstring): parameter gradients are accumulated into
    ``.grad`` as ``(loss * scale).backward()`` would; returns the unscaled loss sum (no graph).

    ``model(ids, ctx=ctx)`` must return the final hidden states ``[B, T, H]`` of the ids it is given and
    read every token mixer's earlier state through ``ctx``; ``loss_fn`` maps (hidden, labels) of one
    segment to the sum of its per-token losses. Per-forward counts (MoE ``last_tokens_per_expert``) hold
    the whole sequence's after the step. ``progress(pass, done, total)`` is told before each segment (a
    1M-token step is minutes long). ``keep_selection``: the DSA selections of the forward pass are kept
    (``[B, T, W]`` int32 per full-indexer layer and segment) and the backward's reruns use them instead of
    scoring again, which saves the indexer's second pass.

    Context parallelism: ``input_ids``, ``labels`` are this rank's shard in the segment layout
    (``parallel.mesh.segment_stripes``) of a sequence of ``cp`` times their length, and ``contexts(lo, hi)``
    the cp group's context of rows ``[lo, hi)`` of it (one rank: ``plain_contexts(doc_ids)``).
    ``after_forward()`` runs between the forward pass and the backward (the trainer's router balancing
    reads the whole sequence's loads there). ``kv_host`` (``memory.segment_kv_host``): the softmax-attention
    and dense-MLA layers' K/V (or latents) and their fp32 gradients kept in host memory
    (``memory/segment_host.py``), the same step bitwise.
    """
    B, S_loc = input_ids.shape
    S = S_loc * cp
    bounds = segment_bounds(S, segment_tokens)
    assert all(s % cp == 0 and e % cp == 0 for s, e in bounds), "every segment splits into cp equal pieces"
    contexts = contexts or plain_contexts(doc_ids)
    store = SegmentStore(len(bounds), keep_selection, HostKV(bounds) if kv_host else None)
    try:
        return _segments(model, input_ids, labels, loss_fn, scale, bounds, store, contexts, cp, progress,
                         after_forward)
    finally:
        if store.host is not None:
            store.host.release()


def _segments(model: nn.Module, input_ids: torch.Tensor, labels: torch.Tensor, loss_fn: LossFn, scale: float,
              bounds: list[tuple[int, int]], store: SegmentStore, contexts: Contexts, cp: int,
              progress: Progress | None, after_forward: Callable[[], None] | None) -> torch.Tensor:
    """The forward pass, then the segments in reverse with their backward (``segmented_loss_backward``)."""
    S = input_ids.shape[1] * cp
    _forward_pass(model, input_ids, bounds, store, contexts, cp, progress=progress)
    if after_forward is not None:
        after_forward()
    loss_sum = None
    with SideState((model,)), torch.enable_grad():  # the reruns leave the forward pass's counts in place
        for j in reversed(range(len(bounds))):
            s, e = bounds[j]
            if progress is not None:
                progress("backward", len(bounds) - 1 - j, len(bounds))
            lo, hi = s // cp, e // cp
            ctx = SegmentContext(store, j, s, e, S, grad=True, inner=contexts(lo, hi))
            hidden = model(input_ids[:, lo:hi], ctx=ctx)
            loss = loss_fn(hidden, labels[:, lo:hi])
            del hidden
            outs = [loss * scale] + ctx.outputs
            grads = [torch.ones_like(outs[0])] + ctx.output_grads
            torch.autograd.backward(outs, grads)
            del outs, grads
            ctx.collect()
            loss_sum = loss.detach() if loss_sum is None else loss_sum + loss.detach()
    assert loss_sum is not None, "sequence segments need at least one token"
    return loss_sum
