"""When a run writes its periodic checkpoints: every ``train.save_every`` steps, and every
``train.save_every_minutes`` of wall-clock time since the run (or its resume) started or last saved, so a kill
loses at most that much work. The ranks agree on a time-based save (any rank's clock past the interval saves on
every rank), since each rank writes its own shards of the checkpoint.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


class SaveSchedule:
    """``due(step)``: whether the loop should checkpoint after ``step``; ``saved()`` restarts the interval
    (call it after every checkpoint, whatever made the loop write it)."""

    def __init__(self, every_steps: int, every_minutes: float, env: Any = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.every_steps, self.interval_s = every_steps, every_minutes * 60.0
        self.env, self.clock = env, clock
        self.last = clock()

    def due(self, step: int) -> bool:
        if self.every_steps and step % self.every_steps == 0:
            return True
        if not self.interval_s:
            return False
        late = self.clock() - self.last >= self.interval_s
        if getattr(self.env, "world_size", 1) > 1:  # every rank writes its shards: all save, or none
            late = bool(self.env.all_reduce_count(1 if late else 0))
        return late

    def saved(self) -> None:
        self.last = self.clock()
