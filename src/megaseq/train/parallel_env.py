"""What the trainer needs to know about the processes it runs in.

``ParallelEnv`` is the one-process environment: every collective is the identity. Under torchrun
or Ray (world size > 1) ``setup_parallel`` returns ``DistributedEnv`` from megaseq.parallel, which
shards sequences over the context-parallel ranks and reduces gradients over dp x cp.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch

from megaseq.config import Config
from megaseq.models.context import SeqContext


class ParallelEnv:
    rank = 0
    world_size = 1
    dp_rank = 0
    dp_size = 1
    cp_size = 1
    is_main = True
    reads_data = True

    def __init__(self, device: torch.device | None = None) -> None:
        self.device = device or torch.device("cpu")

    def to_device(self, batch: dict[str, Any]) -> dict[str, Any]:
        return {k: (v.to(self.device, non_blocking=True) if torch.is_tensor(v) else v) for k, v in batch.items()}

    def context(self, batch: dict[str, Any]) -> SeqContext:
        return SeqContext(doc_ids=batch.get("doc_ids"), position_ids=batch.get("position_ids"))

    def shard_batch(self, batch: dict[str, Any]) -> dict[str, Any]:
        return batch

    def gather_seq(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def loss_sum(self, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                 chunk_tokens: int | None = None) -> torch.Tensor:
        """Sum of the per-token losses (chunked when ``chunk_tokens`` is set)."""
        from megaseq.memory.vocab_loss import linear_cross_entropy

        h_NH = hidden.reshape(-1, hidden.shape[-1])
        return linear_cross_entropy(h_NH, weight, labels.reshape(-1), chunk_tokens=chunk_tokens, reduction="sum")

    def all_reduce_count(self, n: int) -> int:
        return n

    def all_reduce_sum(self, x: float) -> float:
        return x

    def reduce_gradients(self, model: torch.nn.Module) -> None:
        return None

    def broadcast_object(self, obj: Any) -> Any:
        return obj

    def barrier(self) -> None:
        return None

    def log(self, msg: str) -> None:
        if self.is_main:
            print(msg, file=sys.stderr)

    def shutdown(self) -> None:
        return None


def setup_parallel(cfg: Config) -> ParallelEnv:
    """One process unless torchrun (or a Ray worker) set WORLD_SIZE > 1."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1 and cfg.parallel.launcher != "ray":
        if cfg.parallel.cp * cfg.parallel.dp * cfg.parallel.ep > 1:
            raise ValueError(
                f"parallel.dp x cp x ep = {cfg.parallel.dp * cfg.parallel.cp * cfg.parallel.ep} but this is one "
                "process: launch with `torchrun --nproc-per-node N -m megaseq train ...` or "
                "`--parallel.launcher ray --parallel.num_workers N`"
            )
        return ParallelEnv()
    from megaseq.parallel.env import DistributedEnv

    return DistributedEnv(cfg)
