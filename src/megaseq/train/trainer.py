"""A training run end to end: plan, claim the run directory, build data and model, train, save, export, evaluate.

Order matters for the "fixed memory, fail early" contract: the settings are checked when the config is
built, then the run directory and the starting weights (``preflight``: nothing written), then the plan,
before any data is read or any weight is allocated, so a run that cannot fit stops in a second with a
message naming the binding component. The data is read before the run directory is claimed, so a bad
file leaves nothing behind. A non-finite step stops the run before the update (``guard``); SIGTERM and
SIGINT stop it after the step with a resumable checkpoint.

The roles: ``train.build`` builds what trains (device, dtypes, model, optimizer, kernels), ``train.step`` runs
one optimizer step, ``train.loop`` runs the steps (metrics, checkpoints, evaluation, time limit); this module
plans, wires them together and exports (``run_training``, ``export_run``).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch

from megaseq.config import Config, MemorySettings
from megaseq.memory import host_memory
from megaseq.ops import dispatch
from megaseq.train import checkpoint as ckpt
from megaseq.train import indexer_training
from megaseq.train.balance import Balancer, resolve_balance
from megaseq.train.build import (
    build_planned_model,
    check_adapters,
    dtypes,
    kernels_for,
    reserve_pinned,
    resolve_device,
    start_precompile,
    use_expandable_segments,
)
from megaseq.train.family_settings import resolve_family_settings
from megaseq.train.heldout import HeldoutProbe, evaluate_run
from megaseq.train.loop import RunResult, TrainLoop, base_meta, checkpoint_meta, draw_curve
from megaseq.train.parallel_env import ParallelEnv, setup_parallel
from megaseq.train.preflight import check_disk_space, preflight
from megaseq.train.run_dir import claim_run_dir, discard_unstarted, write_plan
from megaseq.train.step import StepState

__all__ = ["RunResult", "export_run", "make_plan", "run_training"]


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
    # the plan's pinned host bytes lock on a background thread while the data and the model are built
    reserve_pinned(device, plan_dict.get("pinned_host", 0))
    with kernels_for(cfg, device):
        # the run's kernel manifests compile while the data and the model are built (a CUDA device only); nothing
        # launches a Triton kernel until the loop joins it before the first step
        precompiled = start_precompile(cfg, spec, device, local_processes(env))
        dispatch.reset_records()  # what ran under this configuration (the first step's report reads them)
        try:
            return _run_planned(cfg, spec, env, device, plan_dict, memory, precompiled)
        except BaseException:
            if precompiled is not None:  # a run that stops before its first step exits without waiting for them
                precompiled.cancel()
            raise
        finally:
            host_memory.drop_reserve()  # freed once the pools that took from it are released


def local_processes(env: ParallelEnv) -> int:
    """The run's processes sharing this machine's CPUs: one per visible GPU at most."""
    if env.world_size <= 1 or not torch.cuda.is_available():
        return 1
    return max(1, min(env.world_size, torch.cuda.device_count()))


def _run_planned(cfg: Config, spec: Any, env: ParallelEnv, device: torch.device, plan_dict: dict[str, Any],
                 memory: MemorySettings, precompiled: Any = None) -> RunResult:
    """Claim the run directory and train; a start that fails before its first step removes the directory
    it created (``run_dir.discard_unstarted``), so a bad path or setting leaves nothing behind."""
    created = env.is_main and not Path(cfg.train.run_dir).exists()
    run_dir, resume_from = claim_run_dir(cfg) if env.is_main else (Path(cfg.train.run_dir), None)
    try:
        return _run_claimed(cfg, spec, env, device, plan_dict, memory, run_dir, env.broadcast_object(resume_from),
                            precompiled)
    except BaseException:
        if created:
            discard_unstarted(run_dir)
        raise


def _run_claimed(cfg: Config, spec: Any, env: ParallelEnv, device: torch.device, plan_dict: dict[str, Any],
                 memory: MemorySettings, run_dir: Path, resume_from: Path | None,
                 precompiled: Any = None) -> RunResult:
    from megaseq.data import build_data

    if env.is_main:
        write_plan(run_dir, plan_dict)
    resume_data = ckpt.read_meta(resume_from).get("data") if resume_from is not None else None
    data = build_data(cfg.data, cfg.eval, batch_size=cfg.train.batch_size, vocab_size=spec.vocab_size,
                      rank=env.dp_rank, world_size=env.dp_size, resume_state=resume_data)
    for line in data.log:
        env.log(line)
    if cfg.train.eval_every and not data.heldout:
        raise ValueError("train.eval_every needs held-out data: set data.heldout (files the model never trains "
                         "on), data.heldout_records or data.heldout_tail, or set --train.eval_every 0")
    autocast = dtypes(cfg, device)[1]
    model, applied, optimizer, scheduler = build_planned_model(cfg, spec, device, memory, cfg.train.steps,
                                                               cfg.model.init_from, env)
    spec_dict = spec.to_dict()
    base = base_meta(cfg)
    if env.is_main:
        check_disk_space(run_dir, model, trainable_only=base is not None)
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
        ckpt.save_checkpoint(run_dir, 0, model, None, None, checkpoint_meta(spec_dict, data, 0, cfg, base), keep=10**9,
                             trainable_only=base is not None)
    result = RunResult(run_dir=run_dir, last_checkpoint=resume_from, is_main=env.is_main)
    balancer = Balancer(model, resolve_balance(cfg.moe, spec), env, cfg.train.grad_accum)
    probe = HeldoutProbe(cfg, data, env, autocast, memory) if cfg.train.eval_every else None
    state = StepState.of(cfg, model, optimizer, scheduler, env, memory, autocast, balancer, plan_dict.get("headroom"))
    loop = TrainLoop(cfg, device, plan_dict, state, data, spec_dict, base, probe, applied, precompiled)
    try:
        loop.run(start, result)
    finally:
        applied.release()  # the SCO and host-kept attention pinned pools
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
        draw_curve(run_dir, data.unit, result.eval_report)
    env.shutdown()
    return result


def export_run(cfg: Config, model: torch.nn.Module, spec: Any, run_dir: Path, result: RunResult,
               is_main: bool = True) -> None:
    """The end-of-run export: the HF checkpoint (``run_dir/hf``), or with LoRA the PEFT adapter
    (``run_dir/adapter``, written by the main rank; the expert-parallel factors gathered first) and, with
    ``lora.export_merged``, the merged model as the HF checkpoint. Every rank calls it (FSDP's shards are
    gathered tensor by tensor)."""
    from megaseq.models.hf_io import export_hf_checkpoint

    if cfg.lora.enabled:
        from megaseq.models.peft_io import export_adapter

        out = run_dir / "adapter"
        result.adapter_export = export_adapter(model, spec, cfg.lora, out, cfg.model.init_from, write=is_main)
        if is_main:  # the tokenizer beside the adapter too, as PEFT adapters saved by users carry it
            from megaseq.data.run_tokenizer import write_run_tokenizer

            write_run_tokenizer(cfg.data, result.adapter_export)
        if not cfg.lora.export_merged:
            return
    result.hf_export = export_hf_checkpoint(model, spec, run_dir / "hf", merged=cfg.lora.enabled,
                                            carry_from=cfg.model.init_from)
    if is_main:  # the tokenizer (a checkpoint's with its chat template, or the built-in one) beside the weights
        from megaseq.data.run_tokenizer import write_run_tokenizer

        write_run_tokenizer(cfg.data, result.hf_export)
