"""Where one training step of a recipe spends its GPU time: torch.profiler over one step after a warm-up.

    python benchmarks/profile_step.py recipes/glm5-flash-1gpu.yaml 32K [--source genome] [--section.key value ...]

Prints the 25 costliest kernels (self CUDA time) and the planned fixes; writes nothing else.
"""

from __future__ import annotations

import sys

import torch

from megaseq.bench.measure import cfg_for, plan_on, planned_step
from megaseq.config import load_config, parse_size, split_overrides


def main(argv: list[str]) -> int:
    from megaseq.models.presets import resolve_spec
    from megaseq.train.trainer import kernels_for, resolve_device

    recipe, length, *rest = argv
    source = "random"
    if rest[:1] == ["--source"]:  # before any --section.key overrides
        source, rest = rest[1], rest[2:]
    cfg = cfg_for(load_config(recipe, split_overrides(rest)), parse_size(length), source)
    device = resolve_device(cfg)
    plan = plan_on(cfg, device)
    print("fixes:", [f[0] for f in plan.fixes], dict(plan.memory))
    with kernels_for(cfg, device):  # the dispatcher as `megaseq train` sets it up (--model.kernels fast)
        _, applied, next_batch, step = planned_step(cfg, resolve_spec(cfg.model.name), device, plan, 3)
        step(next_batch())  # warm-up
        torch.cuda.synchronize(device)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            step(next_batch())
            torch.cuda.synchronize(device)
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=25, max_name_column_width=70))
    applied.release()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
