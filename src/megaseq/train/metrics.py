"""Per-step metrics: ``metrics.jsonl``, TensorBoard events, and progress (a bar, or plain lines in a log).

Every record is one JSON object per line, flushed at once, so a crashed run keeps its history.
On resume the file is truncated to the steps the checkpoint had reached, so the history stays
one consistent curve.
"""

from __future__ import annotations

import json
import logging
import resource
import sys
import time
from pathlib import Path
from typing import Any

import torch

from megaseq.console import TO_STDOUT
from megaseq.plan.stream import IN_FLIGHT

logger = logging.getLogger(__name__)


def host_peak_bytes() -> int:
    """Peak resident set size of this process (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def gpu_peak_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return 0


def moe_load(model: torch.nn.Module) -> dict[str, float]:
    """max/mean tokens per expert for every MoE layer that recorded its routing."""
    out = {}
    for name, mod in model.named_modules():
        counts = getattr(mod, "last_tokens_per_expert", None)
        if counts is None:
            continue
        c = counts.double()
        mean = c.mean().item()
        out[name] = (c.max().item() / mean) if mean > 0 else 0.0
    return out


def _step_of(line: str) -> float:
    try:
        return json.loads(line).get("step", 0)
    except (ValueError, AttributeError):
        return float("inf")  # empty, or cut short by a kill


def _duration(seconds: float) -> str:
    """3725 -> '1h02m', 125 -> '2m05s', 7.2 -> '7s'."""
    s = int(round(seconds))
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    if s >= 60:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s}s"


def step_line(record: dict[str, Any], total: int, eta_s: float | None) -> str:
    """One plain line per logged step, for logs and pipes: step, loss, tokens/s, memory, ETA."""
    parts = [f"step {record['step']}/{total}", f"loss {record['loss']:.4f}",
             f"{record['tokens_per_s']:,.0f} tok/s", f"{record['step_s']:.2f} s/step"]
    if record.get("gpu_peak_gib"):
        parts.append(f"gpu {record['gpu_peak_gib']:.1f} GiB (plan {record.get('plan_gpu_gib', 0):.1f})")
    parts.append(f"host {record['host_peak_gib']:.1f} GiB")
    if eta_s is not None:
        parts.append(f"ETA {_duration(eta_s)}")
    return " | ".join(parts)


def over_plan(record: dict[str, Any], run_dir: str) -> str | None:
    """A warning when a step's tensors (``max_memory_allocated``) outgrew the plan's whole GPU figure (its tensors,
    the allocator's reserve and the CUDA context): the plan is wrong for this run, so a longer sequence it says
    fits may not. None otherwise, and without a GPU figure."""
    peak, plan = record.get("gpu_peak_gib") or 0.0, record.get("plan_gpu_gib") or 0.0
    if not peak or not plan or peak <= plan:
        return None
    return (f"step {record['step']}: the GPU peak, {peak:.1f} GiB of tensors, is above the plan's {plan:.1f} GiB "
            f"(+{peak / plan - 1:.0%}): the plan misses memory this run uses, so a length it says fits may run out "
            f"of memory; the plan and the settings are in {run_dir}/plan.json and config.yaml")


def scheme_drift(record: dict[str, Any]) -> str | None:
    """A warning when a step's memory schemes kept more on the GPU than the plan counts: SCO put fewer layer
    inputs in host memory than planned (the rest stayed on the GPU), or more streamed layers than the two in
    flight were on the device at once. None otherwise, and for a run without these schemes."""
    lines = []
    done, planned = record.get("offloaded_layers"), record.get("plan_offloaded_layers")
    if done is not None and planned and done < planned:
        lines.append(f"memory.checkpoint_offload put {done} of the plan's {planned} layer inputs in host memory; the "
                     f"other {planned - done} stayed on the GPU")
    resident = record.get("streamed_layers_resident") or 0
    if resident > IN_FLIGHT:
        lines.append(f"memory.stream_base had {resident} layers on the GPU at once; the plan counts "
                     f"{IN_FLIGHT}")
    if not lines:
        return None
    return f"step {record['step']}: " + "; ".join(lines) + " (the plan's figures are in plan.json)"


def eval_line(record: dict[str, Any]) -> str:
    """The held-out record of ``train.eval_every`` in words, with the baselines beside it."""
    key = next(k for k in record if k.startswith("eval_bits_per_"))
    unit = key.removeprefix("eval_bits_per_")
    line = f"eval step {record['step']} | held-out {record[key]:.4f} bits per {unit}"
    base = record.get(f"eval_baseline_bits_per_{unit}")
    if base is not None:
        word = "beats" if record[key] < base else "does not beat"
        line += f" | {word} {record['eval_baseline']} ({base:.4f})"
    uniform = record.get(f"eval_uniform_bits_per_{unit}")
    if uniform is not None:
        line += f" | uniform {uniform:.4f}"
    return line + f" | {record['eval_tokens']:,} tokens in {_duration(record['eval_s'])}"


class MetricsLogger:
    """Writes metrics.jsonl and TensorBoard scalars; shows progress (rank 0 only: ``enabled``).

    With ``progress``: a live bar on a terminal; plain lines (``step_line``, ``eval_line``, and a line
    every ``quiet_s`` seconds inside long steps and evaluations) when stdout is a pipe or a batch log.
    """

    def __init__(self, run_dir: Path, total_steps: int, start_step: int = 0, tensorboard: bool = True,
                 progress: bool = True, enabled: bool = True, tty: bool | None = None, quiet_s: float = 30.0,
                 evals_left: int = 0) -> None:
        self.enabled = enabled
        self.path = Path(run_dir) / "metrics.jsonl"
        self.total, self.start = total_steps, start_step
        self.quiet_s, self.evals_left = quiet_s, evals_left
        self._tb = None
        self._bar = None
        self._eval_task = None
        self.lines = False
        self._step_s: list[float] = []
        self._eval_s: list[float] = []
        self._last_note = 0.0
        if not enabled:
            return
        self._truncate(start_step)
        self._file = open(self.path, "a")
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(str(Path(run_dir) / "tb"), purge_step=start_step + 1)
            except ImportError:  # tensorboard is a dependency, but keep training if it is broken
                logger.warning("warning: tensorboard unavailable; metrics go to metrics.jsonl only")
        tty = sys.stdout.isatty() if tty is None else tty
        if progress and tty:
            from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

            self._bar = Progress(TextColumn("[bold]{task.description}"), BarColumn(),
                                 TextColumn("{task.completed}/{task.total}"), TextColumn("{task.fields[info]}"),
                                 TimeRemainingColumn(), transient=False)
            self._task = self._bar.add_task("train", total=total_steps, completed=start_step, info="")
            self._bar.start()
        self.lines = progress and not tty
        self._t0 = time.perf_counter()

    def _truncate(self, start_step: int) -> None:
        """Keep the records up to ``start_step``, atomically (a kill here loses nothing); a line a kill cut
        short can only be a step after the checkpoint, and goes with them."""
        if not self.path.exists():
            return
        from megaseq.train.checkpoint import atomic_write_text

        keep = [ln for ln in self.path.read_text().splitlines() if _step_of(ln) <= start_step]
        atomic_write_text(self.path, "".join(ln + "\n" for ln in keep))

    def eta(self, step: int) -> float | None:
        """Seconds left: the mean step time so far times the steps left, plus the evaluations left."""
        if not self._step_s:
            return None
        mean_eval = sum(self._eval_s) / len(self._eval_s) if self._eval_s else 0.0
        return sum(self._step_s) / len(self._step_s) * (self.total - step) + mean_eval * self.evals_left

    def _write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._tb is not None:
            for k, v in record.items():
                if isinstance(v, (int, float)) and k != "step":
                    self._tb.add_scalar(k, v, record["step"])
                elif isinstance(v, dict):
                    for kk, vv in v.items():
                        self._tb.add_scalar(f"{k}/{kk}", vv, record["step"])

    def log(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        self._step_s.append(record["step_s"])
        self._write(record)
        step = record["step"]
        if self.lines:
            logger.info(step_line(record, self.total, self.eta(step)), extra=TO_STDOUT)
        if self._bar is not None:
            info = f"loss {record['loss']:.4f}  {record['tokens_per_s']:.0f} tok/s"
            if record.get("gpu_peak_gib"):
                info += f"  gpu {record['gpu_peak_gib']:.1f} GiB"
            info += f"  host {record['host_peak_gib']:.1f} GiB"
            self._bar.update(self._task, completed=step, info=info)

    def log_eval(self, record: dict[str, Any]) -> None:
        """A held-out record (``train.eval_every``): metrics.jsonl, TensorBoard and one line."""
        if not self.enabled:
            return
        self._eval_s.append(record["eval_s"])
        self.evals_left = max(self.evals_left - 1, 0)
        self._write(record)
        if self._eval_task is not None:
            self._bar.remove_task(self._eval_task)
            self._eval_task = None
        if self._bar is not None:
            self._bar.console.print(eval_line(record))
        elif self.lines:
            logger.info(eval_line(record), extra=TO_STDOUT)

    def eval_progress(self, done: int, total: int) -> None:
        """Progress of a held-out evaluation, window by window: its own bar, or a line now and then."""
        if not self.enabled:
            return
        if self._bar is not None:
            if self._eval_task is None:
                self._eval_task = self._bar.add_task("eval", total=total, info="held-out windows")
            self._bar.update(self._eval_task, completed=done)
        elif self.lines:
            self._note(f"eval: window {done}/{total}", first=done == 1, last=done == total)

    def _note(self, text: str, first: bool = False, last: bool = False) -> None:
        """A plain line, at most every ``quiet_s`` seconds (and always at the first and the last)."""
        now = time.perf_counter()
        if first or last or now - self._last_note >= self.quiet_s:
            self._last_note = now
            logger.info(text, extra=TO_STDOUT)

    def substep(self, what: str, done: int, total: int) -> None:
        """Progress inside a long step (sequence segments): shown on the bar until the step's record."""
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.update(self._task, info=f"{what} segment {done + 1}/{total}")
        elif self.lines:
            self._note(f"  {what} segment {done + 1}/{total}")

    def close(self) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.stop()
        if self._tb is not None:
            self._tb.close()
        self._file.close()
