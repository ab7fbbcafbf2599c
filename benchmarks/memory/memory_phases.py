"""Where a step's GPU memory goes, measured beside the planner's model of it: per-layer saved bytes and
the peak of each phase (forward, loss + backward, optimizer step), for one config and length.

    python benchmarks/memory/memory_phases.py recipes/glm5-flash-tiny-dna.yaml 128K --model.dtype bf16 \\
        --out $OUT/memory_phases_tiny_128k.json

The step is the trainer's (``bench.planned_step``: the planned fixes applied). A warm-up step first (the
optimizer state then exists, as in the planner's steady state). Per layer: ``memory_allocated`` after its
forward minus before it (what the layer keeps for backward, plus its output: the next layer's boundary),
beside the planner's ``LayerTerms.saved``. Phases: the peak of the forward (to the model's output), of
the loss and backward, and of the optimizer step, each beside the planner's phase peak.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

GIB = 2**30


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("recipe")
    ap.add_argument("seq_len")
    ap.add_argument("--out", required=True)
    args, rest = ap.parse_known_args()
    from _planned_step import planned_step_for

    from megaseq.plan.layer_terms import all_layer_terms
    from megaseq.plan.phases import evaluate

    c, spec, plan, model, applied, next_batch, step, run = planned_step_for(args.recipe, args.seq_len, rest)
    S = c.data.seq_len
    terms = all_layer_terms(run)
    ev = evaluate(run)
    marks: list[tuple[str, int, int]] = []

    def mark(name: str) -> None:
        torch.cuda.synchronize()
        marks.append((name, torch.cuda.memory_allocated(), torch.cuda.max_memory_allocated()))
        torch.cuda.reset_peak_memory_stats()

    hooks = []
    for i, layer in enumerate(model.layers):
        hooks.append(layer.register_forward_pre_hook(lambda m, a, i=i: mark(f"before layer {i}")))
        hooks.append(layer.register_forward_hook(lambda m, a, o, i=i: mark(f"after layer {i}")))
    hooks.append(model.register_forward_hook(lambda m, a, o: mark("forward done")))
    torch.cuda.reset_peak_memory_stats()
    mark("start")
    batch = next_batch()
    step(batch)
    mark("step done")
    for h in hooks:
        h.remove()
    names = [m[0] for m in marks]
    saved = []
    for i in range(len(model.layers)):
        a = marks[names.index(f"before layer {i}")][1]
        b = marks[names.index(f"after layer {i}")][1]
        saved.append({"layer": i, "kind": f"{spec.layer_types[i]} + {spec.mlp_types[i]}",
                      "measured_gib": (b - a) / GIB, "planned_saved_gib": terms[i].saved / GIB})
    fwd_peak = max(m[2] for m in marks[: names.index("forward done") + 1])
    rest_peak = marks[names.index("step done")][2]
    res = {"recipe": args.recipe, "seq_len": S, "fixes": [f[0] for f in plan.fixes], "memory": plan.memory,
           "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
           "layers": saved,
           "forward_peak_gib": fwd_peak / GIB, "planned_forward_gib": ev.phases["forward"] / GIB,
           "loss_backward_step_peak_gib": rest_peak / GIB,
           "planned_loss_gib": ev.phases["loss"] / GIB, "planned_backward_gib": ev.phases["backward"] / GIB,
           "planned_step_gib": ev.phases["optimizer step"] / GIB,
           "planned_peak_gib": ev.peak_tensors / GIB, "planned_phase": ev.phase,
           "planned_breakdown_gib": {k: v / GIB for k, v in ev.breakdown.items()}}
    applied.release()
    Path(args.out).write_text(json.dumps(res, indent=2))
    print(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
