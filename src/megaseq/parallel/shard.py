"""The parallel schemes a family's ``parallelize`` applies after its memory schemes: expert parallelism
(``env.shard_moe`` on every MoE layer when ``parallel.ep > 1``) and FSDP2 per layer (``parallel.fsdp``).

Families of ``models.common.prenorm`` layers call ``shard_layers`` after ``memory.apply.apply_prenorm``;
GLM-5 and Qwen3-MoE do the same two steps inline.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from megaseq.memory.apply import AppliedMemory
from megaseq.parallel.fsdp import apply_fsdp


def shard_layers(model: nn.Module, done: AppliedMemory, env: Any = None) -> AppliedMemory:
    """Shard ``model.layers``' routed experts over ep and then every layer with FSDP, as ``env`` says (both
    no-ops with one rank); returns ``done`` with what was sharded. Applying again keeps the sharding."""
    layers = list(model.layers)
    if env is not None and getattr(env, "ep_size", 1) > 1:
        for layer, kind in zip(layers, model.spec.mlp_types):
            if kind == "moe":
                env.shard_moe(layer.mlp)
    done.sharded = apply_fsdp(model, layers, env)  # last: its hooks surround the wrapped forwards
    return done
