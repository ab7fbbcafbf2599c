"""CUDA graphs of the decoder layers whose kernels are many and small: one launch for a layer's forward, one for
its backward.

At short lengths a step's host work (Python, the autotuners' lookups, one launch per kernel) outlasts its GPU
work: a layer of linear attention (KDA: chunked kernels, gates, convolutions, norms) with its
hyper-connections and MoE launches a few hundred kernels, each a few microseconds of GPU time at 8K tokens.
Replaying a captured graph launches them all at once.

What is graphed (``eligible``): each decoder layer whose token mixer is KDA (GLM-5's and Kimi-Linear's linear
attention). Its forward makes no host sync and its shapes follow the sequence length alone. The softmax-attention
and DSA layers stay eager: the DSA selection reads counts back to the host, and attention at the lengths where
graphs pay is a few large kernels. Gated DeltaNet layers (Qwen3-Next) are not graphed: not yet checked on a GPU.

When (``why_not``): one process on a CUDA device, ``model.cuda_graphs`` on (the default), no memory scheme in
the plan (the schemes wrap layers and move tensors between passes), no autocast, and no auxiliary balance loss
(its gradient is handed to the routers between the forward and the backward, outside any graph).

How: the first step runs eagerly (it compiles and tunes the kernels). Before the second (if its batch is one
micro-batch without documents), ``torch.cuda.make_graphed_callables`` captures every eligible layer's forward and
backward on a sample input of the step's layer-boundary shape (one warm-up iteration, then the capture; one
memory pool for all of them). From then on such a layer, called with autograd on, on an input of that shape,
with a plain context (one rank, no documents, no positions) and one micro-batch a step, copies its input into
the graph's and replays (while its parameters train as they did at the capture); the parameters' gradients come
out of the backward graph into ``.grad``, and the statistics the layer leaves on its modules (an MoE's expert
loads) are the graph's. Any other call runs the layer eagerly. A graph replays the kernels it captured on the
same memory, so its results are the eager layer's (``tests/train/test_layer_graphs.py`` compares losses and
every gradient on a GPU). A capture that fails (an op of the layer syncs with the host, as the reference
kernels' grouped GEMM does) is logged and the layers run eagerly.

Memory: the graphs keep their input, output and gradient buffers and the activations they save in a pool of their
own, which no eager tensor can use. The planner's phases do not hold them; the run holds them to the plan's headroom
(its GPU budget less its peak, ``headroom``) instead. Before the capture, the graphs' gradient and input buffers
alone (a lower bound) must fit in it; after it, the pool's measured size (``pool_bytes``, the allocator's segments of
the new pool) must, or the graphs are dropped, their memory given back, and the layers run eagerly. A step of
graphed layers then peaks at most the plan's peak plus the pool. glm5-flash-1gpu's peak at 8K on an H100 was 46.0 GiB
with and without graphs (``benchmarks/results/speed/runs/2026-12-07_layer-graphs``).
"""

from __future__ import annotations

import gc
import time
import types
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from megaseq.models.common.context import SeqContext
from megaseq.schemes import SCHEMES, is_on
from megaseq.train import host_gc

# the one scheme that leaves graphs on: the DSA indexer's query chunks change only the DSA layers, which stay eager.
# Every other scheme of ``megaseq.schemes`` keeps the layers eager (most wrap layers or move their tensors or
# gradients), a new one too until it is checked with graphs
_BESIDE_GRAPHS = ("indexer_query_chunk",)


def eligible(layer: nn.Module) -> bool:
    """A decoder layer whose token mixer is KDA (see the module doc)."""
    from megaseq.models.common.kda import KimiDeltaAttention

    return any(isinstance(m, KimiDeltaAttention) for m in layer.modules())


def why_not(enabled: bool, device: torch.device, world_size: int, memory: Any, autocast: torch.dtype | None,
            model: nn.Module) -> str | None:
    """Why a run's layers are not graphed (None: they are, where ``eligible``)."""
    from megaseq.models.common.moe import MoE

    if not enabled:
        return "model.cuda_graphs is off"
    if device.type != "cuda":
        return f"device {device.type}"
    if world_size != 1:
        return f"{world_size} processes"
    schemes = [name for name in SCHEMES if name not in _BESIDE_GRAPHS and is_on(memory, name)]
    if schemes:
        return "memory schemes " + ", ".join(schemes)
    if autocast is not None:
        return f"autocast to {autocast}"
    if any(isinstance(m, MoE) and m.aux_loss_coef for m in model.modules()):
        return "an auxiliary balance loss"
    if not any(eligible(layer) for layer in getattr(model, "layers", [])):
        return "no KDA layer"
    return None


