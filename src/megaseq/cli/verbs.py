"""One function per verb; each parses nothing itself beyond what main.py hands it."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from megaseq.cli.help_text import config_help
from megaseq.config import Config, default_recipe, load_config, parse_bytes, parse_size, split_overrides


def _config(args: argparse.Namespace, rest: list[str]) -> Config:
    """The verb's recipe (none: the embedded default job) with its ``--section.key value`` settings. The default
    job's balancing (``moe``) is its own model's: with another ``--model.name`` it follows that model's family."""
    overrides, recipe = split_overrides(rest), getattr(args, "config", None)
    other_model = recipe is None and any(o.startswith("model.name=") for o in overrides)
    return load_config(recipe or default_recipe(), overrides, drop_sections=("moe",) if other_model else ())


def cmd_train(args: argparse.Namespace, rest: list[str]) -> int:
    cfg = _config(args, rest)
    from megaseq.train.trainer import run_training

    if cfg.parallel.launcher == "ray":
        from megaseq.parallel.launch import launch_ray

        launch_ray(cfg, run_training)
        return 0
    result = run_training(cfg)
    if not result.is_main:  # under torchrun every process runs this verb: rank 0 speaks for the run
        return 0
    if result.losses:
        print(f"\ntrained {len(result.losses)} steps: loss {result.losses[0]:.4f} -> {result.losses[-1]:.4f}")
    if result.time_limited:
        step, steps, limit = result.time_limited
        print(f"stopped by train.time_limit {limit} after step {step} of {steps}: continue with the same command "
              "and --train.resume true")
    print(f"run directory:   {result.run_dir}")
    print(f"  config + plan: {result.run_dir / 'config.yaml'}, {result.run_dir / 'plan.json'}")
    print(f"  metrics:       {result.run_dir / 'metrics.jsonl'} (TensorBoard: {result.run_dir / 'tb'}), "
          f"loss curve: {result.run_dir / 'loss_curve.png'}")
    if result.last_checkpoint:
        print(f"  checkpoint:    {result.last_checkpoint}")
    if result.hf_export:
        print(f"  HF export:     {result.hf_export}")
    if result.eval_report:
        print(f"  evaluation:    {result.run_dir / 'eval'} (eval_by_position.md, .json, .png)")
        md = result.run_dir / "eval" / "eval_by_position.md"
        if md.is_file():
            print("\n" + md.read_text())
    return 0


PLAN_FITS, PLAN_DOES_NOT_FIT = 0, 1  # `megaseq plan`'s exit codes: the settings as given fit or not (2: bad input)


def cmd_plan(args: argparse.Namespace, rest: list[str]) -> int:
    """The plan of the settings as given, with the verdict first: whether they fit and the command to run (theirs,
    or the fastest configuration that fits, or the nearest that does). Exit 0: fits as given; 1: does not (the
    first lines name what fits instead, or the nearest when nothing does)."""
    from megaseq.plan.planner import plan_from_config
    from megaseq.plan.report import format_plan

    overrides = split_overrides(rest)
    if args.seq_len:
        overrides.append(f"data.seq_len={args.seq_len}")
    if args.gpus and not any(o.startswith("parallel.dp=") for o in overrides):
        overrides.append("parallel.dp=-1")  # --gpus N: data parallelism takes what cp x ep leaves
    cfg = load_config(*_plan_source(args.config, overrides))
    world = args.gpus or cfg.parallel.dp * cfg.parallel.cp * cfg.parallel.ep
    gpu_bytes, host_bytes = _memory_bytes(args)
    plan = plan_from_config(cfg, world_size=world, gpu_bytes=gpu_bytes, host_bytes=host_bytes,
                            gpus_per_host=args.gpus_per_host)
    if args.json or args.as_given:
        print(json.dumps(plan.to_dict(), indent=2, default=str) if args.json else format_plan(plan))
        return PLAN_FITS if plan.fits else PLAN_DOES_NOT_FIT
    from megaseq.plan.report import format_advice, format_verdict

    advice = _advise(args, rest, world)
    print(format_verdict(plan, advice, _as_given_command(args, rest, world, plan)))
    print("\nthe plan of the settings as given:")
    print(format_plan(plan))
    print("\nthe fastest configuration that fits (searched: weights dtype, FSDP, cp, ep"
          + (", LoRA" if args.allow_lora else "") + "; memory fixes by the planner):")
    print(format_advice(advice))
    return PLAN_FITS if plan.fits else PLAN_DOES_NOT_FIT


