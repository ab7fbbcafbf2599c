"""The training loop: plan, claim the run directory, build data and model, train, save, export, evaluate.

Order matters for the "fixed memory, fail early" contract: the settings are checked when the config is
built, then the run directory and the starting weights (``preflight``: nothing written), then the plan,
before any data is read or any weight is allocated, so a run that cannot fit stops in a second with a
message naming the binding component. The data is read before the run directory is claimed, so a bad
file leaves nothing behind. A non-finite step stops the run before the update (``guard``); SIGTERM and
SIGINT stop it after the step with a resumable checkpoint.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from megaseq.config import AdapterSettings, Config, MemorySettings, parse_duration
from megaseq.ops import dispatch
from megaseq.ops.kernels import cold_start_note, planned_kernels, preferred_kernels
from megaseq.plan.flops import mfu
from megaseq.train import checkpoint as ckpt
from megaseq.train import guard, indexer_training
from megaseq.train.balance import Balancer, resolve_balance
from megaseq.train.family_settings import resolve_family_settings
from megaseq.train.heldout import HeldoutProbe, evaluate_run
from megaseq.train.metrics import MetricsLogger, gpu_peak_bytes, host_peak_bytes
from megaseq.train.optim import build_optimizer
from megaseq.train.parallel_env import ParallelEnv, setup_parallel
from megaseq.train.periodic import SaveSchedule
from megaseq.train.preflight import check_disk_space, preflight
from megaseq.train.run_dir import claim_run_dir, discard_unstarted, write_plan
from megaseq.train.safe_checkpoint import NonFiniteWeights

_log = logging.getLogger(__name__)  # (``logger`` below is a run's MetricsLogger)


GIB = 2**30


@dataclass
class RunResult:
    run_dir: Path
    losses: list[float] = field(default_factory=list)
    last_checkpoint: Path | None = None
    hf_export: Path | None = None
    eval_report: dict[str, Any] | None = None
    adapter_export: Path | None = None
    is_main: bool = True  # rank 0 (or the one process): the one that prints
    time_limited: tuple[int, int, str] | None = None  # (step, train.steps, train.time_limit): stopped by the limit


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


def make_plan(cfg: Config, env: ParallelEnv, device: torch.device,
              spec: Any = None) -> tuple[dict[str, Any], MemorySettings]:
    """Plan memory before anything is allocated; returns (plan as dict, the memory settings to apply). ``spec``:
    the model spec the run resolved (None: resolved from the config)."""
    from megaseq.plan.planner import plan_from_config

    gpu_bytes = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None
    plan = plan_from_config(cfg, world_size=env.world_size, gpu_bytes=gpu_bytes, device_type=device.type, spec=spec)
    # on a GPU the plan binds; on the CPU only when a GPU budget was given (planning a GPU run here)
    if (device.type == "cuda" or cfg.memory.gpu_budget != "auto") and not plan.fits:
        raise ValueError(f"the memory plan does not fit, so nothing was started. {plan.advice} "
                         "(see `megaseq plan` for the table per component)")
    memory = MemorySettings.from_dict(plan.memory)
    if cfg.moe.seq_aux_loss_coef:  # as the Balancer says, but before any weight exists
        from megaseq.train.balance import check_seq_aux_mesh

        check_seq_aux_mesh(cfg.parallel.cp, cfg.parallel.ep)
    if cfg.moe.seq_aux_loss_coef and memory.tiled_mlp:  # before any weight exists, not at the first forward
        how = "was forced" if not cfg.memory.auto else "is what the memory plan needs to fit at this length"
        raise ValueError(f"moe.seq_aux_loss_coef {cfg.moe.seq_aux_loss_coef} (the sequence-wise balance loss) is not "
                         f"implemented with memory.tiled_mlp, which {how}: set --moe.seq_aux_loss_coef 0, or "
                         "shorten data.seq_len / lower the memory the plan needs")
    return plan.to_dict(), memory


def _autocast(dtype: torch.dtype | None, device: torch.device) -> contextlib.AbstractContextManager:
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def train_step(model: torch.nn.Module, micro_batches: list[dict[str, torch.Tensor]], optimizer: Any,
               scheduler: Any, cfg: Config, env: ParallelEnv, autocast: torch.dtype | None,
               memory: MemorySettings, progress: Any = None, balancer: Balancer | None = None) -> tuple[float, float]:
    """One optimizer step over ``grad_accum`` micro-batches; returns (mean loss, grad norm). ``progress``
    (pass, done, total) hears of each sequence segment when the plan runs them; ``balancer`` reduces the
    routers' loads after each forward (the aux loss's gradient) and updates the biases after the step. A
    non-finite loss or gradient norm never reaches the weights (nor the router biases):
    ``guard.NonFiniteStep`` is raised (``train.on_nonfinite stop``) or the step is skipped (``skip``:
    gradients dropped, the schedule moves on, the values returned)."""
    after_forward = balancer.after_forward if balancer is not None else None
    chunk = memory.loss_chunk_tokens if memory.chunked_loss else None
    local = sum(int((b["labels"] != -100).sum()) for b in micro_batches)
    total = env.all_reduce_count(local)  # the loss is a mean over every token of the global batch
    indexer_training.loss_scale(model, total)  # the indexers' KL term is a mean over the same tokens
    loss_sum = 0.0
    segment = memory.model_segment_tokens
    for batch in micro_batches:
        b = env.to_device(batch)
        if segment and b["input_ids"].shape[1] * env.cp_size > segment:  # sequence segments (memory/model_segments.py)
            loss_sum += float(_segmented_step(model, b, env, autocast, chunk, segment, total, progress,
                                              memory.segment_keep_selection, after_forward))
            continue
        with _autocast(autocast, env.device):
            hidden = model(b["input_ids"], doc_ids=b.get("doc_ids"), ctx=env.context(b))
        loss = _loss_sum(model, hidden, b["labels"], env, autocast, chunk)
        if after_forward is not None:
            after_forward()
        (loss / max(total, 1)).backward()
        loss_sum = loss_sum + loss.detach().double()  # read back once, after the update is launched
    env.reduce_gradients(model)
    # with MasterAdamW in one process the update is launched before the loss and norm are read back (it writes
    # nothing for a non-finite step); otherwise they are checked on the host first
    on_device = getattr(optimizer, "guards_on_device", False) and env.world_size == 1
    if on_device:
        loss, grad_norm = _update_guarded_on_device(model, optimizer, cfg, env, loss_sum, total)
    else:
        grad_norm = float(_clip(model, optimizer, cfg.optim.grad_clip, env))
        loss = env.all_reduce_sum(float(loss_sum)) / max(total, 1)
    if not guard.is_finite_step(loss, grad_norm):  # no update reached the weights: they stay as they were
        optimizer.zero_grad(set_to_none=True)
        if balancer is not None:
            balancer.drop_step()
        if cfg.train.on_nonfinite != "skip":
            raise guard.NonFiniteStep(loss, grad_norm)
        scheduler.step()
        return loss, grad_norm
    if not on_device:
        optimizer.step()
    if balancer is not None:
        balancer.after_step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return loss, grad_norm


def _update_guarded_on_device(model: torch.nn.Module, optimizer: Any, cfg: Config, env: ParallelEnv, loss_sum: Any,
                              total: int) -> tuple[float, float]:
    """Norm, clip and update launched behind the backward with the step's finiteness as a device flag
    (``MasterAdamW.step(finite=...)``: a non-finite step leaves weights, moments and step counters as they
    were), then ``(loss, grad norm)`` read back in one host sync, after them: the GPU does not wait for the host
    between the backward and the update."""
    norm = _clip(model, optimizer, cfg.optim.grad_clip, env)
    loss_t = torch.as_tensor(loss_sum, dtype=torch.float64).to(norm.device) / max(total, 1)
    optimizer.step(finite=torch.isfinite(loss_t) & torch.isfinite(norm))
    loss, grad_norm = torch.stack([loss_t, norm.to(torch.float64)]).tolist()
    return loss, grad_norm


def _clip(model: torch.nn.Module, optimizer: Any, max_norm: float, env: ParallelEnv) -> torch.Tensor:
    """The global gradient norm (a tensor, not read back), the gradients clipped to ``max_norm`` (0: not
    clipped): the optimizer's own clip when it holds the gradients (OffloadStreamAdamW, MasterAdamW), the
    shard-aware one when some parameters are DTensors (FSDP's shards; under expert parallelism the routed
    experts, ``Shard(0)`` over the ep axis: each one's squares are summed over its sharded mesh dims), else the
    environment's."""
    from megaseq.memory.master_adam import clip_grad_norm_, is_dtensor

    limit = max_norm if max_norm > 0 else float("inf")
    if hasattr(optimizer, "clip_grad_norm_"):
        return optimizer.clip_grad_norm_(limit)
    params = [p for p in model.parameters() if p.grad is not None]
    if any(is_dtensor(p) for p in params):
        return clip_grad_norm_(params, limit)
    return env.clip_grad_norm(params, max_norm)


def _loss_sum(model: torch.nn.Module, hidden: torch.Tensor, labels: torch.Tensor, env: ParallelEnv,
              autocast: torch.dtype | None, chunk: int | None) -> torch.Tensor:
    """The summed loss of ``hidden``: Ring-DTP over the context-parallel group when cp > 1, else the
    (chunked) local loss; under autocast the vocabulary projection in the compute dtype, as lm_head would
    run (the losses accumulate in fp32)."""
    head = model.lm_head.weight
    if autocast is not None:
        hidden, head = hidden.to(autocast), head.to(autocast)
    return env.loss_sum(hidden, head, labels, chunk)


def _segmented_step(model: torch.nn.Module, b: dict[str, torch.Tensor], env: ParallelEnv,
                    autocast: torch.dtype | None, chunk: int | None, segment: int, total: int,
                    progress: Any = None, keep_selection: bool = False, after_forward: Any = None) -> torch.Tensor:
    """Forward + backward of one micro-batch in sequence segments; returns its loss sum (no graph). Under
    cp the shard is this rank's piece of every segment (``env.shard_batch(batch, segment)``)."""
    from megaseq.memory.model_segments import segmented_loss_backward  # its settings checked when applied

    def loss_fn(hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return _loss_sum(model, hidden, labels, env, autocast, chunk)

    def contexts(lo: int, hi: int) -> Any:  # the cp group's context of rows [lo, hi) of this shard
        return env.context({k: v[:, lo:hi] for k, v in b.items() if k in ("input_ids", "doc_ids", "position_ids")})

    with _autocast(autocast, env.device):
        return segmented_loss_backward(model, b["input_ids"], b["labels"], loss_fn, 1.0 / max(total, 1), segment,
                                       progress, doc_ids=b.get("doc_ids"), keep_selection=keep_selection,
                                       cp=env.cp_size, contexts=contexts if env.cp_size > 1 else None,
                                       after_forward=after_forward)


def build_planned_model(cfg: Config, spec: Any, device: torch.device, memory: MemorySettings, total_steps: int,
                        init_from: str | None = None, env: Any = None) -> tuple[torch.nn.Module, Any, Any, Any]:
    """The model with the plan's memory schemes (and FSDP) applied by its family's ``parallelize``, and its
    planned optimizer and LR schedule: (model, what was applied (release it at the end), optimizer, scheduler).

    Under FSDP the whole model never sits on the device: loaded from ``init_from`` it is built on the meta
    device, sharded, then each rank reads only its rows of the safetensors files; a random init is drawn on
    the host (the one-process weights, one full copy per process) and sharded to the device. A frozen base
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
    if not sharded:
        # a frozen base stored in bf16 is built so from the start (never its fp32 copy: 30B parameters fit)
        frozen = frozen_base_dtypes(adapters) if adapters.freezes and adapters.frozen_dtype else None
        model = build_model(spec, dtype=dtype, device=device, seed=cfg.train.seed, stored=frozen)
        if init_from:
            load_hf_checkpoint(init_from, model=model, spec=spec)
        applied = parallelize(model, memory, env, adapters)
    else:  # a frozen base: its frozen tensors built (and sharded) in their storage dtype, what trains kept whole
        frozen = frozen_base_dtypes(adapters) if adapters.freezes and adapters.frozen_dtype else None
        model = build_model(spec, dtype=dtype, device="meta" if init_from else "cpu", seed=cfg.train.seed,
                            stored=frozen)
        applied = parallelize(model, memory, env, adapters)  # shards (moves each rank's shards to the device)
        if init_from:
            model.to_empty(device=device)
            load_hf_checkpoint(init_from, model=model, spec=spec)  # this rank's rows of each tensor only
            if adapters.lora.enabled:  # the factors were attached on the meta device: draw them now
                from megaseq.models.common.lora import draw_adapters

                draw_adapters(model, adapters)
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
    """The dispatcher set up as the run is planned (``kernel_settings``) for the duration of the run."""
    return dispatch.configured(**kernel_settings(cfg, device))


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


def run_training(cfg: Config) -> RunResult:
    """Plan, then train as planned: the dispatcher holds the run to its planned kernels when
    ``model.strict_kernels`` is set (a fallback is an error naming the layer and the reason)."""
    from megaseq.models.presets import resolve_spec

    spec = resolve_spec(cfg.model.name)  # a bad model name fails before anything else happens
    cfg = resolve_family_settings(cfg, spec)  # the family's balancing where unset; a rule it cannot train refused
    indexer_training.check(cfg, spec)  # and an indexer objective the model or the adapters cannot take
    preflight(cfg, spec)  # the run directory and the starting weights, nothing written
    use_expandable_segments()
    env = setup_parallel(cfg, spec)  # the spec resolved once per process
    if cfg.train.eval_every and env.world_size > 1:  # as the end-of-run evaluation: one process only
        env.log(f"train.eval_every: held-out evaluation runs in one process and this run has {env.world_size}, "
                "so it is skipped; evaluate the checkpoints with `megaseq eval RUN_DIR`")
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, eval_every=0))
    device = env.device = resolve_device(cfg) if env.world_size == 1 else env.device
    plan_dict, memory = make_plan(cfg, env, device, spec)
    check_adapters(cfg, spec, memory)
    with kernels_for(cfg, device):
        dispatch.reset_records()  # what ran under this configuration (the first step's report reads them)
        return _run_planned(cfg, spec, env, device, plan_dict, memory)


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


def _run_planned(cfg: Config, spec: Any, env: ParallelEnv, device: torch.device, plan_dict: dict[str, Any],
                 memory: MemorySettings) -> RunResult:
    """Claim the run directory and train; a start that fails before its first step removes the directory
    it created (``run_dir.discard_unstarted``), so a bad path or setting leaves nothing behind."""
    created = env.is_main and not Path(cfg.train.run_dir).exists()
    run_dir, resume_from = claim_run_dir(cfg) if env.is_main else (Path(cfg.train.run_dir), None)
    try:
        return _run_claimed(cfg, spec, env, device, plan_dict, memory, run_dir, env.broadcast_object(resume_from))
    except BaseException:
        if created:
            discard_unstarted(run_dir)
        raise


def _run_claimed(cfg: Config, spec: Any, env: ParallelEnv, device: torch.device, plan_dict: dict[str, Any],
                 memory: MemorySettings, run_dir: Path, resume_from: Path | None) -> RunResult:
    from megaseq.data import build_data

    if env.is_main:
        write_plan(run_dir, plan_dict)
    data = build_data(cfg.data, cfg.eval, batch_size=cfg.train.batch_size, vocab_size=spec.vocab_size,
                      rank=env.dp_rank, world_size=env.dp_size)
    if cfg.train.eval_every and not data.heldout:
        raise ValueError("train.eval_every needs held-out data: set data.heldout (files the model never trains "
                         "on), data.heldout_records or data.heldout_tail, or set --train.eval_every 0")
    autocast = dtypes(cfg, device)[1]
    model, applied, optimizer, scheduler = build_planned_model(cfg, spec, device, memory, cfg.train.steps,
                                                               cfg.model.init_from, env)
    if env.is_main:
        check_disk_space(run_dir, model)
    spec_dict = spec.to_dict()
    base = _base_meta(cfg)
    start = 0
    if resume_from is not None:
        meta = ckpt.load_checkpoint(resume_from, model, optimizer, scheduler, expected_spec=spec_dict)
        start = meta["step"]
        data.train.load_state_dict(meta["data"])
        env.log(f"resumed from {resume_from} at step {start}")
    elif cfg.train.eval_after and (cfg.model.init_from or cfg.lora.init_from):
        # "before" is worth a column only as a real model (the checkpoint or adapter fine-tuning starts from). The
        # weights only: DCP's optimizer state_dict would initialise AdamW's state (a step with lr 0),
        # shifting its bias correction and so the whole run (every rank: each writes its shards)
        ckpt.save_checkpoint(run_dir, 0, model, None, None, _meta(spec_dict, data, 0, cfg, base), keep=10**9,
                             trainable_only=base is not None)
    result = RunResult(run_dir=run_dir, last_checkpoint=resume_from, is_main=env.is_main)
    balancer = Balancer(model, resolve_balance(cfg.moe, spec), env, cfg.train.grad_accum)
    probe = HeldoutProbe(cfg, data, env, autocast, memory) if cfg.train.eval_every else None
    loop = _Loop(cfg, env, device, plan_dict, memory, autocast, model, optimizer, scheduler, data, spec_dict,
                 balancer, base, probe)
    try:
        loop.run(start, result)
    finally:
        applied.release()  # the SCO pinned pool
    if cfg.train.export_hf:  # every rank: the shards are gathered tensor by tensor, rank 0 writes
        export_run(cfg, model, spec, Path(run_dir), result, env.is_main)
    if cfg.train.eval_after and data.heldout:
        if env.world_size > 1:
            env.log("evaluation after a multi-process run: run `megaseq eval RUN_DIR` (one process)")
        else:
            result.eval_report = evaluate_run(cfg, run_dir, model, spec, data, env, autocast, memory,
                                              kmer=probe.kmer if probe is not None else None,
                                              step=start + len(result.losses))
    if env.is_main:
        _draw_curve(run_dir, data.unit, result.eval_report)
    env.shutdown()
    return result


def _draw_curve(run_dir: Path, unit: str, final: dict[str, Any] | None = None, quiet: bool = False) -> None:
    """``RUN/loss_curve.png``; a plot that fails must not fail the run (metrics.jsonl has the numbers).
    ``quiet``: a failing plot says nothing (a run that is stopping with its own error)."""
    from megaseq.train.loss_curve import plot_loss_curve

    try:
        plot_loss_curve(run_dir, unit, final)
    except Exception as e:  # noqa: BLE001
        if not quiet:
            _log.warning(f"warning: could not draw {run_dir}/loss_curve.png ({type(e).__name__}: {e})")


@dataclass
class _Loop:
    """The optimizer steps of a run: each step's batches, the step, its metrics record, checkpoints."""

    cfg: Config
    env: ParallelEnv
    device: torch.device
    plan: dict[str, Any]
    memory: MemorySettings
    autocast: torch.dtype | None
    model: torch.nn.Module
    optimizer: Any
    scheduler: Any
    data: Any
    spec_dict: dict[str, Any]
    balancer: Balancer | None = None
    base: dict[str, Any] | None = None  # how the frozen base is made (checkpoints then hold what trains only)
    probe: HeldoutProbe | None = None  # train.eval_every

    def run(self, start: int, result: RunResult) -> None:
        cfg, env = self.cfg, self.env
        every = cfg.train.eval_every
        evals = (cfg.train.steps // every - start // every) if every else 0
        logger = MetricsLogger(result.run_dir, cfg.train.steps, start, cfg.log.tensorboard, cfg.log.progress,
                               env.is_main, evals_left=evals)
        skipped = 0  # non-finite steps in a row (train.on_nonfinite skip)
        clock = TimeLimit(parse_duration(cfg.train.time_limit), env)
        schedule = SaveSchedule(cfg.train.save_every, cfg.train.save_every_minutes, env)
        note = cold_start_note(self.device.type)
        if note and start + 1 <= cfg.train.steps:
            env.log(note)
        try:
            with guard.StopSignals(env.log) as signals:
                for step in range(start + 1, cfg.train.steps + 1):
                    loss, record = self.step(step, logger, result)
                    if step == start + 1:
                        report_fallbacks(cfg, self.device, env.log)
                    skipped = self._skipped(step, record, skipped, result)
                    result.losses.append(loss)
                    out_of_time = step < cfg.train.steps and clock.spent(record["step_s"])
                    if step % cfg.log.every == 0 or step == cfg.train.steps or out_of_time:
                        logger.log(record)
                    signum = signals.requested(env)
                    save_now = schedule.due(step)
                    if save_now or step == cfg.train.steps or signum or out_of_time:
                        self.save(step, result, record["lr"])
                        schedule.saved()
                        signum = signum or signals.requested(env)  # a signal during the write: stop now
                    if signum:
                        raise signals.stopped(signum, step, result.last_checkpoint)
                    env.barrier()
                    if self.probe is not None and step % every == 0:  # after the save: a failed eval loses no step
                        logger.log_eval(self.probe(self.model, step, logger.eval_progress))
                    if out_of_time:
                        result.time_limited = (step, cfg.train.steps, cfg.train.time_limit)
                        env.log(f"train.time_limit {cfg.train.time_limit} reached after step {step} of "
                                f"{cfg.train.steps}: checkpoint saved; the run ends here (export, evaluation); "
                                "continue with the same command and --train.resume true")
                        break
        except BaseException:  # the curve so far, quietly: the run's own error is the one message
            logger.close()
            if env.is_main:
                _draw_curve(result.run_dir, self.data.unit, quiet=True)
            raise
        logger.close()
        if env.is_main:
            _draw_curve(result.run_dir, self.data.unit)

    def save(self, step: int, result: RunResult, lr: float) -> None:
        """A resumable checkpoint at ``step`` (every rank writes its shards; rank 0 the rest). Weights the
        update of ``step`` (at learning rate ``lr``) made non-finite, on any rank, stop the run naming the step
        (the ranks agree inside ``save_checkpoint``, so all of them stop)."""
        try:
            with indexer_training.thawed(self.model, self.optimizer):  # what the run trains, also in the warm-up
                result.last_checkpoint = ckpt.save_checkpoint(
                    result.run_dir, step, self.model, self.optimizer, self.scheduler,
                    _meta(self.spec_dict, self.data, step, self.cfg, self.base), self.cfg.train.keep_checkpoints,
                    trainable_only=self.base is not None)
        except NonFiniteWeights as e:  # an update with a finite gradient overflowed: nothing was written
            raise guard.overflowed(step, str(e), lr, ckpt.latest_resumable(result.run_dir)) from None

    def _skipped(self, step: int, record: dict[str, Any], skipped: int, result: RunResult) -> int:
        """Count the steps ``on_nonfinite skip`` skipped in a row; ``guard.MAX_SKIPPED`` of them stop the run."""
        if guard.is_finite_step(record["loss"], record["grad_norm"]):
            return 0
        skipped += 1
        self.env.log(f"step {step} skipped: loss {record['loss']}, gradient norm {record['grad_norm']} "
                     f"({skipped} in a row; {guard.MAX_SKIPPED} stop the run)")
        if skipped >= guard.MAX_SKIPPED:
            raise guard.diverged(step, record["loss"], record["grad_norm"], record["lr"],
                                 ckpt.latest_resumable(result.run_dir), skipped)
        return skipped

    def step(self, step: int, logger: MetricsLogger, result: RunResult) -> tuple[float, dict[str, Any]]:
        """One optimizer step and its metrics record (loss, tokens/s, MFU against the H200's bf16 peak,
        peak GPU and host memory beside the plan, MoE load)."""
        cfg, env, device = self.cfg, self.env, self.device
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        t0 = time.perf_counter()
        # one rank of each context-parallel group reads the sequence and scatters the shards
        batches = [self.data.train.next_batch() if env.reads_data else None for _ in range(cfg.train.grad_accum)]
        batches = [env.shard_batch(b, self.memory.model_segment_tokens) for b in batches]
        lr = self.optimizer.param_groups[0]["lr"]
        indexer_training.begin_step(self.model, step)  # the dense warm-up's steps, then the sparse stage
        try:
            loss, gnorm = train_step(self.model, batches, self.optimizer, self.scheduler, cfg, env, self.autocast,
                                     self.memory, progress=logger.substep, balancer=self.balancer)
        except guard.NonFiniteStep as e:
            raise guard.diverged(step, e.loss, e.grad_norm, lr, ckpt.latest_resumable(result.run_dir)) from None
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        dt = time.perf_counter() - t0
        tokens_per_s = cfg.train.batch_size * cfg.train.grad_accum * cfg.data.seq_len * env.dp_size / dt
        record = {"step": step, "loss": loss, "lr": lr, "grad_norm": gnorm, "tokens_per_s": tokens_per_s,
                  "step_s": dt, "mfu": step_mfu(tokens_per_s, self.plan, env.world_size, device),
                  "gpu_peak_gib": gpu_peak_bytes(device) / GIB, "host_peak_gib": host_peak_bytes() / GIB,
                  "plan_gpu_gib": self.plan.get("peak_gpu", 0) / GIB}
        if self.balancer is not None:  # per MoE layer, the step's load over every rank (and the aux loss)
            record.update(self.balancer.metrics())
        record.update(indexer_training.metrics(self.model, env))
        return loss, record


class TimeLimit:
    """``train.time_limit``: whether the next step would end past the budget (``limit`` seconds from the first
    step), the longest step so far taken as its time, the run's first step left out once another has run (it
    compiles, autotunes and warms the allocator: often several times a warm step); 0: no limit. The ranks
    agree (any rank out of time stops all of them, so none waits in a collective for the others)."""

    def __init__(self, limit: float, env: Any) -> None:
        self.limit, self.env = limit, env
        self.t0 = time.perf_counter()
        self.first: float | None = None
        self.longest = 0.0  # of the steps after the first

    def spent(self, step_s: float) -> bool:
        if not self.limit:
            return False
        if self.first is None:
            self.first = step_s
        else:
            self.longest = max(self.longest, step_s)
        next_s = self.longest if self.longest else self.first
        over = time.perf_counter() - self.t0 + next_s > self.limit
        if getattr(self.env, "world_size", 1) > 1:
            over = bool(self.env.all_reduce_count(1 if over else 0))
        return over


def step_mfu(tokens_per_s: float, plan: dict[str, Any], world_size: int, device: torch.device) -> float | None:
    """Model FLOPs utilisation of a step against the H200's dense bf16 peak (``plan.flops``: the model's
    FLOPs per token, recompute not counted); None off a GPU, where that peak means nothing."""
    if device.type != "cuda":
        return None
    return mfu(tokens_per_s, plan["flops"]["per_token"], world_size)


def _meta(spec_dict: dict[str, Any], data: Any, step: int, cfg: Config | None = None,
          base: dict[str, Any] | None = None) -> dict[str, Any]:
    """A checkpoint's meta; ``init`` says what the starting checkpoint was (``checkpoint.is_random_init``)."""
    source = cfg.model.init_from if cfg is not None else None  # `megaseq convert` carries its unmodelled tensors
    return {"spec": spec_dict, "data": data.train.state_dict(), "step": step, "init_from": source,
            "init": source or "random", **({"base": base} if base else {})}


def _base_meta(cfg: Config) -> dict[str, Any] | None:
    """How a frozen base is made again (``train.convert.load_megaseq_checkpoint``); None: nothing is frozen."""
    if not AdapterSettings.of(cfg).freezes:
        return None
    return {"init_from": cfg.model.init_from, "seed": cfg.train.seed, "lora": dataclasses.asdict(cfg.lora),
            "trainable": list(cfg.train.trainable)}


def export_run(cfg: Config, model: torch.nn.Module, spec: Any, run_dir: Path, result: RunResult,
               is_main: bool = True) -> None:
    """The end-of-run export: the HF checkpoint (``run_dir/hf``), or with LoRA the PEFT adapter
    (``run_dir/adapter``, written by the main rank: adapters are replicated) and, with ``lora.export_merged``,
    the merged model as the HF checkpoint. Every rank calls it (FSDP's shards are gathered tensor by tensor)."""
    from megaseq.models.hf_io import export_hf_checkpoint

    if cfg.lora.enabled:
        from megaseq.models.peft_io import export_adapter

        out = run_dir / "adapter"
        result.adapter_export = export_adapter(model, spec, cfg.lora, out, cfg.model.init_from) if is_main else out
        if not cfg.lora.export_merged:
            return
    result.hf_export = export_hf_checkpoint(model, spec, run_dir / "hf", merged=cfg.lora.enabled,
                                            carry_from=cfg.model.init_from)
    if is_main:  # the tokenizer and its chat template beside the weights, so the export loads whole
        from megaseq.data.chat import copy_tokenizer_files

        copy_tokenizer_files(cfg.data.tokenizer, result.hf_export)
        if cfg.data.kind == "fasta" and cfg.data.tokenizer == "dna":  # the single-nucleotide one, as a HF tokenizer
            from megaseq.data.dna_hf import write_hf_dna_tokenizer
            from megaseq.data.tokenizer import DnaTokenizer

            write_hf_dna_tokenizer(DnaTokenizer(cfg.data.lowercase, cfg.data.non_acgt), result.hf_export)
