"""The runtime side of a memory plan: the wrappers a family's ``parallelize`` applies from outside the model.

The planner chooses ``MemorySettings`` (``megaseq.plan``), the trainer hands them to the family's
``parallelize(model, settings, env)`` (``models/<family>/parallelize.py``), which knows its own layers and
calls the appliers here and in the scheme modules:

- tiling: ``tiling.tile_layer`` (a layer's token-separable parts) or ``tiling.enable_tiling`` (the MLP);
- the DSA indexer's scoring chunk (its ``query_chunk``, the op's working-set bound);
- segmented KDA: ``kda_segments.segment`` on each KDA mixer;
- sequence segments: checked here, run by the trainer's step (``model_segments.segmented_loss_backward``);
- full recompute with SCO boundary offload: ``recompute_layers``;
- a frozen base streamed from pinned host memory: ``stream_base`` (before recompute, so the rerun streams too).

The vocabulary loss and the optimizer are the trainer's to build: ``loss_fn(settings)`` and
``make_optimizer(params, settings, ...)`` return the planned ones (OffloadStreamAdamW, MasterAdamW for bf16
weights, or torch's AdamW). FSDP2 (``parallel.fsdp``) is applied last by the family's ``parallelize``.
Applying again with other settings replaces the previous ones (nothing stacks).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from megaseq.config import MemorySettings
from megaseq.memory import tiling
from megaseq.memory.offload import (
    BoundaryOffloader,
    KeptHostStore,
    checkpoint_layers,
    kept_host_store,
    uncheckpoint_layer,
)
from megaseq.memory.offload_adam import OffloadStreamAdamW
from megaseq.memory.rules import check_model_segments, check_stream_base, kept_attention_layers
from megaseq.memory.stream_base import BaseStreamer, stream_layers, unstream_layers
from megaseq.memory.vocab_loss import linear_cross_entropy
from megaseq.models.common.prenorm import PreNormDecoderLayer
from megaseq.ops import switches


@dataclass
class AppliedMemory:
    """What a ``parallelize`` applied: keep it to release the SCO host pool at the end of a run."""

    settings: MemorySettings
    offloader: BoundaryOffloader | None = None
    tiled: list[str] = field(default_factory=list)  # names of the tiled layers or modules
    query_chunked: list[str] = field(default_factory=list)  # indexers given a query_chunk
    checkpointed: int = 0  # layers under full recompute
    kept_attention: int = 0  # of those, the last ones keeping attention's output for the rerun
    kept_attention_host: int = 0  # of those, the first ones keeping it in pinned host memory
    kept_host: KeptHostStore | None = None  # their host store (its pool released with ``release``)
    kda_segmented: int = 0  # tokens per KDA segment (0: off)
    model_segmented: int = 0  # tokens per sequence segment (0: off)
    sharded: Any = None  # what FSDP sharded (``parallel.fsdp.ShardedModel``), None when nothing is
    adapters: list[str] = field(default_factory=list)  # projections given LoRA adapters (models.common.lora)
    streamed: str = ""  # the frozen base streamed from host memory: "layers" (BaseStreamer), "fsdp", "" (off)
    streamer: BaseStreamer | None = None  # the one-process streamer (its residency counts)

    def start_counts(self) -> None:
        """Start counting a step's scheme events (``counts``)."""
        if self.offloader is not None:
            self.offloader.num_offloaded = 0
        if self.streamer is not None:
            self.streamer.peak_resident = len(self.streamer.resident)

    def counts(self) -> dict[str, int]:
        """Since ``start_counts``: the layer inputs SCO put in host memory (``offloaded_layers``, every forward
        summed) and the most streamed layers on the device at once (``streamed_layers_resident``), for the
        schemes applied: what a step record sets beside the plan's figures."""
        out = {}
        if self.offloader is not None:
            out["offloaded_layers"] = self.offloader.num_offloaded
        if self.streamer is not None:
            out["streamed_layers_resident"] = self.streamer.peak_resident
        return out

    def release(self) -> None:
        """Free the SCO pinned pool and the host-kept attention outputs' pool (each re-planned on demand if
        training continues)."""
        if self.offloader is not None:
            self.offloader.release()
        if self.kept_host is not None:
            self.kept_host.release()


