"""AdamW with linear warmup and cosine decay, and the parameter groups it updates.

Weight decay applies to matrices only: norms, biases, router biases, gates' base/scale vectors
and the KDA decay parameters (all 1-D) are not decayed, as in the reference recipes.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from megaseq.config import MemorySettings, OptimConfig
from megaseq.memory.apply import make_optimizer


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    decay, no_decay = [], []
    for _, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (decay if p.dim() >= 2 else no_decay).append(p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def lr_lambda(step: int, total_steps: int, warmup_steps: int, min_lr_ratio: float) -> float:
    """Multiplier of the peak LR at optimizer step ``step`` (0-based)."""
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    decay_steps = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_optimizer(model: torch.nn.Module, cfg: OptimConfig, total_steps: int, memory: MemorySettings,
                    accumulate: bool = False,
                    distributed: bool = False) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """The planned optimizer (AdamW, MasterAdamW for bf16 weights, or OffloadStreamAdamW) over decay /
    no-decay groups, and its schedule (``memory.apply.make_optimizer``: ``accumulate``, ``distributed``)."""
    opt = make_optimizer(param_groups(model, cfg.weight_decay), memory, lr=cfg.lr, betas=tuple(cfg.betas),
                         eps=cfg.eps, weight_decay=cfg.weight_decay, accumulate=accumulate, distributed=distributed)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: lr_lambda(s, total_steps, cfg.warmup_steps, cfg.min_lr_ratio)
    )
    return opt, sched
