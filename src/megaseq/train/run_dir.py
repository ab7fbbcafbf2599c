"""The run directory: claim it safely, record the resolved config and the plan.

A run directory holds one run. Starting a run in a directory that already holds one is refused
unless the user asks to resume it (same model and data) or to overwrite it, so a typo in a
command line never silently mixes two runs' checkpoints and metrics.

What megaseq writes there is listed in a manifest (``MANIFEST``), written before anything else:
``--train.overwrite`` removes exactly those entries (and their temporary siblings), never a file of
the user's; a directory whose ``config.yaml`` (or another name megaseq writes) has no manifest is
someone else's and is refused either way. ``check_run_dir`` makes every decision without writing
(the trainer calls it before data or model exist); ``claim_run_dir`` repeats it and writes.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from megaseq.config import Config, LoraConfig
from megaseq.files import TMP_INFIX
from megaseq.train.checkpoint import CKPT_DIR, atomic_write_text, latest_complete, latest_resumable

logger = logging.getLogger(__name__)


CONFIG_FILE = "config.yaml"
PLAN_FILE = "plan.json"
MANIFEST = ".megaseq-run.json"
# the top-level entries a run writes; register_output adds others (always before writing them)
OUTPUTS = [CONFIG_FILE, PLAN_FILE, "metrics.jsonl", "tb", CKPT_DIR, "hf", "adapter", "eval", "loss_curve.png"]
# Sections that define what a run *is*; the others (steps, logging, ...) may change on resume.
IDENTITY = ("model", "data", "lora")


def _identity(cfg: dict[str, Any]) -> dict[str, Any]:
    # a run written before the lora section existed had no adapters: its identity holds the defaults
    return {k: cfg.get(k, dataclasses.asdict(LoraConfig()) if k == "lora" else None) for k in IDENTITY}


@dataclass
class RunDirCheck:
    """What ``check_run_dir`` decided: ``mode`` is new, replace (overwrite), rerun (a run that never got to
    train), resume or restart (resume asked, nothing resumable yet: from the start)."""

    run_dir: Path
    mode: str
    resume_from: Path | None = None
    note: str = ""


def read_manifest(run_dir: Path) -> dict[str, Any] | None:
    path = Path(run_dir) / MANIFEST
    if not path.is_file():
        return None
    try:
        manifest = json.loads(path.read_text())
    except ValueError:
        manifest = None
    names = manifest.get("outputs") if isinstance(manifest, dict) else None
    plain = isinstance(names, list) and all(isinstance(n, str) and n and Path(n).name == n and n not in (".", "..")
                                            for n in names)
    if not plain:  # only plain names inside the run directory: overwrite never reaches outside it
        raise ValueError(f"{path} is damaged (not megaseq's manifest JSON); remove the run directory by hand "
                         "or choose another --train.run_dir")
    return manifest


def _writable(run_dir: Path) -> None:
    probe = run_dir
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir():  # first: a file is not "read-only", whatever access() says of it
        raise ValueError(f"train.run_dir {run_dir}: {probe} is a file, not a directory; choose another "
                         "--train.run_dir")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise ValueError(f"train.run_dir {run_dir} cannot be written ({probe} is read-only or not yours): "
                         "choose another --train.run_dir or fix its permissions")


def check_run_dir(cfg: Config) -> RunDirCheck:
    """Decide what to do with ``cfg.train.run_dir`` without writing anything; one ValueError when the run
    cannot start there (naming the directory, what it holds and the flag to set)."""
    run_dir = Path(cfg.train.run_dir)
    _writable(run_dir)
    if not run_dir.exists() or not any(run_dir.iterdir()):
        return RunDirCheck(run_dir, "new")
    manifest = read_manifest(run_dir)
    if manifest is None and _legacy_run(run_dir):
        return _check_megaseq_dir(cfg, run_dir)
    if manifest is None:
        theirs = sorted(n for n in OUTPUTS if (run_dir / n).exists())
        if theirs:
            raise ValueError(f"run directory {run_dir} holds {', '.join(theirs)} not written by megaseq (it has no "
                             f"{MANIFEST}); megaseq neither replaces nor deletes them, even with "
                             "--train.overwrite: move them or choose another --train.run_dir")
        return RunDirCheck(run_dir, "new", note=f"{run_dir} holds other files; megaseq adds its own beside them")
    return _check_megaseq_dir(cfg, run_dir)


def _read_old_config(path: Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    try:
        old = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ValueError(f"{path} is damaged ({e}); set --train.overwrite true to replace the run, or choose "
                         "another --train.run_dir") from None
    return old if isinstance(old, dict) else {}


def _legacy_run(run_dir: Path) -> bool:
    """A run written before manifests: its config.yaml holds megaseq's sections and a checkpoint is complete."""
    try:
        old = _read_old_config(run_dir / CONFIG_FILE)
    except ValueError:
        return False
    return bool(old) and all(k in old for k in IDENTITY) and latest_complete(run_dir) is not None


