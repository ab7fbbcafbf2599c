"""What the trainer needs to know about the processes it runs in.

``ParallelEnv`` (in megaseq.parallel.env) is the one-process environment: every collective is the
identity. Under torchrun or Ray (world size > 1) ``setup_parallel`` returns its subclass
``DistributedEnv``, which shards sequences over the context-parallel ranks and reduces gradients
over dp x cp.
"""

from __future__ import annotations

import os
from typing import Any

from megaseq.config import Config
from megaseq.parallel.env import ParallelEnv

__all__ = ["ParallelEnv", "setup_parallel"]


def setup_parallel(cfg: Config, spec: Any = None) -> ParallelEnv:
    """One process unless torchrun (or a Ray worker) set WORLD_SIZE > 1; ``spec``: the run's model spec, resolved
    once by the caller (None: resolved here)."""
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

    return DistributedEnv(cfg, spec=spec)
