"""Sequence segments with the earlier segments' keys and values in host memory (``memory.segment_kv_host``).

Shapes: B batch, S tokens, T tokens per segment, ``[s, e)`` the segment, ``...`` a layer's K or V row (``[Hk, D]``,
this rank's KV heads) or MLA latent row (``[R + Dr]``).

Under sequence segments (``memory/model_segments.py``) every softmax-attention or dense-MLA layer keeps the K/V
(or latent) rows of every token so far, ``[B, S, ...]`` in the compute dtype, and in the backward pass an fp32
accumulator of their gradient from later segments: ``(c + 4) * row`` bytes per token and layer, the whole model's
sequence-long store. ``HostKV`` keeps both in host memory, per layer key (pinned when the device is a GPU: exactly
sized ``host_memory.HostBuffer``s), and the device holds at most about two layers' worth:

- forward pass, segment j: a layer attends over its rows ``[0, s)`` copied in (fetched while the layer before it
  computed) joined to this segment's; its rows ``[s, e)`` are copied out;
- backward pass, segment j: the rerun's forward does the same, and ``_HostAttend`` keeps none of the earlier rows
  for the backward: it saves the queries and this segment's K/V only, and its backward fetches the rows ``[0, s)``
  again with their fp32 accumulator (fetched while the layer after it ran its backward), recomputes the
  attention, adds the earlier rows' gradient into the accumulator on the device and copies it back out.

Copies run on one side CUDA stream (host-to-device and device-to-host in issue order, so a read of host rows always
follows the writes before it), the compute stream waiting on an event before it reads a fetched tensor; a tensor
copied out is kept from the allocator until its copy ends (``record_stream``). On a CPU "device" the same code makes
plain copies, so the tests run every fetch and write-back on the CPU.

Exact: the same arithmetic as the GPU-resident store (the accumulator starts at zero and each segment's gradient is
added in the same order; ``checkpoint``'s recompute and ``_HostAttend``'s run the same ``joined``), so the two
stores agree bitwise (``tests/memory/test_segment_kv_host.py``). DSA layers' latents (``gather_seq``) stay on the
device.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import torch

from megaseq.memory.host_memory import HostBuffer
from megaseq.ops.amp import autocast_as, autocast_state, lowered

# (rows [0, r), their accumulators (None: none yet), r, the copy's event)
Fetched = tuple[list[torch.Tensor], list[torch.Tensor | None], int, Any]


def join_rows(rows: Sequence[torch.Tensor], kv: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The earlier rows joined before this segment's ``kv``, in the rows' dtype (both stores join so)."""
    return [torch.cat([p, x.to(p.dtype)], dim=1) for p, x in zip(rows, kv, strict=True)]


def joined_attend(attend: Callable[..., torch.Tensor], q: torch.Tensor, rows: list[torch.Tensor],
                  kv: list[torch.Tensor], params: Sequence[torch.Tensor] = ()) -> torch.Tensor:
    """``attend`` over the earlier rows joined before this segment's ``kv`` (no rows: ``kv`` alone; no ``kv``:
    the rows alone), then ``params``."""
    if not rows:
        return attend(q, *kv, *params)
    if not kv:
        return attend(q, *rows, *params)
    return attend(q, *join_rows(rows, kv), *params)


def joined_vjp(vjp: Callable[..., tuple[torch.Tensor | None, ...]], q: torch.Tensor, rows: Sequence[torch.Tensor],
               kv: Sequence[torch.Tensor], params: Sequence[torch.Tensor], g: torch.Tensor,
               needs: Sequence[bool]) -> tuple[torch.Tensor | None, list, list, list]:
    """``attend.vjp`` over the earlier rows ``[0, s)`` joined before ``kv`` (no ``kv``: the rows alone), for the
    output gradient ``g``; ``needs`` says which of ``(q, *rows, *kv, *params)`` want one. Returns the gradients
    of q, of the rows (the joined gradient's ``[0, s)``), of kv (its ``[s, e)`` in kv's dtype) and of params,
    None where not wanted. Both stores' backwards hand an ``attend`` with a ``vjp`` its rows through here."""
    r, k = len(rows), len(kv)
    need_rows, need_kv = needs[1:1 + r], needs[1 + r:1 + r + k]
    joined = join_rows(rows, kv) if kv else list(rows)
    need_joined = [a or b for a, b in zip(need_rows, need_kv, strict=True)] if kv else list(need_rows)
    d = vjp(q, *joined, *params, g, (needs[0], *need_joined, *needs[1 + r + k:]))
    del joined
    s, d_joined = rows[0].shape[1], d[1:1 + r]
    d_rows = [None if x is None or not n else x[:, :s] for x, n in zip(d_joined, need_rows, strict=True)]
    d_kv = [None if x is None or not n else x[:, s:].to(y.dtype) for x, n, y in zip(d_joined, need_kv, kv, strict=True)]
    return d[0], d_rows, d_kv, list(d[1 + r:])


