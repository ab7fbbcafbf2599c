"""The optimizer's update on a stream of its own, beside the next step's forward: each decoder layer's forward
waits only for its own parameters' update.

A step's update (MasterAdamW's one Triton pass per parameter: 28 bytes a parameter, bound by memory bandwidth)
ran on the compute stream between the backward and the next forward, and the step's read-back of the loss and
gradient norm waited for it. On a stream of its own the update runs in parts, in the order the next forward
reads the parameters: first every parameter outside the decoder layers (the embedding, the final norm, the
head, model-level modules), then layer 0, 1, ... Each part records an event. The next forward waits for the
first part's event when it enters the model (or any of its modules outside the layers) and for layer i's event
when it enters layer i, so layer i's forward runs while later layers' updates still do: the bandwidth-bound
update shares the GPU with the forward's compute-bound kernels, and the read-back no longer waits for it.

The kernels are the same kernels on the same tensors in the same order per tensor, so the weights, moments and
losses are those of the update on the compute stream, bit for bit (``tests/train/test_update_overlap.py`` compares
them on a GPU). Where decoder layers replay as CUDA graphs (``train.layer_graphs``), their gradients live in the
graphs' memory pool, which the next replay may overwrite: their parts run first, and every graphed layer's forward
waits for all of them; the eager layers' parts run beside the forward. What else reads the parameters waits for the
whole update (``join``): a checkpoint, an evaluation, the CUDA graphs' capture, the end of the run. The gradients
the update reads are held until the compute stream has waited for the last part, as the next forward enters the
last layer (then their memory may be reused: the next backward's gradients take it).

When (``why_not``): ``optim.overlap_update`` on (the default), one process on a CUDA device, and an optimizer
that takes its parts (``MasterAdamW``'s step with ``parts``, which guards the step on the device: the update
writes nothing for a non-finite step).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def why_not(enabled: bool, device: torch.device, world_size: int, optimizer: Any) -> str | None:
    """Why a run's update stays on the compute stream (None: it overlaps)."""
    if not enabled:
        return "optim.overlap_update is off"
    if device.type != "cuda":
        return f"device {device.type}"
    if world_size != 1:
        return f"{world_size} processes"
    if not getattr(optimizer, "steps_in_parts", False):
        return f"optimizer {type(optimizer).__name__}"
    return None


def parts_in_forward_order(model: nn.Module, optimizer: Any) -> list[tuple[list[nn.Module], set[torch.Tensor]]]:
    """The optimizer's parameters in the parts the update runs, each with the modules whose forward waits for it:
    the parameters outside ``model.layers`` (waited for by the model and each of its other direct children),
    then each layer's (waited for by the layer). A parameter shared by several (tied embeddings) is in the first
    that holds it; a part with no parameter is left out."""
    params = {p for g in optimizer.param_groups for p in g["params"]}
    layers = list(getattr(model, "layers", []))
    seen: set[torch.Tensor] = set()
    per_layer = []
    for layer in layers:
        mine = {p for p in layer.parameters() if p in params and p not in seen}
        seen |= mine
        per_layer.append(([layer], mine))
    rest = params - seen
    outer = [model] + [m for name, m in model.named_children() if name != "layers"]
    parts = [(outer, rest)] + per_layer
    return [(mods, ps) for mods, ps in parts if ps]