def begin(layers: Iterable[nn.Module], settings: MemorySettings) -> AppliedMemory:
    """Start applying ``settings``: the combination checked, a previous recompute taken off every layer (so
    the per-layer wrappers install on the layers' own forwards)."""
    settings.check_combination()
    for layer in layers:
        uncheckpoint_layer(layer)
    unstream_layers(layers)
    return AppliedMemory(settings)


def check_segments(family: str, settings: MemorySettings, done: AppliedMemory, cp: int = 1) -> None:
    """Sequence segments run in the trainer's step; what they cannot run is refused here, before it."""
    if settings.model_segment_tokens:
        check_model_segments(family, settings.model_segment_tokens, cp)
        done.model_segmented = settings.model_segment_tokens


def stream_base(layers: list[nn.Module], settings: MemorySettings, done: AppliedMemory, env: Any = None) -> None:
    """The frozen base of ``layers`` in pinned host memory when ``settings.stream_base``: under FSDP
    (``env.fsdp``) torch's ``CPUOffloadPolicy`` on each block, applied by ``parallel.fsdp.apply_fsdp``; else
    ``stream_base.stream_layers`` to ``env.device`` (default: where the layers are). Before ``recompute_layers``."""
    if not settings.stream_base:
        return
    check_stream_base(any(not p.requires_grad for layer in layers for p in layer.parameters()),
                      int(getattr(env, "ep_size", 1)))
    if getattr(env, "fsdp", None) not in (None, "off"):
        done.streamed = "fsdp"
        return
    device = getattr(env, "device", None) or next(p.device for layer in layers for p in layer.parameters())
    done.streamer = stream_layers(layers, device)
    done.streamed = "layers"


def recompute_layers(layers: list[nn.Module], settings: MemorySettings, done: AppliedMemory) -> None:
    """Full recompute of every layer, with SCO boundary offload up to ``offload_host_budget`` host bytes
    when ``checkpoint_offload`` and the last ``keep_attention_layers`` keeping attention's output (the first
    ``keep_attention_host_layers`` of them in pinned host memory); the last step of a ``parallelize`` (it wraps
    the layers' forwards)."""
    if not settings.recompute:
        return
    offloader = BoundaryOffloader(settings.offload_host_budget) if settings.checkpoint_offload else None
    done.offloader = checkpoint_layers(layers, offloader, settings.keep_attention_layers,
                                       settings.keep_attention_host_layers)
    done.checkpointed = len(layers)
    on_host, on_gpu = kept_attention_layers(len(layers), settings.keep_attention_layers,
                                            settings.keep_attention_host_layers)
    done.kept_attention, done.kept_attention_host = len(on_host) + len(on_gpu), len(on_host)
    done.kept_host = kept_host_store(layers)


def apply_prenorm(model: nn.Module, settings: MemorySettings, env: Any = None,
                  mixer_schemes: Callable[[int, nn.Module, AppliedMemory], None] | None = None) -> AppliedMemory:
    """The schemes of a family of ``models.common.prenorm`` layers (``h + mixer(norm(h))``, then
    ``h + mlp(norm(h))``): ``tiled_mlp`` tiles each layer's MLP/MoE, ``recompute`` (+ SCO) every layer;
    ``mixer_schemes(i, mixer, done)`` applies a family's own mixer settings (a KDA segment size, an indexer's
    query chunk); sequence segments are checked against the family. A family's ``parallelize`` calls it."""
    layers = list(model.layers)
    done = begin(layers, settings)
    for i, layer in enumerate(layers):
        tiling.disable_tiling(layer.mlp)
        if settings.tiled_mlp:
            # a pre-norm layer adds its MLP's output to the residual and reads it nowhere else
            residual_only = type(layer).forward is PreNormDecoderLayer.forward
            tiling.enable_tiling(layer.mlp, settings.mlp_tile_tokens, residual_only=residual_only)
            done.tiled.append(f"layers.{i}.mlp")
        if mixer_schemes is not None:
            mixer_schemes(i, layer.mixer, done)
    check_segments(model.spec.family, settings, done, env_cp(env))
    stream_base(layers, settings, done, env)
    recompute_layers(layers, settings, done)
    return done


