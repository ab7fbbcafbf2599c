"""Which op makes a step's GPU peak: every aten op of one warm step (forward, replays, backward, optimizer)
run under a dispatch mode that records the allocated bytes before it, its own peak and after it, and the
last module whose forward ran (in a backward: the module being recomputed). ``memory_census`` says which
Python line allocated what is live at the peak; this says which op was running and what it allocated.

    python benchmarks/memory/memory_ops.py recipes/qwen3-30b-a3b-lora.yaml 128K --model.name DIR/config.json \\
        --memory.auto false --memory.recompute true --out $OUT/ops.json

GPU only. The step is the trainer's (``bench.planned_step``), after one warm-up step. The output holds the
ops around the peak, the ops that allocate most within themselves, and the planner's breakdown.
"""

from __future__ import annotations

import argparse
import gzip
import json
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

GIB = 2**30


def _shapes(args) -> str:
    out = []
    for a in args:
        if isinstance(a, torch.Tensor):
            out.append(f"{str(a.dtype).removeprefix('torch.')}{list(a.shape)}")
        elif isinstance(a, (list, tuple)) and a and isinstance(a[0], torch.Tensor):
            out.append(f"[{len(a)} tensors]")
    return " ".join(out)


class OpMemory(TorchDispatchMode):
    """Each op's ``(module, op, shapes, allocated before, peak within, allocated after)`` in GiB."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[tuple] = []
        self.module = ""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        out = func(*args, **(kwargs or {}))
        self.rows.append((self.module, str(func), _shapes(args), before / GIB,
                          torch.cuda.max_memory_allocated() / GIB, torch.cuda.memory_allocated() / GIB))
        return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("recipe")
    ap.add_argument("seq_len")
    ap.add_argument("--out", required=True)
    ap.add_argument("--around", type=int, default=40, help="ops either side of the peak to keep")
    args, rest = ap.parse_known_args()
    from _planned_step import planned_step_for

    from megaseq.plan.layer_terms import all_layer_terms
    from megaseq.plan.phases import evaluate

    c, spec, plan, model, applied, next_batch, step, run = planned_step_for(args.recipe, args.seq_len, rest)
    ev = evaluate(run)

    def gib(v):
        return {k: gib(x) for k, x in v.items()} if isinstance(v, dict) else v / GIB if isinstance(v, int) else v

    terms = [gib(vars(t)) for t in all_layer_terms(run)[:1]]  # the first layer's (all alike here)
    mode = OpMemory()

    def pre(name):
        def hook(m, a):
            mode.module = name
        return hook

    hooks = [m.register_forward_pre_hook(pre(n)) for n, m in model.named_modules() if n]
    batch = next_batch()
    torch.cuda.synchronize()
    with mode:
        step(batch)
    torch.cuda.synchronize()
    for h in hooks:
        h.remove()
    rows = mode.rows
    i_peak = max(range(len(rows)), key=lambda i: rows[i][4])
    keys = ("module", "op", "args", "before_gib", "peak_gib", "after_gib")
    as_dict = [dict(zip(keys, r), i=i) for i, r in enumerate(rows)]
    within = sorted(as_dict, key=lambda r: -(r["peak_gib"] - r["before_gib"]))[:40]
    res = {"recipe": args.recipe, "seq_len": c.data.seq_len, "fixes": [f[0] for f in plan.fixes],
           "memory": plan.memory, "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
           "ops": len(rows), "peak_op": i_peak, "peak_gib": rows[i_peak][4],
           "planned_peak_tensors_gib": ev.peak_tensors / GIB, "planned_phase": ev.phase,
           "planned_phases_gib": {k: v / GIB for k, v in ev.phases.items()},
           "planned_breakdown_gib": {k: v / GIB for k, v in ev.breakdown.items()},
           "planned_layer_terms_gib": terms,
           "around_peak": as_dict[max(0, i_peak - args.around):i_peak + args.around],
           "largest_within_op": within}
    applied.release()
    Path(args.out).write_text(json.dumps(res, indent=1))
    with gzip.open(Path(args.out).with_suffix(".trace.jsonl.gz"), "wt") as f:
        for r in as_dict:
            f.write(json.dumps(r) + "\n")
    print(json.dumps({k: v for k, v in res.items() if k not in ("around_peak", "largest_within_op")}, indent=1))
    for r in res["around_peak"]:
        if abs(r["i"] - i_peak) <= 12:
            print(f"{r['i']:6d} {r['peak_gib']:7.2f} {r['before_gib']:7.2f} {r['module'][:40]:40s} {r['op'][:45]:45s} "
                  f"{r['args'][:80]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
