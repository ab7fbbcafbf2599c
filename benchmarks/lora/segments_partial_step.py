"""The peak GPU memory of a planned sequence-segments step within one device call: the forward of every
segment, then the loss and backward of the last ``--backward-segments`` segments, then the step is stopped.

    python benchmarks/lora/segments_partial_step.py 1M --forward-loss --out $OUT/kimi_1m_partial.json   # one H200
    python benchmarks/lora/segments_partial_step.py 256 --smoke --check-full --out /tmp/seg.json        # CPU, tiny

Why: under sequence segments (``memory.model_segment_tokens``) a step runs the forward of every segment
without a graph, then each segment again in reverse with its loss and backward. A whole step of
Kimi-Linear-48B-A3B LoRA at 1M tokens is longer than one 10-minute device call. The last segment's backward
has the largest working set of the backward pass (its attention joins the keys of every earlier token), so
the forward pass and the last segments' backward bound the step's peak.

The model and step are the planner's own (``train.build.build_planned_model`` with the plan's memory
settings, ``memory.stream_base`` and ``memory.segment_kv_host`` included; ``train.step.train_step``), after
a warm-up step on the first ``--warm-tokens`` of the window (the optimizer's state then exists). The step's
``progress`` hook, told before each segment, reads the memory and the clock and stops the step:

- ``forward_peak_gib``: ``max_memory_allocated`` over the forward of every segment;
- ``backward_peak_gib``: over the loss and backward of the last segments (the peak counter is reset between);
- ``forward_segment_s`` / ``backward_segment_s``: the time of each segment (synchronised);
- ``estimate_step_s``: an estimate, not a measurement: the forward time plus each segment's forward time
  scaled by the measured backward-to-forward ratio of the last segments (``estimate_step_upper_s``: every
  segment's backward as long as the last ones'). The optimizer step is not included.
- ``forward_loss``: with ``--forward-loss``, the loss of every segment computed from its final hidden states
  during the forward pass (the step's own loss function): the whole step's loss without its backward
  (``--check-full`` also runs a whole step after it and records its loss, ``full_step_loss``).

``OUT.progress.jsonl`` (beside ``--out``) gets a line once the model is built and once it is warm (the time
and the process's peak host memory, also printed) and one as each segment starts (the time so far and the
peak since the last reset): a run stopped by its time limit still says how far it got.

The peaks are compared with the plan's tensors peak (``plan.peak_gpu_tensors``) and its phase peaks.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import torch

GIB = 1024**3


class StopStep(Exception):
    """Raised from the step's progress hook once the last segments' backward has run."""


def should_stop(backward_done: int, k: int) -> bool:
    """Whether the step stops before the next segment's backward, ``backward_done`` segments' having run."""
    return backward_done >= k


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("length")
    ap.add_argument("--recipe", default="recipes/kimi-linear-48b-a3b-lora.yaml")
    ap.add_argument("--backward-segments", type=int, default=1, help="segments whose backward runs (from the last)")
    ap.add_argument("--warm-tokens", type=int, default=4096, help="length of the warm-up step")
    ap.add_argument("--forward-loss", action="store_true",
                    help="compute each segment's loss in the forward pass (adds the loss's working set to it)")
    ap.add_argument("--check-full", action="store_true", help="then run a whole step and record its loss")
    ap.add_argument("--smoke", action="store_true",
                    help="CPU: kimi-linear-tiny LoRA, 64-token segments, K/V in host memory, the base streamed")
    ap.add_argument("--source", choices=("random", "genome"), default="random",
                    help="random tokens, or windows of data.train's genome (real data routes unevenly)")
    ap.add_argument("--out", required=True)
    ap.add_argument("overrides", nargs="*", help="config overrides key=value")
    return ap.parse_intermixed_args(argv)


SMOKE = ["model.name=kimi-linear-tiny", "model.dtype=fp32", "memory.auto=false",
         "memory.model_segment_tokens=64", "memory.segment_kv_host=true", "memory.stream_base=true"]


def build(cfg: Any, device: torch.device, plan: Any) -> tuple:
    """``(model, applied, next_batch, state)``: the trainer's data, model, optimizer and step state with
    ``plan``'s memory settings, as ``megaseq train`` builds them (``bench.measure.planned_step``)."""
    from megaseq.config import MemorySettings
    from megaseq.data import build_data
    from megaseq.models.presets import resolve_spec
    from megaseq.train.build import build_planned_model, dtypes
    from megaseq.train.parallel_env import ParallelEnv
    from megaseq.train.step import StepState

    spec = resolve_spec(cfg.model.name)
    autocast = dtypes(cfg, device)[1]
    data = build_data(cfg.data, None, batch_size=cfg.train.batch_size, vocab_size=spec.vocab_size)
    memory = MemorySettings.from_dict(plan.memory)
    env = ParallelEnv(device)
    model, applied, opt, sched = build_planned_model(cfg, spec, device, memory, 2, env=env)
    return model, applied, data.train.next_batch, StepState.of(cfg, model, opt, sched, env, memory, autocast)


