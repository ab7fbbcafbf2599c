"""The ``megaseq`` command: thin verbs that parse a config + dotted overrides and call one function.

    megaseq train  [config.yaml] [--section.key value ...]
    megaseq eval   RUN_OR_CHECKPOINT [--data held-out.fa] [--by-position 32K]
    megaseq eval   before=RUN,after=RUN,control=RUN [--ablation-cut-to 16K]
    megaseq plan   [config.yaml | HF-checkpoint-dir] [--seq-len 1M] [--gpus 8]
    megaseq bench  [config.yaml] [--seq-lens 32K,128K,1M] [--find-max]
    megaseq verify [config.yaml]
    megaseq convert SRC DST
    megaseq export RUN_OR_CHECKPOINT DST [--merged]
"""

from __future__ import annotations

import argparse
import os
import sys
import textwrap
from collections.abc import Callable

from megaseq.config import field_help

VERBS = {
    "train": "fine-tune a model (one GPU, torchrun, or Ray); with no config, the embedded default job",
    "eval": "held-out loss by position for a run or checkpoints, with the k-mer baseline for DNA",
    "plan": "will it fit? the memory plan per component, the fixes it needs and their cost",
    "bench": "measured peak memory, tokens/s and MFU per sequence length, against the plan",
    "verify": "which kernel each layer runs, and parity with the transformers reference",
    "convert": "Hugging Face checkpoint <-> megaseq checkpoint",
    "export": "a run's LoRA adapter in PEFT's format, or the merged model (adapters folded in) as a HF checkpoint",
}


def config_help() -> str:
    lines = ["configuration (YAML sections, or --section.key value on the command line):"]
    for section, rows in field_help().items():
        lines.append(f"\n  {section}:")
        for key, help_text, default in rows:
            wrapped = textwrap.wrap(f"{help_text} [default: {default}]", 70)
            lines.append(f"    --{section}.{key:<24} {wrapped[0] if wrapped else ''}")
            lines.extend(f"    {'':<33}{w}" for w in wrapped[1:])
    return "\n".join(lines)


