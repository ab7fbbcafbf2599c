"""Resumable checkpoints with torch's distributed checkpoint (DCP), written atomically.

Layout of a run directory's ``checkpoints/``::

    step_000020/            a complete checkpoint: DCP shards + meta.json (written last)
    step_000040.tmp-1234/   an interrupted write: never loaded, removed by the next save

A checkpoint is trusted only when its directory has no ``.tmp`` suffix and holds ``meta.json``
with ``"complete": true``. The directory is written under a temporary name and renamed when
everything, ``meta.json`` last, is on disk, so a crash at any point leaves nothing a resume
would load. It is *resumable* only when it also holds the optimizer and trainer state
(``"resumable": true``; the step-0 "before" weights are not). Nothing in it is unpickled, and a model
with a non-finite weight is never saved (``safe_checkpoint``).

Several processes (``torch.distributed`` initialised, world > 1): every rank calls ``save_checkpoint`` and
``load_checkpoint``. DCP writes each rank's shards (FSDP2 DTensors: model, fp32 masters, moments; a
tensor held whole by several ranks is written once) into the temporary directory, whose name rank 0 chose;
after a barrier rank 0 writes the trainer state and ``meta.json`` and renames it. Every rank checks its own
shards for non-finite values and the ranks agree (one all-gather) before a byte is written, and a failed
write on any rank is the same ValueError on every rank (no rank is left waiting at a barrier). A load reads
the shards each rank's tensors need, whatever mesh wrote them: a 4-rank checkpoint resumes on 2 ranks or
on 1 (DCP reshards).

With a frozen base (LoRA, ``train.trainable``) a checkpoint holds only what trains (the adapters and the
trained parameters, their optimizer state) and buffers: ``meta.json`` says ``"trainable_only": true``, lists
the trained names and records how to make the base again (``base``: ``model.init_from`` and the seed), with
a fingerprint of its frozen tensors that a resume checks.
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)

from megaseq.files import write_atomic
from megaseq.train import safe_checkpoint as safe

# One process without torch.distributed is a supported case, not a warning.
warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)

CKPT_DIR = "checkpoints"
META = "meta.json"


def _step_dir(run_dir: Path, step: int) -> Path:
    return run_dir / CKPT_DIR / f"step_{step:06d}"


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` with ``files.write_atomic``: the one name through which a checkpoint's, the run directory's
    and the metrics' small files are written."""
    write_atomic(path, text)


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


def run_dir_of(target: Path) -> Path | None:
    """The run directory a target belongs to (the target itself, or two levels above a checkpoint); None for a
    checkpoint outside any run (e.g. written by ``megaseq convert``)."""
    if (target / "config.yaml").is_file():
        return target
    if (target / META).is_file():
        return target.parent.parent if (target.parent.parent / "config.yaml").is_file() else None
    raise ValueError(f"{target} is neither a megaseq run directory nor a checkpoint")


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


def _agree(why: str | None) -> str | None:
    """Every rank's failure (None: none) made the same on all of them: the first rank's that failed."""
    if not _distributed():
        return why
    everyone: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, why)
    return next((w for w in everyone if w is not None), None)


def is_resumable(ckpt: Path) -> bool:
    """A complete checkpoint holding the full training state (written with an optimizer)."""
    try:
        meta = json.loads((Path(ckpt) / META).read_text())
    except (OSError, ValueError):
        return False
    return meta.get("resumable", (Path(ckpt) / safe.TRAINER_STATE).is_file()) is True


def latest_resumable(run_dir: Path) -> Path | None:
    """The newest checkpoint a resume can continue from (weights-only ones are skipped)."""
    found = [p for _, p in list_complete(run_dir) if is_resumable(p)]
    return found[-1] if found else None


