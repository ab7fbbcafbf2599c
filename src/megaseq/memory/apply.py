"""Apply a memory plan to a model from outside: the planner decides, the trainer calls this.

``MemoryPlan`` is what ``megaseq.plan`` produces (its ``memory`` dict has these field names) and what
``MemoryConfig`` forces when ``memory.auto`` is off. ``apply_memory_plan(model, plan)`` then:

- tiles every ``layer.mlp`` (dense MLP or MoE) over ``mlp_tile_tokens`` tokens (``tiling``);
- sets the DSA indexer's query chunk (``query_chunk`` on every module that has that attribute, and
  ``indexer_scoring.QUERY_CHUNK`` for indexers that read the module default);
- wraps every layer of ``model.layers`` in full recompute, with SCO boundary offload up to
  ``offload_host_budget`` host bytes when ``checkpoint_offload`` (``offload``);
- checks that the model can run sequence segments (``model_segment_tokens``; the trainer's step runs
  them, ``model_segments.segmented_loss_backward``).

The vocabulary loss and the optimizer are the trainer's to build: ``loss_fn(plan)`` and
``make_optimizer(params, plan, ...)`` return the planned ones. Applying again with another plan
replaces the previous one (nothing stacks). Models follow docs/architecture.md: ``model.layers`` is a
ModuleList of ``layer(h, ctx)``, and ``layer.mlp`` is token-separable.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from megaseq.memory import indexer_scoring
from megaseq.memory.kda_segments import enable_kda_segments
from megaseq.memory.offload import BoundaryOffloader, checkpoint_layers, uncheckpoint_layer
from megaseq.memory.offload_adam import OffloadStreamAdamW
from megaseq.memory.tiling import disable_tiling, enable_tiling
from megaseq.memory.vocab_loss import linear_cross_entropy


@dataclass
class MemoryPlan:
    """The exact memory schemes to apply, and their chunk sizes (``MemoryConfig`` has the help text)."""

    chunked_loss: bool = False
    loss_chunk_tokens: int = 8192
    tiled_mlp: bool = False
    mlp_tile_tokens: int = 16384
    indexer_query_chunk: int = 1024
    recompute: bool = False
    checkpoint_offload: bool = False
    offload_host_budget: int = 0
    optimizer_offload: bool = False
    optimizer_bucket_params: int = 100_000_000
    kda_segment_tokens: int = 0  # 0: off
    model_segment_tokens: int = 0  # 0: off; sequence segments (memory/model_segments.py), run by the trainer
    segment_keep_selection: bool = False  # sequence segments keep the forward pass's DSA selections

    def __post_init__(self) -> None:
        for name in ("loss_chunk_tokens", "mlp_tile_tokens", "indexer_query_chunk",
                     "optimizer_bucket_params"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"memory.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("kda_segment_tokens", "model_segment_tokens"):
            if int(getattr(self, name)) < 0:
                raise ValueError(f"memory.{name} must be >= 0 (0: off), got {getattr(self, name)}")
        if int(self.model_segment_tokens):
            on = [f"memory.{k}" for k in ("recompute", "checkpoint_offload", "kda_segment_tokens") if getattr(self, k)]
            if on:
                from megaseq.memory.model_segments import check_model_segments

                check_model_segments("glm5_next", int(self.model_segment_tokens), layer_schemes=tuple(on))
        if self.offload_host_budget < 0:
            raise ValueError(f"memory.offload_host_budget must be >= 0, got {self.offload_host_budget}")
        if self.checkpoint_offload and not self.recompute:
            raise ValueError("memory.checkpoint_offload needs memory.recompute: set --memory.recompute true")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> MemoryPlan:
        """From the planner's ``Plan.memory`` or a ``MemoryConfig`` (extra keys such as budgets ignored)."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


@dataclass
class AppliedMemory:
    """What ``apply_memory_plan`` did: keep it to release the SCO host pool at the end of a run."""

    plan: MemoryPlan
    offloader: BoundaryOffloader | None = None
    tiled: list[str] = field(default_factory=list)  # names of the tiled modules
    query_chunked: list[str] = field(default_factory=list)  # modules given a query_chunk
    checkpointed: int = 0  # layers under full recompute
    kda_segmented: int = 0  # tokens per KDA segment (0: off)
    model_segmented: int = 0  # tokens per sequence segment (0: off)

    def release(self) -> None:
        """Free the SCO pinned pool (re-planned on demand if training continues)."""
        if self.offloader is not None:
            self.offloader.release()