def _copy_in(host: torch.Tensor, s: int, e: int, device: torch.device) -> torch.Tensor:
    """Rows ``[s, e)`` of ``host [B, S, ...]`` on ``device``, one sequence at a time (each a contiguous host range:
    an asynchronous DMA from pinned memory, where a strided source would be staged through pageable memory)."""
    out = torch.empty((host.shape[0], e - s) + tuple(host.shape[2:]), dtype=host.dtype, device=device)
    for b in range(host.shape[0]):
        out[b].copy_(host[b, s:e], non_blocking=True)
    return out


class HostKV:
    """The host-kept K/V (or latent) rows and fp32 gradient accumulators of one step, by layer key; the copy
    stream; the fetches issued one layer ahead. ``device_bytes`` / ``peak_device_bytes``: what its fetched
    tensors hold on the device (the bound the planner counts)."""

    def __init__(self, bounds: list[tuple[int, int]]) -> None:
        self.bounds = bounds  # [s, e) of every segment
        self.n = len(bounds)
        self.rows: dict[str, torch.Tensor] = {}  # host [B, S, ...] in the compute dtype
        self.grad: dict[str, torch.Tensor] = {}  # host fp32 [B, S, ...]: rows [0, s) of the last segment written
        self.names: dict[str, list[str]] = {}  # layer key -> its tensors' names (k, v or the latent)
        self.order: list[str] = []  # layer keys in forward order (recorded by the first segment)
        self.ahead: dict[tuple[str, str, int], Fetched] = {}  # (pass, layer, segment) -> fetched
        self.buffers: list[HostBuffer] = []
        self.stream: Any = None
        self.device_bytes = 0
        self.peak_device_bytes = 0

    # ---- host memory ------------------------------------------------------------------------------------
    def host_bytes(self) -> int:
        return sum(b.nbytes for b in self.buffers)

    def _host(self, shape: tuple[int, ...], dtype: torch.dtype, on_cuda: bool) -> torch.Tensor:
        numel = 1
        for d in shape:
            numel *= d
        buf = HostBuffer(numel * torch.empty((), dtype=dtype).element_size(), pin=on_cuda)
        self.buffers.append(buf)
        return buf.view(0, shape, dtype)

    def release(self) -> None:
        """After the step: wait for the last copies, free the host memory."""
        if self.stream is not None:
            self.stream.synchronize()
        for b in self.buffers:
            b.release()
        self.buffers, self.rows, self.grad, self.ahead = [], {}, {}, {}

    def _copy_ctx(self, on_cuda: bool) -> contextlib.AbstractContextManager:
        if not on_cuda:
            return contextlib.nullcontext()
        if self.stream is None:
            self.stream = torch.cuda.Stream()
        self.stream.wait_stream(torch.cuda.current_stream())  # what it copies out is ready; what it overwrites free
        return torch.cuda.stream(self.stream)

    def _count(self, tensors: list[torch.Tensor | None], sign: int) -> None:
        self.device_bytes += sign * sum(t.numel() * t.element_size() for t in tensors if t is not None)
        self.peak_device_bytes = max(self.peak_device_bytes, self.device_bytes)

    # ---- copies -----------------------------------------------------------------------------------------
    def _fetch(self, key: str, r: int, grads: bool, device: torch.device) -> Fetched:
        """Start copying rows ``[0, r)`` of layer ``key`` (and, with ``grads``, their accumulators) in."""
        on_cuda = device.type == "cuda"
        names = self.names[key]
        with self._copy_ctx(on_cuda):
            rows = [_copy_in(self.rows[n], 0, r, device) for n in names]
            accs: list[torch.Tensor | None] = [_copy_in(self.grad[n], 0, r, device) if grads and n in self.grad
                                               else None for n in names]
            event = torch.cuda.Event() if on_cuda else None
            if event is not None:
                event.record()
        self._count(rows + accs, 1)
        return rows, accs, r, event

    def prefetch(self, phase: str, key: str, j: int, r: int, device: torch.device) -> None:
        """Fetch ``key``'s rows ``[0, r)`` for segment ``j``'s ``phase`` ("forward", "rerun" or "backward": the
        accumulators too) now, ahead of its use."""
        if r > 0 and (phase, key, j) not in self.ahead and self.names[key][0] in self.rows:
            self.ahead[(phase, key, j)] = self._fetch(key, r, phase == "backward", device)

    def take(self, phase: str, key: str, j: int, r: int, device: torch.device) -> tuple[list[torch.Tensor],
                                                                                        list[torch.Tensor | None]]:
        """``key``'s rows ``[0, r)`` on the device (prefetched, or fetched now); the compute stream waits for them."""
        got = self.ahead.pop((phase, key, j), None)
        if got is not None and got[2] != r:  # fetched for another length (a frozen layer reads [0, e))
            self.done(got[0] + got[1])
            got = None
        if got is None:
            got = self._fetch(key, r, phase == "backward", device)
        rows, accs, _, event = got
        if event is not None:
            torch.cuda.current_stream().wait_event(event)
        return rows, accs

    def done(self, tensors: list[torch.Tensor | None]) -> None:
        """Fetched tensors no longer needed (the device may reuse them once the caller drops them)."""
        self._count(tensors, -1)

    def write_rows(self, name: str, x: torch.Tensor, s: int, e: int, S: int) -> None:
        """This segment's rows ``[s, e)`` of ``name`` out to the host store (made on first use)."""
        x = x.to(lowered(x))  # in the dtype the attention reads the rows in (bf16 under autocast)
        if name not in self.rows:
            self.rows[name] = self._host((x.shape[0], S) + tuple(x.shape[2:]), x.dtype, x.is_cuda)
        self._copy_out(self.rows[name], s, x)

    def write_grad(self, name: str, acc: torch.Tensor, S: int) -> None:
        """The accumulated gradient of rows ``[0, s)`` (``acc [B, s, ...]``) back out to the host."""
        if name not in self.grad:
            self.grad[name] = self._host((acc.shape[0], S) + tuple(acc.shape[2:]), acc.dtype, acc.is_cuda)
        self._copy_out(self.grad[name], 0, acc)

    def _copy_out(self, host: torch.Tensor, s: int, x: torch.Tensor) -> None:
        """``x [B, L, ...]`` into rows ``[s, s + L)`` of ``host``, one sequence at a time (each a contiguous host
        range, so the copy is one asynchronous DMA)."""
        with self._copy_ctx(x.is_cuda):
            for b in range(x.shape[0]):
                host[b, s:s + x.shape[1]].copy_(x[b].detach(), non_blocking=True)
        if x.is_cuda:
            x.record_stream(self.stream)  # the allocator may reuse x only after the copy

    def grad_rows(self, name: str, s: int, e: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The accumulated gradient of rows ``[s, e)`` (final: every later segment has run), in ``dtype``."""
        on_cuda = device.type == "cuda"
        with self._copy_ctx(on_cuda):
            g = _copy_in(self.grad[name], s, e, device)
        if on_cuda:
            torch.cuda.current_stream().wait_stream(self.stream)
        return g.to(dtype)

    # ---- the order of the layers: what to fetch next ----------------------------------------------------
    def after(self, phase: str, key: str, j: int, s: int, e: int, device: torch.device) -> None:
        """Layer ``key`` of segment ``[s, e)`` has taken its rows in ``phase``: fetch the next layer's now."""
        if key not in self.order:
            self.order.append(key)
        i = self.order.index(key)
        if phase == "backward":  # the layers in reverse; after the first, the next segment's rerun (first layer)
            if i > 0:
                self.prefetch("backward", self.order[i - 1], j, s, device)
            elif j > 0:
                self.prefetch("rerun", self.order[0], j - 1, self.bounds[j - 1][0], device)
            return
        if i + 1 < len(self.order):
            self.prefetch(phase, self.order[i + 1], j, s, device)
        elif phase == "forward" and j + 1 < self.n:
            self.prefetch("forward", self.order[0], j + 1, e, device)
        elif phase == "rerun":  # the backward starts with the last layer
            self.prefetch("backward", key, j, s, device)

    def accumulate(self, name: str, g: torch.Tensor, acc: torch.Tensor | None, S: int) -> None:
        """Add ``g``, the gradient of rows ``[0, s)``, into their accumulator (fetched; None: zeros, as the
        GPU-resident store starts it) on the device and write it back out."""
        made = acc is None
        if acc is None:
            acc = torch.zeros(g.shape, dtype=torch.promote_types(g.dtype, torch.float32), device=g.device)
            self._count([acc], 1)
        acc += g
        self.write_grad(name, acc, S)
        if made:
            self._count([acc], -1)


class _HostAttend(torch.autograd.Function):
    """``attend(q, *(rows [0, s) joined to kv), *params)`` keeping neither the rows nor the joined keys for the
    backward: the backward fetches the rows again, reruns ``joined`` with a graph (or, where ``attend`` has a
    ``vjp``, hands it the joined rows, and it runs the forward it needs itself), and adds the rows' gradient
    into the host accumulators (``params`` get theirs as any input does)."""

    @staticmethod
    def forward(ctx: Any, seg: Any, key: str, attend: Callable[..., torch.Tensor], n_params: int, q: torch.Tensor,
                *rest: torch.Tensor) -> torch.Tensor:
        host, dev = seg.store.host, q.device
        params, kv = rest[:n_params], rest[n_params:]
        rows, _ = host.take("rerun", key, seg.j, seg.s if kv else seg.e, dev)
        host.after("rerun", key, seg.j, seg.s, seg.e, dev)
        out = joined_attend(attend, q, rows, list(kv), params)
        host.done(rows)
        ctx.seg, ctx.key, ctx.attend, ctx.n_params = seg, key, attend, n_params
        ctx.autocast = autocast_state()  # the backward's rerun casts as this forward did (as checkpoint)
        ctx.save_for_backward(q, *rest)
        return out

    @staticmethod
    def backward(ctx: Any, g_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        seg, key, m = ctx.seg, ctx.key, ctx.n_params
        host = seg.store.host
        q, *rest = ctx.saved_tensors
        params, kv = rest[:m], rest[m:]
        need_params = ctx.needs_input_grad[5:5 + m]
        need_kv = ctx.needs_input_grad[5 + m:] if kv else [False] * len(host.names[key])
        rows, accs = host.take("backward", key, seg.j, seg.s if kv else seg.e, q.device)
        host.after("backward", key, seg.j, seg.s, seg.e, q.device)
        vjp = getattr(ctx.attend, "vjp", None)
        if vjp is not None:  # the attention's own backward over the joined rows: no forward rerun for a graph
            with autocast_as(ctx.autocast):
                d_q, d_rows, d_kv, d_params = joined_vjp(
                    vjp, q, rows, kv, params, g_out,
                    (ctx.needs_input_grad[4], *need_kv, *(need_kv if kv else ()), *need_params))
        else:
            with torch.enable_grad(), autocast_as(ctx.autocast):
                q_ = q.detach().requires_grad_(ctx.needs_input_grad[4])
                params_ = [p.detach().requires_grad_(need) for p, need in zip(params, need_params, strict=True)]
                kv_ = [x.detach().requires_grad_(need) for x, need in zip(kv, need_kv, strict=False)]
                rows_ = [r.detach().requires_grad_(need) for r, need in zip(rows, need_kv, strict=True)]
                out = joined_attend(ctx.attend, q_, rows_, kv_, params_)
                leaves = [q_, *rows_, *kv_, *params_]
                got = iter(torch.autograd.grad(out, [t for t in leaves if t.requires_grad], g_out, allow_unused=True))
            d = [next(got) if t.requires_grad else None for t in leaves]
            r, k = len(rows_), len(kv_)
            d_q, d_rows, d_kv, d_params = d[0], d[1:1 + r], d[1 + r:1 + r + k], d[1 + r + k:]
            del out, leaves, rows_
        for name, g, acc in zip(host.names[key], d_rows, accs, strict=True):
            if g is not None:
                host.accumulate(name, g, acc, seg.S)
        host.done(rows + accs)
        return (None, None, None, None, d_q, *d_params, *d_kv)


def host_attend(seg: Any, q: torch.Tensor, kv: tuple[torch.Tensor, ...], key: str, names: list[str],
                attend: Callable[..., torch.Tensor], params: tuple[torch.Tensor, ...] = ()) -> torch.Tensor:
    """``SegmentContext.attend_seq`` with the host-kept store (``seg``: the segment's context; ``kv`` this
    segment's whole rows, gathered over the cp group where the layer's keys are sharded)."""
    st, host, dev = seg.store, seg.store.host, q.device
    host.names.setdefault(key, names)
    if not seg.grad:
        rows, _ = host.take("forward", key, seg.j, seg.s, dev) if seg.s else ([], [])
        for x, n in zip(kv, names, strict=True):
            host.write_rows(n, x, seg.s, seg.e, seg.S)
        host.after("forward", key, seg.j, seg.s, seg.e, dev)
        out = joined_attend(attend, q, rows, list(kv), params)
        host.done(rows)
        return out
    trained = [x for x in kv if x.requires_grad]
    for x, n in zip(kv, names, strict=True):
        if x.requires_grad and seg.j + 1 < st.n and n in host.grad:
            seg.outputs.append(x)
            seg.output_grads.append(host.grad_rows(n, seg.s, seg.e, x.dtype, dev))
    if seg.s == 0:
        return attend(q, *kv, *params)
    if not trained:  # a frozen projection: the forward pass's rows [0, e), as the GPU-resident store reads them
        return _HostAttend.apply(seg, key, attend, len(params), q, *params)
    return _HostAttend.apply(seg, key, attend, len(params), q, *params, *kv)
