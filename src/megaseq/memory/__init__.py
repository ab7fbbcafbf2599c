"""Exact memory schemes: each changes only the order and granularity of computation and data movement.

- ``vocab_loss``       plain and chunked linear cross-entropy, the online log-sum-exp Ring-DTP reuses
- ``tiling``           sequence-tiled MLP/MoE (forward without a graph, backward per tile)
- ``indexer_scoring``  chunked DSA indexer scoring
- ``offload``          full recompute per layer, SCO boundary offload to an exactly sized pinned pool
- ``offload_adam``     OffloadStreamAdamW (host fp32 state streamed through two GPU slots)
- ``apply``            ``MemoryPlan`` and ``apply_memory_plan(model, plan)``

Each has a float64 CPU test against the plain computation (tests/test_memory_*.py) and a memory formula.
"""

from megaseq.memory.apply import AppliedMemory, MemoryPlan, apply_memory_plan, loss_fn, make_optimizer
from megaseq.memory.offload import BoundaryOffloader, checkpoint_layers, sco_plan
from megaseq.memory.offload_adam import OffloadStreamAdamW, SequentialOffloadAdamW
from megaseq.memory.tiling import TiledModule, enable_tiling, tiled_forward
from megaseq.memory.vocab_loss import (
    LSEState,
    chunked_linear_cross_entropy,
    linear_cross_entropy,
    lse_finalize,
    lse_init,
    lse_update,
    plain_linear_cross_entropy,
    vocab_loss_bytes,
)

__all__ = [
    "AppliedMemory", "BoundaryOffloader", "LSEState", "MemoryPlan", "OffloadStreamAdamW",
    "SequentialOffloadAdamW", "TiledModule", "apply_memory_plan", "checkpoint_layers",
    "chunked_linear_cross_entropy", "enable_tiling", "linear_cross_entropy", "loss_fn", "lse_finalize",
    "lse_init", "lse_update", "make_optimizer", "plain_linear_cross_entropy", "sco_plan", "tiled_forward",
    "vocab_loss_bytes",
]
