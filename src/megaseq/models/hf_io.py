"""Hugging Face checkpoints in and out: safetensors files (single or sharded), tensor by tensor.

Loading streams one tensor at a time (``safe_open``) into the parameters of an already-built model,
so host memory never holds a second copy of the weights; the family's ``StateDictAdapter``
(``models/<family>/state_dict_adapter.py``) says which megaseq tensor, or which slice of a fused one,
each checkpoint key fills, and what is skipped. Every tensor must be filled exactly once: a missing
tensor or a wrong shape is one error naming it. A parameter sharded by FSDP2 (a DTensor, split along dim 0)
gets only this rank's rows: a plain key is read as the slice ``[a, b)`` of its rows (safetensors reads only
those bytes), an expert's key only when the expert is one of the rank's, a fused part only where its rows
meet the rank's; no rank reads, or holds, a whole tensor it does not own.

Export writes what ``save_pretrained`` of transformers writes (the on-disk format, per-expert keys):
``config.json`` from ``models.spec.to_hf_config`` plus shards of at most ``max_shard_bytes`` and, when
there is more than one, ``model.safetensors.index.json``; all into a temporary directory renamed into place.
Under FSDP every rank calls it: each tensor is gathered whole in turn (``full_tensor``) and rank 0 writes.
A tensor that is not finite stops the export (nothing appears). ``carry_from`` (the checkpoint the run
started from) copies the tensors megaseq does not model (a vision tower, the MTP layer) into the export
unchanged, so it is the source checkpoint with the text model replaced.

``check_hf_checkpoint`` runs the load's whole mapping on shapes alone (a meta-device model, safetensors
headers): an empty, truncated or mismatched checkpoint is refused before a run sets anything up. Every
error names the file.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from megaseq.models.common.state_dict_adapter import StateDictAdapter
from megaseq.models.registry import family_module
from megaseq.models.spec import ModelSpec, from_hf_config, to_hf_config

DEFAULT_MAX_SHARD_BYTES = 5 * 2**30


def adapter_for(spec: ModelSpec) -> StateDictAdapter:
    """The family's key mapping (``models/<family>/state_dict_adapter.py``)."""
    return family_module(spec.family, "state_dict_adapter").ADAPTER


# ---- loading ----------------------------------------------------------------------------------
def _checkpoint_files(path: Path) -> dict[Path, list[str] | None]:
    """Safetensors files of a checkpoint and, for a sharded one, the keys each holds."""
    index = path / "model.safetensors.index.json"
    single = path / "model.safetensors"
    if index.is_file():
        files: dict[Path, list[str] | None] = {}
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{index} is not a valid safetensors index ({type(e).__name__}: {e})") from None
        for key, fname in weight_map.items():
            files.setdefault(path / fname, []).append(key)  # type: ignore[union-attr]
        absent = [str(f) for f in files if not f.is_file()]
        if absent:
            raise ValueError(f"{index} names shard files that do not exist: {absent[:3]}")
        return files
    if single.is_file():
        return {single: None}
    if any(path.glob("pytorch_model*.bin")):
        raise ValueError(f"{path} holds pytorch_model*.bin weights (pickles); megaseq reads safetensors only: "
                         "convert them (transformers' save_pretrained writes safetensors)")
    raise ValueError(f"no model.safetensors or model.safetensors.index.json in {path}: "
                     "pass a Hugging Face checkpoint directory")


@contextmanager
def _open(file: Path) -> Iterator[Any]:
    """``safe_open`` with an empty, truncated or damaged file named in one ValueError."""
    from safetensors import SafetensorError, safe_open

    try:
        handle = safe_open(str(file), framework="pt", device="cpu")
    except (SafetensorError, OSError) as e:
        size = file.stat().st_size if file.exists() else 0
        raise ValueError(f"{file} is not a readable safetensors file ({size} bytes: {e}); it is empty, truncated "
                         "or damaged: download or copy it again") from None
    with handle as f:
        yield f


