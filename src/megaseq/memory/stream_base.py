"""A frozen base streamed from pinned host memory: the decoder layers' frozen weights live on the host and
come to the GPU a layer ahead of use, so a base larger than what the GPU can spare trains (LoRA,
``train.trainable``).

Shapes: L decoder layers; ``W_i`` the bytes of layer i's frozen parameters (one flat buffer, each tensor at
a 512-byte aligned offset).

``stream_layers(layers, device)`` moves every frozen parameter of each layer into one pinned host buffer per
layer (``host_memory.HostBuffer``: ``cudaHostRegister``, the exact size, no power-of-two rounding). What trains
(the adapters, the ``train.trainable`` tensors) and the buffers stay on the device. Then:

- **forward** (and the rerun of a recomputed layer in backward): before layer i runs, its weights are on the
  device (one ``[W_i]`` copy on a side CUDA stream, started when the layer before it ran) and the copy of the
  next layer in the direction of travel (i + 1 in forward, i - 1 in backward) is started;
- **backward**: autograd keeps no device weight. While a layer runs, ``saved_tensors_hooks`` replace every
  saved view of a streamed weight by a handle (layer, dtype, offset, size, stride) and tag every other saved
  tensor with the layer; unpacking either makes the layer resident again (copied anew if it left) and
  prefetches the layer below, so the backward re-fetches each layer, and a replay inside it (tiled MLP,
  segmented KDA) finds its weights;
- **residency**: a parameter's ``.data`` is the device view while its layer is resident and the host view
  otherwise; making a layer resident evicts every layer but it and the one prefetched, so at most two layers'
  weights are on the device (``peak_resident`` counts it). An evicted buffer's storage is freed at once
  (``resize_(0)``): anything that kept a device weight past its layer fails loudly instead of reading
  another layer's bytes.

Composes with recompute (the layer wrapper sits inside ``offload.checkpoint_layers``' so the rerun streams
too), SCO, tiling, segmented KDA and sequence segments (each segment's forward, grad forward and backward
stream the layers again), and under FSDP2 torch's own ``CPUOffloadPolicy`` does the same for each rank's
shards (``parallel.fsdp.apply_fsdp``: the shard copied to the GPU inside the unit's prefetched all-gather).
On the CPU the same code runs with a plain copy for the transfer (``device`` cpu: tests).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from megaseq.memory import forwards
from megaseq.memory.host_memory import HostBuffer
from megaseq.memory.rules import check_stream_base, round_up

SETTING = "memory.stream_base"


@dataclass
class _Layer:
    """One layer's streamed weights: the parameters, their byte offsets, the host buffer, the device copy."""

    params: list[nn.Parameter]
    offsets: list[int]
    nbytes: int
    host: HostBuffer | None = None
    host_views: list[torch.Tensor] = field(default_factory=list)
    device_buf: torch.Tensor | None = None  # [nbytes] uint8 while resident
    ready: Any = None  # CUDA event: the copy into device_buf has finished


def _layout(params: list[nn.Parameter]) -> tuple[list[int], int]:
    """Byte offsets of each tensor in the layer's flat buffer (512-aligned) and the buffer's size."""
    offsets, off = [], 0
    for p in params:
        offsets.append(off)
        off = round_up(off + p.numel() * p.element_size())
    return offsets, max(off, 8)


def _view(buf: torch.Tensor, offset: int, like: torch.Tensor) -> torch.Tensor:
    nbytes = like.numel() * like.element_size()
    return buf[offset:offset + nbytes].view(like.dtype).view(like.shape)


