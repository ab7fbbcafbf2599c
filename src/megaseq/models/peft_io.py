"""LoRA adapters in PEFT's format, out and in: ``adapter_config.json`` + ``adapter_model.safetensors``.

An exported adapter loads with ``peft.PeftModel.from_pretrained`` on the transformers model of the same
checkpoint and gives the same logits (``tests/models/test_lora_peft.py``); ``load_adapter`` reads one (written
by megaseq or by PEFT) back into a model that has the same adapters, so training goes on from it. The
key names and layouts are ``models.adapters``' (PEFT's ``lora.Linear`` and ``ParamWrapper``):

    linear   lora_A.weight [r, in]       = A                  lora_B.weight [out, r]     = B
    experts  lora_A.weight [E * r, in]   = A_Eri.reshape      lora_B.weight [out, r * E] = B_EOr.permute(1, 2, 0)

Every adapter tensor of the model is written once and must be read once: a missing or extra key, or a
shape that differs, is one error naming it. Writing goes to a temporary directory renamed into place.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from torch import nn

from megaseq.config import LoraConfig
from megaseq.models.adapters import Projection, check_peft_config, peft_config, peft_keys
from megaseq.models.common.lora import LoRAExperts, LoRALinear, adapted, copy_whole
from megaseq.models.hf_io import adapter_for
from megaseq.models.spec import ModelSpec, to_hf_config

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"


def targets_of(model: nn.Module) -> list[tuple[Projection, torch.Tensor, torch.Tensor]]:
    """``(projection, A, B)`` of every adapter of ``model``, in megaseq's layout (``models.adapters``)."""
    out = []
    for name, m, tensor in adapted(model):
        if isinstance(m, LoRALinear):
            proj = Projection(name, "linear", m.in_features, m.out_features)
            out.append((proj, m.lora_A.weight, m.lora_B.weight))
        else:
            assert isinstance(m, LoRAExperts) and tensor is not None
            A, B = m.lora_A[tensor], m.lora_B[tensor]
            out.append((Projection(name, "experts", A.shape[2], B.shape[1], A.shape[0], "experts"), A, B))
    return out