def _memory_bytes(args: argparse.Namespace) -> tuple[int | None, int | None]:
    """``--gpu-mem`` and ``--host-mem`` in bytes (None: not given)."""
    return (parse_bytes(args.gpu_mem, "--gpu-mem") if args.gpu_mem else None,
            parse_bytes(args.host_mem, "--host-mem") if args.host_mem else None)


def _hardware(args: argparse.Namespace, gpus: int) -> Any:
    from megaseq.plan.advisor import Hardware

    gpu_bytes, host_bytes = _memory_bytes(args)
    return Hardware(gpus, gpu_bytes, args.gpus_per_host, host_bytes)


def _advise(args: argparse.Namespace, rest: list[str], gpus: int) -> Any:
    """``megaseq plan``'s advice: the fastest configuration that fits (plan/advisor.py) and its command."""
    from megaseq.plan.advisor import Source, advise

    src = Source(args.config, split_overrides(rest))
    return advise(src, _hardware(args, gpus), parse_size(args.seq_len) if args.seq_len else None,
                  allow_lora=args.allow_lora)


def _as_given_command(args: argparse.Namespace, rest: list[str], gpus: int, plan: Any) -> str:
    """The command that trains the settings as given (the recipe, the user's settings, --seq-len)."""
    from megaseq.plan.advisor import Choice, Source, command

    src = Source(args.config, split_overrides(rest))
    given = [f"data.seq_len={parse_size(args.seq_len)}"] if args.seq_len else []
    return command(src, Choice({}, given, plan, 0.0, 0.0), _hardware(args, gpus))


def cmd_plan_max_len(args: argparse.Namespace, rest: list[str]) -> int:
    """``megaseq plan --max-len``: the longest length that fits on each GPU count, and how."""
    from megaseq.plan.advisor import GPU_COUNTS, Source, longest
    from megaseq.plan.report import model_table_row

    src = Source(args.config, split_overrides(rest))
    counts = [args.gpus] if args.gpus else list(GPU_COUNTS)
    for n in counts:
        print(model_table_row(n, *longest(src, _hardware(args, n), allow_lora=args.allow_lora)))
    return 0


def _plan_source(config: str | None, overrides: list[str]) -> tuple[str | None, list[str]]:
    """(recipe, overrides) for ``megaseq plan``: a YAML recipe as given, or a Hugging Face checkpoint
    directory (or its config.json) as the model of a bf16 run on random tokens (``--model.name DIR``)."""
    if config is None:
        return default_recipe(), overrides
    path = Path(config)
    if path.is_dir() or path.suffix == ".json":
        if not (path / "config.json" if path.is_dir() else path).is_file():
            raise ValueError(f"{path} is neither a YAML recipe nor a checkpoint directory with a config.json")
        return None, [f"model.name={path}", "model.dtype=bf16", "data.kind=random", *overrides]
    return config, overrides


def cmd_bench(args: argparse.Namespace, rest: list[str]) -> int:
    from megaseq.bench.run import run_bench

    cfg = _config(args, rest)
    if args.steps < 0:
        raise ValueError(f"--steps must be >= 0 (0: one cold step per length), got {args.steps}")
    lens = [parse_size(s) for s in args.seq_lens.split(",") if s]
    lp = [parse_size(s) for s in args.logprob_check.split(",") if s]
    result = run_bench(cfg, lens, steps=args.steps, source=args.source, find_max_len=args.find_max,
                       baseline=args.baseline, out=args.out, logprob_lengths=lp,
                       max_limit=parse_size(args.max_limit), routing=args.routing,
                       recipe=args.config if args.config and Path(args.config).suffix in (".yaml", ".yml") else None,
                       overrides=split_overrides(rest), profile=args.profile,
                       profile_first=args.profile_first)
    from megaseq.bench.report import markdown

    print(markdown(result))
    print(f"wrote {args.out}.json, .md, .png")
    return 0


