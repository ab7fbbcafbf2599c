"""The setup the memory benchmarks share (``memory_phases.py``, ``memory_ops.py``): a recipe's planned training
step at one length, warmed up, and the planner's ``Run`` for it."""

from __future__ import annotations

import torch


def planned_step_for(recipe: str, seq_len: str, overrides: list[str]) -> tuple:
    """``(c, spec, plan, model, applied, next_batch, step, run)``: ``recipe`` with ``overrides`` at ``seq_len``
    (``bench.measure.warm_planned_step``: the trainer's model and step with the plan's fixes, one warm-up step
    run) and the run the planner evaluated (the frozen base and adapters too). On a machine without CUDA a
    smoke run: the memory reads are zeros."""
    from megaseq.bench.measure import warm_planned_step
    from megaseq.config import AdapterSettings, load_config, parse_size, split_overrides
    from megaseq.plan.given import run_for
    from megaseq.train.build import use_expandable_segments

    use_expandable_segments()  # as `megaseq train` (before any CUDA allocation)
    cfg = load_config(recipe, split_overrides(overrides))
    S = parse_size(seq_len)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if dev.type == "cpu":
        torch.cuda.synchronize = torch.cuda.reset_peak_memory_stats = lambda *a: None
        torch.cuda.memory_allocated = torch.cuda.max_memory_allocated = lambda *a: 0
        torch.cuda.get_device_name = lambda *a: "cpu"
    c, spec, plan, model, applied, next_batch, step = warm_planned_step(cfg, S, dev)
    run = run_for(spec, S, plan.memory, model_dtype=c.model.dtype, weights=c.model.weights,
                  adapters=AdapterSettings.of(c), fast_ops=frozenset(plan.mesh.get("fast_kernels", ())))
    return c, spec, plan, model, applied, next_batch, step, run
