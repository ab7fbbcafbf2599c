"""What a run checks before it writes anything, reads data or allocates a weight.

The settings themselves are checked when the config is built (``config``: types, ranges, duplicate
keys). Here: the run directory (``run_dir.check_run_dir``: writable, ours, resumable or not) and the
starting weights (``model.init_from``: every safetensors header readable, every tensor present with the
model's shape, checked on a meta-device model), each refusal one ValueError naming the setting or file.
``check_disk_space`` follows once the model exists: a disk that cannot hold one resumable checkpoint
would fail the run at its first save, so it is refused before the first step.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch

from megaseq.config import Config
from megaseq.train.run_dir import RunDirCheck, check_run_dir

GIB = 2**30


def preflight(cfg: Config, spec: Any) -> RunDirCheck:
    """The run directory and the starting weights; nothing is written."""
    check = check_run_dir(cfg)
    if cfg.model.init_from:
        check_init_from(cfg.model.init_from, spec)
    return check


def check_init_from(path: str, spec: Any) -> None:
    """``model.init_from`` is a HF checkpoint whose tensors fill ``spec``'s model exactly."""
    from megaseq.models.hf_io import check_hf_checkpoint

    p = Path(path)
    if not p.exists():
        raise ValueError(f"model.init_from {p} does not exist: give a Hugging Face checkpoint directory")
    if not p.is_dir():
        raise ValueError(f"model.init_from {p} is a file: give the directory holding config.json and the "
                         "safetensors weights")
    try:
        check_hf_checkpoint(p, spec)
    except ValueError as e:
        raise ValueError(f"model.init_from {p}: {e} (model.name gives the architecture: the checkpoint's own "
                         "directory or its config.json)") from None


def checkpoint_bytes(model: torch.nn.Module, trainable_only: bool = False) -> int:
    """A lower bound on one resumable checkpoint: the weights and AdamW's two moments of the same size.
    ``trainable_only`` (a frozen base: LoRA, ``train.trainable``): the checkpoint holds the trained parameters
    with their moments and the buffers, not the frozen base (``checkpoint.save_checkpoint``)."""
    if not trainable_only:
        return 3 * sum(t.numel() * t.element_size() for t in model.state_dict().values())
    trained = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    return 3 * trained + sum(b.numel() * b.element_size() for b in model.buffers())


def check_disk_space(run_dir: Path, model: torch.nn.Module, trainable_only: bool = False) -> None:
    need = checkpoint_bytes(model, trainable_only)
    free = shutil.disk_usage(run_dir).free
    if free < need:
        raise ValueError(f"train.run_dir {run_dir} has {free / GIB:.2f} GiB free, but one resumable checkpoint of "
                         f"this model needs at least {need / GIB:.2f} GiB: free space or choose another "
                         "--train.run_dir")
