"""``megaseq convert``: Hugging Face checkpoint <-> megaseq checkpoint.

- HF -> megaseq: ``SRC`` holds ``config.json`` + safetensors. The model is built from the config and
  filled tensor by tensor (no second full copy), then saved as a weights-only megaseq checkpoint
  (``DST/checkpoints/step_000000``) that ``megaseq eval`` and ``--model.init_from`` accept.
- megaseq -> HF: ``SRC`` is a run directory (its newest complete checkpoint) or one checkpoint
  directory. The result is a directory ``transformers`` loads with ``from_pretrained``.
"""

from __future__ import annotations

from pathlib import Path

import torch

from megaseq.models.spec import ModelSpec
from megaseq.train import checkpoint as ckpt


def load_megaseq_checkpoint(src: Path, device: str = "cpu", dtype: torch.dtype = torch.float32):
    """(model, spec, checkpoint dir) from a run directory or a checkpoint directory."""
    from megaseq.models.build import build_model

    src = Path(src)
    target = src if (src / ckpt.META).is_file() else ckpt.latest_complete(src)
    if target is None:
        raise ValueError(f"{src} holds no complete megaseq checkpoint (a run directory or checkpoints/step_N)")
    meta = ckpt.read_meta(target)
    if "spec" not in meta:
        raise ValueError(f"{target} has no model spec in its {ckpt.META}; it was not written by megaseq")
    spec = ModelSpec.from_dict(meta["spec"])
    model = build_model(spec, dtype=dtype, device=device)
    ckpt.load_checkpoint(target, model)
    return model, spec, target


def convert(src: Path, dst: Path) -> Path:
    from megaseq.models.hf_io import export_hf_checkpoint, load_hf_checkpoint

    src, dst = Path(src), Path(dst)
    if not src.exists():
        raise ValueError(f"convert: {src} does not exist")
    if (src / "config.json").is_file():
        if dst.exists() and any(dst.iterdir()):
            raise ValueError(f"convert: {dst} is not empty; choose a new directory")
        model, spec = _load_hf(src, load_hf_checkpoint)
        return ckpt.save_checkpoint(dst, 0, model, None, None,
                                    {"spec": spec.to_dict(), "source": str(src)}, keep=10**9)
    model, spec, target = load_megaseq_checkpoint(src)
    meta = ckpt.read_meta(target)
    source = meta.get("init_from") or meta.get("source")  # the HF checkpoint it came from, if still there
    carry = source if source and (Path(source) / "config.json").is_file() else None
    export_hf_checkpoint(model, spec, dst, carry_from=carry)
    return dst


def _load_hf(src: Path, load_hf_checkpoint):
    from megaseq.models.build import build_model
    from megaseq.models.spec import from_hf_config

    spec = from_hf_config(src)
    model = build_model(spec, dtype=torch.float32, device="cpu")
    load_hf_checkpoint(src, model=model, spec=spec)
    return model, spec
