"""``megaseq convert``: Hugging Face checkpoint <-> megaseq checkpoint; ``megaseq export``: a run's adapter.

- HF -> megaseq: ``SRC`` holds ``config.json`` + safetensors. The model is built from the config and
  filled tensor by tensor (no second full copy), then saved as a weights-only megaseq checkpoint
  (``DST/checkpoints/step_000000``) that ``megaseq eval`` and ``--model.init_from`` accept.
- megaseq -> HF: ``SRC`` is a run directory (its newest complete checkpoint) or one checkpoint
  directory. The result is a directory ``transformers`` loads with ``from_pretrained``.
- ``export``: a LoRA run's adapter in PEFT's format (``peft.PeftModel.from_pretrained`` loads it on the
  transformers model of the base), or the merged model (adapters folded into the base) as a HF checkpoint.
  A trainable-only checkpoint is loaded by making its frozen base again (``model.init_from``, the seed).
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
    base = meta.get("base")
    model = build_model(spec, dtype=dtype, device=device, seed=base["seed"] if base else None)
    if base:  # a trainable-only checkpoint: the frozen base made again as the run made it, then its adapters
        _rebuild_base(model, spec, base)
    ckpt.load_checkpoint(target, model)
    return model, spec, target


def _rebuild_base(model: torch.nn.Module, spec: ModelSpec, base: dict) -> None:
    from megaseq.config import AdapterSettings, LoraConfig
    from megaseq.models.common.lora import apply_adapters

    if base.get("init_from"):
        from megaseq.models.hf_io import load_hf_checkpoint

        if not Path(base["init_from"]).exists():
            raise ValueError(f"the checkpoint's frozen base comes from {base['init_from']}, which is gone: put that "
                             "HF checkpoint back there to load its adapters")
        load_hf_checkpoint(base["init_from"], model=model, spec=spec)
    lora = LoraConfig(**{**base["lora"], "init_from": None})
    apply_adapters(model, AdapterSettings(lora, tuple(base.get("trainable") or ()), base["seed"]))


def export(src: Path, dst: Path, merged: bool = False) -> Path:
    """``megaseq export``: a run or checkpoint as a HF checkpoint; with LoRA adapters their PEFT adapter
    directory, or with ``merged`` the HF checkpoint with the adapters folded into the base."""
    from megaseq.models.hf_io import export_hf_checkpoint
    from megaseq.models.peft_io import export_adapter, targets_of

    model, spec, target = load_megaseq_checkpoint(Path(src))
    base = ckpt.read_meta(target).get("base") or {}
    if targets_of(model) and not merged:
        from megaseq.config import LoraConfig

        out = export_adapter(model, spec, LoraConfig(**{**base["lora"], "init_from": None}), Path(dst),
                             base.get("init_from"))
    else:
        out = export_hf_checkpoint(model, spec, Path(dst), merged=merged)
    write_run_tokenizer_of(target, out)
    return out


def write_run_tokenizer_of(target: Path, out: Path) -> list[str]:
    """The tokenizer files of the run a checkpoint belongs to (its ``config.yaml``'s data settings) beside an
    export of it, as the end-of-run export writes them; nothing for a checkpoint outside a run."""
    import yaml

    from megaseq.config import build_config
    from megaseq.data.run_tokenizer import write_run_tokenizer

    run_dir = target if (target / "config.yaml").is_file() else target.parent.parent
    if not (run_dir / "config.yaml").is_file():
        return []
    raw = yaml.safe_load((run_dir / "config.yaml").read_text()) or {}
    try:
        return write_run_tokenizer(build_config({"data": raw.get("data") or {}}).data, out)
    except ValueError as e:  # e.g. the run's chat template file is gone since: the weights are written all the same
        import warnings

        warnings.warn(f"{out}: written without the run's tokenizer files ({e})", stacklevel=2)
        return []


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
    write_run_tokenizer_of(target, dst)
    return dst


def _load_hf(src: Path, load_hf_checkpoint):
    from megaseq.models.build import build_model
    from megaseq.models.spec import from_hf_config

    spec = from_hf_config(src)
    model = build_model(spec, dtype=torch.float32, device="cpu")
    load_hf_checkpoint(src, model=model, spec=spec)
    return model, spec