class Probe:
    """The step's ``progress`` hook: the clock and the memory at each segment, the stop after ``k`` backward
    segments; with ``labels`` the loss of each segment's forward (a forward hook on the model)."""

    def __init__(self, device: torch.device, k: int, bounds: list[tuple[int, int]], state: Any,
                 labels: torch.Tensor | None, log: str | None = None) -> None:
        self.device, self.k, self.bounds, self.state, self.labels = device, k, bounds, state, labels
        self.log = log  # a JSON line per segment (a run stopped by its time limit still says how far it got)
        self.cuda = device.type == "cuda"
        self.marks: dict[str, Any] = {"forward_segment_s": [], "backward_segment_s": []}
        self.j: int | None = None
        self.t = self.t0 = time.perf_counter()
        self.loss_sum: torch.Tensor | None = None

    def _tick(self) -> float:
        if self.cuda:
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        dt, self.t = now - self.t, now
        return dt

    def __call__(self, phase: str, done: int, total: int) -> None:
        self._record(phase, done, total)
        m = self.marks
        if phase == "forward":
            if done > 0:
                m["forward_segment_s"].append(self._tick())
            else:
                self._tick()
            self.j = done
            return
        if done == 0:  # the forward of every segment has run
            m["forward_segment_s"].append(self._tick())
            m["forward_s"] = self.t - self.t0
            self.j = None
            if self.cuda:
                m["forward_peak"] = torch.cuda.max_memory_allocated(self.device)
                m["after_forward"] = torch.cuda.memory_allocated(self.device)
                torch.cuda.reset_peak_memory_stats(self.device)
        else:
            m["backward_segment_s"].append(self._tick())
        if should_stop(done, self.k):
            if self.cuda:
                m["backward_peak"] = torch.cuda.max_memory_allocated(self.device)
            m["backward_segments_run"] = done
            raise StopStep(f"stopped after the backward of {done} of {total} segments")

    def _record(self, phase: str, done: int, total: int) -> None:
        if self.log is None:
            return
        if self.cuda:
            torch.cuda.synchronize(self.device)
        line = {"phase": phase, "done": done, "total": total, "s": time.perf_counter() - self.t0,
                "peak_since_reset_gib": torch.cuda.max_memory_allocated(self.device) / GIB if self.cuda else None}
        with open(self.log, "a") as f:
            f.write(json.dumps(line) + "\n")

    def on_hidden(self, _mod: Any, _args: Any, hidden: torch.Tensor) -> None:
        """The loss of the forward pass's segment ``j`` (no graph), as the step computes a segment's loss."""
        if self.j is None or torch.is_grad_enabled() or self.labels is None:
            return
        from megaseq.train.step import _loss_sum

        st = self.state
        s, e = self.bounds[self.j]
        chunk = st.memory.loss_chunk_tokens if st.memory.chunked_loss else None
        loss = _loss_sum(st.model, hidden, self.labels[:, s:e].to(hidden.device), st.env, st.autocast, chunk)
        self.loss_sum = loss.double() if self.loss_sum is None else self.loss_sum + loss.double()


