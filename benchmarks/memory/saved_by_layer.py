"""Where one training step's GPU memory goes, layer by layer and phase by phase, beside the planner's figure for
each: what every layer keeps for backward (autograd's saved tensors, each storage once, split by the dispatcher op
that made it), the memory held when the forward ends, and the peak of the forward, the loss, each layer's backward
and the optimizer step.

    python benchmarks/memory/saved_by_layer.py recipes/glm5-flash-1gpu.yaml --seq-len 32K --out $OUT/saved_32k.json
    python benchmarks/memory/saved_by_layer.py recipes/glm5-flash-1gpu.yaml --seq-len 32K --model.weights fp32 \\
        --out $OUT/saved_32k_fp32.json

The step is the trainer's (``bench.measure.warm_planned_step``: the plan's fixes, the dispatcher as ``megaseq train``
sets it up), measured after one warm-up step (the optimizer's state exists, as in the planner's steady state).
Phases are marked by hooks: the forward ends at the model's output; the loss ends when the loss's backward reaches
the final hidden state; layer ``i``'s backward runs from the gradient of its output to that of its input; the
optimizer step is the rest (the embedding's backward, clipping, the update). Each phase's peak is
``max_memory_allocated`` since the previous mark. Saved bytes are read where no memory scheme installs saved-tensor
hooks of its own (no recompute, offload or sequence segments: their layers show what the scheme keeps instead).
Other extra arguments are dotted overrides of the recipe. On a machine without CUDA it runs as a smoke test (every
memory figure 0).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from _planned_step import planned_step_for

from megaseq.bench.saved import SavedStorages

GIB = 2**30


class Marks:
    """``(name, allocated now, peak since the previous mark)`` at each phase boundary."""

    def __init__(self) -> None:
        self.rows: list[dict] = []

    def __call__(self, name: str) -> None:
        torch.cuda.synchronize()
        self.rows.append({"mark": name, "allocated_gib": torch.cuda.memory_allocated() / GIB,
                          "peak_since_last_gib": torch.cuda.max_memory_allocated() / GIB})
        torch.cuda.reset_peak_memory_stats()

    def peak(self, first: str, last: str) -> float | None:
        """The peak between mark ``first`` (exclusive) and mark ``last`` (inclusive); None where one is missing (a
        frozen embedding's output has no gradient)."""
        names = [r["mark"] for r in self.rows]
        if first not in names or last not in names or names.index(last) <= names.index(first):
            return None  # a scheme that runs the model in pieces (sequence segments) marks its phases otherwise
        i, j = names.index(first), names.index(last)
        return max(r["peak_since_last_gib"] for r in self.rows[i + 1: j + 1])

    def get(self, name: str) -> dict:
        return next((r for r in self.rows if r["mark"] == name), {"allocated_gib": None})


def install_hooks(model, marks: Marks, saved: SavedStorages) -> list:
    """Forward hooks naming the running layer, and gradient hooks marking the loss's end and each layer's
    backward (its output's gradient: the start; its input's: the end)."""
    hooks = []

    def grad_mark(t: torch.Tensor, name: str) -> None:
        if t.requires_grad:
            t.register_hook(lambda g: marks(name))

    def pre(i):
        def hook(module, args):
            saved.label = f"layer {i}"
            grad_mark(args[0], f"backward layer {i} done")
        return hook

    def post(i):
        def hook(module, args, out):
            saved.label = f"after layer {i}"
            grad_mark(out, f"backward layer {i} start")
        return hook

    for i, layer in enumerate(model.layers):
        hooks.append(layer.register_forward_pre_hook(pre(i)))
        hooks.append(layer.register_forward_hook(post(i)))

    def model_done(module, args, out):
        saved.label = "loss"
        marks("forward done")
        grad_mark(out, "loss done")

    hooks.append(model.register_forward_hook(model_done))
    return hooks


def planned(run) -> dict:
    """The planner's figures for the run: its phase peaks, each layer's saved set (and autocast's weight copies)
    and backward peak, the state and the saved sum."""
    from megaseq.plan.layer_terms import all_layer_terms
    from megaseq.plan.phases import _copies, _phases, evaluate

    ev = evaluate(run)
    terms = all_layer_terms(run)
    by_phase = {name: sum(c.values()) / GIB for name, c, _ in _phases(run, terms)}
    layers = []
    for i, t in enumerate(terms):
        layers.append({"saved_gib": t.saved / GIB, "weight_copies_gib": _copies(run, i, cached_only=False) / GIB,
                       "terms_gib": {k: v / GIB for k, v in {**t.attn, **t.ffn}.items()},
                       "backward_peak_gib": next(v for k, v in by_phase.items()
                                                 if k.startswith(f"backward, layer {i} "))})
    return {"phases_gib": {k: v / GIB for k, v in ev.phases.items()}, "peak_gib": ev.peak_tensors / GIB,
            "peak_phase": ev.phase, "breakdown_gib": {k: v / GIB for k, v in ev.breakdown.items()},
            "layers": layers}


def measure(c, spec, model, next_batch, step) -> tuple[Marks, SavedStorages]:
    marks, saved = Marks(), SavedStorages(model.parameters())
    saved.label = "embedding"
    hooks = install_hooks(model, marks, saved)
    batch = next_batch()
    try:
        marks("start")
        with saved.recording():
            step(batch)
        marks("step done")
    finally:
        for h in hooks:
            h.remove()
    return marks, saved


def report(c, spec, plan, run, marks: Marks, saved: SavedStorages) -> dict:
    p = planned(run)
    by_layer = saved.by_label()
    L = spec.num_layers
    layers = []
    for i in range(L):
        m = by_layer.get(f"layer {i}", {"total": 0, "by_op": {}, "largest": []})
        layers.append({"layer": i, "kind": f"{spec.layer_types[i]} + {spec.mlp_types[i]}",
                       "saved_gib": m["total"] / GIB, "planned_saved_gib": p["layers"][i]["saved_gib"],
                       "planned_weight_copies_gib": p["layers"][i]["weight_copies_gib"],
                       "saved_by_op_gib": {k: v / GIB for k, v in sorted(m["by_op"].items(), key=lambda kv: -kv[1])},
                       "largest_saved": [{"gib": b / GIB, "op": o, "dtype": d, "shape": sh}
                                         for b, o, d, sh in m["largest"]],
                       "planned_terms_gib": p["layers"][i]["terms_gib"],
                       "backward_peak_gib": marks.peak(f"backward layer {i} start", f"backward layer {i} done"),
                       "planned_backward_peak_gib": p["layers"][i]["backward_peak_gib"]})
    phases = {
        "forward": (marks.peak("start", "forward done"), p["phases_gib"]["forward"]),
        "loss": (marks.peak("forward done", "loss done"), p["phases_gib"]["loss"]),
        "backward": (marks.peak("loss done", "backward layer 0 done"), p["phases_gib"]["backward"]),
        "optimizer step": (marks.peak("backward layer 0 done", "step done"), p["phases_gib"]["optimizer step"]),
    }
    return {"seq_len": c.data.seq_len, "weights": c.model.weights, "fixes": [f[0] for f in plan.fixes],
            "memory": plan.memory, "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
            "allocated_before_step_gib": marks.get("start")["allocated_gib"],
            "allocated_after_forward_gib": marks.get("forward done")["allocated_gib"],
            "saved_outside_layers_gib": {k: v["total"] / GIB for k, v in by_layer.items()
                                         if not k.startswith("layer ")},
            "phases": {k: {"measured_gib": a, "planned_gib": b} for k, (a, b) in phases.items()},
            "planned_peak_gib": p["peak_gib"], "planned_peak_phase": p["peak_phase"],
            "planned_breakdown_gib": p["breakdown_gib"], "layers": layers, "marks": marks.rows}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("recipe")
    ap.add_argument("--seq-len", required=True)
    ap.add_argument("--out", required=True)
    args, rest = ap.parse_known_args(argv)
    c, spec, plan, model, applied, next_batch, step, run = planned_step_for(args.recipe, args.seq_len, rest)
    try:
        marks, saved = measure(c, spec, model, next_batch, step)
        res = report(c, spec, plan, run, marks, saved)
    finally:
        applied.release()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1))
    print(f"{args.recipe} {c.data.seq_len} tokens, weights {c.model.weights}, fixes {res['fixes']}")
    print(f"{'phase':<16}{'measured':>10}{'planned':>10}  GiB")
    for k, v in res["phases"].items():
        m = v["measured_gib"]
        print(f"{k:<16}{m if m is not None else float('nan'):>10.2f}{v['planned_gib']:>10.2f}")
    print(f"allocated after the forward {res['allocated_after_forward_gib']} GiB")
    print(f"{'layer':<18}{'saved':>8}{'planned':>9}{'bwd peak':>10}{'planned':>9}  GiB")
    for r in res["layers"]:
        bwd = r["backward_peak_gib"]
        print(f"{r['layer']:>2} {r['kind']:<15}{r['saved_gib']:>8.2f}{r['planned_saved_gib']:>9.2f}"
              f"{bwd if bwd is not None else float('nan'):>10.2f}{r['planned_backward_peak_gib']:>9.2f}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
