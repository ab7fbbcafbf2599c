"""``build_model(spec)``: the family's CausalLM from a ModelSpec, initialised, cast and placed.

Families are imported lazily through ``models.registry``, so building a Qwen3-MoE never imports the GLM
blocks and vice versa.
"""

from __future__ import annotations

import torch
from torch import nn

from megaseq.models.registry import family_module
from megaseq.models.spec import ModelSpec


def fp32_param_suffixes(family: str) -> tuple[str, ...]:
    """Names (suffixes) of the tensors the family keeps in float32 in a bf16/fp16 model."""
    return tuple(family_module(family, "model").FP32_PARAM_SUFFIXES)


def build_model(spec: ModelSpec, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                seed: int | None = None) -> nn.Module:
    """Construct ``spec.family``'s model on ``device`` with HF's init (seeded when ``seed`` is set).

    Parameters are cast to ``dtype``, except the ones HF keeps in float32 (router, KDA conv and decay,
    mHC base/scale) when ``dtype`` is narrower than float32.
    """
    cls = family_module(spec.family, "model").Model
    device = torch.device(device)
    fork_devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=fork_devices, enabled=seed is not None):
        if seed is not None:
            torch.manual_seed(seed)
        with device:
            model = cls(spec)
    model = model.to(dtype=dtype)
    # The DSA indexer runs under no_grad (as in the reference) and feeds only integer indices forward,
    # so the LM loss never reaches its weights: mark them frozen, so optimizers carry no state for them.
    for name, p in model.named_parameters():
        if ".indexer." in name:
            p.requires_grad_(False)
    if torch.finfo(dtype).bits < 32:
        keep = fp32_param_suffixes(spec.family)
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            if name.endswith(keep) and t.is_floating_point():
                t.data = t.data.to(torch.float32)
    return model
