"""Stopping a run on purpose: the divergence guard and SIGTERM / SIGINT.

Divergence. ``train_step`` checks the step's loss and global gradient norm *before* the optimizer
updates the weights (both are reduced over every rank, so all ranks decide alike; with ``MasterAdamW`` in
one process the check is a device flag inside the update, which then writes nothing: no host sync before it). With
``train.on_nonfinite stop`` a non-finite value raises ``Diverged`` (a ValueError: the CLI prints it and
exits 2) naming the step, the values, the newest resumable checkpoint and the settings to change;
nothing is written for that step. With ``skip`` the step's gradients are dropped, the schedule and the
data move on, and ``MAX_SKIPPED`` non-finite steps in a row stop the run as ``stop`` would. Weights are
also checked before every checkpoint and export (``safe_checkpoint.check_finite``, ``hf_io``), so a
non-finite weight never reaches the disk even when an update with a finite gradient overflowed (the loop
then stops with ``overflowed``, naming the step and the tensor).

Signals. A batch scheduler preempts with SIGTERM; a user stops with Ctrl-C (SIGINT). ``StopSignals``
notes the first one, the loop finishes the step it is in, writes a resumable checkpoint and raises
``RunStopped`` naming it (the CLI exits 128 + the signal number, as a shell reports a killed process).
A second signal stops at once, with the signal's usual effect. Under several processes the request is
all-reduced after every step, so every rank stops after the same step.
"""

from __future__ import annotations

import math
import signal
import threading
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

MAX_SKIPPED = 5  # with on_nonfinite skip: this many non-finite steps in a row stop the run


class NonFiniteStep(Exception):
    """Raised inside ``train_step`` (which does not know the step number); the loop turns it into ``Diverged``."""

    def __init__(self, loss: float, grad_norm: float) -> None:
        super().__init__(f"loss {loss}, gradient norm {grad_norm}")
        self.loss, self.grad_norm = loss, grad_norm

    def __reduce__(self) -> tuple:  # rebuilt from both values (a bench row's worker process pickles it)
        return (NonFiniteStep, (self.loss, self.grad_norm))


class Diverged(ValueError):
    """The run stopped at a non-finite step; nothing was written for it."""


class RunStopped(Exception):
    """The run stopped on request (a signal) after saving; ``exit_code`` is what the CLI returns."""

    def __init__(self, message: str, exit_code: int, checkpoint: Path | None) -> None:
        super().__init__(message)
        self.exit_code, self.checkpoint = exit_code, checkpoint


def is_finite_step(loss: float, grad_norm: float) -> bool:
    return math.isfinite(loss) and math.isfinite(grad_norm)


def diverged(step: int, loss: float, grad_norm: float, lr: float, last: Path | None, skipped: int = 0) -> Diverged:
    """The message of a run stopped at a non-finite step."""
    run = f"; {skipped} steps in a row were not finite" if skipped else ""
    return Diverged(
        f"training diverged at step {step}: the loss is {loss} and the gradient norm {grad_norm}{run}; "
        f"the run stopped before updating the weights and wrote nothing for this step. The newest resumable "
        f"checkpoint is {last or 'none'}. Lower --optim.lr (it was {lr:g} at this step) and keep --optim.grad_clip "
        "on" + ("" if skipped else ", or set --train.on_nonfinite skip to skip such steps"))


def overflowed(step: int, why: str, lr: float, last: Path | None) -> Diverged:
    """The message of a run whose step-``step`` update (finite loss and gradient) made a weight non-finite."""
    return Diverged(
        f"training diverged at step {step}: its loss and gradient norm were finite but the update made the weights "
        f"non-finite ({why}). The newest resumable checkpoint is {last or 'none'}. Lower --optim.lr (it was "
        f"{lr:g} at this step) and keep --optim.grad_clip on")


class StopSignals:
    """Context manager: the first SIGTERM / SIGINT is noted (``received``), a second one acts at once.
    Outside the main thread (a Ray actor's worker thread) signals cannot be caught and nothing is installed."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self, log: Callable[[str], None]) -> None:
        self.log, self.received = log, None
        self._old: dict[int, Any] = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            self._old = {s: signal.signal(s, self._handle) for s in self.SIGNALS}
        return self

    def __exit__(self, *exc: Any) -> None:
        for s, old in self._old.items():
            signal.signal(s, old)
        self._old = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.received is not None:  # asked twice: stop now, as the signal would without us
            self.__exit__()
            signal.raise_signal(signum)
            return
        self.received = signum
        self.log(f"\nmegaseq: {signal.Signals(signum).name} received: finishing this step, then writing a "
                 "resumable checkpoint and stopping (send it again to stop at once, without saving)")

    def requested(self, env: Any) -> int | None:
        """The signal any rank received (all-reduced when there are several processes), or None."""
        got = self.received or 0
        if getattr(env, "world_size", 1) > 1:
            got = signal.SIGTERM if env.all_reduce_count(1 if got else 0) and not got else got
        return got or None

    @staticmethod
    def stopped(signum: int, step: int, checkpoint: Path | None) -> RunStopped:
        name = signal.Signals(signum).name
        return RunStopped(f"stopped by {name} after step {step}; resumable checkpoint {checkpoint}: continue with "
                          "the same command and --train.resume true", 128 + signum, checkpoint)