def cmd_tune(args: argparse.Namespace, rest: list[str]) -> int:
    from megaseq.bench.tune import run_tune, tune_lengths

    cfg = _config(args, rest)
    result = run_tune(cfg, tune_lengths(cfg, args.seq_lens), out=args.out, kernels_out=args.kernels_out)
    for r in result["rows"]:
        first = f", first step {r['step_s']:.1f} s" if r.get("step_s") else ""
        print(f"{r['seq_len']:,} tokens: {r['status']}{first}")
    print(f"wrote {result['entries']} tuned configs for {result['device']} to {result['table']}")
    if result.get("manifest"):
        m = result["manifest"]
        print(f"wrote the kernel manifest {m['path']}: {m['kernels']} kernels ({m['added']} new)")
        if m.get("pack"):
            p = m["pack"]
            print(f"wrote the kernel pack {p['path']}: {p['files']} files, {p['bytes'] / 2**20:.1f} MiB before "
                  "compression")
    return 0 if all(r["status"] == "ok" for r in result["rows"]) else 1


def cmd_verify(args: argparse.Namespace, rest: list[str]) -> int:
    from megaseq.bench.verify import verify

    cfg = _config(args, rest)
    return 0 if verify(cfg) else 1


def cmd_eval(args: argparse.Namespace, rest: list[str]) -> int:
    from megaseq.train.evaluate import evaluate_targets

    overrides = split_overrides(rest)
    if args.by_position:
        overrides.append(f"eval.by_position={args.by_position}")
    if args.seq_len:
        overrides.append(f"eval.seq_len={args.seq_len}")
    if "=" in args.target:  # named models: the long-context protocol's evaluation
        from megaseq.train.protocol_eval import evaluate_protocol

        print(evaluate_protocol(args.target.split(","), data=args.data.split(",") if args.data else None,
                                overrides=overrides, out=args.out,
                                ablation_cut_to=parse_size(args.ablation_cut_to, "--ablation-cut-to"),
                                ablation_chunk=parse_size(args.ablation_chunk, "--ablation-chunk"),
                                ablation_model=args.ablation_model, oracle_k=args.oracle_k,
                                oracle_distance=parse_size(args.oracle_distance, "--oracle-distance")))
        return 0
    report = evaluate_targets(args.target.split(","), data=args.data.split(",") if args.data else None,
                              overrides=overrides, out=args.out)
    print(report)
    return 0


def cmd_convert(args: argparse.Namespace, rest: list[str]) -> int:
    from megaseq.train.convert import convert

    if rest:
        print(f"megaseq convert: unexpected arguments {rest}", file=sys.stderr)
        return 2
    out = convert(Path(args.src), Path(args.dst))
    print(f"wrote {out}")
    return 0


def cmd_config(args: argparse.Namespace, rest: list[str]) -> int:
    from megaseq.models.presets import PRESETS

    if rest:
        raise ValueError(f"megaseq config takes at most a section name, got {rest}")
    print(config_help(args.section))
    if args.section in (None, "model"):
        print("\nmodel presets (--model.name): " + ", ".join(sorted(PRESETS)))
    return 0


def cmd_export(args: argparse.Namespace, rest: list[str]) -> int:
    from megaseq.train.convert import export

    if rest:
        print(f"megaseq export: unexpected arguments {rest}", file=sys.stderr)
        return 2
    out = export(Path(args.src), Path(args.dst), merged=args.merged)
    print(f"wrote {out}")
    return 0