def _check_megaseq_dir(cfg: Config, run_dir: Path) -> RunDirCheck:
    old = _read_old_config(run_dir / CONFIG_FILE)
    same = old is None or _identity(old) == _identity(cfg.to_dict())
    trained = latest_complete(run_dir) is not None or (run_dir / "metrics.jsonl").exists()
    if cfg.train.overwrite:
        return RunDirCheck(run_dir, "replace")
    if cfg.train.resume:
        if not same:
            diff = [k for k in IDENTITY if old.get(k) != cfg.to_dict().get(k)]
            raise ValueError(
                f"run directory {run_dir} holds a different run (its {' and '.join(diff)} settings differ); "
                "resume with the same config, choose another --train.run_dir, or set --train.overwrite true")
        last = latest_resumable(run_dir)
        if last is not None:
            return RunDirCheck(run_dir, "resume", last)
        why = ("it stopped before its first resumable checkpoint (set --train.save_every N to checkpoint "
               "during a run; SIGTERM/SIGINT also write one)") if trained else "it never started training"
        return RunDirCheck(run_dir, "restart", note=f"--train.resume: {run_dir} holds no resumable checkpoint: {why}; "
                                                   "starting again from step 0")
    if trained:
        what = "the same run" if same else "a different run"
        raise ValueError(f"run directory {run_dir} already holds {what}; set --train.resume true to continue it, "
                         "--train.overwrite true to replace it, or choose another --train.run_dir")
    return RunDirCheck(run_dir, "rerun")


def _remove(paths: list[Path]) -> None:
    for p in paths:
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        elif p.exists() or p.is_symlink():
            p.unlink()


def _temporaries(run_dir: Path, name: str) -> list[Path]:
    """What a killed write of ``name`` leaves: ``files.write_atomic``'s ``.NAME.tmp-*``, a replace's ``.old-``."""
    return [*run_dir.glob(f".{name}{TMP_INFIX}*"), *run_dir.glob(f".{name}.old-*")]


def _remove_outputs(run_dir: Path, manifest: dict[str, Any]) -> list[str]:
    """Remove what the manifest lists (and temporary siblings of those names); returns the names kept."""
    for name in manifest["outputs"]:
        _remove([run_dir / name, *_temporaries(run_dir, name)])
    (run_dir / MANIFEST).unlink(missing_ok=True)
    return sorted(p.name for p in run_dir.iterdir())


def _remove_stale_temporaries(run_dir: Path) -> None:
    """A run killed while writing config.yaml, plan.json, metrics.jsonl or the manifest left a temporary file
    beside it; the run taking the directory over removes those (of megaseq's names only, never a user's)."""
    manifest = read_manifest(run_dir) or {"outputs": []}
    for name in dict.fromkeys([MANIFEST, *OUTPUTS, *manifest["outputs"]]):
        _remove(_temporaries(run_dir, name))


def claim_run_dir(cfg: Config) -> tuple[Path, Path | None]:
    """Validate and prepare ``cfg.train.run_dir``; return (run_dir, checkpoint to resume or None)."""
    check = check_run_dir(cfg)
    run_dir = check.run_dir
    if check.mode == "replace":
        kept = _remove_outputs(run_dir, read_manifest(run_dir) or {"outputs": OUTPUTS})
        if kept:
            logger.warning(f"--train.overwrite: removed the previous run from {run_dir}; kept {len(kept)} entries "
                        f"megaseq did not write: {', '.join(kept[:5])}")
    if check.note:
        logger.info(check.note)
    run_dir.mkdir(parents=True, exist_ok=True)
    _remove_stale_temporaries(run_dir)
    _write_manifest(run_dir)
    atomic_write_text(run_dir / CONFIG_FILE, cfg.to_yaml())
    return run_dir, check.resume_from


def _write_manifest(run_dir: Path, extra: list[str] | None = None) -> None:
    manifest = read_manifest(run_dir) or {"megaseq_run": 1, "outputs": []}
    names = list(dict.fromkeys([*manifest["outputs"], *OUTPUTS, *(extra or [])]))
    atomic_write_text(run_dir / MANIFEST, json.dumps({**manifest, "outputs": names}, indent=2))


def register_output(run_dir: Path, name: str) -> None:
    """Record a top-level entry megaseq is about to write (so overwrite may remove it later)."""
    if name not in (read_manifest(run_dir) or {"outputs": []})["outputs"]:
        _write_manifest(Path(run_dir), [name])


def discard_unstarted(run_dir: Path) -> bool:
    """After a failed start: remove ``run_dir``, which this start created, unless a training step was
    recorded or a checkpoint past the starting one written (then it holds a run worth reading). True if removed.
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