class UpdateOverlap:
    """A run's update on its own stream (see the module doc): ``step(finite)`` in place of the optimizer's,
    ``join()`` before anything but the next forward reads the parameters."""

    def __init__(self, model: nn.Module, optimizer: Any, device: torch.device, graphs: Any = None) -> None:
        self.optimizer = optimizer
        self.model = model
        self.graphs = graphs  # the run's LayerGraphs (train.layer_graphs), or None
        self.stream = torch.cuda.Stream(device)
        self.parts = parts_in_forward_order(model, optimizer)
        self.pending: dict[nn.Module, torch.cuda.Event] = {}  # module -> the event its next forward waits for
        self.held: list[torch.Tensor] = []  # what the update reads that the compute stream may free meanwhile
        self.last: torch.cuda.Event | None = None  # the last part's event
        self.hooks = [m.register_forward_pre_hook(self._wait) for mods, _ in self.parts for m in mods]

    def step(self, finite: torch.Tensor) -> None:
        """Launch the update behind the compute stream's work so far (the gradients, their norm, ``finite``)."""
        self.join()
        opt = self.optimizer
        main = torch.cuda.current_stream(self.stream.device)
        self.held = [p.grad for g in opt.param_groups for p in g["params"] if p.grad is not None]
        self.held += list(getattr(opt, "acc", {}).values()) + [t for t in (opt.clip_coef, finite) if t is not None]
        parts, first_replay = self._order()
        self.stream.wait_stream(main)
        events: list[torch.cuda.Event] = []

        def recorded(i: int) -> None:
            ev = torch.cuda.Event()
            ev.record(self.stream)
            events.append(ev)

        with torch.cuda.stream(self.stream):
            opt.step(finite=finite, parts=[ps for _, ps in parts], after_part=recorded)
        graphed = self._graphed()
        for (mods, _), ev in zip(parts, events, strict=True):
            for m in mods:
                # a graphed layer replays only once every graphed layer's gradients are read (see _order)
                self.pending[m] = events[first_replay] if m in graphed else ev
        self.last = events[-1] if events else None

    def _graphed(self) -> set[nn.Module]:
        layers = getattr(self.model, "layers", [])
        return {layers[i] for i in getattr(self.graphs, "graphed", [])} if self.graphs is not None else set()

    def _order(self) -> tuple[list[tuple[list[nn.Module], set[torch.Tensor]]], int]:
        """The parts in launch order, and the index of the part a graphed layer's forward waits for.

        A graphed layer's gradients are the CUDA graphs' static outputs, in the graphs' memory pool, which the
        next replay of any graphed layer's forward may overwrite (one pool serves every graph, in capture order).
        So where layers are graphed, their parts go first (after the parameters outside the layers) and every
        graphed layer waits for the last of them; the eager layers' parts then run beside the forward."""
        graphed = self._graphed()
        if not graphed:
            return self.parts, 0
        outer, layers = self.parts[:1], self.parts[1:]
        if outer and outer[0][0][0] is not self.model:  # no parameter outside the layers
            outer, layers = [], self.parts
        first = [part for part in layers if part[0][0] in graphed]
        rest = [part for part in layers if part[0][0] not in graphed]
        return outer + first + rest, len(outer) + len(first) - 1 if first else 0

    def _wait(self, module: nn.Module, args: Any) -> None:
        ev = self.pending.pop(module, None)
        if ev is not None:
            torch.cuda.current_stream(self.stream.device).wait_event(ev)
            if ev is self.last:  # the last part waited for (the parts run in order): the whole update is behind
                self.pending.clear()  # the compute stream's work from here, the gradients' memory its again
                self.held = []

    def join(self) -> None:
        """The compute stream waits for the whole update (a checkpoint, an evaluation or a capture reads the
        parameters next)."""
        if self.pending or self.held:
            torch.cuda.current_stream(self.stream.device).wait_stream(self.stream)
            self.pending.clear()
            self.held = []

    def remove(self) -> None:
        self.join()
        for h in self.hooks:
            h.remove()
        self.hooks = []


def for_run(enabled: bool, model: nn.Module, optimizer: Any, device: torch.device, world_size: int,
            log: Any = None, graphs: Any = None) -> UpdateOverlap | None:
    """The run's ``UpdateOverlap``, or None where ``why_not`` says (logged when ``log`` is given, it was asked
    for and the device is a GPU)."""
    why = why_not(enabled, device, world_size, optimizer)
    if why is not None:
        if log is not None and enabled and device.type == "cuda":
            log(f"update overlap: not used ({why})")
        return None
    return UpdateOverlap(model, optimizer, device, graphs)
