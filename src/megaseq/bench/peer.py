"""The peer of ``megaseq bench --baseline``: what a user of transformers-based fine-tuning (a LLaMA-Factory-style
setup) runs for the same recipe, in the same job.

- transformers' implementation of the architecture in bf16, SDPA attention, ``grouped_mm`` experts, activation
  checkpointing (non-reentrant);
- Liger Kernel where it has kernels for the family (``apply_liger``: its fused linear cross-entropy, RMSNorm,
  SwiGLU and RoPE through ``liger_kernel.transformers``' table of families); imported lazily, and the row says
  when it is absent or has no kernels for the family;
- with ``lora.rank > 0``, PEFT's LoRA on the same targets as megaseq's adapters (``target_modules`` for the
  linears, ``target_parameters`` for the fused routed experts: ``models.adapters.peft_config``), rank, alpha
  and rsLoRA as the recipe sets them; the base frozen.

Weights: megaseq's initial weights, copied through an HF export, when the model is small enough to build in
fp32 on the host (``SAME_WEIGHTS_MAX_PARAMS``); otherwise transformers' own random init on the GPU (the speed
and memory of a step do not depend on the values, and a 30B model in fp32 does not fit the host).
"""

from __future__ import annotations

import inspect
import json
import tempfile
from pathlib import Path
from typing import Any

import torch

from megaseq.bench.hf_model import load_reference_model
from megaseq.bench.verify import param_count
from megaseq.config import Config
from megaseq.ops.liger_backends import quiet_backend_probes

SAME_WEIGHTS_MAX_PARAMS = 8_000_000_000  # 32 GB in fp32 on the host (and as a temporary export)
LIGER_WANTED = {"rope": True, "rms_norm": True, "swiglu": True, "fused_linear_cross_entropy": True,
                "cross_entropy": False}


def _hf_class(config_dir: str) -> type:
    import transformers

    cls = json.loads((Path(config_dir) / "config.json").read_text())["architectures"][0]
    return getattr(transformers, cls)


def _random_hf_model(spec: Any, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """transformers' model of ``spec`` with its own random init, built on ``device`` in ``dtype``."""
    import transformers

    from megaseq.models.spec import to_hf_config

    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(to_hf_config(spec)))
        config = transformers.AutoConfig.from_pretrained(tmp)
        cls = _hf_class(tmp)
    for c in (config, getattr(config, "text_config", None)):
        if c is not None:
            c._experts_implementation = "grouped_mm"
    with torch.device(device):
        return cls._from_config(config, dtype=dtype, attn_implementation="sdpa")


def peer_model(cfg: Config, device: torch.device, dtype: torch.dtype = torch.bfloat16) -> tuple[torch.nn.Module,
                                                                                              Any, str]:
    """(transformers model on ``device``, spec, which weights) before Liger, PEFT and checkpointing."""
    from megaseq.models.build import build_model
    from megaseq.models.hf_io import export_hf_checkpoint
    from megaseq.models.presets import resolve_spec

    spec = resolve_spec(cfg.model.name)
    if param_count(spec) > SAME_WEIGHTS_MAX_PARAMS:
        return _random_hf_model(spec, device, dtype), spec, "transformers' random init (too large to copy)"
    ours = build_model(spec, dtype=torch.float32, device="cpu", seed=cfg.train.seed)
    with tempfile.TemporaryDirectory() as tmp:
        export_hf_checkpoint(ours, spec, f"{tmp}/hf")
        del ours
        ref = load_reference_model(f"{tmp}/hf", dtype=dtype, attn="sdpa", experts="grouped_mm")
    return ref.to(device), spec, "megaseq's initial weights"


def apply_liger(model: torch.nn.Module) -> str:
    """Liger's kernels for the model's family, applied to this instance; says what it did or why not. Off CUDA
    it applies none: Liger's kernels run on CUDA only, and some of its patches are module-wide (transformers'
    RoPE and loss functions), so they would reach every later model of the family in the process."""
    quiet_backend_probes()
    device = next(model.parameters()).device
    if device.type != "cuda":
        return f"not applied: Liger's kernels run on CUDA, the model is on {device.type}"
    try:
        from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN
    except ImportError as e:  # not installed, or its Triton is missing
        return f"not applied: liger-kernel is not importable ({e}); pip install liger-kernel"
    model_type = model.config.model_type
    fn = MODEL_TYPE_TO_APPLY_LIGER_FN.get(model_type)
    if fn is None:
        return f"not applied: Liger has no kernels for model_type {model_type}"
    params = inspect.signature(fn).parameters
    kwargs = {k: v for k, v in LIGER_WANTED.items() if k in params}
    try:
        fn(model=model, **kwargs)
    except Exception as e:  # noqa: BLE001  (a Liger release that does not know this transformers: run without)
        return f"not applied: {fn.__name__} failed ({type(e).__name__}: {str(e)[:200]})"
    return "applied: " + ", ".join(k for k, v in kwargs.items() if v)


def peft_lora_config(cfg: Config, spec: Any) -> dict[str, Any]:
    """PEFT's ``LoraConfig`` arguments for the recipe's ``lora.*``: the same targets megaseq adapts."""
    from megaseq.models.adapters import peft_config, projections, resolve_targets
    from megaseq.models.hf_io import adapter_for
    from megaseq.plan.params import param_table

    table = param_table(spec)
    targets = resolve_targets(projections(table), cfg.lora.targets, table)
    full = peft_config(targets, adapter_for(spec).export_prefix, cfg.lora.rank, cfg.lora.alpha, cfg.lora.dropout,
                       cfg.lora.use_rslora, cfg.lora.init)
    keep = ("r", "lora_alpha", "lora_dropout", "target_modules", "target_parameters", "use_rslora",
            "init_lora_weights", "bias", "task_type")
    return {k: full[k] for k in keep}


def apply_peft(model: torch.nn.Module, cfg: Config, spec: Any) -> tuple[torch.nn.Module, str]:
    import peft

    args = peft_lora_config(cfg, spec)
    wrapped = peft.get_peft_model(model, peft.LoraConfig(**args))
    trainable = sum(p.numel() for p in wrapped.parameters() if p.requires_grad)
    return wrapped, (f"peft {peft.__version__} LoRA r{args['r']} on {len(args['target_modules'])} modules and "
                     f"{len(args['target_parameters'])} expert tensors, {trainable:,} trainable parameters")


def build_peer(cfg: Config, device: torch.device, routing: str = "natural",
               dtype: torch.dtype = torch.bfloat16) -> tuple[torch.nn.Module, Any, dict[str, str]]:
    """(the peer's model in training mode, spec, what it runs: ``weights``, ``liger``, ``peft``, ``checkpointing``,
    ``routing``); ``routing`` balanced: the experts get ``models.common.routing``'s balanced ids."""
    import transformers

    from megaseq.models.common.routing import balance_hf_experts, check_routing

    model, spec, weights = peer_model(cfg, device, dtype)
    notes = {"system": f"transformers {transformers.__version__}, bf16, sdpa, grouped_mm experts",
             "weights": weights, "liger": apply_liger(model), "routing": check_routing(routing)}
    if routing == "balanced" and not balance_hf_experts(model):
        notes["routing"] = "natural (no fused experts module to balance)"
    if cfg.lora.enabled:
        model, notes["peft"] = apply_peft(model, cfg, spec)
    base = model.get_base_model() if cfg.lora.enabled else model
    if hasattr(base, "activation_checkpointing_enable"):  # transformers >= 5.24
        base.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    notes["checkpointing"] = "activation checkpointing per layer (non-reentrant)"
    base.config.use_cache = False
    return model.train(), spec, notes