def env_cp(env: Any) -> int:
    """The context-parallel size of a ``parallel.env.ParallelEnv`` (1 without one)."""
    return int(getattr(env, "cp_size", 1)) if env is not None else 1


def loss_fn(settings: MemorySettings) -> Callable[..., torch.Tensor]:
    """``fn(hidden, weight, labels, ignore_index=-100, reduction="mean", num_items=None)``: the planned
    vocabulary loss (chunked when ``settings.chunked_loss``)."""
    chunk = settings.loss_chunk_tokens if settings.chunked_loss else None
    return functools.partial(linear_cross_entropy, chunk_tokens=chunk)


def master_kernel(on_cuda: bool) -> str:
    """MasterAdamW's step: ``triton`` (``ops.adamw.fused``) on CUDA where Triton is installed, unless
    ``MEGASEQ_ADAMW=torch``; else torch's fused AdamW with its casts and copies around it."""
    choice = switches.adamw_kernel()
    from megaseq.ops.adamw import fused as triton_adamw

    return "triton" if choice == "triton" and on_cuda and triton_adamw.available() else "torch"


def make_optimizer(params: Iterable[Any], settings: MemorySettings, lr: float, betas: tuple[float, float],
                   eps: float, weight_decay: float, accumulate: bool = False,
                   distributed: bool = False) -> torch.optim.Optimizer:
    """OffloadStreamAdamW when the settings offload the optimizer; ``MasterAdamW`` (fp32 master weights and
    moments beside them; fused on CUDA for its whole tensors) when some weights are narrower than fp32
    (``model.weights bf16``); else
    ``torch.optim.AdamW`` (fused on CUDA; ``master_adam.SplitAdamW`` when DTensors and whole parameters mix,
    as under expert parallelism).

    ``params``: tensors or parameter groups (FSDP2 shards included). With the offloaded optimizer each
    gradient moves to the host as soon as backward produces it, so the model's gradients never all sit on the
    GPU; clip with ``optimizer.clip_grad_norm_`` (gradients live on the host). ``accumulate``: a step has
    several backward passes (micro-batches, sequence segments), whose gradients MasterAdamW sums in fp32;
    ``distributed``: several ranks, so only FSDP's shards (complete when FSDP hands them over) may leave
    ``.grad`` before the whole parameters and the expert-parallel experts are all-reduced
    (``master_adam.complete_in_backward``)."""
    from megaseq.memory.master_adam import MasterAdamW, SplitAdamW, complete_in_backward, mixes_dtensors

    params = list(params)
    flat = [p for g in params for p in (g["params"] if isinstance(g, dict) else [g])]
    if settings.optimizer_offload:
        # under sequence segments every gradient arrives once per segment: keep them on the GPU until the
        # step (a hook would send each one down and back once per segment), their sums in fp32 as MasterAdamW's;
        # on several ranks only FSDP's shards are complete when the backward leaves them
        return OffloadStreamAdamW(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                  bucket_params=settings.optimizer_bucket_params,
                                  grads_in_backward=not settings.model_segment_tokens,
                                  hookable=complete_in_backward if distributed else None, accumulate=accumulate)
    on_cuda = bool(flat) and all(p.is_cuda for p in flat)
    if any(p.dtype in (torch.bfloat16, torch.float16) for p in flat):
        return MasterAdamW(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                           foreach=None if on_cuda else False, accumulate=accumulate,
                           foldable=complete_in_backward if distributed else None, fused=on_cuda,
                           kernel=master_kernel(on_cuda))
    adamw = SplitAdamW if mixes_dtensors(flat) else torch.optim.AdamW  # expert parallelism: fused per kind
    return adamw(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                 fused=True if on_cuda else None, foreach=None if on_cuda else False)
