"""One measured point of ``megaseq bench``: the planned training step of a recipe at one length, timed and
its peak GPU and host memory read, beside the plan's prediction.

The step is the trainer's own (``train.step.train_step`` with the plan's fixes applied, as ``megaseq
train`` runs it). Warm steps only: one warm-up step (kernels, autotune, the allocator) is left out, unless
``steps`` is 0 (the one, cold, step of a length whose step is minutes long). MFU comes from the planner's
FLOP count (``plan.flops.mfu``: model FLOPs only, attention and indexer included, recompute not).
"""

from __future__ import annotations

import contextlib
import copy
import logging
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from megaseq.config import Config, MemorySettings
from megaseq.ops import dispatch, kept_attention
from megaseq.ops.kernels import cold_start_note, preferred_kernels
from megaseq.plan.flops import mfu

logger = logging.getLogger(__name__)


GIB = 2**30


def host_rss_peak_reset() -> None:
    """Reset the kernel's peak-RSS counter (VmHWM) so each length reports its own host peak."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def host_rss_peak() -> int:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def cfg_for(cfg: Config, seq_len: int, source: str) -> Config:
    c = copy.deepcopy(cfg)
    c.data.seq_len = seq_len
    if source == "random":
        c.data.kind = "random"
    elif source == "genome" and c.data.kind == "random":
        c.data.kind = "fasta"  # data.train (or the built-in genome) through the DNA tokenizer
    c.train.eval_after = False
    c.train.export_hf = False
    return c


def plan_on(c: Config, device: torch.device) -> Any:
    """The plan ``megaseq train`` would make for ``c`` on this one device (its real memory on a GPU)."""
    from megaseq.plan.planner import plan_from_config

    gpu_bytes = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None
    return plan_from_config(c, world_size=1, gpu_bytes=gpu_bytes, device_type=device.type)


def planned_step(c: Config, spec: Any, device: torch.device, plan: Any, total_steps: int) -> tuple:
    """``(model, applied memory, next_batch(), step(batch))``: the trainer's data, model, optimizer and step
    with ``plan``'s fixes applied, as ``megaseq train`` runs them; ``step.graphs`` is the run's
    ``train.layer_graphs.LayerGraphs`` (captured before the second step), or None."""
    from megaseq.data import build_data
    from megaseq.train.build import build_planned_model, dtypes
    from megaseq.train.parallel_env import ParallelEnv
    from megaseq.train.step import StepState, train_step

    autocast = dtypes(c, device)[1]
    data = build_data(c.data, None, batch_size=c.train.batch_size, vocab_size=spec.vocab_size)
    memory = MemorySettings.from_dict(plan.memory)
    env = ParallelEnv(device)
    model, applied, opt, sched = build_planned_model(c, spec, device, memory, total_steps, env=env)

    state = StepState.of(c, model, opt, sched, env, memory, autocast, headroom=plan.headroom)

    def step(batch: dict[str, torch.Tensor]) -> None:
        train_step(state, [batch])

    step.graphs = state.graphs  # the layers replayed as CUDA graphs from the second step (None: none)
    return model, applied, data.train.next_batch, step


def warm_planned_step(cfg: Config, seq_len: int, device: torch.device) -> tuple:
    """``(c, spec, plan, model, applied, next_batch, step)`` for a memory benchmark: ``cfg`` at ``seq_len`` on
    random tokens, planned on ``device``, the trainer's model and step with the plan's fixes (``planned_step``),
    one warm-up step run (kernels, the optimizer state) and synchronised. The dispatcher is set up as
    ``megaseq train`` sets it (``model.kernels``) for the rest of the process: a memory benchmark's step
    runs the kernels the plan counts."""
    from megaseq.models.presets import resolve_spec
    from megaseq.train.build import kernel_settings

    c = cfg_for(cfg, seq_len, "random")
    spec = resolve_spec(c.model.name)
    dispatch.configure(**kernel_settings(c, device))  # as `megaseq train`'s kernels_for; kept: the process ends after
    plan = plan_on(c, device)
    model, applied, next_batch, step = planned_step(c, spec, device, plan, 2)
    step(next_batch())
    _sync(device)
    return c, spec, plan, model, applied, next_batch, step


def measure_megaseq(cfg: Config, seq_len: int, steps: int, source: str, routing: str = "natural",
                    profile: Path | None = None, profile_first: Path | None = None) -> dict[str, Any]:
    """Warm-up step + ``steps`` timed steps of megaseq at ``seq_len`` (``steps`` 0: the one step, timed cold);
    an OOM is a result, not an error. ``routing``: the MoE routers' (``models.common.routing``). ``profile``:
    one more step after the timed ones under ``torch.profiler``, its table of ops by device time written to
    that file (the timed steps run without the profiler). ``profile_first``: the first step under the profiler,
    its table by host time written to that file (where a first step's time beyond a warm one goes; the profiler
    slows that step, so its ``first_step_s`` is not a figure)."""
    from megaseq.memory import host_memory
    from megaseq.models.common.moe import set_routing
    from megaseq.models.presets import resolve_spec
    from megaseq.ops.switches import host_gc_manual
    from megaseq.train import host_gc
    from megaseq.train.build import grow_pool, kernels_for, reserve_pinned, resolve_device, start_precompile
    from megaseq.train.metrics import moe_load

    c = cfg_for(cfg, seq_len, source)
    device = resolve_device(c)
    spec = resolve_spec(c.model.name)
    plan = plan_on(c, device)
    row: dict[str, Any] = {"seq_len": seq_len, "source": source, "system": "megaseq",
                           "fixes": [f[0] if isinstance(f, (list, tuple)) else str(f) for f in plan.fixes],
                           "predicted_gpu_gib": plan.peak_gpu / GIB,
                           "predicted_gpu_tensors_gib": plan.peak_gpu_tensors / GIB,
                           "predicted_host_gib": plan.peak_host / 1e9, "memory_plan": dict(plan.memory),
                           "plan_fits": plan.fits, "routing": routing}
    model = applied = pre = next_batch = step = None
    left = left_allocated(device)
    if left is not None:
        row["gpu_gib_before_row"] = left / GIB
    try:
        reserve_pinned(device, plan.pinned_host)  # the plan's pinned host bytes, locked while the model is built
        with kernels_for(c, device):  # the dispatcher as `megaseq train` sets it up
            # the run's kernel manifests compile while the model is built (a CUDA device only); the main thread
            # launches no Triton kernel until timed_steps joins it before the first step
            pre = start_precompile(c, spec, device)
            dispatch.reset_records()
            t_build = time.perf_counter()
            model, applied, next_batch, step = planned_step(c, spec, device, plan, steps + 1)
            set_routing(model, routing)
            _sync(device)
            row["build_s"] = time.perf_counter() - t_build  # the model, its weights and the step, before the first
            row["pool_grown_gib"] = grow_pool(device, plan.peak_gpu_tensors) / GIB  # MEGASEQ_GROW_POOL=1
            host_rss_peak_reset()
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            kept_attention.STATS.reset()  # the steps' kept attention calls (memory.keep_attention_layers)
            first: list[float] = []
            compiles: dict[str, Any] = {}
            tunings: dict[str, Any] = {}
            graphs = getattr(step, "graphs", None)
            with host_gc.steps() as collected:
                times = timed_steps(lambda: step(next_batch()), steps, device, first, compiles, pre, profile_first,
                                    tunings, warmups=2 if graphs is not None else 1)
            row["cuda_graphs"] = graphs.summary() if graphs is not None else None
            row["step_times_s"] = times
            row["host_gc"] = dict(mode="step" if host_gc_manual() else "auto", **vars(collected))
            row["precompile"] = pre.summary() if pre is not None else None
            row["pinned_host"] = host_memory.describe()  # locked ahead, and what the pools took of it or locked
            row["kept_attention"] = dict(layers=getattr(applied, "kept_attention", 0), **vars(kept_attention.STATS))
            cuda = device.type == "cuda"  # the timed steps' peaks and routing, read before any profiled step
            peaks = dict(measured_gpu_gib=torch.cuda.max_memory_allocated(device) / GIB if cuda else None,
                         measured_gpu_reserved_gib=torch.cuda.max_memory_reserved(device) / GIB if cuda else None,
                         measured_host_gib=host_rss_peak() / 1e9, **load_summary(moe_load(model)))
            if profile is not None:
                profiled_step(lambda: step(next_batch()), device, profile)
            # the ops `model.kernels` prefers that ran something else (where and why): the row says what it timed
            row["kernel_fallbacks"] = dispatch.fallback_summary(preferred_kernels(device.type, c.model.kernels))
            for g in row["kernel_fallbacks"]:
                logger.info(f"megaseq bench: model.kernels {c.model.kernels}: {dispatch.describe_fallback(g)}")
        row["timed_steps"] = len(times) if steps else "1 (cold: includes the warm-up)"
        if not steps:  # the one step ran without the optimizer state (made by its update): compare with that
            row["predicted_gpu_tensors_gib"] = plan.first_step_gpu_tensors / GIB
            row["predicted_is_first_step"] = True
        dt = sum(times) / len(times)
        tokens = c.train.batch_size * seq_len
        row.update(status="ok", step_s=dt, first_step_s=first[0], capture_step_s=first[1] if len(first) > 1 else None,
                   first_step_compiles=compiles,
                   first_step_tunings=tunings,
                   tokens_per_s=tokens / dt,
                   mfu=mfu(tokens / dt, plan.flops["per_token"], 1) if device.type == "cuda" else None, **peaks)
    except torch.OutOfMemoryError as e:
        row.update(status="oom", error=str(e).splitlines()[0][:200])
        # where it ran out, for whoever reads the log (the row keeps the message only)
        logger.warning(f"megaseq bench: {seq_len} tokens: out of memory\n{traceback.format_exc()}")
        if device.type == "cuda":
            logger.warning(f"peak allocated {torch.cuda.max_memory_allocated(device) / GIB:.2f} GiB, allocated now "
                        f"{torch.cuda.memory_allocated(device) / GIB:.2f} GiB")
    finally:
        if pre is not None:
            pre.cancel()  # a length that failed before its first step leaves no compiles running (none after a join)
        if applied is not None:
            applied.release()
        host_memory.drop_reserve()
        # the step (its optimizer and state), the data and the model dropped before the collection: what a cycle
        # holds goes now, not at some later row's allocation
        model = applied = next_batch = step = None
        free_memory(device)
    return row


def load_summary(load: dict[str, float]) -> dict[str, Any]:
    """A row's MoE load: max/mean tokens per expert per layer, and its largest and mean over the layers."""
    vals = list(load.values())
    return {"moe_max_over_mean": load, "moe_load_max": max(vals) if vals else None,
            "moe_load_mean": sum(vals) / len(vals) if vals else None}