def save_checkpoint(run_dir: Path, step: int, model: torch.nn.Module, optimizer: Any | None, scheduler: Any | None,
                    extra_meta: dict[str, Any], keep: int = 2, trainable_only: bool = False) -> Path:
    """Save model, optimizer, scheduler, RNG and data position at ``step``; returns the directory. With
    several processes every rank calls it (each writes its shards). ``trainable_only``: the model's trained
    parameters (and buffers) only, with the frozen base's fingerprint.

    Refused (``safe_checkpoint.NonFiniteWeights``) before anything is written when a weight (on any rank) is
    not finite; a failed write (full disk, read-only directory) removes its temporary directory and is one
    ValueError naming the checkpoint, the cause and the newest checkpoint still on disk."""
    run_dir = Path(run_dir)
    final = _step_dir(run_dir, step)
    _check_finite_everywhere(model, f"checkpoint {final}")
    tmp = _tmp_name(final)
    state = _state(model, optimizer, trainable_only)
    why = _agree(_failure(lambda: _prepare(tmp, final), tmp) if _is_main() else None)
    if why is None:  # one process writes everything without collectives; several write their own shards
        why = _agree(_failure(lambda: dcp.save(state, checkpoint_id=str(tmp), no_dist=not _distributed()), tmp))
    if why is None:  # rank 0: the trainer state, meta.json last, the rename
        meta = {**extra_meta, "step": step, "complete": True, "resumable": optimizer is not None}
        if trainable_only:
            meta["trainable_only"] = True
            meta["trainable"] = sorted(n for n, p in model.named_parameters() if p.requires_grad)
            meta["base_fingerprint"] = base_fingerprint(model)
        why = _agree(_failure(lambda: _finish(tmp, final, optimizer, scheduler, meta), tmp) if _is_main() else None)
    if why is not None:
        if _is_main():
            shutil.rmtree(tmp, ignore_errors=True)
        last = latest_resumable(run_dir)
        raise ValueError(f"could not write checkpoint {final}: {why}. The newest resumable checkpoint is "
                         f"{last or 'none'}; free space or fix the directory, then continue with "
                         "--train.resume true") from None
    if _is_main():
        _prune(run_dir, keep, protect={final})
    _barrier()
    return final


def _check_finite_everywhere(model: torch.nn.Module, what: str) -> None:
    """``safe_checkpoint.check_finite`` on this rank's tensors (an FSDP shard each), agreed by every rank."""
    try:
        safe.check_finite(model, what)
        why = None
    except safe.NonFiniteWeights as e:
        why = str(e)
    why = _agree(why)
    if why is not None:
        raise safe.NonFiniteWeights(why)


def _failure(write: Any, tmp: Path) -> str | None:
    """Run ``write()``; None, or one sentence for what a full disk or a read-only directory raised."""
    try:
        write()
    except (OSError, RuntimeError, CheckpointException) as e:
        return safe.write_failure(e, tmp)
    return None


def _prepare(tmp: Path, final: Path) -> None:
    for stale in final.parent.glob("*.tmp-*") if final.parent.exists() else []:
        shutil.rmtree(stale, ignore_errors=True)
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)


def _finish(tmp: Path, final: Path, optimizer: Any, scheduler: Any, meta: dict[str, Any]) -> None:
    """The trainer state (the scheduler and rank 0's RNG: a step draws no random numbers), ``meta.json``
    last, then the rename."""
    if optimizer is not None:
        atomic_write_text(tmp / safe.TRAINER_STATE, safe.trainer_state_json(scheduler))
    atomic_write_text(tmp / META, json.dumps(meta, indent=2))
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)