class _Bound(nn.Module):
    """``layer(h, SeqContext())`` as a module of one tensor input (what ``make_graphed_callables`` takes); its
    parameters are the layer's."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.layer._megaseq_eager_forward(h, SeqContext())


@dataclass
class LayerGraphs:
    """A run's graphed layers: ``before_step`` captures them before the second step and says which calls of
    the step may replay; the layers' ``forward`` then replays (patched on the instance, so module names and
    state dicts stay as they are)."""

    model: nn.Module
    log: Any = None  # where a failed capture is said (None: nowhere)
    headroom: int | None = None  # GPU bytes the plan leaves below its budget, for the graphs (None: not held to it)
    failed: str | None = None  # why the capture failed or its graphs were dropped (the layers then run eagerly)
    pool_bytes: int = 0  # the graphs' own GPU memory, measured after the capture
    steps: int = 0
    shape: tuple[int, ...] | None = None  # the layer-boundary shape the graphs were captured at
    graphed: list[int] = field(default_factory=list)  # indices of the graphed layers
    capture_s: float = 0.0
    replays: int = 0
    _on: bool = False  # the current step may replay (one micro-batch without documents)

    def before_step(self, micro_batches: list[dict[str, torch.Tensor]]) -> None:
        self.steps += 1
        # one micro-batch without documents or positions (a packed batch's context has them: no replay, and no
        # capture, whose memory pool would stay reserved for nothing)
        self._on = len(micro_batches) == 1 and all(micro_batches[0].get(k) is None for k in ("doc_ids", "position_ids"))
        if self.steps == 2 and self.shape is None and self._on:
            self._capture(micro_batches[0])

    def _capture(self, batch: dict[str, torch.Tensor]) -> None:
        model = self.model
        device = model.lm_head.weight.device
        ids = batch["input_ids"].to(device)
        with torch.no_grad():
            h = model.embed(ids)
        shape, dtype = tuple(h.shape), h.dtype
        idx = [i for i, layer in enumerate(model.layers) if eligible(layer)]
        if not idx:
            return
        # the static gradient of every trained parameter and one input buffer per layer: a lower bound on the pool
        inputs = len(idx) * h.numel() * h.element_size()  # the samples below, the graphs' input buffers
        least = inputs + sum(p.numel() * p.element_size() for i in idx for p in model.layers[i].parameters()
                             if p.requires_grad)
        del h
        if self.headroom is not None and least > self.headroom:
            self._eager(f"their gradient and input buffers alone ({least / 2**30:.2f} GiB) exceed the plan's headroom "
                        f"({max(self.headroom, 0) / 2**30:.2f} GiB)", "not captured")
            return
        t0 = time.perf_counter()
        # what the layers' forwards leave on their modules (an MoE's loads): the capture leaves tensors of the
        # graphs' pool there, put back if the graphs are not kept, so none of their pool outlives them
        before = [stat for i in idx for stat in _statistics(model.layers[i])]
        for i in idx:
            layer = model.layers[i]
            layer._megaseq_eager_forward = layer.forward
        # the capture's backward accumulates into each parameter's gradient node: one a garbage cycle still holds
        # from an eager step belongs to the default stream, which a capture may not wait on. Collected first
        host_gc.collect_all()
        torch.cuda.synchronize(device)
        pools = private_pool_bytes(device)
        bound = tuple(_Bound(model.layers[i]) for i in idx)
        gen = torch.Generator(device=device).manual_seed(0)
        samples = tuple((torch.randn(shape, generator=gen, device=device, dtype=dtype).requires_grad_(),)
                        for _ in idx)
        stream = torch.cuda.current_stream(device)
        try:
            callables = torch.cuda.make_graphed_callables(bound, samples, num_warmup_iters=1,
                                                          allow_unused_input=True)
            torch.cuda.synchronize(device)
        except RuntimeError as e:  # an op that syncs with the host or copies from pageable memory: eager
            torch.cuda.set_stream(stream)  # a capture that raised leaves its own stream current
            self._restore(idx, before)
            self._eager(str(e).splitlines()[0][:300], "the capture failed")
            return
        # the graphs' memory: the segments of private pools that are new or grew, and the input buffers
        self.pool_bytes = inputs + sum(max(0, n - pools.get(pool, 0)) for pool, n in private_pool_bytes(device).items())
        if self.headroom is not None and self.pool_bytes > self.headroom:
            del callables, bound, samples
            self._restore(idx, before)
            gc.collect()  # the graphs' autograd functions and their closures, then their pool
            torch.cuda.synchronize(device)
            torch.cuda.empty_cache()
            self._eager(f"their memory ({self.pool_bytes / 2**30:.2f} GiB) exceeds the plan's headroom "
                        f"({max(self.headroom, 0) / 2**30:.2f} GiB)", "dropped")
            self.pool_bytes = 0
            return
        for i, graphed in zip(idx, callables, strict=True):
            stats = _statistics(model.layers[i])
            model.layers[i].forward = types.MethodType(
                _replaying(self, graphed, stats, list(model.layers[i].parameters())), model.layers[i])
        self.shape, self.graphed = shape, idx
        self.capture_s = time.perf_counter() - t0

    def _restore(self, idx: list[int], stats: list[tuple[nn.Module, str, torch.Tensor]]) -> None:
        """The layers as before the capture: their own forward, and the statistics their modules held."""
        for i in idx:
            del self.model.layers[i]._megaseq_eager_forward
        for m, k, v in stats:
            setattr(m, k, v)

    def _eager(self, why: str, what: str) -> None:
        self.failed = why
        if self.log is not None:
            self.log(f"CUDA graphs: {what} ({why}); the layers run eagerly")

    def replayable(self, h: torch.Tensor, ctx: SeqContext) -> bool:
        return (self._on and torch.is_grad_enabled() and tuple(h.shape) == self.shape and h.requires_grad
                and type(ctx) is SeqContext and ctx.doc_ids is None and ctx.position_ids is None
                and ctx.cp_size == 1)

    def summary(self) -> dict[str, Any]:
        return {"layers": list(self.graphed), "shape": list(self.shape) if self.shape else None,
                "capture_s": round(self.capture_s, 3), "replays": self.replays, "failed": self.failed,
                "pool_gib": round(self.pool_bytes / 2**30, 3)}


def private_pool_bytes(device: torch.device) -> dict[Any, int]:
    """The bytes the caching allocator holds on ``device`` in each private pool (CUDA graphs' memory), by pool."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    out: dict[Any, int] = {}
    for seg in torch.cuda.memory_snapshot():
        pool = tuple(seg.get("segment_pool_id") or (0, 0))
        if seg.get("device", index) == index and pool != (0, 0):
            out[pool] = out.get(pool, 0) + int(seg["total_size"])
    return out


def _statistics(layer: nn.Module) -> list[tuple[nn.Module, str, torch.Tensor]]:
    """The tensors a layer's forward leaves on its modules as plain attributes (an MoE's ``last_tokens_per_expert``,
    which the balancer and the metrics read), as they are now. Taken before a capture, they are put back if its
    graphs are not kept. Taken after it, they are the graph's memory, rewritten by every replay: an eager call
    between replays (an evaluation's forward, without autograd) points them elsewhere, and a replay points them
    back."""
    return [(m, k, v) for m in layer.modules() for k, v in vars(m).items() if isinstance(v, torch.Tensor)]


def _replaying(graphs: LayerGraphs, graphed: Any, stats: list[tuple[nn.Module, str, torch.Tensor]],
               params: list[nn.Parameter]) -> Any:
    # which parameters the graphs give gradients: the ones that trained at the capture (a run that freezes or
    # unfreezes some later, as the DSA indexer's dense warm-up does, runs the layer eagerly from then on)
    trained = [p.requires_grad for p in params]

    def forward(self: nn.Module, h: torch.Tensor, ctx: SeqContext) -> torch.Tensor:
        if graphs.replayable(h, ctx) and [p.requires_grad for p in params] == trained:
            graphs.replays += 1
            out = graphed(h)
            for m, k, v in stats:
                setattr(m, k, v)
            return out
        return self._megaseq_eager_forward(h, ctx)

    return forward


def for_run(enabled: bool, model: nn.Module, device: torch.device, world_size: int, memory: Any,
            autocast: torch.dtype | None, log: Any = None, headroom: int | None = None) -> LayerGraphs | None:
    """The run's ``LayerGraphs``, or None where ``why_not`` says (logged when ``log`` is given and graphs were
    asked for); ``headroom``: the plan's GPU budget less its peak, which the graphs' memory must fit in."""
    why = why_not(enabled, device, world_size, memory, autocast, model)
    if why is not None:
        if log is not None and enabled and device.type == "cuda":
            log(f"CUDA graphs: not used ({why})")
        return None
    return LayerGraphs(model, log, headroom)