class BaseStreamer:
    """The streamed layers of one model, their device copies and the copy stream (see the module docstring)."""

    def __init__(self, layers: list[nn.Module], device: torch.device | str) -> None:
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.layers: list[_Layer] = []
        self.resident: list[int] = []  # layers whose device copy exists, oldest first
        self.live: dict[int, int] = {}  # device buffer storage address -> layer
        self.peak_resident = 0  # the most layers resident at once
        self.fetches = 0  # host-to-device copies
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        for layer in layers:
            self.layers.append(self._host_layer(layer))

    # ---- placement -------------------------------------------------------------------------------------------
    def _host_layer(self, layer: nn.Module) -> _Layer:
        from torch.distributed.tensor import DTensor

        named = [(n, p) for n, p in layer.named_parameters() if not p.requires_grad]
        sharded = [n for n, p in named if isinstance(p, DTensor)]
        if sharded:
            raise ValueError(f"{SETTING}: {sharded[0]} is sharded (expert parallelism); the one-process streamer "
                             "takes whole tensors: set --parallel.ep 1 or use FSDP (parallel.fsdp dp), which "
                             "streams each rank's shards")
        params = [p for _, p in named]
        offsets, nbytes = _layout(params)
        rec = _Layer(params, offsets, nbytes)
        rec.host = HostBuffer(nbytes, pin=self.device.type == "cuda")
        for p, off in zip(params, offsets):
            view = _view(rec.host.base, off, p)
            view.copy_(p.detach())
            rec.host_views.append(view)
            p.data = view  # the device copy (if the model was built there) is freed with its last reference
        return rec

    @property
    def host_bytes(self) -> int:
        """Host bytes the streamed layers hold (pinned on CUDA)."""
        return sum(rec.nbytes for rec in self.layers)

    # ---- copies ----------------------------------------------------------------------------------------------
    def _copy_in(self, i: int) -> None:
        """Start the host-to-device copy of layer i's buffer (a side stream on CUDA)."""
        rec = self.layers[i]
        buf = torch.empty(rec.nbytes, dtype=torch.uint8, device=self.device)
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))  # buf's memory was free on compute
            with torch.cuda.stream(self.stream):
                buf.copy_(rec.host.base, non_blocking=True)
                rec.ready = torch.cuda.Event()
                rec.ready.record()
            buf.record_stream(self.stream)
        else:
            buf.copy_(rec.host.base)
        rec.device_buf = buf

    def _fetch(self, i: int) -> None:
        rec = self.layers[i]
        self._copy_in(i)
        self.fetches += 1
        buf = rec.device_buf
        for p, off in zip(rec.params, rec.offsets):
            p.data = _view(buf, off, p)
        self.live[buf.untyped_storage().data_ptr()] = i
        self.resident.append(i)
        self.peak_resident = max(self.peak_resident, len(self.resident))

    def _evict(self, i: int) -> None:
        rec = self.layers[i]
        for p, view in zip(rec.params, rec.host_views):
            p.data = view
        buf, rec.device_buf, rec.ready = rec.device_buf, None, None
        self.live.pop(buf.untyped_storage().data_ptr(), None)
        self.resident.remove(i)
        buf.untyped_storage().resize_(0)  # freed now (stream-ordered); a stale reference fails loudly

    def use(self, i: int, backward: bool) -> None:
        """Layer i resident and ready for the compute stream; the next layer in the direction of travel
        (``backward``: i - 1) prefetched; every other layer evicted."""
        nxt = i - 1 if backward else i + 1
        keep = {i} | ({nxt} if 0 <= nxt < len(self.layers) else set())
        for j in [j for j in self.resident if j not in keep]:
            self._evict(j)
        if i not in self.resident:
            self._fetch(i)
        for j in keep - set(self.resident):
            self._fetch(j)
        ready = self.layers[i].ready
        if ready is not None:
            torch.cuda.current_stream(self.device).wait_event(ready)

    def release(self) -> None:
        """Evict every resident layer (the end of a run, or before the host weights are changed)."""
        for j in list(self.resident):
            self._evict(j)

    # ---- autograd's saved tensors ----------------------------------------------------------------------------
    def hooks(self, i: int) -> torch.autograd.graph.saved_tensors_hooks:
        """The saved-tensor hooks of layer i's forward: streamed weights become handles, the rest is tagged."""
        def pack(t: torch.Tensor) -> Any:
            layer = self.live.get(t.untyped_storage().data_ptr()) if t.device.type == self.device.type else None
            if layer is not None:
                return (layer, None, (t.dtype, t.storage_offset(), tuple(t.shape), t.stride()))
            return (i, t, None)

        def unpack(packed: Any) -> torch.Tensor:
            layer, t, view = packed
            self.use(layer, backward=True)
            if view is None:
                return t
            dtype, offset, shape, stride = view
            buf = self.layers[layer].device_buf
            return buf.view(dtype).as_strided(shape, stride, offset)

        return torch.autograd.graph.saved_tensors_hooks(pack, unpack)


