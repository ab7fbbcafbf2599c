"""Per-step metrics: ``metrics.jsonl``, TensorBoard events, and a progress bar.

Every record is one JSON object per line, flushed at once, so a crashed run keeps its history.
On resume the file is truncated to the steps the checkpoint had reached, so the history stays
one consistent curve.
"""

from __future__ import annotations

import json
import resource
import sys
import time
from pathlib import Path
from typing import Any

import torch


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


class MetricsLogger:
    """Writes metrics.jsonl and TensorBoard scalars; draws the progress bar."""

    def __init__(self, run_dir: Path, total_steps: int, start_step: int = 0, tensorboard: bool = True,
                 progress: bool = True, enabled: bool = True) -> None:
        self.enabled = enabled
        self.path = Path(run_dir) / "metrics.jsonl"
        self.total = total_steps
        self._tb = None
        self._bar = None
        if not enabled:
            return
        self._truncate(start_step)
        self._file = open(self.path, "a")
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(str(Path(run_dir) / "tb"), purge_step=start_step + 1)
            except ImportError:  # tensorboard is a dependency, but keep training if it is broken
                print("warning: tensorboard unavailable; metrics go to metrics.jsonl only", file=sys.stderr)
        if progress:
            from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

            self._bar = Progress(TextColumn("[bold]train"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                                 TextColumn("{task.fields[info]}"), TimeRemainingColumn(), transient=False)
            self._task = self._bar.add_task("train", total=total_steps, completed=start_step, info="")
            self._bar.start()
        self._t0 = time.perf_counter()

    def _truncate(self, start_step: int) -> None:
        """Keep the records up to ``start_step``, atomically (a kill here loses nothing); a line a kill cut
        short can only be a step after the checkpoint, and goes with them."""
        if not self.path.exists():
            return
        from megaseq.train.checkpoint import atomic_write_text

        keep = [ln for ln in self.path.read_text().splitlines() if _step_of(ln) <= start_step]
        atomic_write_text(self.path, "".join(ln + "\n" for ln in keep))

    def log(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        step = record["step"]
        if self._tb is not None:
            for k, v in record.items():
                if isinstance(v, (int, float)) and k != "step":
                    self._tb.add_scalar(k, v, step)
                elif isinstance(v, dict):
                    for kk, vv in v.items():
                        self._tb.add_scalar(f"{k}/{kk}", vv, step)
        if self._bar is not None:
            info = f"loss {record['loss']:.4f}  {record['tokens_per_s']:.0f} tok/s"
            if record.get("gpu_peak_gib"):
                info += f"  gpu {record['gpu_peak_gib']:.1f} GiB"
            info += f"  host {record['host_peak_gib']:.1f} GiB"
            self._bar.update(self._task, completed=step, info=info)

    def substep(self, what: str, done: int, total: int) -> None:
        """Progress inside a long step (sequence segments): shown on the bar until the step's record."""
        if self._bar is not None:
            self._bar.update(self._task, info=f"{what} segment {done + 1}/{total}")

    def close(self) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.stop()
        if self._tb is not None:
            self._tb.close()
        self._file.close()