def timed_steps(run_step: Callable[[], None], steps: int, device: torch.device,
                first: list[float] | None = None, first_compiles: dict | None = None,
                precompiled: Any = None, profile_first: Path | None = None,
                first_tunings: dict | None = None, warmups: int = 1) -> list[float]:
    """Seconds of each measured step: ``steps + warmups`` runs of ``run_step``, the first ``warmups`` left out:
    the first (kernels, autotune, the allocator; its seconds appended to ``first`` when given; the Triton kernels it
    compiled, ``compiles.CompileRecord.summary``, put in ``first_compiles`` when given); ``steps`` 0: the one
    (cold) step. ``precompiled`` (``ops.precompile.RunPrecompile``): joined before the first step (the seconds
    waited for it in its ``summary()`` as ``wait_s``, outside the step's), the step's compiles added to the user's
    kernel manifest. ``profile_first``: the first step profiled (``first_profiled``). ``first_tunings``: given, the
    autotuner timings of the first step (``compiles.timed_summary``) put in it. ``warmups`` 2: the second step
    captures the CUDA graphs (``train.layer_graphs``), its seconds appended to ``first`` too."""
    from megaseq.bench.compiles import compile_record, timed_summary
    from megaseq.ops.triton_autotune import recording_tunings

    times = []
    note = cold_start_note(device.type)
    if note:  # a cold first step is silent for minutes otherwise
        logger.info(f"megaseq bench: {note}")
    if precompiled is not None:
        precompiled.join(lambda line: logger.info(f"megaseq bench: {line}"))
    warmups = warmups if steps else 1
    for i in range(steps + warmups):
        t0 = time.perf_counter()
        counting = i == 0 and first_compiles is not None
        manifest = precompiled.recording() if i == 0 and precompiled is not None else contextlib.nullcontext()
        profiling = first_profiled(device, profile_first) if i == 0 and profile_first else contextlib.nullcontext()
        tuning = recording_tunings() if i == 0 and first_tunings is not None else contextlib.nullcontext()
        with manifest, compile_record() if counting else contextlib.nullcontext() as rec, profiling, \
                tuning as timed:
            run_step()
            _sync(device)
        if counting:
            first_compiles.update(rec.summary())
        if i == 0 and first_tunings is not None:
            first_tunings.update(timed_summary(timed))
        dt = time.perf_counter() - t0
        if i >= warmups or steps == 0:
            times.append(dt)
        if i < warmups and first is not None:
            first.append(dt)
        # as each step ends (stderr): a long bench stopped by a time limit still shows what it measured
        what = "timed" if i >= warmups or not steps else "warm-up" if i == 0 else "warm-up, CUDA graph capture"
        logger.info(f"megaseq bench: step {i + 1} of {steps + warmups} ({what}): {dt:.1f} s")
    return times


