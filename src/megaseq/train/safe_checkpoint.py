"""What a checkpoint may hold and how it is read back: no pickled code, no non-finite weights, no half writes.

A checkpoint may come from someone else, so reading one must never run code:

- the trainer state (LR schedule, RNG streams) is ``trainer_state.json``: numbers, strings and base64 bytes;
- DCP's own files are read through ``SafeReader`` / ``SafePlanner``: DCP pickles its ``.metadata`` and the
  non-tensor values of a state dict (optimizer hyper-parameters) and loads them with ``pickle.load`` and
  ``torch.load(weights_only=False)``; here ``.metadata`` goes through an unpickler that resolves only DCP's
  metadata classes and torch's dtypes/sizes, and the values through ``torch.load(weights_only=True)``.
  Anything else is a ValueError naming the file.

``check_finite`` stops a save before a byte is written when a weight is NaN or infinite, and
``write_failure`` turns what a full disk or a read-only directory raises inside DCP (a
``CheckpointException`` wrapping, for a full disk, an ``unexpected pos`` RuntimeError) into one sentence.
"""

from __future__ import annotations

import base64
import builtins
import collections
import io
import json
import pathlib
import pickle
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.planner import ReadItem

TRAINER_STATE = "trainer_state.json"
LEGACY_TRAINER_STATE = "trainer_state.pt"  # pickled: refused


# ---- trainer state as JSON ------------------------------------------------------------------
def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.cpu().numpy().tobytes()).decode("ascii")


def _unb64(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8).clone()


def rng_to_json() -> dict[str, Any]:
    """torch (CPU and CUDA), numpy and Python RNG states as plain JSON values."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    version, internal, gauss_next = random.getstate()
    state: dict[str, Any] = {
        "torch": _b64(torch.get_rng_state()),
        "numpy": {"kind": kind, "keys": keys.tolist(), "pos": int(pos), "has_gauss": int(has_gauss),
                  "gauss": float(gauss)},
        "python": {"version": version, "internal": list(internal), "gauss_next": gauss_next},
    }
    if torch.cuda.is_available():
        state["cuda"] = [_b64(s) for s in torch.cuda.get_rng_state_all()]
    return state


def rng_from_json(state: dict[str, Any]) -> None:
    torch.set_rng_state(_unb64(state["torch"]))
    n = state["numpy"]
    np.random.set_state((n["kind"], np.array(n["keys"], dtype=np.uint32), n["pos"], n["has_gauss"], n["gauss"]))
    p = state["python"]
    random.setstate((p["version"], tuple(p["internal"]), p["gauss_next"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([_unb64(s) for s in state["cuda"]])


def trainer_state_json(scheduler: Any) -> str:
    sched = scheduler.state_dict() if scheduler is not None else None
    if sched is not None:  # LambdaLR keeps its lambdas as None; everything else is numbers
        sched = {k: v for k, v in sched.items() if k != "lr_lambdas"}
    return json.dumps({"scheduler": sched, "rng": rng_to_json()})


def load_trainer_state(ckpt: Path, scheduler: Any) -> None:
    """The schedule and RNG streams of a resumable checkpoint (JSON; a pickled one is refused)."""
    path = Path(ckpt) / TRAINER_STATE
    if not path.is_file():
        if (Path(ckpt) / LEGACY_TRAINER_STATE).is_file():
            raise ValueError(f"{ckpt} keeps its trainer state in {LEGACY_TRAINER_STATE} (a pickle, from an older "
                             "megaseq); unpickling can run arbitrary code, so it is not read: start a new run or "
                             "continue it with the megaseq version that wrote it")
        raise ValueError(f"{ckpt} has no {TRAINER_STATE}: it holds model weights only and cannot be resumed")
    try:
        state = json.loads(path.read_text())
    except ValueError as e:
        raise ValueError(f"{path} is not valid JSON ({e}); the checkpoint is damaged") from None
    if scheduler is not None and state.get("scheduler") is not None:
        scheduler.load_state_dict({**state["scheduler"], "lr_lambdas": [None] * len(scheduler.lr_lambdas)})
    rng_from_json(state["rng"])


# ---- reading DCP without running code -------------------------------------------------------
def _allowed_globals() -> dict[tuple[str, str], Any]:
    from torch.distributed.checkpoint import metadata as md

    allowed: dict[tuple[str, str], Any] = {
        (md.__name__, name): getattr(md, name) for name in dir(md) if isinstance(getattr(md, name), type)}
    from torch.distributed.checkpoint import filesystem as fs

    allowed[(fs.__name__, "_StorageInfo")] = fs._StorageInfo
    for name in ("Size", "device", "dtype", "layout", "memory_format"):
        allowed[("torch", name)] = getattr(torch, name)
    for name in dir(torch):
        obj = getattr(torch, name, None)
        if isinstance(obj, (torch.dtype, torch.layout, torch.memory_format)):
            allowed[("torch", name)] = obj
    allowed[("torch.serialization", "_get_layout")] = torch.serialization._get_layout  # a layout by name
    allowed[("collections", "OrderedDict")] = collections.OrderedDict
    for name in ("Path", "PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"):  # the checkpoint id
        allowed[("pathlib", name)] = getattr(pathlib, name)
    for name in ("set", "frozenset", "tuple", "list", "dict", "slice", "complex", "getattr"):
        allowed[("builtins", name)] = getattr(builtins, name)
    return allowed


class _MetadataUnpickler(pickle.Unpickler):
    """Resolves only DCP metadata classes and torch's dtype/size types; ``getattr`` only on torch."""

    def __init__(self, file: Any, path: Path) -> None:
        super().__init__(file)
        self.path, self.allowed = path, _allowed_globals()

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in self.allowed:
            found = self.allowed[(module, name)]
            if name == "getattr":
                return _torch_getattr
            return found
        raise ValueError(f"{self.path} references {module}.{name}, which a DCP checkpoint's metadata never "
                         "needs; it was not written by megaseq (or was tampered with), so it is not loaded")