def _take_overrides(argv: list[str]) -> tuple[list[str], list[str]]:
    """Pull ``--section.key [value]`` settings out before argparse sees the verb's own options."""
    keep, overrides, i = [], [], 0
    while i < len(argv):
        arg = argv[i]
        if arg.startswith("--") and "." in arg.split("=")[0]:
            overrides.append(arg)
            if "=" not in arg and i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                overrides.append(argv[i + 1])
                i += 1
        else:
            keep.append(arg)
        i += 1
    return keep, overrides


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="megaseq", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Fine-tune MoE and hybrid-attention language models on million-token sequences.",
        epilog="verbs:\n" + "\n".join(f"  {k:<8} {v}" for k, v in VERBS.items())
        + "\n\n`megaseq VERB --help` lists the verb's options and every configuration key.",
    )
    sub = p.add_subparsers(dest="verb", metavar="VERB")
    fmt = argparse.RawDescriptionHelpFormatter
    for verb, help_text in VERBS.items():
        sp = sub.add_parser(verb, help=help_text, description=help_text, formatter_class=fmt,
                            epilog=config_help() if verb in ("train", "plan", "bench", "verify", "eval") else None)
        if verb in ("train", "plan", "bench", "verify"):
            sp.add_argument("config", nargs="?", help="YAML recipe (see recipes/); none: the embedded default"
                            + ("; or a Hugging Face checkpoint directory / config.json to plan" if verb == "plan"
                               else ""))
        if verb == "plan":
            sp.add_argument("--seq-len", help="tokens per sequence (e.g. 1M); default: data.seq_len")
            sp.add_argument("--gpus", type=int, default=None, help="GPUs in all (default: dp x cp x ep)")
            sp.add_argument("--gpus-per-host", type=int, default=8, help="GPUs per host (host RAM is shared)")
            sp.add_argument("--gpu-mem", default=None, help="GPU memory per GPU (default 139.8G, an H200)")
            sp.add_argument("--host-mem", default=None, help="host memory per host (default 128G)")
            sp.add_argument("--json", action="store_true", help="print the plan as JSON")
        if verb == "bench":
            sp.add_argument("--seq-lens", default="4K", help="comma-separated lengths, e.g. 32K,128K,1M")
            sp.add_argument("--steps", type=int, default=3,
                            help="measured steps per length (after one warm-up); 0: time the one (cold) step, "
                            "for lengths whose step is minutes long")
            sp.add_argument("--source", default="random", help="random, genome, or both")
            sp.add_argument("--find-max", action="store_true", help="search the longest length that trains")
            sp.add_argument("--baseline", action="store_true", help="also run the transformers reference")
            sp.add_argument("--out", default="benchmarks/results/bench", help="output path prefix")
            sp.add_argument("--logprob-check", default="", metavar="LENS",
                            help="per-token log-probs of megaseq (bf16) vs the reference (fp32) at the longest "
                                 "of these lengths the reference can run, e.g. 32K,16K,8K")
            sp.add_argument("--max-limit", default="4M", help="--find-max stops doubling at this length")
        if verb == "eval":
            sp.add_argument("target", help="a run directory or checkpoint directories (comma-separated); or named "
                                           "models before=RUN,after=RUN,control=RUN (the long-context protocol)")
            sp.add_argument("--data", default=None, help="held-out FASTA/text files (comma-separated)")
            sp.add_argument("--by-position", default=None, help="bucket width (e.g. 32K)")
            sp.add_argument("--seq-len", default=None, help="tokens per evaluation window")
            sp.add_argument("--out", default=None, help="output directory (default RUN/eval)")
            # the long-context protocol: named targets (before=RUN,after=RUN,control=RUN), docs/long_context.md
            sp.add_argument("--ablation-cut-to", default="0", metavar="N",
                            help="named targets: score the late buckets again with the context cut to N tokens "
                                 "(e.g. 16K, the start's training length); 0: no context ablation")
            sp.add_argument("--ablation-chunk", default="0", metavar="N",
                            help="tokens scored per forward of the cut arm (0: half of --ablation-cut-to)")
            sp.add_argument("--ablation-model", default="after", help="the named model whose context is cut")
            sp.add_argument("--oracle-k", type=int, default=20, help="copy oracle's k-mer length (0: no oracle)")
            sp.add_argument("--oracle-distance", default="16K",
                            help="copy oracle: how far back the earlier k-mer must be")
        if verb == "convert":
            sp.add_argument("src", help="HF checkpoint dir, or a megaseq run/checkpoint dir")
            sp.add_argument("dst", help="output directory")
        if verb == "export":
            sp.add_argument("src", help="a megaseq run directory (its newest checkpoint) or a checkpoint directory")
            sp.add_argument("dst", help="output directory")
            sp.add_argument("--merged", action="store_true",
                            help="the HF checkpoint with the adapters folded into the base, not the PEFT adapter")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = parser()
    if not argv:
        argv = ["train"]  # `megaseq` alone runs the embedded default job
    if argv[0] in ("-h", "--help"):
        p.print_help()
        return 0
    argv, rest = _take_overrides(argv)
    args, unknown = p.parse_known_args(argv)
    rest = unknown + rest
    if args.verb is None:
        p.print_help()
        return 2
    from megaseq.cli import verbs
    from megaseq.train.guard import RunStopped

    fn: Callable[[argparse.Namespace, list[str]], int] = getattr(verbs, f"cmd_{args.verb}")
    try:
        return fn(args, rest)
    except ValueError as e:  # user errors: one clear message, no traceback
        if os.environ.get("RANK", "0") == "0":  # under torchrun every rank has the same message: say it once
            print(f"megaseq {args.verb}: error: {e}", file=sys.stderr)
        return 2
    except RunStopped as e:  # SIGTERM / SIGINT: stopped after a resumable checkpoint
        print(f"megaseq {args.verb}: {e}", file=sys.stderr)
        return e.exit_code
    except OSError as e:  # a file megaseq could not read or write: name it and what would fix it
        print(f"megaseq {args.verb}: error: {os_error_message(e)}", file=sys.stderr)
        return 2


def os_error_message(e: OSError) -> str:
    """``[Errno 28] No space left on device`` as a sentence naming the file and the fix."""
    import errno

    where = e.filename or "a file"
    fix = {errno.ENOSPC: "free disk space (or choose another --train.run_dir), then continue with --train.resume true",
           errno.EDQUOT: "free disk space within your quota, then continue with --train.resume true",
           errno.EROFS: "the file system is read-only: choose another --train.run_dir",
           errno.EACCES: "permission denied: fix the permissions or choose another path",
           errno.EPERM: "permission denied: fix the permissions or choose another path",
           errno.ENOENT: "check the path",
           errno.EISDIR: "give a file, not a directory"}.get(e.errno or -1, "check the path and the disk")
    return f"{where}: {e.strerror or e}; {fix}"


if __name__ == "__main__":
    sys.exit(main())
