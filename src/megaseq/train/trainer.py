"""The training loop: plan, claim the run directory, build data and model, train, save, export, evaluate.

Order matters for the "fixed memory, fail early" contract: the plan is made and checked before
any data is read or any weight is allocated, so a run that cannot fit stops in a second with a
message naming the binding component.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from megaseq.config import Config, MemorySettings
from megaseq.ops import dispatch
from megaseq.ops.kernels import planned_kernels, preferred_kernels
from megaseq.plan.flops import mfu
from megaseq.train import checkpoint as ckpt
from megaseq.train.heldout import HeldoutProbe, evaluate_run
from megaseq.train.metrics import MetricsLogger, gpu_peak_bytes, host_peak_bytes, moe_load
from megaseq.train.optim import build_optimizer
from megaseq.train.parallel_env import ParallelEnv, setup_parallel
from megaseq.train.run_dir import claim_run_dir, discard_unstarted, write_plan

GIB = 2**30


@dataclass
class RunResult:
    run_dir: Path
    losses: list[float] = field(default_factory=list)
    last_checkpoint: Path | None = None
    hf_export: Path | None = None
    eval_report: dict[str, Any] | None = None
    is_main: bool = True  # rank 0 (or the one process): the one that prints


def resolve_device(cfg: Config) -> torch.device:
    want = cfg.train.device
    if want == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if want.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("train.device is cuda but no CUDA GPU is visible; set --train.device cpu")
    return torch.device(want)


def dtypes(cfg: Config, device: torch.device) -> tuple[torch.dtype, torch.dtype | None]:
    """(parameter dtype, autocast dtype). bf16 compute keeps fp32 master weights under autocast."""
    if cfg.model.dtype == "fp64":
        return torch.float64, None
    if cfg.model.dtype == "bf16" and device.type == "cuda":
        return torch.float32, torch.bfloat16
    return torch.float32, None  # bf16 on the CPU is slow and unhelpful: compute in fp32


def make_plan(cfg: Config, env: ParallelEnv, device: torch.device) -> tuple[dict[str, Any], MemorySettings]:
    """Plan memory before anything is allocated; returns (plan as dict, the memory settings to apply)."""
    from megaseq.plan.planner import plan_from_config

    gpu_bytes = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None
    plan = plan_from_config(cfg, world_size=env.world_size, gpu_bytes=gpu_bytes)
    # on a GPU the plan binds; on the CPU only when a GPU budget was given (planning a GPU run here)
    if (device.type == "cuda" or cfg.memory.gpu_budget != "auto") and not plan.fits:
        raise ValueError(f"the memory plan does not fit, so nothing was started. {plan.advice} "
                         "(see `megaseq plan` for the table per component)")
    return plan.to_dict(), MemorySettings.from_dict(plan.memory)


def _autocast(dtype: torch.dtype | None, device: torch.device) -> contextlib.AbstractContextManager:
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def train_step(model: torch.nn.Module, micro_batches: list[dict[str, torch.Tensor]], optimizer: Any,
               scheduler: Any, cfg: Config, env: ParallelEnv, autocast: torch.dtype | None,
               memory: MemorySettings, progress: Any = None) -> tuple[float, float]:
    """One optimizer step over ``grad_accum`` micro-batches; returns (mean loss, grad norm). ``progress``
    (pass, done, total) hears of each sequence segment when the plan runs them."""
    chunk = memory.loss_chunk_tokens if memory.chunked_loss else None
    local = sum(int((b["labels"] != -100).sum()) for b in micro_batches)
    total = env.all_reduce_count(local)  # the loss is a mean over every token of the global batch
    loss_sum = 0.0
    segment = memory.model_segment_tokens
    for batch in micro_batches:
        b = env.to_device(batch)
        if segment and b["input_ids"].shape[1] > segment:  # sequence segments (memory/model_segments.py)
            loss_sum += float(_segmented_step(model, b, env, autocast, chunk, segment, total, progress,
                                              memory.segment_keep_selection))
            continue
        with _autocast(autocast, env.device):
            hidden = model(b["input_ids"], doc_ids=b.get("doc_ids"), ctx=env.context(b))
        loss = _loss_sum(model, hidden, b["labels"], env, autocast, chunk)
        (loss / max(total, 1)).backward()
        loss_sum += float(loss.detach())
    env.reduce_gradients(model)
    params = [p for p in model.parameters() if p.grad is not None]
    if cfg.optim.grad_clip > 0:
        if hasattr(optimizer, "clip_grad_norm_"):
            grad_norm = float(optimizer.clip_grad_norm_(cfg.optim.grad_clip))
        else:
            grad_norm = float(torch.nn.utils.clip_grad_norm_(params, cfg.optim.grad_clip))
    else:
        grad_norm = float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params])))
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return env.all_reduce_sum(loss_sum) / max(total, 1), grad_norm


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
                    progress: Any = None, keep_selection: bool = False) -> torch.Tensor:
    """Forward + backward of one micro-batch in sequence segments; returns its loss sum (no graph)."""
    from megaseq.memory.model_segments import check_model_segments, segmented_loss_backward

    check_model_segments(getattr(getattr(model, "spec", None), "family", type(model).__name__), segment, env.cp_size)

    def loss_fn(hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return _loss_sum(model, hidden, labels, env, autocast, chunk)

    with _autocast(autocast, env.device):
        return segmented_loss_backward(model, b["input_ids"], b["labels"], loss_fn, 1.0 / max(total, 1), segment,
                                       progress, doc_ids=b.get("doc_ids"), keep_selection=keep_selection)


def build_planned_model(cfg: Config, spec: Any, device: torch.device, memory: MemorySettings, total_steps: int,
                        init_from: str | None = None, env: Any = None) -> tuple[torch.nn.Module, Any, Any, Any]:
    """The model with the plan's memory schemes applied by its family's ``parallelize``, and its planned
    optimizer and LR schedule: (model, what was applied (release it at the end), optimizer, scheduler)."""
    from megaseq.models.build import build_model
    from megaseq.models.registry import parallelize

    model = build_model(spec, dtype=dtypes(cfg, device)[0], device=device, seed=cfg.train.seed)
    if init_from:
        from megaseq.models.hf_io import load_hf_checkpoint

        load_hf_checkpoint(init_from, model=model, spec=spec)
    applied = parallelize(model, memory, env)
    optimizer, scheduler = build_optimizer(model, cfg.optim, total_steps, memory)
    return model, applied, optimizer, scheduler


def kernels_for(cfg: Config, device: torch.device) -> contextlib.AbstractContextManager:
    """The dispatcher set up as the run is planned: ``model.kernels``' preferences, the planned kernels, and
    with ``model.strict_kernels`` a fallback from them an error naming the layer and the reason."""
    return dispatch.configured(preferred=preferred_kernels(device.type, cfg.model.kernels),
                               planned=planned_kernels(device.type, cfg.model.dtype), strict=cfg.model.strict_kernels)


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
    use_expandable_segments()
    env = setup_parallel(cfg)
    if cfg.train.eval_every and env.world_size > 1:  # as the end-of-run evaluation: one process only
        env.log(f"train.eval_every: held-out evaluation runs in one process and this run has {env.world_size}, "
                "so it is skipped; evaluate the checkpoints with `megaseq eval RUN_DIR`")
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, eval_every=0))
    device = env.device = resolve_device(cfg) if env.world_size == 1 else env.device
    plan_dict, memory = make_plan(cfg, env, device)
    with kernels_for(cfg, device):
        return _run_planned(cfg, spec, env, device, plan_dict, memory)


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
    spec_dict = spec.to_dict()
    start = 0
    if resume_from is not None:
        meta = ckpt.load_checkpoint(resume_from, model, optimizer, scheduler, expected_spec=spec_dict)
        start = meta["step"]
        data.train.load_state_dict(meta["data"])
        env.log(f"resumed from {resume_from} at step {start}")
    elif cfg.train.eval_after and cfg.model.init_from and env.is_main:
        # "before" is worth a column only as a real model (the checkpoint fine-tuning starts from). The
        # weights only: DCP's optimizer state_dict would initialise AdamW's state (a step with lr 0),
        # shifting its bias correction and so the whole run
        ckpt.save_checkpoint(run_dir, 0, model, None, None, _meta(cfg, spec_dict, data, 0), keep=10**9)
    result = RunResult(run_dir=run_dir, last_checkpoint=resume_from, is_main=env.is_main)
    probe = HeldoutProbe(cfg, data, env, autocast, memory) if cfg.train.eval_every else None
    loop = _Loop(cfg, env, device, plan_dict, memory, autocast, model, optimizer, scheduler, data, spec_dict, probe)
    try:
        loop.run(start, result)
    finally:
        applied.release()  # the SCO pinned pool
    if cfg.train.export_hf and env.is_main:
        from megaseq.models.hf_io import export_hf_checkpoint

        result.hf_export = Path(run_dir) / "hf"
        export_hf_checkpoint(model, spec, result.hf_export)
    if cfg.train.eval_after and data.heldout:
        if env.world_size > 1:
            env.log("evaluation after a multi-process run: run `megaseq eval RUN_DIR` (one process)")
        else:
            result.eval_report = evaluate_run(cfg, run_dir, model, spec, data, env, autocast, memory,
                                              kmer=probe.kmer if probe is not None else None)
    if env.is_main:
        _draw_curve(run_dir, data.unit, result.eval_report)
    env.shutdown()
    return result


def _draw_curve(run_dir: Path, unit: str, final: dict[str, Any] | None = None) -> None:
    """``RUN/loss_curve.png``; a plot that fails must not fail the run (metrics.jsonl has the numbers)."""
    from megaseq.train.loss_curve import plot_loss_curve

    try:
        plot_loss_curve(run_dir, unit, final)
    except Exception as e:  # noqa: BLE001
        print(f"warning: could not draw {run_dir}/loss_curve.png ({type(e).__name__}: {e})", file=sys.stderr)


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
    probe: HeldoutProbe | None = None  # train.eval_every

    def run(self, start: int, result: RunResult) -> None:
        cfg, env = self.cfg, self.env
        every = cfg.train.eval_every
        evals = (cfg.train.steps // every - start // every) if every else 0
        logger = MetricsLogger(result.run_dir, cfg.train.steps, start, cfg.log.tensorboard, cfg.log.progress,
                               env.is_main, evals_left=evals)
        try:
            for step in range(start + 1, cfg.train.steps + 1):
                loss, record = self.step(step, logger)
                result.losses.append(loss)
                if step % cfg.log.every == 0 or step == cfg.train.steps:
                    logger.log(record)
                save_now = cfg.train.save_every and step % cfg.train.save_every == 0
                if (save_now or step == cfg.train.steps) and env.is_main:
                    result.last_checkpoint = ckpt.save_checkpoint(
                        result.run_dir, step, self.model, self.optimizer, self.scheduler,
                        _meta(cfg, self.spec_dict, self.data, step), cfg.train.keep_checkpoints)
                env.barrier()
                if self.probe is not None and step % every == 0:  # after the save: a failed eval loses no step
                    logger.log_eval(self.probe(self.model, step, logger.eval_progress))
        finally:
            logger.close()
            if env.is_main:
                _draw_curve(result.run_dir, self.data.unit)

    def step(self, step: int, logger: MetricsLogger) -> tuple[float, dict[str, Any]]:
        """One optimizer step and its metrics record (loss, tokens/s, MFU against the H200's bf16 peak,
        peak GPU and host memory beside the plan, MoE load)."""
        cfg, env, device = self.cfg, self.env, self.device
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        t0 = time.perf_counter()
        # one rank of each context-parallel group reads the sequence and scatters the shards
        batches = [self.data.train.next_batch() if env.reads_data else None for _ in range(cfg.train.grad_accum)]
        batches = [env.shard_batch(b) for b in batches]
        lr = self.optimizer.param_groups[0]["lr"]
        loss, gnorm = train_step(self.model, batches, self.optimizer, self.scheduler, cfg, env, self.autocast,
                                 self.memory, progress=logger.substep)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        dt = time.perf_counter() - t0
        tokens_per_s = cfg.train.batch_size * cfg.train.grad_accum * cfg.data.seq_len * env.dp_size / dt
        record = {"step": step, "loss": loss, "lr": lr, "grad_norm": gnorm, "tokens_per_s": tokens_per_s,
                  "step_s": dt, "mfu": step_mfu(tokens_per_s, self.plan, env.world_size, device),
                  "gpu_peak_gib": gpu_peak_bytes(device) / GIB, "host_peak_gib": host_peak_bytes() / GIB,
                  "plan_gpu_gib": self.plan.get("peak_gpu", 0) / GIB, "moe_max_over_mean": moe_load(self.model)}
        return loss, record


def step_mfu(tokens_per_s: float, plan: dict[str, Any], world_size: int, device: torch.device) -> float | None:
    """Model FLOPs utilisation of a step against the H200's dense bf16 peak (``plan.flops``: the model's
    FLOPs per token, recompute not counted); None off a GPU, where that peak means nothing."""
    if device.type != "cuda":
        return None
    return mfu(tokens_per_s, plan["flops"]["per_token"], world_size)


def _meta(cfg: Config, spec_dict: dict[str, Any], data: Any, step: int) -> dict[str, Any]:
    """A checkpoint's meta; ``init`` says what step 0 was (``checkpoint.is_random_init``)."""
    return {"spec": spec_dict, "data": data.train.state_dict(), "step": step,
            "init": cfg.model.init_from or "random"}
