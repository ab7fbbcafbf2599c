"""AdamW with linear warmup and cosine decay, and the parameter groups it updates.

Weight decay applies to matrices only: norms, biases, router biases, gates' base/scale vectors
and the KDA decay parameters (all 1-D) are not decayed, as in the reference recipes. The DSA indexers, when they
train on their KL objective, are groups of their own with AdamW's epsilon times the objective's coefficient
(``indexer_training.adam_groups``).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from megaseq.config import MemorySettings, OptimConfig
from megaseq.memory.apply import make_optimizer


def param_groups(model: torch.nn.Module, weight_decay: float, eps: float = 1e-8) -> list[dict[str, Any]]:
    """Decayed (2-D and up) and undecayed trainable parameters; the trained indexers' in groups of their own, with
    ``eps`` times their objective's coefficient (only where an indexer trains: other runs keep their two groups)."""
    from megaseq.train import indexer_training

    own = indexer_training.adam_groups(model)
    ids, coef = own if own is not None else (set(), 1.0)
    decay, no_decay, ix_decay, ix_no_decay = [], [], [], []
    for _, p in model.named_parameters():
        if not p.requires_grad:
            continue
        mine = id(p) in ids
        if p.dim() >= 2:
            (ix_decay if mine else decay).append(p)
        else:
            (ix_no_decay if mine else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    if own is None:
        return groups
    # an empty group would come back from a checkpoint without its hyperparameters (torch's DCP maps groups by
    # their parameters' names), so a run with indexer groups keeps only the groups that hold parameters
    groups += [{"params": ix_decay, "weight_decay": weight_decay, "eps": eps * coef},
               {"params": ix_no_decay, "weight_decay": 0.0, "eps": eps * coef}]
    return [g for g in groups if g["params"]]


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
    opt = make_optimizer(param_groups(model, cfg.weight_decay, cfg.eps), memory, lr=cfg.lr, betas=tuple(cfg.betas),
                         eps=cfg.eps, weight_decay=cfg.weight_decay, accumulate=accumulate, distributed=distributed)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: lr_lambda(s, total_steps, cfg.warmup_steps, cfg.min_lr_ratio)
    )
    return opt, sched
