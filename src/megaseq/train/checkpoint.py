"""Resumable checkpoints with torch's distributed checkpoint (DCP), written atomically.

Layout of a run directory's ``checkpoints/``::

    step_000020/            a complete checkpoint: DCP shards + meta.json (written last)
    step_000040.tmp-1234/   an interrupted write: never loaded, removed by the next save

A checkpoint is trusted only when its directory has no ``.tmp`` suffix and holds ``meta.json``
with ``"complete": true``. The directory is written under a temporary name and renamed when
everything, ``meta.json`` last, is on disk, so a crash at any point leaves nothing a resume
would load.

Several processes (``torch.distributed`` initialised, world > 1): every rank calls ``save_checkpoint`` and
``load_checkpoint``. DCP writes each rank's shards (FSDP2 DTensors: model, fp32 masters, moments; a
tensor held whole by several ranks is written once) into the temporary directory, whose name rank 0 chose;
after a barrier rank 0 writes the trainer state and ``meta.json`` and renames it. A load reads the shards
each rank's tensors need, whatever mesh wrote them: a 4-rank checkpoint resumes on 2 ranks or on 1 (DCP
reshards).
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
import torch.distributed as dist
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


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _is_main() -> bool:
    return not _distributed() or dist.get_rank() == 0


def _barrier() -> None:
    if _distributed():
        dist.barrier()


def _tmp_name(final: Path) -> Path:
    """The temporary directory of a save: rank 0's pid in its name, agreed by every rank."""
    box = [os.getpid()]
    if _distributed():
        dist.broadcast_object_list(box, src=0)
    return final.with_name(f"{final.name}.tmp-{box[0]}")


def save_checkpoint(run_dir: Path, step: int, model: torch.nn.Module, optimizer: Any | None, scheduler: Any | None,
                    extra_meta: dict[str, Any], keep: int = 2) -> Path:
    """Save model, optimizer, scheduler, RNG and data position at ``step``; returns the directory. With
    several processes every rank calls it (each writes its shards)."""
    run_dir = Path(run_dir)
    final = _step_dir(run_dir, step)
    tmp = _tmp_name(final)
    if _is_main():
        for stale in final.parent.glob("*.tmp-*") if final.parent.exists() else []:
            shutil.rmtree(stale, ignore_errors=True)
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    _barrier()
    # one process writes everything without collectives; several write their own shards
    dcp.save(_state(model, optimizer), checkpoint_id=str(tmp), no_dist=not _distributed())
    _barrier()
    if _is_main():
        _write_trainer_state(tmp, optimizer, scheduler)
        meta = {**extra_meta, "step": step, "complete": True}
        atomic_write_text(tmp / META, json.dumps(meta, indent=2))
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        _prune(run_dir, keep, protect={final})
    _barrier()
    return final


def _write_trainer_state(tmp: Path, optimizer: Any | None, scheduler: Any | None) -> None:
    """The scheduler and the RNG state (rank 0's: a step draws no random numbers)."""
    if optimizer is not None:
        torch.save({"scheduler": scheduler.state_dict() if scheduler is not None else None, "rng": rng_state()},
                   tmp / "trainer_state.pt")


def _prune(run_dir: Path, keep: int, protect: set[Path]) -> None:
    found = list_complete(run_dir)
    # step 0 is the "before" model that evaluation compares against: keep it.
    candidates = [p for s, p in found if s != 0 and p not in protect]
    for p in candidates[: max(0, len(candidates) - max(keep - 1, 0))]:
        shutil.rmtree(p, ignore_errors=True)


def _state(model: torch.nn.Module, optimizer: Any) -> dict[str, Any]:
    """FQN-keyed model (+ optimizer) state that DCP saves and loads in place: FSDP2's shards as DTensors
    (MasterAdamW's masters and moments too), so a load reshards them."""
    if optimizer is None:
        return {"model": model.state_dict()}
    if isinstance(optimizer, torch.optim.Optimizer):
        msd, osd = get_state_dict(model, optimizer)
        return {"model": msd, "optim": osd}
    # OffloadStreamAdamW keeps its state in host buffers and exposes a plain state_dict
    return {"model": model.state_dict(), "optim": optimizer.state_dict()}


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
    dcp.load(state, checkpoint_id=str(ckpt), no_dist=not _distributed())
    if optimizer is None:
        model.load_state_dict(state["model"])
    elif isinstance(optimizer, torch.optim.Optimizer):
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    else:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optim"])
    if optimizer is not None:
        _read_trainer_state(ckpt, scheduler)
    return meta


def _read_trainer_state(ckpt: Path, scheduler: Any | None) -> None:
    if not (ckpt / "trainer_state.pt").is_file():
        raise ValueError(f"{ckpt} holds model weights only (no optimizer state): it cannot be resumed")
    trainer_state = torch.load(ckpt / "trainer_state.pt", weights_only=False)
    if scheduler is not None and trainer_state["scheduler"] is not None:
        scheduler.load_state_dict(trainer_state["scheduler"])
    set_rng_state(trainer_state["rng"])