def load_hf_checkpoint(path: str | Path, model: nn.Module | None = None, spec: ModelSpec | None = None,
                       dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> nn.Module:
    """Copy a HF checkpoint into ``model`` (built from ``config.json`` when None) and return the model.

    Raises ValueError for an unsupported architecture, missing tensors (first few and the count),
    tensors of the wrong shape (name, expected, got) or a directory that is not a checkpoint.
    """
    path = Path(path)
    if spec is None:
        spec = from_hf_config(path)  # ValueError for an unsupported model_type
    if model is None:
        from megaseq.models.build import build_model

        model = build_model(spec, dtype=dtype, device=device, seed=0)
    from megaseq.models.common.lora import is_adapter

    # the base weights only: LoRA adapters, if the model has them already, are not in a HF checkpoint
    targets = {k: v for k, v in model.state_dict(keep_vars=True).items() if not is_adapter(k)}
    unexpected = _map_checkpoint(path, spec, targets, _fill_into)
    if unexpected:
        warnings.warn(f"{len(unexpected)} checkpoint tensors have no place in the {spec.family} model and "
                      f"were ignored, e.g. {unexpected[:5]}", stacklevel=2)
    return model


def check_hf_checkpoint(path: str | Path, spec: ModelSpec) -> None:
    """Everything ``load_hf_checkpoint`` would refuse (unreadable files, missing tensors, wrong shapes), from
    the safetensors headers and a meta-device model: no weight is read or allocated."""
    from megaseq.models.build import build_model

    model = build_model(spec, dtype=torch.float32, device="meta", seed=0)

    def shape_only(dst: torch.Tensor, index: tuple | None, f: Any, key: str) -> bool:
        part = dst if index is None else dst[index]  # meta tensors: indexing allocates nothing
        _check_shape(tuple(f.get_slice(key).get_shape()), tuple(part.shape), key)
        return True

    _map_checkpoint(Path(path), spec, dict(model.state_dict(keep_vars=True)), shape_only)


def _map_checkpoint(path: Path, spec: ModelSpec, targets: dict[str, torch.Tensor],
                    fill: Callable[[torch.Tensor, tuple | None, Any, str], bool]) -> list[str]:
    """Walk every checkpoint key through the family's adapter, ``fill(target, index, file, key)`` each (index
    None: the whole target; else an expert or a fused part of it; returns whether this rank holds any of it),
    check that every model tensor (this rank's rows of an FSDP shard) was filled exactly; returns the keys
    that have no place in the model."""
    adapter = adapter_for(spec)
    filled: set[int] = set()  # ids of tensors written whole
    sliced: dict[str, set[str]] = {}
    unexpected: list[str] = []
    with torch.no_grad():
        for file, keys in _checkpoint_files(path).items():
            with _open(file) as opened:
                f = adapter.reader(opened)
                present = set(f.keys())
                for key in keys if keys is not None else present:
                    if key not in present:
                        raise ValueError(f"{file} lacks tensor {key}, which its index lists: the shard is "
                                         "damaged or from another checkpoint")
                    name = adapter.model_name(key, spec.num_layers)
                    if name is None:
                        continue
                    if name in targets:
                        fill(targets[name], None, f, key)
                        filled.add(id(targets[name]))
                    elif (routed := adapter.route(name, targets)) is not None:
                        target, index, slice_id = routed
                        if fill(targets[target], index, f, key):
                            sliced.setdefault(target, set()).add(slice_id)
                    elif 0 not in f.get_slice(key).get_shape():
                        unexpected.append(key)
                    # else an empty tensor (a 0-size shared expert, as transformers builds for n_shared_experts
                    # 0): it holds no weight, and the model has no such block, which computes the same
    _check_complete(targets, filled, sliced, adapter)
    return unexpected


def _is_dtensor(t: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def local_rows(t: torch.Tensor) -> tuple[int, int]:
    """``[a, b)``: the rows (dim 0) of a tensor this rank holds (all of a whole tensor; FSDP2's shard of a
    DTensor, replicated over any other mesh dim)."""
    if not _is_dtensor(t):
        return 0, t.shape[0]
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    assert all(p.is_replicate() or (p.is_shard() and p.dim == 0) for p in t.placements), t.placements
    shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    return offset[0], offset[0] + shape[0]


def _fill(dst: torch.Tensor, f: Any, key: str) -> None:
    """The key's tensor into ``dst``; only this rank's rows of it for an FSDP shard."""
    if not _is_dtensor(dst):
        _copy(dst, f.get_tensor(key), key)
        return
    sl = f.get_slice(key)
    _check_shape(tuple(sl.get_shape()), tuple(dst.shape), key)
    a, b = local_rows(dst)
    if b > a:
        dst.to_local().copy_(sl[a:b])


def _fill_part(dst: torch.Tensor, index: tuple, f: Any, key: str) -> bool:
    """The key's tensor into ``dst[index]`` (an expert ``(j, ...)`` or a dim-0 part ``(slice, ...)`` of a fused
    tensor); under FSDP only where it meets this rank's rows. Returns whether this rank holds any of it."""
    if not _is_dtensor(dst):
        _copy(dst[index], f.get_tensor(key), key)
        return True
    a, b = local_rows(dst)
    head, rest = index[0], index[1:]
    out = dst.to_local()
    if isinstance(head, int):
        if not a <= head < b:
            return False
        _copy(out[(head - a, *rest)], f.get_tensor(key), key)
        return True
    lo, hi = max(head.start, a), min(head.stop, b)
    if lo >= hi:
        return False
    sl = f.get_slice(key)
    _check_shape(tuple(sl.get_shape())[:1], (head.stop - head.start,), key)
    _copy(out[(slice(lo - a, hi - a), *rest)], sl[lo - head.start:hi - head.start], key)
    return True


def _copy(dst: torch.Tensor, src: torch.Tensor, key: str) -> None:
    _check_shape(tuple(src.shape), tuple(dst.shape), key)
    dst.copy_(src)


def _fill_into(dst: torch.Tensor, index: tuple | None, f: Any, key: str) -> bool:
    """``_map_checkpoint``'s fill for a real load: whole targets through ``_fill``, parts through
    ``_fill_part`` (each rank reads only its rows of an FSDP shard)."""
    if index is None:
        _fill(dst, f, key)
        return True
    return _fill_part(dst, index, f, key)


def _check_shape(got: tuple, want: tuple, key: str) -> None:
    if got != want:
        raise ValueError(f"checkpoint tensor {key} has shape {got}, the model expects "
                         f"{want}: config.json and the weights disagree, or the spec is wrong")


def _check_complete(targets: dict[str, torch.Tensor], filled: set[int], sliced: dict[str, set[str]],
                    adapter: StateDictAdapter) -> None:
    missing = []
    for name, t in targets.items():
        if id(t) in filled:  # tied weights count once
            continue
        need = _parts_needed(adapter, name, t)
        if need and name not in sliced:
            missing.append(name)
        elif need and len(sliced[name]) < need:
            missing.append(f"{name} ({len(sliced[name])} of {need} parts)")
    if missing:
        raise ValueError(f"checkpoint is missing {len(missing)} tensors the model needs, e.g. {missing[:5]}; "
                         "check that config.json matches the weights")


def _parts_needed(adapter: StateDictAdapter, name: str, t: torch.Tensor) -> int:
    """Slices that fill a fused target (only those meeting this rank's rows for an FSDP shard); 1 for a
    plain tensor."""
    if not _is_dtensor(t):
        return adapter.slices_needed(name, t) if _is_fused(adapter, name) else 1
    a, b = local_rows(t)
    if name.endswith(".experts.gate_up_proj"):
        return 2 * (b - a)
    if name.endswith(".experts.down_proj"):
        return b - a
    for _, suffix, parts in adapter.part_fusions:
        if name.endswith("." + suffix):
            size = t.shape[0] // len(parts)
            return sum(1 for i in range(len(parts)) if max(i * size, a) < min((i + 1) * size, b))
    return 1


def _is_fused(adapter: StateDictAdapter, name: str) -> bool:
    return name.endswith((".experts.gate_up_proj", ".experts.down_proj")) or any(
        name.endswith("." + suffix) for _, suffix, _ in adapter.part_fusions)


# ---- export -----------------------------------------------------------------------------------
def export_hf_checkpoint(model: nn.Module, spec: ModelSpec, out_dir: str | Path,
                         max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
                         dtype: torch.dtype | None = None, carry_from: str | Path | None = None,
                         merged: bool = False) -> Path:
    """Write ``model`` as a HF checkpoint transformers loads (``from_pretrained``); returns ``out_dir``.

    ``dtype`` casts every tensor (None keeps each tensor's dtype). LoRA adapters are left out, or with
    ``merged`` folded into their weights (``models.common.lora.base_items``, one weight at a time). At most
    one shard is held in host memory at a time. The directory appears complete or not at all; a non-finite
    tensor is a ValueError naming it, and nothing is written. ``carry_from``: a HF checkpoint whose tensors
    megaseq does not model
    (vision tower, MTP layer) are copied in unchanged. With several processes every rank calls it (FSDP2's
    shards are gathered one tensor at a time, and every rank checks each gathered tensor, so a non-finite
    one raises on all of them alike) and rank 0 writes.
    """
    out_dir = Path(out_dir)
    if not _writes():  # several processes: take part in every gather (FSDP's shards) and check, write nothing
        for _ in _tensors_to_export(model, spec, dtype, None, merged):
            pass
        _barrier()
        return out_dir
    config = to_hf_config(spec)
    tmp = out_dir.parent / f".{out_dir.name}.tmp-{os.getpid()}"
    for pattern in (f".{out_dir.name}.tmp-*", f".{out_dir.name}.old-*"):  # left by a killed export
        for stale in out_dir.parent.glob(pattern):
            shutil.rmtree(stale, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        _write_export(model, spec, config, tmp, max_shard_bytes, dtype, carry_from, merged)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if e.filename and str(e.filename).startswith(str(tmp)):  # a write failed: name the export, not its temp
            raise OSError(e.errno, e.strerror, f"{out_dir} (the HF export)") from e
        raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _replace_dir(tmp, out_dir)
    _barrier()
    return out_dir


def _tensors_to_export(model: nn.Module, spec: ModelSpec, dtype: torch.dtype | None,
                       carry_from: str | Path | None, merged: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """The model's base tensors in on-disk form (LoRA adapters left out, or folded in with ``merged``; each
    checked finite), then the source's unmodelled ones."""
    from megaseq.models.common.lora import base_items

    for key, t in adapter_for(spec).hf_items(model, spec.tie_word_embeddings, dtype, base_items(model, merged)):
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise ValueError(f"tensor {key} holds NaN or infinite values: the HF export was not written")
        yield key, t
    if carry_from is None:
        return
    adapter = adapter_for(spec)
    for file, keys in _checkpoint_files(Path(carry_from)).items():
        with _open(file) as f:
            for key in keys if keys is not None else f.keys():
                if adapter.carried(key, spec.num_layers):
                    yield key, f.get_tensor(key)


def _write_export(model: nn.Module, spec: ModelSpec, config: dict[str, Any], tmp: Path, max_shard_bytes: int,
                  dtype: torch.dtype | None, carry_from: str | Path | None, merged: bool = False) -> None:
    shards: list[dict[str, torch.Tensor]] = [{}]
    names: list[str] = []
    size = total = 0

    def flush() -> None:
        names.append(f"shard-{len(names):05d}.safetensors")
        save_safetensors(shards[-1], tmp / names[-1])
        shards[-1] = {}

    first_dtype = None
    for key, t in _tensors_to_export(model, spec, dtype, carry_from, merged):
        first_dtype = first_dtype or t.dtype
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            flush()
            size = 0
        shards[-1][key] = t
        size, total = size + nbytes, total + nbytes
    if shards[-1] or not names:
        flush()
    weight_map = _name_shards(tmp, names)
    config["dtype"] = str(first_dtype).removeprefix("torch.")
    (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    if len(names) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def default_file_mode() -> int:
    """The mode ``open`` gives a new file under this process's umask (0644 under the usual 022)."""
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


def save_safetensors(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """safetensors' ``save_file`` with the file's mode as ``open`` would give it (safetensors writes through
    a private temporary file: 0600), and its I/O failures (a full disk, a read-only file system) raised as
    the OSError they are, naming the file: safetensors reports them as ``SafetensorError("...IoError(Os {
    code: 28, ...")``, which the CLI would print as a traceback."""
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    try:
        save_file(tensors, str(path), metadata={"format": "pt"})
    except SafetensorError as e:
        code = re.search(r"code: (\d+)", str(e))
        if code is None:
            raise
        err = int(code.group(1))
        raise OSError(err, os.strerror(err), str(path)) from e
    os.chmod(path, default_file_mode())


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _writes() -> bool:
    """Whether this process writes the export (rank 0 of several, or the only one)."""
    return not _distributed() or dist.get_rank() == 0


def _barrier() -> None:
    if _distributed():
        dist.barrier()


def _name_shards(tmp: Path, names: list[str]) -> dict[str, str]:
    """Rename shards to transformers' names now that their count is known; key -> file name."""
    from safetensors import safe_open

    weight_map = {}
    for i, name in enumerate(names):
        n = len(names)
        final = "model.safetensors" if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        os.replace(tmp / name, tmp / final)
        with safe_open(str(tmp / final), framework="pt") as f:
            weight_map.update({k: final for k in f.keys()})
    return weight_map


def _replace_dir(tmp: Path, out_dir: Path) -> None:
    """Move the finished ``tmp`` to ``out_dir``; an old ``out_dir`` is removed only after the rename."""
    old = None
    if out_dir.exists():
        old = out_dir.parent / f".{out_dir.name}.old-{os.getpid()}"
        os.replace(out_dir, old)
    os.replace(tmp, out_dir)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
