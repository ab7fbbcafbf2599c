"""Where one training step of a recipe spends its GPU time: torch.profiler over one step after a warm-up.

    python benchmarks/profile_step.py recipes/glm5-flash-1gpu.yaml 32K [--source genome --data.train F]

Prints the 25 costliest kernels (self CUDA time) and the planned fixes; writes nothing else.
"""

from __future__ import annotations

import sys

import torch

from megaseq.bench import _cfg_for
from megaseq.config import load_config, parse_size


def main(argv: list[str]) -> int:
    from megaseq.data import build_data
    from megaseq.models.presets import resolve_spec
    from megaseq.plan.planner import plan_from_config
    from megaseq.train.parallel_env import ParallelEnv
    from megaseq.train.trainer import build_planned_model, dtypes, resolve_device, train_step

    recipe, length, *rest = argv
    source = "random"
    if rest[:1] == ["--source"]:  # before any --section.key overrides
        source, rest = rest[1], rest[2:]
    cfg = _cfg_for(load_config(recipe, rest), parse_size(length), source)
    device = resolve_device(cfg)
    spec = resolve_spec(cfg.model.name)
    plan = plan_from_config(cfg, world_size=1, gpu_bytes=torch.cuda.get_device_properties(device).total_memory)
    print("fixes:", [f[0] for f in plan.fixes], dict(plan.memory))
    data = build_data(cfg.data, None, batch_size=cfg.train.batch_size, vocab_size=spec.vocab_size)
    memory = dict(plan.memory)
    model, applied, opt, sched = build_planned_model(cfg, spec, device, memory, 3)
    env, autocast = ParallelEnv(device), dtypes(cfg, device)[1]
    train_step(model, [data.train.next_batch()], opt, sched, cfg, env, autocast, memory)  # warm-up
    torch.cuda.synchronize(device)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        train_step(model, [data.train.next_batch()], opt, sched, cfg, env, autocast, memory)
        torch.cuda.synchronize(device)
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=25, max_name_column_width=70))
    applied.release()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