def in_backward() -> bool:
    """Whether autograd's engine is running (a recomputed layer's rerun): the travel is downward."""
    return torch._C._current_graph_task_id() != -1


class _StreamedForward(forwards.InstanceForward):
    """The forward ``stream_layers`` installs on a layer instance (inside any recompute wrapper)."""

    def __init__(self, layer: nn.Module, streamer: BaseStreamer, index: int) -> None:
        super().__init__(layer)
        self.streamer, self.index = streamer, index

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.streamer.use(self.index, backward=in_backward())
        grad = torch.is_grad_enabled()
        with self.streamer.hooks(self.index) if grad else contextlib.nullcontext():
            return self.inner(*args, **kwargs)


def stream_layers(layers: list[nn.Module], device: torch.device | str) -> BaseStreamer:
    """Stream every frozen parameter of ``layers`` from host memory to ``device`` (see the module docstring);
    applying again first puts the weights back (``unstream_layers``)."""
    layers = list(layers)
    unstream_layers(layers)
    streamer = BaseStreamer(layers, device)
    for i, layer in enumerate(layers):
        layer.forward = _StreamedForward(layer, streamer, i)
    return streamer


def streamed_forward(layer: nn.Module) -> _StreamedForward | None:
    """The streamed forward installed on ``layer``, under whatever wrappers were installed after it (recompute,
    SCO and tiling each keep the forward they replaced as ``prior``), or None."""
    return forwards.installed(layer, _StreamedForward)


def streamed_parameters(model: nn.Module) -> list[nn.Parameter]:
    """Every parameter of ``model`` that a streamer holds in host memory."""
    return [p for m in model.modules() if (f := streamed_forward(m)) is not None
            for p in f.streamer.layers[f.index].params]


def unstream_layers(layers: list[nn.Module], device: torch.device | str | None = None) -> None:
    """Undo ``stream_layers``: each streamed weight back on ``device`` (default: the streamer's) as a tensor of
    its own; the layers' forwards as they were (a wrapper installed after the streamed forward calls what the
    streamed forward wrapped)."""
    for layer in layers:
        current = forwards.remove(layer, _StreamedForward)
        if current is None:
            continue
        streamer = current.streamer
        streamer.release()
        for p in streamer.layers[current.index].params:
            p.data = p.data.to(device or streamer.device, copy=True)


def to_device_resident(model: nn.Module, device: torch.device | str) -> None:
    """Move what is not streamed to ``device``: every parameter that is neither a streamed host weight nor an
    FSDP shard (``DTensor``: FSDP placed it, on the device or, offloaded, on the host), and every buffer."""
    from torch.distributed.tensor import DTensor

    streamed = {id(p) for p in streamed_parameters(model)}
    for m in model.modules():
        for p in m._parameters.values():
            if p is not None and id(p) not in streamed and not isinstance(p, DTensor):
                p.data = p.data.to(device)
        for name, b in m._buffers.items():
            if b is not None:
                m._buffers[name] = b.to(device)
    if torch.device(device).type == "cuda":  # a model built on the GPU left its streamed layers' blocks cached
        torch.cuda.empty_cache()


def check_run(freezes: bool, sharded: bool, init_from: bool) -> None:
    """ValueError naming ``memory.stream_base`` and the fix, before a model is built, for what it cannot run."""
    check_stream_base(freezes)
    if sharded and init_from:
        raise ValueError(f"{SETTING} with parallel.fsdp and model.init_from: the offloaded shards are loaded on the "
                         "device before FSDP's offload; run on one GPU per process without FSDP "
                         f"(--parallel.fsdp off) or set --{SETTING} false")


def build_device(meta_model: nn.Module, device: torch.device) -> torch.device | str:
    """Where to build the model before its base is streamed: ``device`` when the whole model (built on the meta
    device, in its storage dtypes) fits in 90% of the device's free memory (drawing random weights on a GPU is
    fast; the streamer copies each layer to the host and frees it), else the host."""
    if device.type != "cuda":
        return device
    nbytes = sum(p.numel() * p.element_size() for p in meta_model.parameters())
    return device if nbytes < 0.9 * torch.cuda.mem_get_info(device)[0] else "cpu"