def _torch_getattr(obj: Any, name: str) -> Any:
    if obj is not torch or not isinstance(getattr(torch, name, None), (torch.dtype, torch.layout,
                                                                         torch.memory_format)):
        raise ValueError(f"checkpoint metadata asks for getattr({obj!r}, {name!r}); refused")
    return getattr(torch, name)


class SafeReader(FileSystemReader):
    """``FileSystemReader`` whose ``.metadata`` is read with ``_MetadataUnpickler``."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        from torch.distributed.checkpoint.metadata import StorageMeta

        rank = kwargs.get("rank")
        path = Path(self._get_metadata_path(rank))
        if not path.is_file():
            raise ValueError(f"{path} is missing: {self.path} is not a complete DCP checkpoint")
        try:
            metadata = _MetadataUnpickler(io.BytesIO(path.read_bytes()), path).load()
        except (pickle.UnpicklingError, EOFError, AttributeError, TypeError) as e:
            raise ValueError(f"{path} is damaged ({type(e).__name__}: {e})") from None
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafePlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` whose non-tensor values load with ``weights_only=True`` (no code)."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        from torch.distributed.checkpoint._traverse import set_element

        try:
            loaded = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as e:
            raise ValueError(f"checkpoint value {read_item.dest_index.fqn} is not plain data ({e}); refused") from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


def safe_load_kwargs(ckpt: Path) -> dict[str, Any]:
    """What ``dcp.load`` takes to read ``ckpt`` without unpickling code. The metadata is read once here
    first, so a refused or damaged one is one clean ValueError rather than DCP's logged fallbacks."""
    SafeReader(str(ckpt)).read_metadata()
    return {"storage_reader": SafeReader(str(ckpt)), "planner": SafePlanner()}


# ---- what may be written --------------------------------------------------------------------
class NonFiniteWeights(ValueError):
    """A weight is NaN or infinite: nothing is written."""


def check_finite(model: torch.nn.Module, what: str) -> None:
    """Raise ``NonFiniteWeights`` naming the first non-finite parameter or buffer before ``what`` is written."""
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        t = t.to_local() if hasattr(t, "to_local") else t
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise NonFiniteWeights(f"{name} holds NaN or infinite values, so {what} was not written")


def write_failure(exc: BaseException, where: Path) -> str:
    """One sentence for a failed write (full disk, read-only or permission denied) at ``where``."""
    inner: BaseException = exc
    if isinstance(exc, CheckpointException):
        inner = next(iter(exc.failures.values()))[0] if exc.failures else exc
    if isinstance(inner, OSError) and inner.strerror:
        return f"{inner.strerror} ({inner.filename or where})"
    probe = where if where.exists() else where.parent
    try:
        free = shutil.disk_usage(probe).free
    except OSError:
        free = None
    if free is not None and free < 2**20:
        return f"no space left on the device of {probe} ({free} bytes free)"
    return f"{type(inner).__name__}: {inner}"