def _prune(run_dir: Path, keep: int, protect: set[Path]) -> None:
    found = list_complete(run_dir)
    # the starting checkpoint is the "before" model that evaluation compares against: keep it.
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
    rounding). Under FSDP each rank sums its shards and the sums are added over the shard mesh (DTensor's
    partial sum), so every rank gets the whole base's fingerprint, up to rounding; each mesh and placement
    (FSDP's shards over every rank, the routed experts split over ep and replicated over dp) is summed apart."""
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    whole, sharded = [0.0, 0.0], {}
    for i, p in enumerate(p for p in model.parameters() if not p.requires_grad):
        local, acc = p.detach(), whole
        if isinstance(local, DTensor):
            placements = tuple(Partial() if isinstance(q, Shard) else Replicate() for q in local.placements)
            acc = sharded.setdefault((local.device_mesh, placements), [0.0, 0.0])
            local = local.to_local()
        for piece in local.reshape(-1).split(1 << 24):
            acc[0] += (i + 1) * float(piece.sum(dtype=torch.float64))
            acc[1] += float(piece.abs().sum(dtype=torch.float64))
    for (mesh, placements), acc in sharded.items():  # the same parameters in the same order on every rank
        t = torch.tensor(acc, dtype=torch.float64, device=mesh.device_type)
        total = DTensor.from_local(t, mesh, list(placements)).full_tensor().tolist()
        whole = [whole[0] + total[0], whole[1] + total[1]]
    return whole


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


def is_random_init(meta: dict[str, Any]) -> bool:
    """Whether a checkpoint holds untrained random weights: the starting checkpoint of a run that did not start from
    ``model.init_from`` (its meta says ``"init": "random"``, or nothing in runs written before the field),
    and not a converted Hugging Face checkpoint (``"source"``)."""
    return meta.get("step") == 0 and not meta.get("source") and meta.get("init", "random") == "random"


def read_meta(ckpt: Path) -> dict[str, Any]:
    meta = Path(ckpt) / META
    if not meta.is_file():
        raise ValueError(f"{ckpt} is not a complete megaseq checkpoint (no {META}); it may be an interrupted write")
    try:
        data = json.loads(meta.read_text())
    except ValueError as e:
        raise ValueError(f"{meta} is not valid JSON ({e}); the checkpoint is damaged") from None
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
    if optimizer is not None and not is_resumable(ckpt):
        raise ValueError(f"{ckpt} holds model weights only (no optimizer state): it cannot be resumed")
    partial = bool(meta.get("trainable_only"))
    if partial:
        _check_base(ckpt, meta, model)
    state = _state(model, optimizer, partial)
    try:  # every key of ``state`` must be in the checkpoint
        dcp.load(state, checkpoint_id=str(ckpt), no_dist=not _distributed(), **safe.safe_load_kwargs(ckpt))
    except CheckpointException as e:
        inner = next(iter(e.failures.values()))[0] if e.failures else e
        if isinstance(inner, ValueError):
            raise ValueError(str(inner)) from None
        if optimizer is not None and "optim.param_groups" in str(inner):
            raise ValueError(
                f"checkpoint {ckpt}: its optimizer holds other parameter groups than this run's (with "
                "model.train_indexer the trained DSA indexers are groups of their own, their AdamW epsilon times "
                "model.indexer_loss_coef), so it cannot be resumed; start a new run from its weights: "
                f"megaseq export {ckpt} DIR (--merged with LoRA), then --model.init_from DIR") from None
        raise ValueError(f"checkpoint {ckpt} could not be read ({type(inner).__name__}: {inner}); it is damaged "
                         "or was not written by megaseq") from None
    opts = StateDictOptions(ignore_frozen_params=partial, strict=not partial)
    if optimizer is None:
        model.load_state_dict(state["model"], strict=not partial)
    elif isinstance(optimizer, torch.optim.Optimizer):
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                       options=opts)
    else:
        model.load_state_dict(state["model"], strict=not partial)
        optimizer.load_state_dict(state["optim"])
    try:
        safe.check_finite(model, "")
    except safe.NonFiniteWeights as e:
        raise ValueError(f"checkpoint {ckpt}: {str(e).split(',')[0]}; it is not loaded (resume from an earlier "
                         "checkpoint: move this one away)") from None
    if optimizer is not None:
        safe.load_trainer_state(ckpt, scheduler)
    return meta


def load_trained_state(ckpt: Path, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A trainable-only checkpoint's trained tensors, read into new tensors shaped as ``model``'s (the model
    itself untouched): what the step-0 "before" model is, given this run's frozen base."""
    meta = read_meta(ckpt)
    _check_base(Path(ckpt), meta, model)
    state = {n: torch.empty_like(p) for n, p in model.named_parameters() if p.requires_grad}
    dcp.load({"model": state}, checkpoint_id=str(ckpt), no_dist=not _distributed(),
             **safe.safe_load_kwargs(ckpt))
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
