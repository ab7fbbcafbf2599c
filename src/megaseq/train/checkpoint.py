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

With a frozen base (LoRA, ``train.trainable``) a checkpoint holds only what trains (the adapters and the
trained parameters, their optimizer state) and buffers: ``meta.json`` says ``"trainable_only": true``, lists
the trained names and records how to make the base again (``base``: ``model.init_from`` and the seed), with
a fingerprint of its frozen tensors that a resume checks.
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
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)

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
                    extra_meta: dict[str, Any], keep: int = 2, trainable_only: bool = False) -> Path:
    """Save model, optimizer, scheduler, RNG and data position at ``step``; returns the directory. With
    several processes every rank calls it (each writes its shards). ``trainable_only``: the model's trained
    parameters (and buffers) only, with the frozen base's fingerprint."""
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
    dcp.save(_state(model, optimizer, trainable_only), checkpoint_id=str(tmp), no_dist=not _distributed())
    _barrier()
    if _is_main():
        _write_trainer_state(tmp, optimizer, scheduler)
        meta = {**extra_meta, "step": step, "complete": True}
        if trainable_only:
            meta["trainable_only"] = True
            meta["trainable"] = sorted(n for n, p in model.named_parameters() if p.requires_grad)
            meta["base_fingerprint"] = base_fingerprint(model)
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


def _state(model: torch.nn.Module, optimizer: Any, trainable_only: bool = False) -> dict[str, Any]:
    """FQN-keyed model (+ optimizer) state that DCP saves and loads in place: FSDP2's shards as DTensors
    (MasterAdamW's masters and moments too), so a load reshards them (``trainable_only``: without the frozen
    parameters)."""
    opts = StateDictOptions(ignore_frozen_params=trainable_only)
    msd = get_model_state_dict(model, options=opts) if trainable_only else model.state_dict()
    if optimizer is None:
        return {"model": msd}
    if isinstance(optimizer, torch.optim.Optimizer):
        msd, osd = get_state_dict(model, optimizer, options=opts)
        return {"model": msd, "optim": osd}
    # OffloadStreamAdamW keeps its state in host buffers and exposes a plain state_dict
    return {"model": msd, "optim": optimizer.state_dict()}


@torch.no_grad()
def base_fingerprint(model: torch.nn.Module) -> list[float]:
    """Sum and sum of magnitudes of every frozen tensor, in float64 and 16M-element pieces: what a resume
    compares to know it rebuilt the same frozen base (another seed or checkpoint differs far beyond
    rounding). The frozen base is replicated (a frozen base under FSDP is refused): every rank's is whole."""
    total, mag = 0.0, 0.0
    for i, p in enumerate(p for p in model.parameters() if not p.requires_grad):
        for piece in p.detach().reshape(-1).split(1 << 24):
            total += (i + 1) * float(piece.sum(dtype=torch.float64))
            mag += float(piece.abs().sum(dtype=torch.float64))
    return [total, mag]


def _check_base(ckpt: Path, meta: dict[str, Any], model: torch.nn.Module) -> None:
    mine = sorted(n for n, p in model.named_parameters() if p.requires_grad)
    if meta.get("trainable") != mine:
        theirs = set(meta.get("trainable") or [])
        diff = sorted(theirs.symmetric_difference(mine))
        raise ValueError(f"checkpoint {ckpt} trained other parameters than this run does (e.g. {diff[:3]}): resume "
                         "with the lora.* and train.trainable settings that wrote it")
    want, got = meta.get("base_fingerprint"), base_fingerprint(model)
    if want and any(abs(a - b) > 1e-6 * max(abs(a), abs(b), 1e-30) for a, b in zip(want, got)):
        raise ValueError(f"checkpoint {ckpt} holds adapters for another frozen base (fingerprint {want}, this run's "
                         f"{got}): resume with the model.init_from and train.seed that wrote it")


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
    partial = bool(meta.get("trainable_only"))
    if partial:
        _check_base(ckpt, meta, model)
    state = _state(model, optimizer, partial)
    # every key of ``state`` must be in the checkpoint
    dcp.load(state, checkpoint_id=str(ckpt), no_dist=not _distributed())
    opts = StateDictOptions(ignore_frozen_params=partial, strict=not partial)
    if optimizer is None:
        model.load_state_dict(state["model"], strict=not partial)
    elif isinstance(optimizer, torch.optim.Optimizer):
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                       options=opts)
    else:
        model.load_state_dict(state["model"], strict=not partial)
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


def load_trained_state(ckpt: Path, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A trainable-only checkpoint's trained tensors, read into new tensors shaped as ``model``'s (the model
    itself untouched): what the step-0 "before" model is, given this run's frozen base."""
    meta = read_meta(ckpt)
    _check_base(Path(ckpt), meta, model)
    state = {n: torch.empty_like(p) for n, p in model.named_parameters() if p.requires_grad}
    dcp.load({"model": state}, checkpoint_id=str(ckpt), no_dist=not _distributed())
    return state


def with_trained_state(fn: Any, model: torch.nn.Module, state: dict[str, torch.Tensor]) -> Any:
    """``fn(*args)`` run with ``state``'s tensors in ``model``'s trained parameters, put back after each call."""
    params = dict(model.named_parameters())

    def run(*args: Any, **kwargs: Any) -> Any:
        kept = {n: params[n].detach().clone() for n in state}
        with torch.no_grad():
            for n, t in state.items():
                params[n].copy_(t)
        try:
            return fn(*args, **kwargs)
        finally:
            with torch.no_grad():
                for n, t in kept.items():
                    params[n].copy_(t)

    return run
