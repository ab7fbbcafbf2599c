"""What a run trains, built as planned: the device and dtypes, the model with its family's ``parallelize``
applying the plan's memory schemes, adapters and FSDP, its optimizer and LR schedule, and the kernel
dispatcher set up as the plan assumed.

Nothing here plans or trains: ``train.trainer`` plans and calls these, ``train.step`` runs the step, and the
bench (``bench.measure``) builds its measured step from the same functions.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

import torch

from megaseq.config import AdapterSettings, Config, MemorySettings
from megaseq.ops import dispatch, switches
from megaseq.ops.kernels import planned_kernels, preferred_kernels
from megaseq.train import indexer_training
from megaseq.train.optim import build_optimizer


def resolve_device(cfg: Config) -> torch.device:
    want = cfg.train.device
    if want == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if want.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("train.device is cuda but no CUDA GPU is visible; set --train.device cpu")
    return torch.device(want)


def dtypes(cfg: Config, device: torch.device) -> tuple[torch.dtype, torch.dtype | None]:
    """(parameter dtype, autocast dtype). bf16 compute keeps fp32 weights under autocast, or with
    ``model.weights bf16`` bf16 weights (the optimizer's fp32 master beside them) and no autocast."""
    if cfg.model.dtype == "fp64":
        return torch.float64, None
    if cfg.model.weights == "bf16":
        return torch.bfloat16, None
    if cfg.model.dtype == "bf16" and device.type == "cuda":
        return torch.float32, torch.bfloat16
    return torch.float32, None  # bf16 on the CPU is slow and unhelpful: compute in fp32


def adapter_settings(cfg: Config, device: torch.device) -> AdapterSettings:
    """The run's frozen parameters and adapters; frozen matmul weights stored in bf16 under bf16 autocast."""
    return AdapterSettings.of(cfg, frozen_dtype="bf16" if dtypes(cfg, device)[1] == torch.bfloat16 else None)


def build_planned_model(cfg: Config, spec: Any, device: torch.device, memory: MemorySettings, total_steps: int,
                        init_from: str | None = None, env: Any = None) -> tuple[torch.nn.Module, Any, Any, Any]:
    """The model with the plan's memory schemes (and FSDP) applied by its family's ``parallelize``, and its
    planned optimizer and LR schedule: (model, what was applied (release it at the end), optimizer, scheduler).

    Under FSDP the whole model never sits on the device: loaded from ``init_from`` it is built on the meta
    device, sharded, then each rank reads only its rows of the safetensors files; a random init is made in
    host memory (the one-process weights, one full copy per process; a frozen base drawn on the GPU a module at
    a time, ``build_model(draw_on=...)``) and sharded to the device. A frozen base
    (LoRA, ``train.trainable``) is sharded in its storage dtype (bf16 under bf16 autocast); the adapters and
    the trained tensors stay whole on every rank (``parallel.fsdp``)."""
    from megaseq.models.build import build_model
    from megaseq.models.hf_io import load_hf_checkpoint
    from megaseq.models.registry import parallelize

    dtype = dtypes(cfg, device)[0]
    adapters = adapter_settings(cfg, device)
    sharded = getattr(env, "fsdp", None) not in (None, "off") and getattr(env, "world_size", 1) > 1
    if init_from and env is not None:
        env.log(f"model weights from {init_from}")
    if memory.stream_base:  # the frozen base in host memory (memory/stream_base.py): what it cannot run, said now
        from megaseq.memory import stream_base

        stream_base.check_run(adapters.freezes, sharded, bool(init_from))
    # a frozen base stored in bf16 is built so from the start (never its fp32 copy: 30B parameters fit), its
    # random init drawn on the run's GPU wherever it is built
    frozen = frozen_base_dtypes(adapters) if adapters.freezes and adapters.frozen_dtype else None
    draw_on = device if device.type == "cuda" and not init_from else None
    if not sharded:
        where = device
        if memory.stream_base:  # built where it fits (the host when the GPU cannot hold it), streamed from the host
            where = stream_base.build_device(build_model(spec, dtype=dtype, device="meta", stored=frozen), device)
            where = "cpu" if init_from else where
        model = build_model(spec, dtype=dtype, device=where, seed=cfg.train.seed, stored=frozen, draw_on=draw_on)
        if init_from:
            load_hf_checkpoint(init_from, model=model, spec=spec)
        applied = parallelize(model, memory, env, adapters)
        if memory.stream_base:
            stream_base.to_device_resident(model, device)
    else:  # a frozen base: its frozen tensors built (and sharded) in their storage dtype, what trains kept whole
        model = build_model(spec, dtype=dtype, device="meta" if init_from else "cpu", seed=cfg.train.seed,
                            stored=frozen, draw_on=draw_on)
        applied = parallelize(model, memory, env, adapters)  # shards (moves each rank's shards to the device)
        if init_from:
            model.to_empty(device=device)
            load_hf_checkpoint(init_from, model=model, spec=spec)  # this rank's rows of each tensor only
            if adapters.lora.enabled:  # the factors were attached on the meta device: draw them now
                from megaseq.models.common.lora import draw_adapters

                draw_adapters(model, adapters)
        if memory.stream_base:  # the blocks' shards stay in host memory (FSDP's CPUOffloadPolicy)
            stream_base.to_device_resident(model, device)
        else:
            model.to(device)  # the parameters FSDP keeps whole (a bf16 model's fp32 router, the adapters), buffers
    if cfg.lora.init_from:
        from megaseq.models.peft_io import load_adapter

        load_adapter(model, spec, cfg.lora, cfg.lora.init_from)
    if cfg.model.train_indexer:  # before the optimizer: the indexers' parameters train
        indexer_training.enable(model, cfg.model.indexer_loss_coef, cfg.model.dsa_warmup_steps, dtype)
    several = cfg.train.grad_accum > 1 or 0 < memory.model_segment_tokens < cfg.data.seq_len
    optimizer, scheduler = build_optimizer(model, cfg.optim, total_steps, memory, accumulate=several,
                                           distributed=getattr(env, "world_size", 1) > 1)
    return model, applied, optimizer, scheduler


def frozen_base_dtypes(adapters: AdapterSettings) -> Any:
    """``build_model``'s ``stored``: each parameter's storage dtype, from the model built on the meta device."""
    from megaseq.models.common.lora import storage_dtypes

    return lambda model, param_dtype: storage_dtypes(model, adapters, param_dtype)


def kernel_settings(cfg: Config, device: torch.device) -> dict[str, Any]:
    """``dispatch.configure``'s arguments for the run: ``model.kernels``' preferences, the planned kernels, and
    with ``model.strict_kernels`` a fallback from them an error naming the layer and the reason."""
    return dict(preferred=preferred_kernels(device.type, cfg.model.kernels),
                planned=planned_kernels(device.type, cfg.model.dtype), strict=cfg.model.strict_kernels)


def kernels_for(cfg: Config, device: torch.device) -> contextlib.AbstractContextManager:
    """The dispatcher set up as the run is planned (``kernel_settings``), and ``model.autotune``,
    ``model.kernel_cache`` and ``model.precompile`` in force (``ops.switches``), for the duration of the run."""
    stack = contextlib.ExitStack()
    stack.enter_context(dispatch.configured(**kernel_settings(cfg, device)))
    stack.enter_context(switches.configured(cfg.model.autotune, cfg.model.kernel_cache, cfg.model.precompile))
    return stack


# the forced memory settings that change which kernels a step runs (under memory.auto the plan picks them per
# length, and a manifest holds the union over lengths)
KERNEL_MEMORY_SETTINGS = ("chunked_loss", "tiled_mlp", "optimizer_offload", "kda_segment_tokens",
                          "model_segment_tokens", "segment_keep_selection", "stream_base")


def kernel_fingerprint(cfg: Config, spec: Any) -> tuple[str, dict[str, Any]]:
    """The name of the run's kernel manifest (``ops.precompile.fingerprint``) and the settings it stands for:
    the model spec, the compute and weight dtypes, ``model.kernels``, the indexer objective, LoRA and its
    targets, FSDP, the context- and expert-parallel sizes and, with ``memory.auto`` false, the forced memory
    settings that change which kernels run. The sequence length is not part of it: every length of a recipe
    shares one manifest."""
    from megaseq.ops.precompile import fingerprint

    describes = {"model": cfg.model.name, "dtype": cfg.model.dtype, "weights": cfg.model.weights,
                 "kernels": cfg.model.kernels, "train_indexer": cfg.model.train_indexer,
                 "lora": list(cfg.lora.targets) if cfg.lora.enabled else None, "fsdp": cfg.parallel.fsdp,
                 "cp": cfg.parallel.cp, "ep": cfg.parallel.ep,
                 "memory": "auto" if cfg.memory.auto else {k: getattr(cfg.memory, k) for k in KERNEL_MEMORY_SETTINGS}}
    parts = {**describes, "model": spec.to_dict()}
    return fingerprint(parts), describes


def start_precompile(cfg: Config, spec: Any, device: torch.device, processes: int = 1) -> Any:
    """On a CUDA device with ``model.precompile`` on (``ops.precompile.enabled``): the run's kernel manifests
    compiling in the background (``ops.precompile.RunPrecompile``), ``processes`` the run's processes on this
    machine sharing its CPUs; else None. Call inside ``kernels_for`` (the switches and the kernel cache in
    force), before the model is built."""
    from megaseq.ops import precompile

    if not precompile.enabled(device.type):
        return None
    from megaseq.ops import autotune

    fp, describes = kernel_fingerprint(cfg, spec)
    index = device.index if device.index is not None else torch.cuda.current_device()
    # the default mode reads the tuned table before it tunes: only the configs it chose are launched
    tuned = autotune.table(torch.cuda.get_device_name(index)).kernels if autotune.mode() == "pruned" else None
    warmup = None
    if switches.warm_ops():  # torch's first calls of the step's ops, made while the compiles finish
        from megaseq.ops import op_warmup

        warmup = op_warmup.RunWarmup(fp, cfg.data.seq_len, cfg.train.batch_size, torch.device("cuda", index))
    return precompile.RunPrecompile(fp, index, describes, precompile.default_workers(processes), tuned=tuned,
                                    length=cfg.data.seq_len, warmup=warmup)


def report_fallbacks(cfg: Config, device: torch.device, log: Any) -> None:
    """After the first step: each op that ``model.kernels`` prefers but that ran another implementation, where
    and why (the preferred kernels are not held to as the planned ones are under ``strict_kernels``)."""
    for g in dispatch.fallback_summary(preferred_kernels(device.type, cfg.model.kernels)):
        log(f"model.kernels {cfg.model.kernels}: {dispatch.describe_fallback(g)}")


def use_expandable_segments() -> None:
    """Long sequences allocate a few huge, differently sized blocks per step: expandable segments keep the
    caching allocator from fragmenting them. Call before the first CUDA allocation (processes spawned
    later inherit it); a value the user set is kept."""
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")


GROW_FRACTION = 0.9  # of the plan's tensor peak: a plan above the step's real peak must not pin memory it never uses


def grow_pool(device: torch.device, plan_tensors: int, fraction: float = GROW_FRACTION) -> int:
    """With ``MEGASEQ_GROW_POOL=1`` (``ops.switches.grow_pool``), on a CUDA device under expandable segments:
    grow the caching allocator's pool to ``fraction`` of the plan's tensor peak ``plan_tensors`` before the first
    step, by one allocation freed at once (its pages stay mapped, and the step's tensors are carved from them), so
    the step does not map them as it goes; called while the precompile's threads finish, it overlaps their wait.
    Never more than the GPU has free, less a reserve for what allocates outside the pool; an allocation that fails
    is given up. Returns the bytes it added to the pool. Peak statistics read after it include the block: reset
    them before a step's."""
    from megaseq.ops import switches

    if device.type != "cuda" or not switches.grow_pool():
        return 0
    if "expandable_segments:True" not in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""):
        return 0  # without expandable segments one block the size of the peak would be one segment to split
    free, _ = torch.cuda.mem_get_info(device)
    need = min(int(plan_tensors * fraction) - torch.cuda.memory_reserved(device), free - (1 << 30))
    if need <= 0:
        return 0
    try:
        block = torch.empty(need, dtype=torch.uint8, device=device)
    except torch.OutOfMemoryError:
        return 0
    del block
    return need


