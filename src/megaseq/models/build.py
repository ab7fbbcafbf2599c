"""``build_model(spec)``: the family's CausalLM from a ModelSpec, initialised, cast and placed.

Families are imported lazily through ``models.registry``, so building a Qwen3-MoE never imports the GLM
blocks and vice versa.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from megaseq.models.registry import family_module
from megaseq.models.spec import ModelSpec


def fp32_param_suffixes(family: str) -> tuple[str, ...]:
    """Names (suffixes) of the tensors the family keeps in float32 in a bf16/fp16 model."""
    return tuple(family_module(family, "model").FP32_PARAM_SUFFIXES)


# (the model on the meta device, the parameter dtype) -> each parameter's storage dtype
StoredDtypes = Callable[[nn.Module, torch.dtype], dict[str, torch.dtype]]


def build_model(spec: ModelSpec, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                seed: int | None = None, stored: StoredDtypes | None = None,
                draw_on: str | torch.device | None = None) -> nn.Module:
    """Construct ``spec.family``'s model on ``device`` with HF's init (seeded when ``seed`` is set).

    Parameters are cast to ``dtype``, except the ones HF keeps in float32 (router, KDA conv and decay,
    mHC base/scale) when ``dtype`` is narrower than float32. ``stored`` gives each parameter its own dtype
    instead (a frozen base in bf16: ``models.common.lora.storage_dtypes``): the model is then made on the
    meta device and each tensor allocated once, in its dtype, before the init (another draw of the random
    weights than the default path's, the same for a seed). With ``stored``, ``draw_on`` (a CUDA device) draws
    the init there, a module's own tensors at a time, and copies them to ``device``: a model built in host
    memory (a streamed or sharded base) gets the weights it would get built on that GPU, without drawing
    tens of billions of values on one CPU thread.
    """
    cls = family_module(spec.family, "model").Model
    device = torch.device(device)
    fork_devices = [device] if device.type == "cuda" else []
    if stored is not None:
        model = _build_stored(cls, spec, dtype, device, seed, stored, draw_on)
    else:
        with torch.random.fork_rng(devices=fork_devices, enabled=seed is not None):
            if seed is not None:
                torch.manual_seed(seed)
            with device:
                model = cls(spec)
        model = model.to(dtype=dtype)
    # The DSA indexer runs under no_grad (as in the reference) and feeds only integer indices forward,
    # so the LM loss never reaches its weights: mark them frozen, so optimizers carry no state for them
    # (``model.train_indexer`` trains them with their KL objective: ``train.indexer_training.enable``).
    for name, p in model.named_parameters():
        if ".indexer." in name:
            p.requires_grad_(False)
    if stored is None and torch.finfo(dtype).bits < 32:
        keep = fp32_param_suffixes(spec.family)
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            if name.endswith(keep) and t.is_floating_point():
                t.data = t.data.to(torch.float32)
    return model


def _build_stored(cls: type, spec: ModelSpec, dtype: torch.dtype, device: torch.device, seed: int | None,
                  stored: StoredDtypes, draw_on: str | torch.device | None = None) -> nn.Module:
    """The model made on the meta device, each parameter allocated on ``device`` in ``stored``'s dtype, then
    initialised (HF's init, seeded; drawn on ``draw_on`` when given); buffers and per-forward tensors made again
    on ``device``."""
    with torch.device("meta"):
        model = cls(spec)
    dtypes = stored(model, dtype)
    for name, p in model.named_parameters():
        p.data = torch.empty_like(p, dtype=dtypes.get(name, dtype))
    model.to_empty(device=device)
    if spec.tie_word_embeddings:  # to_empty made the tied tensors apart: tie them again
        model.lm_head.weight = model.embed_tokens.weight
    for m in model.modules():
        for k, v in list(m.__dict__.items()):
            if isinstance(v, torch.Tensor) and v.is_meta:
                setattr(m, k, torch.zeros_like(v, device=device))
        for b in m._buffers.values():
            if b is not None:
                b.zero_()  # every buffer megaseq has starts at zero (the router's correction bias)
    draw = torch.device(draw_on) if draw_on is not None else device
    fork_devices = [draw] if draw.type == "cuda" else []
    with torch.random.fork_rng(devices=fork_devices, enabled=seed is not None):
        if seed is not None:
            torch.manual_seed(seed)
        model.reset_parameters(draw_on=None if draw == device else draw)
    return model