@contextlib.contextmanager
def first_profiled(device: torch.device, out: Path, rows: int = 40) -> Iterator[None]:
    """A first step's host time two ways: ``torch.profiler``'s ops by self host time into ``out``, and Python's
    own profile (``cProfile``, the calling thread) by cumulative time into ``<out stem>_python.txt``, which shows
    what the ops table cannot: imports, first-call setup, waits outside torch's ops."""
    import cProfile
    import io
    import pstats

    py = cProfile.Profile()
    with profiled(device, out, "self_cpu_time_total"):
        py.enable()
        try:
            yield
        finally:
            py.disable()
    text = io.StringIO()
    pstats.Stats(py, stream=text).sort_stats("cumulative").print_stats(rows)
    out = Path(out)
    out.with_name(f"{out.stem}_python.txt").write_text(text.getvalue())


def profiled_step(run_step: Callable[[], None], device: torch.device, out: Path, rows: int = 60) -> None:
    """One step under ``torch.profiler`` (CPU and, on a GPU, CUDA activity): its ops sorted by device time
    (self time first: where the step's time goes) into ``out``."""
    with profiled(device, out, "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total", rows):
        run_step()
        _sync(device)


@contextlib.contextmanager
def profiled(device: torch.device, out: Path, sort_by: str, rows: int = 60) -> Iterator[None]:
    """The block under ``torch.profiler`` (CPU and, on a GPU, CUDA activity); its ops sorted by ``sort_by`` into
    ``out``."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        yield
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(prof.key_averages().table(sort_by=sort_by, row_limit=rows))
    logger.info(f"megaseq bench: wrote the profile of one step to {out}")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


LEFT_WARN_BYTES = 256 << 20  # allocated before a row's build: more than this is named in the log


def left_allocated(device: torch.device) -> int | None:
    """Bytes the process has allocated on ``device`` before a row builds its model (None off CUDA): what earlier
    rows of the process left. A row's measured peak (``max_memory_allocated``) counts them; the plan does not.
    More than ``LEFT_WARN_BYTES`` is logged as a warning that names the fix (a process per row)."""
    if device.type != "cuda":
        return None
    free_memory(device)
    left = torch.cuda.memory_allocated(device)
    if left > LEFT_WARN_BYTES:
        logger.warning(f"megaseq bench: {left / GIB:.2f} GiB of the GPU is still allocated from earlier rows of this "
                       "process; this row's measured peak includes it (run the row in a process of its own to "
                       "compare it with the plan)")
    return left


def free_memory(device: torch.device) -> None:
    import gc

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