def partial_step(state: Any, batch: dict[str, torch.Tensor], probe: Probe) -> str | None:
    """The planned step on ``batch`` until the probe stops it; returns the stop's message."""
    from megaseq.train.step import train_step

    hook = state.model.register_forward_hook(probe.on_hidden)
    if probe.cuda:
        torch.cuda.reset_peak_memory_stats(probe.device)
    probe.t = probe.t0 = time.perf_counter()
    try:
        train_step(state, [batch], progress=probe)
    except StopStep as e:
        return str(e)
    finally:
        hook.remove()
    return None


def estimates(marks: dict[str, Any], n: int) -> dict[str, float | None]:
    """The whole step's time, estimated (not measured) from the forward pass and the last segments' backward."""
    fwd, bwd = marks["forward_segment_s"], marks["backward_segment_s"]
    if not bwd or len(fwd) != n:
        return {"estimate_step_s": None, "estimate_step_upper_s": None}
    ratio = sum(bwd) / sum(fwd[n - len(bwd):])  # the backward (rerun + backward) of a segment over its forward
    return {"backward_to_forward_ratio": ratio, "estimate_step_s": sum(fwd) * (1 + ratio),
            "estimate_step_upper_s": sum(fwd) + n * max(bwd)}


def check_row(row: dict[str, Any]) -> list[str]:
    """What the row lacks to be a partial step of the planned segments run (empty: none)."""
    bad = []
    n = row["segments"]
    if n < 2:
        bad.append(f"{n} segment(s): the length must exceed memory.model_segment_tokens")
    if len(row["forward_segment_s"]) != n:
        bad.append(f"the forward ran {len(row['forward_segment_s'])} of {n} segments")
    if row["backward_segments_run"] < 1 or row["backward_segments_run"] != row["backward_segments"]:
        bad.append(f"the backward ran {row['backward_segments_run']} segments, not {row['backward_segments']}")
    if row["trainable_with_grad"] != row["trainable"]:
        bad.append(f"{row['trainable_with_grad']} of {row['trainable']} trainable tensors have a gradient")
    if row["device"] != "cpu" and row.get("backward_peak_gib") is None:
        bad.append("no backward peak")
    full, fwd = row.get("full_step_loss"), row.get("forward_loss")
    if full is not None and (fwd is None or abs(fwd - full) > 1e-5 * max(1.0, abs(full))):
        bad.append(f"the forward pass's loss {fwd} is not the whole step's {full}")
    return bad