def reserve_pinned(device: torch.device, pinned_host: int) -> Any:
    """On a CUDA device, with ``MEGASEQ_PIN_AHEAD`` on (the default): start page-locking the plan's ``pinned_host``
    bytes (its host terms but the process's) on a background thread, so the memory schemes' host pools take them
    ready-locked in the first step instead of locking their own in it (``memory.host_memory``). Call right after
    the plan, before the model is built; ``memory.host_memory.drop_reserve`` ends it. Returns the arena or None."""
    from megaseq.memory import host_memory
    from megaseq.ops import switches

    return host_memory.reserve(pinned_host if switches.pin_ahead() else 0, device)  # 0 or off CUDA: none


def check_adapters(cfg: Config, spec: Any, memory: MemorySettings) -> None:
    """What the adapters cannot do in this run, said before data or weights are touched: dropout under a
    replaying scheme, an export PEFT could not load, an adapter to start from that does not fit."""
    if not cfg.lora.enabled:
        return
    from megaseq.models.adapters import check_dropout, projections, resolve_targets
    from megaseq.plan.params import param_table

    check_dropout(cfg.lora, memory)
    if cfg.train.export_hf:
        from megaseq.models.peft_io import check_exportable

        table = param_table(spec)
        check_exportable(spec, resolve_targets(projections(table), cfg.lora.targets, table))
    if cfg.lora.init_from:
        from megaseq.models.adapters import check_peft_config
        from megaseq.models.peft_io import CONFIG, read_adapter_config

        check_peft_config(read_adapter_config(cfg.lora.init_from), f"{cfg.lora.init_from}/{CONFIG}", cfg.lora.rank,
                          cfg.lora.alpha, cfg.lora.use_rslora)
