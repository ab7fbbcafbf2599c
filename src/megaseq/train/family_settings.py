"""Settings that follow the model's family unless the user sets them: each is None (``config.FAMILY_DEFAULT`` in
``--help``) until ``resolve_family_settings`` fills it in, once the model's spec is known and before the run
directory records the configuration, so the run's config.yaml holds the values the run used. A value the user set
is kept as given (and refused, naming it, where the model cannot train with it).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from megaseq.config import Config, MoEConfig
from megaseq.train.balance import resolve_balance


def resolve_moe(moe: MoEConfig, spec: Any) -> MoEConfig:
    """``moe`` with each unset setting the family's (``train.balance.resolve_balance``: the mode the routers
    train with, the model's aux-loss coefficient, the family's bias update rate, the sequence-wise loss off)."""
    rule = resolve_balance(moe, spec)
    resolved = {"balance": rule.mode, "aux_loss_coef": rule.aux_loss_coef, "bias_update_rate": rule.bias_update_rate,
                "seq_aux_loss_coef": rule.seq_aux_loss_coef}
    return MoEConfig(**{k: v if getattr(moe, k) is None else getattr(moe, k) for k, v in resolved.items()})


def resolve_family_settings(cfg: Config, spec: Any) -> Config:
    """A copy of ``cfg`` with every setting left to the model's family resolved for ``spec``."""
    return dataclasses.replace(cfg, moe=resolve_moe(cfg.moe, spec))
