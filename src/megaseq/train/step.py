"""One optimizer step: the forward and backward of each micro-batch (whole, or in sequence segments), the
gradients reduced over the ranks, clipped, and the update applied only when the loss and the gradient norm are
finite (``guard``).

``StepState`` holds what every step of a run uses (the model, its optimizer and schedule, the process's
``ParallelEnv``, the memory settings, the autocast dtype and the MoE ``Balancer``); ``train_step(state,
micro_batches)`` runs one step of it. The loss is a mean over every token of the global batch, so a step over
dp x cp ranks and ``grad_accum`` micro-batches equals the one-process step over the same tokens.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch

from megaseq.config import Config, MemorySettings
from megaseq.train import guard, host_gc, indexer_training
from megaseq.train.balance import Balancer
from megaseq.train.parallel_env import ParallelEnv


@dataclass
class StepState:
    """What every optimizer step of a run uses; built once per run (``StepState.of``)."""

    model: torch.nn.Module
    optimizer: Any
    scheduler: Any  # stepped once per optimizer step, skipped steps included
    env: ParallelEnv  # the process's ranks: reductions, loss over the cp group, devices
    memory: MemorySettings  # the run's memory schemes (chunked loss, sequence segments)
    grad_clip: float = 1.0  # optim.grad_clip (0: not clipped)
    on_nonfinite: str = "stop"  # train.on_nonfinite: stop (raise guard.NonFiniteStep) or skip
    autocast: torch.dtype | None = None  # the autocast dtype (None: none)
    balancer: Balancer | None = None  # the MoE routers' balancing (aux loss, bias update)
    graphs: Any = None  # the layers replayed as CUDA graphs (train.layer_graphs.LayerGraphs), or None

    @classmethod
    def of(cls, cfg: Config, model: torch.nn.Module, optimizer: Any, scheduler: Any, env: ParallelEnv,
           memory: MemorySettings, autocast: torch.dtype | None = None,
           balancer: Balancer | None = None, headroom: int | None = None) -> StepState:
        """The state of a run under ``cfg`` (its ``optim.grad_clip``, ``train.on_nonfinite`` and
        ``model.cuda_graphs``); ``headroom``: the plan's GPU budget less its peak, which the CUDA graphs' memory
        must fit in (``train.layer_graphs``)."""
        from megaseq.train import layer_graphs

        graphs = layer_graphs.for_run(cfg.model.cuda_graphs, model, env.device, env.world_size, memory, autocast,
                                      env.log, headroom)
        return cls(model, optimizer, scheduler, env, memory, cfg.optim.grad_clip, cfg.train.on_nonfinite,
                   autocast, balancer, graphs)


def _autocast(dtype: torch.dtype | None, device: torch.device) -> contextlib.AbstractContextManager:
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def train_step(state: StepState, micro_batches: list[dict[str, torch.Tensor]],
               progress: Any = None) -> tuple[float, float]:
    """One optimizer step over ``grad_accum`` micro-batches; returns (mean loss, grad norm). ``progress``
    (pass, done, total) hears of each sequence segment when the plan runs them; the balancer reduces the
    routers' loads after each forward (the aux loss's gradient) and updates the biases after the step. A
    non-finite loss or gradient norm never reaches the weights (nor the router biases):
    ``guard.NonFiniteStep`` is raised (``train.on_nonfinite stop``) or the step is skipped (``skip``:
    gradients dropped, the schedule moves on, the values returned)."""
    model, optimizer, env, balancer = state.model, state.optimizer, state.env, state.balancer
    if state.graphs is not None:
        state.graphs.before_step(micro_batches)
    local = sum(int((b["labels"] != -100).sum()) for b in micro_batches)
    total = env.all_reduce_count(local)  # the loss is a mean over every token of the global batch
    indexer_training.loss_scale(model, total)  # the indexers' KL term is a mean over the same tokens
    loss_sum = _backward(state, micro_batches, total, progress)
    env.reduce_gradients(model)
    # with MasterAdamW in one process the update is launched before the loss and norm are read back (it writes
    # nothing for a non-finite step); otherwise they are checked on the host first
    on_device = getattr(optimizer, "guards_on_device", False) and env.world_size == 1
    if on_device:
        loss, grad_norm = _update_guarded_on_device(state, loss_sum, total)
    else:
        grad_norm = float(_clip(model, optimizer, state.grad_clip, env))
        loss = env.all_reduce_sum(float(loss_sum)) / max(total, 1)
    if not guard.is_finite_step(loss, grad_norm):  # no update reached the weights: they stay as they were
        optimizer.zero_grad(set_to_none=True)
        if balancer is not None:
            balancer.drop_step()
        if state.on_nonfinite != "skip":
            raise guard.NonFiniteStep(loss, grad_norm)
        state.scheduler.step()
        return loss, grad_norm
    if not on_device:
        optimizer.step()
        host_gc.between_steps()  # while the GPU runs the update
    if balancer is not None:
        balancer.after_step()
    state.scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return loss, grad_norm


def _backward(state: StepState, micro_batches: list[dict[str, torch.Tensor]], total: int, progress: Any) -> Any:
    """Forward and backward of each micro-batch, each loss scaled by 1 / ``total``; returns the summed loss
    (a float64 tensor, or a float after sequence segments), not read back."""
    model, env, memory, autocast = state.model, state.env, state.memory, state.autocast
    after_forward = state.balancer.after_forward if state.balancer is not None else None
    chunk = memory.loss_chunk_tokens if memory.chunked_loss else None
    loss_sum: Any = 0.0
    segment = memory.model_segment_tokens
    for batch in micro_batches:
        b = env.to_device(batch)
        if segment and b["input_ids"].shape[1] * env.cp_size > segment:  # sequence segments (memory/model_segments.py)
            loss_sum += float(_segmented_step(model, b, env, autocast, chunk, segment, total, progress,
                                              memory.segment_keep_selection, after_forward,
                                              kv_host=memory.segment_kv_host))
            continue
        with _autocast(autocast, env.device):
            hidden = model(b["input_ids"], doc_ids=b.get("doc_ids"), ctx=env.context(b))
        loss = _loss_sum(model, hidden, b["labels"], env, autocast, chunk)
        if after_forward is not None:
            after_forward()
        (loss / max(total, 1)).backward()
        loss_sum = loss_sum + loss.detach().double()  # read back once, after the update is launched
    return loss_sum


def _update_guarded_on_device(state: StepState, loss_sum: Any, total: int) -> tuple[float, float]:
    """Norm, clip and update launched behind the backward with the step's finiteness as a device flag
    (``MasterAdamW.step(finite=...)``: a non-finite step leaves weights, moments and step counters as they
    were), then ``(loss, grad norm)`` read back in one host sync, after them: the GPU does not wait for the host
    between the backward and the update."""
    norm = _clip(state.model, state.optimizer, state.grad_clip, state.env)
    loss_t = torch.as_tensor(loss_sum, dtype=torch.float64).to(norm.device) / max(total, 1)
    state.optimizer.step(finite=torch.isfinite(loss_t) & torch.isfinite(norm))
    host_gc.between_steps()  # while the GPU runs the update, before the read-back waits for it
    loss, grad_norm = torch.stack([loss_t, norm.to(torch.float64)]).tolist()
    return loss, grad_norm


def _clip(model: torch.nn.Module, optimizer: Any, max_norm: float, env: ParallelEnv) -> torch.Tensor:
    """The global gradient norm (a tensor, not read back), the gradients clipped to ``max_norm`` (0: not
    clipped): the optimizer's own clip when it holds the gradients (OffloadStreamAdamW, MasterAdamW), the
    shard-aware one when some parameters are DTensors (FSDP's shards; under expert parallelism the routed
    experts, ``Shard(0)`` over the ep axis: each one's squares are summed over its sharded mesh dims), else the
    environment's."""
    from megaseq.memory.master_adam import clip_grad_norm_, is_dtensor

    limit = max_norm if max_norm > 0 else float("inf")
    if hasattr(optimizer, "clip_grad_norm_"):
        return optimizer.clip_grad_norm_(limit)
    params = [p for p in model.parameters() if p.grad is not None]
    if any(is_dtensor(p) for p in params):
        return clip_grad_norm_(params, limit)
    return env.clip_grad_norm(params, max_norm)


def _loss_sum(model: torch.nn.Module, hidden: torch.Tensor, labels: torch.Tensor, env: ParallelEnv,
              autocast: torch.dtype | None, chunk: int | None) -> torch.Tensor:
    """The summed loss of ``hidden``: Ring-DTP over the context-parallel group when cp > 1, else the
    (chunked) local loss; under autocast the vocabulary projection in the compute dtype, as lm_head would
    run (the losses accumulate in fp32)."""
    head = model.lm_head.weight
    if autocast is not None:
        hidden, head = hidden.to(autocast), head.to(autocast)
    return env.loss_sum(hidden, head, labels, chunk)


def _segmented_step(model: torch.nn.Module, b: dict[str, torch.Tensor], env: ParallelEnv,
                    autocast: torch.dtype | None, chunk: int | None, segment: int, total: int,
                    progress: Any = None, keep_selection: bool = False, after_forward: Any = None,
                    kv_host: bool = False) -> torch.Tensor:
    """Forward + backward of one micro-batch in sequence segments; returns its loss sum (no graph). Under
    cp the shard is this rank's piece of every segment (``env.shard_batch(batch, segment)``)."""
    from megaseq.memory.model_segments import segmented_loss_backward  # its settings checked when applied

    def loss_fn(hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return _loss_sum(model, hidden, labels, env, autocast, chunk)

    def contexts(lo: int, hi: int) -> Any:  # the cp group's context of rows [lo, hi) of this shard
        return env.context({k: v[:, lo:hi] for k, v in b.items() if k in ("input_ids", "doc_ids", "position_ids")})

    with _autocast(autocast, env.device):
        return segmented_loss_backward(model, b["input_ids"], b["labels"], loss_fn, 1.0 / max(total, 1), segment,
                                       progress, doc_ids=b.get("doc_ids"), keep_selection=keep_selection,
                                       cp=env.cp_size, contexts=contexts if env.cp_size > 1 else None,
                                       after_forward=after_forward, kv_host=kv_host)

