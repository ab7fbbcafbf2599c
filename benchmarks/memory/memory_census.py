"""Which code holds the GPU memory at a step's peak (and at the end of its forward): the CUDA caching
allocator's history of one warm step (``torch.cuda.memory._record_memory_history``), replayed to the peak,
each live block grouped by the innermost megaseq frame that allocated it, beside the planner's breakdown.

    python benchmarks/memory/memory_census.py recipes/qwen3-30b-a3b-lora.yaml 128K --model.name DIR/config.json \\
        --memory.auto false --memory.recompute true --out $OUT/census.json

GPU only. The step is the trainer's (``bench.planned_step``), after one warm-up step.
"""

from __future__ import annotations

import argparse
import collections
import json
from pathlib import Path

import torch

GIB = 2**30


def where(frames: list[dict]) -> str:
    """The innermost megaseq frame and the op under it (frames are innermost first)."""
    op = frames[0]["name"] if frames else "?"
    for f in frames:
        fn = f.get("filename", "")
        if "megaseq" in fn:
            return f"{fn.split('megaseq/')[-1]}:{f.get('line')} {f.get('name')} [{op}]"
    return f"(no megaseq frame) [{op}]"


def live_at(trace: list[dict], stop: int) -> dict[int, tuple[int, str]]:
    live: dict[int, tuple[int, str]] = {}
    for e in trace[:stop]:
        a = e.get("action")
        if a == "alloc":
            live[e["addr"]] = (e["size"], where(e.get("frames", [])))
        elif a in ("free_completed",):
            live.pop(e["addr"], None)
    return live


def summary(live: dict[int, tuple[int, str]], top: int = 25) -> list[dict]:
    groups: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])
    for size, w in live.values():
        groups[w][0] += size
        groups[w][1] += 1
    rows = sorted(groups.items(), key=lambda kv: -kv[1][0])[:top]
    return [{"where": w, "gib": b / GIB, "blocks": n} for w, (b, n) in rows]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("recipe")
    ap.add_argument("seq_len")
    ap.add_argument("--out", required=True)
    args, rest = ap.parse_known_args()
    from megaseq.bench.measure import warm_planned_step
    from megaseq.config import load_config, parse_size, split_overrides
    from megaseq.train.build import use_expandable_segments

    use_expandable_segments()
    cfg = load_config(args.recipe, split_overrides(rest))
    c, _, plan, model, applied, next_batch, step = warm_planned_step(cfg, parse_size(args.seq_len),
                                                                     torch.device("cuda"))
    base = torch.cuda.memory_allocated()
    torch.cuda.memory._record_memory_history(enabled="all", context="alloc", stacks="python", max_entries=400000)
    marks: dict[str, int] = {}

    def fwd_done(m, a, o):
        torch.cuda.synchronize()
        marks["forward"] = len(torch.cuda.memory._snapshot()["device_traces"][0])

    h = model.register_forward_hook(fwd_done)
    torch.cuda.reset_peak_memory_stats()
    step(next_batch())
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    h.remove()
    trace = snap["device_traces"][0]
    # the event index of the peak: running sum of this step's allocations over the warm step's base
    cur, best, best_i = 0, 0, 0
    for i, e in enumerate(trace):
        a = e.get("action")
        if a == "alloc":
            cur += e["size"]
        elif a == "free_completed":
            cur -= e["size"]
        if cur > best:
            best, best_i = cur, i + 1
    # blocks allocated before recording (weights, optimizer state, ...) are not in the trace: `base`
    res = {"recipe": args.recipe, "seq_len": c.data.seq_len, "fixes": [f[0] for f in plan.fixes],
           "memory": plan.memory, "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
           "allocated_before_step_gib": base / GIB, "peak_allocated_gib": peak / GIB,
           "trace_events": len(trace), "peak_event": best_i, "step_new_at_peak_gib": best / GIB,
           "planned_peak_tensors_gib": plan.peak_gpu_tensors / GIB,
           "at_peak": summary(live_at(trace, best_i)),
           "at_forward_end": summary(live_at(trace, marks.get("forward", 0)))}
    applied.release()
    Path(args.out).write_text(json.dumps(res, indent=2))
    print(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
