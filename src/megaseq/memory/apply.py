"""The runtime side of a memory plan: the wrappers a family's ``parallelize`` applies from outside the model.

The planner chooses ``MemorySettings`` (``megaseq.plan``), the trainer hands them to the family's
``parallelize(model, settings, env)`` (``models/<family>/parallelize.py``), which knows its own layers and
calls the appliers here and in the scheme modules:

- tiling: ``tiling.tile_layer`` (a layer's token-separable parts) or ``tiling.enable_tiling`` (the MLP);
- the DSA indexer's scoring chunk (its ``query_chunk``, the op's working-set bound);
- segmented KDA: ``kda_segments.segment`` on each KDA mixer;
- sequence segments: checked here, run by the trainer's step (``model_segments.segmented_loss_backward``);
- full recompute with SCO boundary offload: ``recompute_layers``.

The vocabulary loss and the optimizer are the trainer's to build: ``loss_fn(settings)`` and
``make_optimizer(params, settings, ...)`` return the planned ones. Applying again with other settings
replaces the previous ones (nothing stacks).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from megaseq.config import MemorySettings
from megaseq.memory.offload import BoundaryOffloader, checkpoint_layers, uncheckpoint_layer
from megaseq.memory.offload_adam import OffloadStreamAdamW
from megaseq.memory.vocab_loss import linear_cross_entropy
from megaseq.plan.fixes import check_model_segments


@dataclass
class AppliedMemory:
    """What a ``parallelize`` applied: keep it to release the SCO host pool at the end of a run."""

    settings: MemorySettings
    offloader: BoundaryOffloader | None = None
    tiled: list[str] = field(default_factory=list)  # names of the tiled layers or modules
    query_chunked: list[str] = field(default_factory=list)  # indexers given a query_chunk
    checkpointed: int = 0  # layers under full recompute
    kda_segmented: int = 0  # tokens per KDA segment (0: off)
    model_segmented: int = 0  # tokens per sequence segment (0: off)
    adapters: list[str] = field(default_factory=list)  # projections given LoRA adapters (models.common.lora)

    def release(self) -> None:
        """Free the SCO pinned pool (re-planned on demand if training continues)."""
        if self.offloader is not None:
            self.offloader.release()


def begin(layers: Iterable[nn.Module], settings: MemorySettings) -> AppliedMemory:
    """Start applying ``settings``: the combination checked, a previous recompute taken off every layer (so
    the per-layer wrappers install on the layers' own forwards)."""
    settings.check_combination()
    for layer in layers:
        uncheckpoint_layer(layer)
    return AppliedMemory(settings)


def check_segments(family: str, settings: MemorySettings, done: AppliedMemory, cp: int = 1) -> None:
    """Sequence segments run in the trainer's step; what they cannot run is refused here, before it."""
    if settings.model_segment_tokens:
        check_model_segments(family, settings.model_segment_tokens, cp)
        done.model_segmented = settings.model_segment_tokens


def recompute_layers(layers: list[nn.Module], settings: MemorySettings, done: AppliedMemory) -> None:
    """Full recompute of every layer, with SCO boundary offload up to ``offload_host_budget`` host bytes
    when ``checkpoint_offload``; the last step of a ``parallelize`` (it wraps the layers' forwards)."""
    if not settings.recompute:
        return
    offloader = BoundaryOffloader(settings.offload_host_budget) if settings.checkpoint_offload else None
    done.offloader = checkpoint_layers(layers, offloader)
    done.checkpointed = len(layers)


def env_cp(env: Any) -> int:
    """The context-parallel size of a ``parallel.env.ParallelEnv`` (1 without one)."""
    return int(getattr(env, "cp_size", 1)) if env is not None else 1


def loss_fn(settings: MemorySettings) -> Callable[..., torch.Tensor]:
    """``fn(hidden, weight, labels, ignore_index=-100, reduction="mean", num_items=None)``: the planned
    vocabulary loss (chunked when ``settings.chunked_loss``)."""
    chunk = settings.loss_chunk_tokens if settings.chunked_loss else None
    return functools.partial(linear_cross_entropy, chunk_tokens=chunk)


def make_optimizer(params: Iterable[Any], settings: MemorySettings, lr: float, betas: tuple[float, float],
                   eps: float, weight_decay: float) -> torch.optim.Optimizer:
    """OffloadStreamAdamW when the settings offload the optimizer, else ``torch.optim.AdamW`` (fused on CUDA).

    ``params``: tensors or parameter groups. With the offloaded optimizer each gradient moves to the host
    as soon as backward produces it, so the model's gradients never all sit on the GPU; clip with
    ``optimizer.clip_grad_norm_`` (gradients live on the host)."""
    params = list(params)
    if settings.optimizer_offload:
        # under sequence segments every gradient arrives once per segment: keep them on the GPU until the
        # step (a hook would send each one down and back once per segment)
        return OffloadStreamAdamW(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                  bucket_params=settings.optimizer_bucket_params,
                                  grads_in_backward=not settings.model_segment_tokens)
    flat = [p for g in params for p in (g["params"] if isinstance(g, dict) else [g])]
    on_cuda = bool(flat) and all(p.is_cuda for p in flat)
    return torch.optim.AdamW(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                             fused=True if on_cuda else None, foreach=None if on_cuda else False)
