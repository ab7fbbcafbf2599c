"""The loop of a run: its optimizer steps, each one's metrics record, checkpoints (every N steps, every M
minutes, at the end, on SIGTERM / SIGINT), the held-out probe every ``train.eval_every`` steps, and the wall-clock
``train.time_limit``; the run's loss curve drawn when it ends, however it ends.

The step itself is ``train.step.train_step`` (looked up on its module at each step, so a test can wrap it);
what it trains is built by ``train.build``; ``train.trainer`` plans the run and calls ``TrainLoop.run``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from megaseq.config import AdapterSettings, Config, parse_duration
from megaseq.memory import host_memory
from megaseq.ops.kernels import cold_start_note
from megaseq.plan.flops import mfu
from megaseq.train import checkpoint as ckpt
from megaseq.train import guard, host_gc, indexer_training
from megaseq.train import step as step_mod
from megaseq.train.build import grow_pool, report_fallbacks
from megaseq.train.heldout import HeldoutProbe
from megaseq.train.metrics import MetricsLogger, gpu_peak_bytes, host_peak_bytes, over_plan, scheme_drift
from megaseq.train.parallel_env import ParallelEnv
from megaseq.train.periodic import SaveSchedule
from megaseq.train.safe_checkpoint import NonFiniteWeights
from megaseq.train.step import StepState

_log = logging.getLogger(__name__)  # (``logger`` below is a run's MetricsLogger)


GIB = 2**30


@dataclass
class RunResult:
    """What a run did: its losses, checkpoints, exports and evaluation report (``run_training``'s result)."""

    run_dir: Path
    losses: list[float] = field(default_factory=list)
    last_checkpoint: Path | None = None
    hf_export: Path | None = None
    eval_report: dict[str, Any] | None = None
    adapter_export: Path | None = None
    is_main: bool = True  # rank 0 (or the one process): the one that prints
    time_limited: tuple[int, int, str] | None = None  # (step, train.steps, train.time_limit): stopped by the limit


def draw_curve(run_dir: Path, unit: str, final: dict[str, Any] | None = None, quiet: bool = False) -> None:
    """``RUN/loss_curve.png``; a plot that fails must not fail the run (metrics.jsonl has the numbers).
    ``quiet``: a failing plot says nothing (a run that is stopping with its own error)."""
    from megaseq.train.loss_curve import plot_loss_curve

    try:
        plot_loss_curve(run_dir, unit, final)
    except Exception as e:  # noqa: BLE001
        if not quiet:
            _log.warning(f"warning: could not draw {run_dir}/loss_curve.png ({type(e).__name__}: {e})")


@dataclass
class TrainLoop:
    """The optimizer steps of a run: each step's batches, the step, its metrics record, checkpoints, the
    held-out probe, the time limit and the stop signals."""

    cfg: Config
    device: torch.device
    plan: dict[str, Any]
    state: StepState  # the model, optimizer, schedule, env, memory settings, autocast, balancer
    data: Any
    spec_dict: dict[str, Any]
    base: dict[str, Any] | None = None  # how the frozen base is made (checkpoints then hold what trains only)
    probe: HeldoutProbe | None = None  # train.eval_every
    schemes: Any = None  # memory.apply.AppliedMemory: its step counts go in each record beside the plan's
    precompiled: Any = None  # ops.precompile.RunPrecompile: joined before the first step, which it records

    @property
    def env(self) -> ParallelEnv:
        return self.state.env

    @property
    def model(self) -> torch.nn.Module:
        return self.state.model

    def run(self, start: int, result: RunResult) -> None:
        """Steps ``start + 1`` .. ``train.steps`` (or until the time limit or a stop signal), then the curve."""
        cfg, env = self.cfg, self.env
        every = cfg.train.eval_every
        evals = (cfg.train.steps // every - start // every) if every else 0
        logger = MetricsLogger(result.run_dir, cfg.train.steps, start, cfg.log.tensorboard, cfg.log.progress,
                               env.is_main, evals_left=evals)
        note = cold_start_note(self.device.type)
        if note and start + 1 <= cfg.train.steps:
            env.log(note)
        try:
            self._steps(start, result, logger)
        except BaseException:  # the curve so far, quietly: the run's own error is the one message
            logger.close()
            if env.is_main:
                draw_curve(result.run_dir, self.data.unit, quiet=True)
            raise
        logger.close()
        if env.is_main:
            draw_curve(result.run_dir, self.data.unit)

    def _steps(self, start: int, result: RunResult, logger: MetricsLogger) -> None:
        cfg, env, every = self.cfg, self.env, self.cfg.train.eval_every
        skipped = 0  # non-finite steps in a row (train.on_nonfinite skip)
        warned_plan: str | None = None  # the first step above the plan says so once
        warned_drift: str | None = None  # and the first step whose memory schemes ran other than planned
        clock = TimeLimit(parse_duration(cfg.train.time_limit), env)
        schedule = SaveSchedule(cfg.train.save_every, cfg.train.save_every_minutes, env)
        with guard.StopSignals(env.log) as signals, host_gc.steps():
            for step in range(start + 1, cfg.train.steps + 1):
                first = step == start + 1
                precompiled = self.precompiled if first else None
                if first:  # MEGASEQ_GROW_POOL=1; the step resets the peak statistics after it
                    grow_pool(self.device, self.plan.get("peak_gpu_tensors", 0))
                if precompiled is not None:
                    precompiled.join(env.log)  # the manifests' kernels compiled: none launched before this
                # what the first step still compiles: the next run's too
                with precompiled.recording() if precompiled is not None else contextlib.nullcontext():
                    loss, record = self.step(step, logger, result)
                if first:
                    report_fallbacks(cfg, self.device, env.log)
                    if line := host_memory.summary_line():
                        env.log(line)
                if not warned_plan and (warned_plan := over_plan(record, str(result.run_dir))):
                    env.log(warned_plan)
                if not warned_drift and (warned_drift := scheme_drift(record)):
                    env.log(warned_drift)
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

    def save(self, step: int, result: RunResult, lr: float) -> None:
        """A resumable checkpoint at ``step`` (every rank writes its shards; rank 0 the rest). Weights the
        update of ``step`` (at learning rate ``lr``) made non-finite, on any rank, stop the run naming the step
        (the ranks agree inside ``save_checkpoint``, so all of them stop)."""
        try:
            with indexer_training.thawed(self.model, self.state.optimizer):  # what the run trains, in the warm-up too
                result.last_checkpoint = ckpt.save_checkpoint(
                    result.run_dir, step, self.model, self.state.optimizer, self.state.scheduler,
                    checkpoint_meta(self.spec_dict, self.data, step, self.cfg, self.base),
                    self.cfg.train.keep_checkpoints, trainable_only=self.base is not None)
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
        peak GPU and host memory beside the plan (with the CUDA graphs' pool), MoE load)."""
        cfg, env, device = self.cfg, self.env, self.device
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        if self.schemes is not None:
            self.schemes.start_counts()
        t0 = time.perf_counter()
        # one rank of each context-parallel group reads the sequence and scatters the shards
        batches = [self.data.train.next_batch() if env.reads_data else None for _ in range(cfg.train.grad_accum)]
        batches = [env.shard_batch(b, self.state.memory.model_segment_tokens) for b in batches]
        lr = self.state.optimizer.param_groups[0]["lr"]
        indexer_training.begin_step(self.model, step)  # the dense warm-up's steps, then the sparse stage
        try:
            loss, gnorm = step_mod.train_step(self.state, batches, progress=logger.substep)
        except guard.NonFiniteStep as e:
            raise guard.diverged(step, e.loss, e.grad_norm, lr, ckpt.latest_resumable(result.run_dir)) from None
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        dt = time.perf_counter() - t0
        tokens_per_s = cfg.train.batch_size * cfg.train.grad_accum * cfg.data.seq_len * env.dp_size / dt
        # the CUDA graphs' pool is held outside the plan's phases, within its headroom (train.layer_graphs)
        graph_pool = self.state.graphs.pool_bytes if self.state.graphs is not None else 0
        record = {"step": step, "loss": loss, "lr": lr, "grad_norm": gnorm, "tokens_per_s": tokens_per_s,
                  "step_s": dt, "mfu": step_mfu(tokens_per_s, self.plan, env.world_size, device),
                  "gpu_peak_gib": gpu_peak_bytes(device) / GIB, "host_peak_gib": host_peak_bytes() / GIB,
                  "plan_gpu_gib": (self.plan.get("peak_gpu", 0) + graph_pool) / GIB}
        record.update(self._scheme_counts())
        if self.state.balancer is not None:  # per MoE layer, the step's load over every rank (and the aux loss)
            record.update(self.state.balancer.metrics())
        record.update(indexer_training.metrics(self.model, env))
        return loss, record

    def _scheme_counts(self) -> dict[str, Any]:
        """The step's memory-scheme counts beside the plan's: layer inputs SCO put in host memory in each
        forward (a whole-sequence forward: not under sequence segments, which run several) and the most streamed
        layers on the device at once."""
        if self.schemes is None:
            return {}
        counts, out = self.schemes.counts(), {}
        if "offloaded_layers" in counts and not self.state.memory.model_segment_tokens:
            out["offloaded_layers"] = counts["offloaded_layers"] // self.cfg.train.grad_accum
            out["plan_offloaded_layers"] = self.plan.get("offloaded_layers", 0)
        if "streamed_layers_resident" in counts:
            out["streamed_layers_resident"] = counts["streamed_layers_resident"]
        return out


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


def checkpoint_meta(spec_dict: dict[str, Any], data: Any, step: int, cfg: Config | None = None,
          base: dict[str, Any] | None = None) -> dict[str, Any]:
    """A checkpoint's meta; ``init`` says what the starting checkpoint was (``checkpoint.is_random_init``)."""
    source = cfg.model.init_from if cfg is not None else None  # `megaseq convert` carries its unmodelled tensors
    return {"spec": spec_dict, "data": data_state(data.train), "step": step, "init_from": source,
            "init": source or "random", **({"base": base} if base else {})}


def data_state(train: Any) -> dict[str, Any]:
    """The training source's state. A stream's position is each data-parallel rank's own (``positions``), so with
    several processes every rank's is gathered into the one rank 0 writes (every rank saves, so all call this)."""
    state = train.state_dict()
    dist = torch.distributed
    if "positions" in state and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        from megaseq.data.packing import merge_positions

        got: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(got, (state["index"], state["positions"]))
        state["positions"] = merge_positions([p for index, p in got if index == state["index"]])
    return state


def base_meta(cfg: Config) -> dict[str, Any] | None:
    """How a frozen base is made again (``train.convert.load_megaseq_checkpoint``); None: nothing is frozen."""
    if not AdapterSettings.of(cfg).freezes:
        return None
    return {"init_from": cfg.model.init_from, "seed": cfg.train.seed, "lora": dataclasses.asdict(cfg.lora),
            "trainable": list(cfg.train.trainable)}