def _peft_layout(proj: Projection, A: torch.Tensor, B: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if proj.kind == "linear":
        return A, B
    E, r, _ = A.shape
    return A.reshape(E * r, -1), B.permute(1, 2, 0).reshape(B.shape[1], r * E)


def _megaseq_layout(proj: Projection, a: torch.Tensor, b: torch.Tensor, rank: int) -> tuple[torch.Tensor, ...]:
    if proj.kind == "linear":
        return a, b
    E = proj.num_experts
    return a.reshape(E, rank, -1), b.reshape(b.shape[0], rank, E).permute(2, 0, 1)


def check_exportable(spec: ModelSpec, projs: list[Projection]) -> None:
    """ValueError when PEFT could not load these targets back on the transformers model: for the model types
    whose v4 MoE layout PEFT converts (qwen2_moe, qwen3_moe, mixtral, ...), PEFT renames every
    ``target_modules`` entry ending in ``gate_proj``, ``up_proj`` or ``down_proj`` to the fused experts, so a
    dense MLP or shared expert adapter would land on the routed experts instead."""
    experts = [p.name for p in projs if p.kind == "experts"]
    if experts and not adapter_for(spec).peft_experts:
        raise ValueError(f"lora.targets include the routed experts ({experts[0]}): {spec.family}'s experts are laid "
                         "out differently in transformers, so the adapter cannot be written in PEFT's format; "
                         "leave 'experts' out of lora.targets, or export the merged model instead "
                         "(megaseq export RUN DST --merged)")
    try:
        from peft.utils.transformers_weight_conversion import _MODEL_TO_CONVERSION_PATTERN, _MOE_TARGET_MODULE_MAPPING
    except ImportError:  # no peft (or another version): nothing to check against
        return
    model_type = to_hf_config(spec).get("model_type")
    renamed = _MOE_TARGET_MODULE_MAPPING.get(_MODEL_TO_CONVERSION_PATTERN.get(model_type, ""), {})
    bad = [p.name for p in projs if p.kind == "linear" and p.name.rpartition(".")[2] in renamed]
    if bad:
        raise ValueError(f"lora.targets include {bad[0]} (and {len(bad) - 1} more like it): for {model_type} models "
                         f"PEFT renames {', '.join(sorted(renamed))} targets to the fused routed experts when it "
                         "loads an adapter, so this adapter could not be loaded back; leave the dense MLP "
                         "projections out of lora.targets (or set --train.export_hf false)")


def base_reference(base_model: str | None) -> str | None:
    """The base as an adapter records it: a local checkpoint as its absolute path (a relative one would not
    resolve from another directory), anything else (a hub id) as given."""
    if base_model and Path(base_model).exists():
        return str(Path(base_model).resolve())
    return base_model


def export_adapter(model: nn.Module, spec: ModelSpec, lora: LoraConfig, out_dir: str | Path,
                   base_model: str | None = None, write: bool = True) -> Path:
    """Write ``model``'s adapters as a PEFT adapter directory; returns it. ``base_model`` is recorded as
    ``base_model_name_or_path`` (the HF checkpoint the adapter goes on). Under expert parallelism the routed
    experts' factors are split over the ep ranks: every rank calls it (each factor is gathered whole in turn)
    and only the one with ``write`` writes."""
    from megaseq.models.hf_io import save_safetensors

    found = targets_of(model)
    if not found:
        raise ValueError("the model has no LoRA adapters to export (lora.rank is 0)")
    projs = [p for p, _, _ in found]
    check_exportable(spec, projs)
    prefix = adapter_for(spec).export_prefix
    tensors = {}
    for proj, A, B in found:
        key_a, key_b = peft_keys(proj, projs, prefix)
        A, B = (t.detach().full_tensor() if hasattr(t, "full_tensor") else t.detach() for t in (A, B))
        a, b = _peft_layout(proj, A, B)
        tensors[key_a], tensors[key_b] = (t.to("cpu").contiguous().clone() for t in (a, b))
    if not write:
        return Path(out_dir)
    cfg = peft_config(projs, prefix, lora.rank, lora.alpha, lora.dropout, lora.use_rslora, lora.init,
                      base_reference(base_model))
    out_dir = Path(out_dir)
    tmp = out_dir.parent / f".{out_dir.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_safetensors(tensors, tmp / WEIGHTS)
    (tmp / CONFIG).write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    old = out_dir.parent / f".{out_dir.name}.old-{os.getpid()}"
    if out_dir.exists():
        os.replace(out_dir, old)
    os.replace(tmp, out_dir)
    shutil.rmtree(old, ignore_errors=True)
    return out_dir


def read_adapter_config(path: str | Path) -> dict:
    cfg_file = Path(path) / CONFIG
    if not cfg_file.is_file() or not (Path(path) / WEIGHTS).is_file():
        raise ValueError(f"{path} is not a PEFT adapter directory (needs {CONFIG} and {WEIGHTS})")
    return json.loads(cfg_file.read_text())


def load_adapter(model: nn.Module, spec: ModelSpec, lora: LoraConfig, path: str | Path) -> None:
    """Fill ``model``'s adapters from a PEFT adapter directory; its r, alpha and set of targets must be the
    model's (one ValueError naming the setting, or the first missing / extra / misshapen tensor)."""
    from safetensors.torch import load_file

    cfg = read_adapter_config(path)
    check_peft_config(cfg, str(Path(path) / CONFIG), lora.rank, lora.alpha, lora.use_rslora)
    found = targets_of(model)
    projs = [p for p, _, _ in found]
    prefix = adapter_for(spec).export_prefix
    disk = load_file(str(Path(path) / WEIGHTS))
    unused = set(disk)
    with torch.no_grad():
        for proj, A, B in found:
            keys = peft_keys(proj, projs, prefix)
            missing = [k for k in keys if k not in disk]
            if missing:
                raise ValueError(f"{path}: no {missing[0]}: the adapter does not target {proj.name}, which "
                                 "lora.targets selects; set lora.targets to the adapter's targets")
            a, b = _megaseq_layout(proj, disk[keys[0]], disk[keys[1]], lora.rank)
            for dst, src, key in ((A, a, keys[0]), (B, b, keys[1])):
                if tuple(src.shape) != tuple(dst.shape):
                    raise ValueError(f"{path}: {key} has shape {tuple(disk[key].shape)}, which does not fit "
                                     f"{proj.name} (megaseq {tuple(dst.shape)}): another model or rank")
                copy_whole(dst, src)
            unused -= set(keys)
    if unused:
        raise ValueError(f"{path} holds {len(unused)} tensors for targets lora.targets does not select, e.g. "
                         f"{sorted(unused)[0]}; set lora.targets to the adapter's targets")