def _layers(model: nn.Module) -> list[nn.Module]:
    layers = getattr(model, "layers", None)
    if not isinstance(layers, (nn.ModuleList, list, tuple)):
        raise ValueError(f"{type(model).__name__} has no `layers` ModuleList: memory plans need the "
                         "CausalLM interface of docs/architecture.md")
    return list(layers)


def apply_memory_plan(model: nn.Module, plan: MemoryPlan) -> AppliedMemory:
    """Install ``plan``'s tiling, indexer chunking, recompute and SCO on ``model`` (in place)."""
    layers = _layers(model)
    done = AppliedMemory(plan)
    for i, layer in enumerate(layers):
        mlp = getattr(layer, "mlp", None)
        if mlp is None:
            continue
        if hasattr(layer, "token_tile"):
            # a layer that tiles all its token-separable parts (GLM-5: mHC, norms, merge and MLP/MoE)
            # covers the MLP too; tiling the MLP inside it again would run the MoE forward three times
            layer.token_tile = int(plan.mlp_tile_tokens) if plan.tiled_mlp else None
            disable_tiling(mlp)
            if plan.tiled_mlp:
                done.tiled.append(f"layers.{i}")
        elif plan.tiled_mlp:
            enable_tiling(mlp, int(plan.mlp_tile_tokens))
            done.tiled.append(f"layers.{i}.mlp")
        else:
            disable_tiling(mlp)
    for name, module in model.named_modules():
        if hasattr(module, "query_chunk"):
            module.query_chunk = int(plan.indexer_query_chunk)
            done.query_chunked.append(name)
    indexer_scoring.QUERY_CHUNK = int(plan.indexer_query_chunk)
    segments = int(plan.kda_segment_tokens) or None
    if enable_kda_segments(model, segments) and segments:
        done.kda_segmented = segments
    if int(plan.model_segment_tokens):
        from megaseq.memory.model_segments import check_model_segments

        family = getattr(getattr(model, "spec", None), "family", type(model).__name__)
        check_model_segments(family, int(plan.model_segment_tokens))
        done.model_segmented = int(plan.model_segment_tokens)
    if plan.recompute:
        offloader = BoundaryOffloader(int(plan.offload_host_budget)) if plan.checkpoint_offload else None
        done.offloader = checkpoint_layers(layers, offloader)
        done.checkpointed = len(layers)
    else:
        for layer in layers:
            uncheckpoint_layer(layer)
    return done


def loss_fn(plan: MemoryPlan) -> Callable[..., torch.Tensor]:
    """``fn(hidden, weight, labels, ignore_index=-100, reduction="mean", num_items=None)``: the planned
    vocabulary loss (chunked when ``plan.chunked_loss``)."""
    chunk = int(plan.loss_chunk_tokens) if plan.chunked_loss else None
    return functools.partial(linear_cross_entropy, chunk_tokens=chunk)


def make_optimizer(params: Iterable[Any], plan: MemoryPlan, lr: float, betas: tuple[float, float],
                   eps: float, weight_decay: float) -> torch.optim.Optimizer:
    """OffloadStreamAdamW when the plan offloads the optimizer, else ``torch.optim.AdamW`` (fused on CUDA).

    ``params``: tensors or parameter groups. With the offloaded optimizer each gradient moves to the host
    as soon as backward produces it, so the model's gradients never all sit on the GPU; clip with
    ``optimizer.clip_grad_norm_`` (gradients live on the host)."""
    params = list(params)
    if plan.optimizer_offload:
        # under sequence segments every gradient arrives once per segment: keep them on the GPU until the
        # step (a hook would send each one down and back once per segment)
        return OffloadStreamAdamW(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                  bucket_params=int(plan.optimizer_bucket_params),
                                  grads_in_backward=not int(plan.model_segment_tokens))
    flat = [p for g in params for p in (g["params"] if isinstance(g, dict) else [g])]
    on_cuda = bool(flat) and all(p.is_cuda for p in flat)
    return torch.optim.AdamW(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                             fused=True if on_cuda else None, foreach=None if on_cuda else False)
