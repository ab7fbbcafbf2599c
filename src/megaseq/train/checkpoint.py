"""Resumable checkpoints with torch's distributed checkpoint (DCP), written atomically.

Layout of a run directory's ``checkpoints/``::

    step_000020/            a complete checkpoint: DCP shards + meta.json (written last)
    step_000040.tmp-1234/   an interrupted write: never loaded, removed by the next save

A checkpoint is trusted only when its directory has no ``.tmp`` suffix and holds ``meta.json``
with ``"complete": true``. The directory is written under a temporary name and renamed when
everything, ``meta.json`` last, is on disk, so a crash at any point leaves nothing a resume
would load.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

# One process without torch.distributed is a supported case, not a warning.
warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)

CKPT_DIR = "checkpoints"
META = "meta.json"


def _step_dir(run_dir: Path, step: int) -> Path:
    return run_dir / CKPT_DIR / f"step_{step:06d}"


def atomic_write_text(path: Path, text: str) -> None:
    """Write a file via a temp file + rename, so readers never see half of it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def rng_state() -> dict[str, Any]:
    state = {
        "torch": torch.get_rng_state(),
        "numpy": np.random.get_state(),
        "python": random.getstate(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def list_complete(run_dir: Path) -> list[tuple[int, Path]]:
    """(step, path) of every complete checkpoint, oldest first."""
    root = Path(run_dir) / CKPT_DIR
    if not root.is_dir():
        return []
    out = []
    for p in root.iterdir():
        if not p.is_dir() or ".tmp" in p.name or not p.name.startswith("step_"):
            continue
        meta = p / META
        try:
            ok = json.loads(meta.read_text()).get("complete") is True
        except (OSError, ValueError):
            ok = False
        if ok:
            out.append((int(p.name.split("_")[1]), p))
    return sorted(out)


def latest_complete(run_dir: Path) -> Path | None:
    found = list_complete(run_dir)
    return found[-1][1] if found else None


def save_checkpoint(run_dir: Path, step: int, model: torch.nn.Module, optimizer: Any | None, scheduler: Any | None,
                    extra_meta: dict[str, Any], keep: int = 2) -> Path:
    """Save model, optimizer, scheduler, RNG and data position at ``step``; returns the directory."""
    run_dir = Path(run_dir)
    final = _step_dir(run_dir, step)
    tmp = final.with_name(f"{final.name}.tmp-{os.getpid()}")
    for stale in final.parent.glob("*.tmp-*") if final.parent.exists() else []:
        shutil.rmtree(stale, ignore_errors=True)
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    # parameters are replicated over the ranks, so one rank writes the whole state: no collectives
    dcp.save(_state(model, optimizer), checkpoint_id=str(tmp), no_dist=True)
    if optimizer is not None:
        torch.save({"scheduler": scheduler.state_dict() if scheduler is not None else None, "rng": rng_state()},
                   tmp / "trainer_state.pt")
    meta = {**extra_meta, "step": step, "complete": True}
    atomic_write_text(tmp / META, json.dumps(meta, indent=2))
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    _prune(run_dir, keep, protect={final})
    return final


def _prune(run_dir: Path, keep: int, protect: set[Path]) -> None:
    found = list_complete(run_dir)
    # step 0 is the "before" model that evaluation compares against: keep it.
    candidates = [p for s, p in found if s != 0 and p not in protect]
    for p in candidates[: max(0, len(candidates) - max(keep - 1, 0))]:
        shutil.rmtree(p, ignore_errors=True)


def _state(model: torch.nn.Module, optimizer: Any) -> dict[str, Any]:
    """FQN-keyed model (+ optimizer) state that DCP saves and loads in place."""
    if optimizer is None:
        return {"model": model.state_dict()}
    if isinstance(optimizer, torch.optim.Optimizer):
        msd, osd = get_state_dict(model, optimizer)
        return {"model": msd, "optim": osd}
    # OffloadStreamAdamW keeps its state in host buffers and exposes a plain state_dict
    return {"model": model.state_dict(), "optim": optimizer.state_dict()}


def is_random_init(meta: dict[str, Any]) -> bool:
    """Whether a checkpoint holds untrained random weights: step 0 of a run that did not start from
    ``model.init_from`` (its meta says ``"init": "random"``, or nothing in runs written before the field),
    and not a converted Hugging Face checkpoint (``"source"``)."""
    return meta.get("step") == 0 and not meta.get("source") and meta.get("init", "random") == "random"


def read_meta(ckpt: Path) -> dict[str, Any]:
    meta = Path(ckpt) / META
    if not meta.is_file():
        raise ValueError(f"{ckpt} is not a complete megaseq checkpoint (no {META}); it may be an interrupted write")
    data = json.loads(meta.read_text())
    if data.get("complete") is not True:
        raise ValueError(f"{ckpt} is marked incomplete; refusing to load it")
    return data


def load_checkpoint(ckpt: Path, model: torch.nn.Module, optimizer: Any = None, scheduler: Any = None,
                    expected_spec: dict[str, Any] | None = None) -> dict[str, Any]:
    """Load a complete checkpoint in place; returns its meta (step, data position, ...)."""
    ckpt = Path(ckpt)
    meta = read_meta(ckpt)
    if expected_spec is not None and meta.get("spec") != expected_spec:
        diff = sorted(k for k in set(expected_spec) | set(meta.get("spec") or {})
                      if (meta.get("spec") or {}).get(k) != expected_spec.get(k))
        raise ValueError(
            f"checkpoint {ckpt} is of a different model (fields differ: {', '.join(diff[:6])}); "
            "resume with the config that wrote it, or start a new run directory"
        )
    state = _state(model, optimizer)
    dcp.load(state, checkpoint_id=str(ckpt), no_dist=True)
    if optimizer is None:
        model.load_state_dict(state["model"])
    elif isinstance(optimizer, torch.optim.Optimizer):
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    else:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optim"])
    if optimizer is not None:
        if not (ckpt / "trainer_state.pt").is_file():
            raise ValueError(f"{ckpt} holds model weights only (no optimizer state): it cannot be resumed")
        trainer_state = torch.load(ckpt / "trainer_state.pt", weights_only=False)
        if scheduler is not None and trainer_state["scheduler"] is not None:
            scheduler.load_state_dict(trainer_state["scheduler"])
        set_rng_state(trainer_state["rng"])
    return meta