def main(argv: list[str] | None = None) -> int:
    from megaseq.bench.measure import cfg_for, plan_on
    from megaseq.config import load_config, parse_size
    from megaseq.memory.model_segments import segment_bounds
    from megaseq.train.build import kernels_for, resolve_device, use_expandable_segments
    from megaseq.train.metrics import host_peak_bytes
    from megaseq.train.step import train_step

    args = parse(argv)
    over = (SMOKE if args.smoke else []) + list(args.overrides)  # the user's overrides last: they win
    use_expandable_segments()
    cfg = cfg_for(load_config(args.recipe, over), parse_size(args.length), args.source)
    device = resolve_device(cfg)
    plan = plan_on(cfg, device)
    seg = int(plan.memory.get("model_segment_tokens") or 0)
    if not seg or cfg.data.seq_len <= seg:
        raise SystemExit(f"the plan runs no sequence segments at {cfg.data.seq_len} tokens (segment {seg}): "
                         "use a longer length, or benchmarks/lora/lora_partial_step.py for recompute")
    bounds = segment_bounds(cfg.data.seq_len, seg)
    n, k = len(bounds), min(args.backward_segments, len(bounds) - 1)
    log = args.out + ".progress.jsonl"
    open(log, "w").close()
    t0 = time.perf_counter()

    def setup(stage: str) -> None:  # printed and logged: a run stopped before its first segment says where
        line = {"phase": stage, "s": round(time.perf_counter() - t0, 1),
                "host_peak_gib": round(host_peak_bytes() / GIB, 2)}
        print(json.dumps(line), flush=True)
        with open(log, "a") as f:
            f.write(json.dumps(line) + "\n")

    with kernels_for(cfg, device):
        model, applied, next_batch, state = build(cfg, device, plan)
        setup("built")
        batch = next_batch()
        warm = min(args.warm_tokens, seg)  # one segment or less: the optimizer's state made, not the segments run
        train_step(state, [{key: v[:, :warm] if torch.is_tensor(v) else v for key, v in batch.items()}])
        build_s = time.perf_counter() - t0
        setup("warmed")
        labels = batch["labels"] if args.forward_loss or args.check_full else None
        probe = Probe(device, k, bounds, state, labels, log=log)
        stopped = partial_step(state, batch, probe)
        marks = probe.marks
        trainable = [p for p in model.parameters() if p.requires_grad]
        with_grad = sum(p.grad is not None for p in trainable)
        total = int((batch["labels"] != -100).sum())
        row: dict[str, Any] = {
            "recipe": args.recipe, "overrides": over, "seq_len": cfg.data.seq_len, "source": args.source,
            "segment_tokens": seg, "segments": n, "backward_segments": k, "stopped": stopped,
            "backward_segments_run": marks.get("backward_segments_run", 0),
            "trainable": len(trainable), "trainable_with_grad": with_grad,
            "fixes": [f[0] for f in plan.fixes], "memory_plan": dict(plan.memory), "plan_fits": plan.fits,
            "planned_peak_tensors_gib": plan.peak_gpu_tensors / GIB, "planned_peak_gpu_gib": plan.peak_gpu / GIB,
            "planned_phase_peaks_gib": {name: v / GIB for name, v in plan.phases.items()},
            "build_and_warm_s": build_s, "forward_s": marks.get("forward_s"),
            "forward_segment_s": marks["forward_segment_s"], "backward_segment_s": marks["backward_segment_s"],
            "estimates_note": "estimate_step_s and estimate_step_upper_s are estimates from the measured phases, "
                              "not a measured step; the optimizer step is not included",
            **estimates(marks, n),
            "forward_loss": None if probe.loss_sum is None else float(probe.loss_sum) / max(total, 1),
            "device": torch.cuda.get_device_name(device) if probe.cuda else "cpu", "torch": torch.__version__}
        if probe.cuda and "backward_peak" in marks:
            fp, bp = marks["forward_peak"], marks["backward_peak"]
            planned = plan.peak_gpu_tensors
            row |= {"forward_peak_gib": fp / GIB, "after_forward_gib": marks["after_forward"] / GIB,
                    "backward_peak_gib": bp / GIB, "measured_peak_gib": max(fp, bp) / GIB,
                    "plan_vs_measured": planned / max(fp, bp) - 1}
            ph = plan.phases  # the measured backward phase holds the last segment's loss too
            if "forward" in ph:
                row["plan_vs_measured_forward"] = ph["forward"] / fp - 1
            if "backward" in ph:
                row["plan_vs_measured_backward"] = max(ph["backward"], ph.get("loss", 0)) / bp - 1
        if args.check_full:  # a whole step on the same batch (the partial one updated nothing)
            state.optimizer.zero_grad(set_to_none=True)
            row["full_step_loss"] = train_step(state, [batch])[0]
    row["checks"] = check_row(row)
    with open(args.out, "w") as f:
        json.dump(row, f, indent=2, default=str)
    print(json.dumps(row, indent=2, default=str))
    applied.release()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
