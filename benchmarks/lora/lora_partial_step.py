"""The peak GPU memory of a 48-layer LoRA step at 512K+ within one device call: the whole forward, the loss and
the backward through the last ``--backward-layers`` layers, then the step is stopped.

    python benchmarks/lora/lora_partial_step.py 512K --out $OUT/lora_48l_512k_partial.json     # one H200, ~8 min
    python benchmarks/lora/lora_partial_step.py 2K --smoke --out /tmp/partial.json              # CPU, qwen3-moe-tiny

Why: a whole step of Qwen3-30B-A3B at 512K takes about 20 minutes (the attention is 97% of its FLOPs), longer
than one 10-minute device call. The forward of all 48 layers runs in about 5 of them. Every layer of that
model has the same shapes, so each layer's backward repeats the same working set; what grows from one
layer's backward to the next is only the adapter gradients (allocated as their layer's backward runs).

So the script measures, with the planner's own plan (as ``megaseq train`` runs it), after a warm-up step on
the first ``--warm-tokens`` of the window (the optimizer's state then exists, as in the plan's steady state):

- ``forward_peak``: ``max_memory_allocated`` over the forward of all the layers;
- ``backward_peak``: over the loss and the backward of the last layers (the recompute of each, its
  backward, the boundary prefetch from the host). The layer before them is stopped as its recompute starts;
- ``unreached_grad_bytes``: the gradient bytes of the trainable parameters whose backward did not run. The
  whole step's peak lies between ``backward_peak`` and ``backward_peak + unreached_grad_bytes`` (the optimizer
  step's own peak is planned well under the backward's; its phase is not run here).

Each is compared with the plan's tensors peak (``plan.peak_gpu_tensors``) and its phase peaks.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

GIB = 1024**3


class StopStep(Exception):
    """Raised inside the backward to stop the step once the last layers' backward has run."""


def main() -> None:
    from megaseq.bench.measure import cfg_for, plan_on, planned_step
    from megaseq.config import load_config, parse_size
    from megaseq.models.presets import resolve_spec
    from megaseq.train.build import kernels_for, resolve_device, use_expandable_segments

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("length")
    ap.add_argument("--recipe", default="recipes/qwen3-30b-a3b-lora.yaml")
    ap.add_argument("--backward-layers", type=int, default=2, help="layers whose backward runs (from the last)")
    ap.add_argument("--warm-tokens", type=int, default=4096, help="length of the warm-up step")
    ap.add_argument("--smoke", action="store_true", help="CPU: qwen3-moe-tiny with recompute forced")
    ap.add_argument("--source", choices=("random", "genome"), default="random",
                    help="random tokens, or windows of data.train's genome (real data routes unevenly)")
    ap.add_argument("--out", required=True)
    ap.add_argument("overrides", nargs="*", help="config overrides key=value")
    args = ap.parse_args()
    over = list(args.overrides)
    if args.smoke:
        over += ["model.name=qwen3-moe-tiny", "model.dtype=fp32", "memory.auto=false", "memory.recompute=true"]
    use_expandable_segments()
    cfg = cfg_for(load_config(args.recipe, over), parse_size(args.length), args.source)
    device = resolve_device(cfg)
    cuda = device.type == "cuda"
    plan = plan_on(cfg, device)
    spec = resolve_spec(cfg.model.name)
    if not plan.memory.get("recompute") and not args.smoke:
        raise SystemExit("the plan does not recompute layers: run the whole step (benchmarks/lora/lora_h200.py)")
    t0 = time.perf_counter()
    with kernels_for(cfg, device):
        model, applied, next_batch, step = planned_step(cfg, spec, device, plan, 2)
        batch = next_batch()
        # a short warm-up step: the optimizer's state exists (the plan is the steady state after step 1)
        step({key: v[:, :args.warm_tokens] if torch.is_tensor(v) else v for key, v in batch.items()})
        layers = model.layers
        n = len(layers)
        k = min(args.backward_layers, n - 1)
        # the recompute calls the layer's own forward (the wrapper is on the layer), so the hook goes on its
        # mixer: the step stops as the recompute of layer n-1-k reaches its attention
        stop_at = layers[n - 1 - k].mixer
        marks: dict[str, float] = {}
        state = {"forward_done": False}

        def after_forward(_mod, _args, _out):  # the final norm: the forward of every layer has run
            if not state["forward_done"]:
                state["forward_done"] = True
                if cuda:
                    torch.cuda.synchronize(device)
                    marks["forward_peak"] = torch.cuda.max_memory_allocated(device)
                    marks["after_forward"] = torch.cuda.memory_allocated(device)
                    torch.cuda.reset_peak_memory_stats(device)
                marks["forward_s"] = time.perf_counter() - t_step

        def stop(_mod, _args):
            if state["forward_done"]:
                raise StopStep(f"stopped at the recompute of layer {n - 1 - k}")

        h1 = model.norm.register_forward_hook(after_forward)
        h2 = stop_at.register_forward_pre_hook(stop)
        build_s = time.perf_counter() - t0
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        t_step = time.perf_counter()
        stopped = None
        try:
            step(batch)
        except StopStep as e:  # raised from the autograd engine's thread, re-raised here
            stopped = str(e)
        except RuntimeError as e:
            if "stopped at the recompute" not in str(e):
                raise
            stopped = str(e).splitlines()[0]
        if cuda:
            torch.cuda.synchronize(device)
            marks["backward_peak"] = torch.cuda.max_memory_allocated(device)
        step_s = time.perf_counter() - t_step
        h1.remove()
        h2.remove()
    unreached = sum(p.numel() * p.element_size() for i in range(n - 1 - k + 1)
                    for p in layers[i].parameters() if p.requires_grad and p.grad is None)
    reached = [sum(p.grad is not None for p in layers[i].parameters() if p.requires_grad) for i in range(n - k, n)]
    planned = plan.peak_gpu_tensors
    phases = {name: v / GIB for name, v in plan.phases.items()}
    row = {"recipe": args.recipe, "overrides": over, "seq_len": cfg.data.seq_len, "layers": n,
           "backward_layers_run": k, "stopped": stopped, "fixes": [f[0] for f in plan.fixes],
           "memory_plan": dict(plan.memory), "planned_peak_tensors_gib": planned / GIB,
           "planned_peak_gpu_gib": plan.peak_gpu / GIB, "planned_phase_peaks_gib": phases,
           "build_s": build_s, "forward_s": marks.get("forward_s"), "step_until_stop_s": step_s,
           "unreached_grad_gib": unreached / GIB, "grads_in_last_layers": reached,
           "device": torch.cuda.get_device_name(device) if cuda else "cpu", "torch": torch.__version__}
    if cuda:
        bwd = marks["backward_peak"]
        row |= {"forward_peak_gib": marks["forward_peak"] / GIB, "after_forward_gib": marks["after_forward"] / GIB,
                "backward_peak_gib": bwd / GIB, "step_peak_bounds_gib": [bwd / GIB, (bwd + unreached) / GIB],
                "plan_vs_measured_low": planned / (bwd + unreached) - 1, "plan_vs_measured_high": planned / bwd - 1}
    with open(args.out, "w") as f:
        json.dump(row, f, indent=2, default=str)
    print(json.dumps(row, indent=2, default=str))
    applied.release()


if __name__ == "__main__":
    main()
