"""The run directory: claim it safely, record the resolved config and the plan.

A run directory holds one run. Starting a run in a directory that already holds one is refused
unless the user asks to resume it (same model and data) or to overwrite it, so a typo in a
command line never silently mixes two runs' checkpoints and metrics.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import yaml

from megaseq.config import Config
from megaseq.train.checkpoint import atomic_write_text, latest_complete

CONFIG_FILE = "config.yaml"
PLAN_FILE = "plan.json"
# Sections that define what a run *is*; the others (steps, logging, ...) may change on resume.
IDENTITY = ("model", "data")


def _identity(cfg: dict[str, Any]) -> dict[str, Any]:
    return {k: cfg.get(k) for k in IDENTITY}


def claim_run_dir(cfg: Config) -> tuple[Path, Path | None]:
    """Validate and prepare ``cfg.train.run_dir``; return (run_dir, checkpoint to resume or None)."""
    run_dir = Path(cfg.train.run_dir)
    existing = run_dir / CONFIG_FILE
    resume_from = None
    if existing.is_file():
        old = yaml.safe_load(existing.read_text()) or {}
        same = _identity(old) == _identity(cfg.to_dict())
        latest = latest_complete(run_dir)
        if cfg.train.overwrite:
            shutil.rmtree(run_dir)
        elif cfg.train.resume:
            if not same:
                diff = [k for k in IDENTITY if old.get(k) != cfg.to_dict().get(k)]
                raise ValueError(
                    f"run directory {run_dir} holds a different run (its {' and '.join(diff)} settings differ); "
                    "resume with the same config, choose another --train.run_dir, or set --train.overwrite true"
                )
            resume_from = latest
        elif latest is not None or (run_dir / "metrics.jsonl").exists():
            what = "the same run" if same else "a different run"
            raise ValueError(
                f"run directory {run_dir} already holds {what}; set --train.resume true to continue it, "
                "--train.overwrite true to replace it, or choose another --train.run_dir"
            )
    elif cfg.train.resume and run_dir.exists() and any(run_dir.iterdir()):
        raise ValueError(f"--train.resume: {run_dir} holds no megaseq run ({CONFIG_FILE} missing)")
    run_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_text(run_dir / CONFIG_FILE, cfg.to_yaml())
    return run_dir, resume_from


def discard_unstarted(run_dir: Path) -> bool:
    """After a failed start: remove ``run_dir``, which this start created, unless a training step was
    recorded or a checkpoint past step 0 written (then it holds a run worth reading). True if removed.
    Only for directories the start created: an existing run (resume, overwrite) is never touched here."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return False
    metrics = run_dir / "metrics.jsonl"
    stepped = metrics.is_file() and any(ln.strip() for ln in metrics.read_text().splitlines())
    latest = latest_complete(run_dir)
    if stepped or (latest is not None and latest.name != "step_000000"):
        return False
    shutil.rmtree(run_dir, ignore_errors=True)
    return True


def write_plan(run_dir: Path, plan_dict: dict[str, Any]) -> None:
    atomic_write_text(Path(run_dir) / PLAN_FILE, json.dumps(plan_dict, indent=2, default=str))
