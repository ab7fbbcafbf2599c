"""The ``megaseq`` command: thin verbs that parse a config + dotted overrides and call one function.

    megaseq train  [config.yaml] [--section.key value ...]
    megaseq eval   RUN_OR_CHECKPOINT [--data held-out.fa] [--by-position 32K]
    megaseq eval   before=RUN,after=RUN,control=RUN [--ablation-cut-to 16K]
    megaseq plan   [config.yaml | HF-checkpoint-dir] [--seq-len 1M] [--gpus 8]
    megaseq bench  [config.yaml] [--seq-lens 32K,128K,1M] [--find-max]
    megaseq verify [config.yaml]
    megaseq tune   config.yaml [--seq-lens 8K,32K] [--out table.json] [--kernels-out DIR]
    megaseq convert SRC DST
    megaseq export RUN_OR_CHECKPOINT DST [--merged]
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable

from megaseq.cli import verbs
from megaseq.cli.help_text import config_help
from megaseq.config import take_overrides
from megaseq.console import show_logs

VERBS = {
    "train": "fine-tune a model (one GPU, torchrun, or Ray); with no config, the embedded default job",
    "eval": "held-out loss by position for a run or checkpoints, with the k-mer baseline for DNA",
    "plan": "will it fit? the memory plan per component, the fixes it needs and their cost",
    "bench": "measured peak memory, tokens/s and MFU per sequence length, against the plan",
    "verify": "which kernel each layer runs, and parity with the transformers reference",
    "tune": "pre-tune the GPU kernels for the lengths a plan will use (a tuned table later runs read)",
    "convert": "Hugging Face checkpoint <-> megaseq checkpoint",
    "export": "a run's LoRA adapter in PEFT's format, or the merged model (adapters folded in) as a HF checkpoint",
    "config": "every setting (section, help, default) and the model presets",
}

# two or three examples per verb, shown under its --help
EXAMPLES = {
    "train": ["megaseq train                                   # the embedded default job (CPU, minutes)",
              "megaseq train recipes/glm5-flash-tiny-dna.yaml --train.steps 100 --optim.lr 1e-3",
              "torchrun --nproc-per-node 8 -m megaseq train recipes/glm5-flash-1gpu.yaml --parallel.cp 8"],
    "eval": ["megaseq eval runs/glm5-flash-tiny-dna --by-position 256",
             "megaseq eval runs/glm5-flash-tiny-dna --data held_out.fa --seq-len 4K"],
    "plan": ["megaseq plan recipes/glm5-flash.yaml --seq-len 1M --gpus 64",
             "megaseq plan recipes/qwen3-30b-a3b/config.json --seq-len 1M --gpus 8 --allow-lora",
             "megaseq plan recipes/glm5-flash-1gpu.yaml --max-len"],
    "bench": ["megaseq bench recipes/glm5-flash-1gpu.yaml --seq-lens 8K,32K --baseline",
              "megaseq bench recipes/glm5-flash-1gpu.yaml --seq-lens 1M --steps 1"],
    "verify": ["megaseq verify recipes/glm5-flash-tiny-dna.yaml",
               "megaseq verify --model.name qwen3-moe-tiny"],
    "convert": ["megaseq convert runs/glm5-flash-tiny-dna/hf runs/converted    # HF -> megaseq",
                "megaseq convert runs/converted runs/exported-hf                 # megaseq -> HF"],
    "export": ["megaseq export runs/qwen3-30b-a3b-lora runs/adapter            # PEFT adapter",
               "megaseq export runs/qwen3-30b-a3b-lora runs/merged --merged   # merged HF checkpoint"],
    "tune": ["megaseq tune recipes/glm5-flash-1gpu.yaml --seq-lens 8K,32K",
             "megaseq tune recipes/qwen3-30b-a3b-lora.yaml --seq-lens 32K,128K --out tuned.json"],
    "config": ["megaseq config            # every section", "megaseq config memory     # one section"],
}
CONFIG_POINTER = ("settings: any configuration key as --section.key value; `megaseq config` lists every one with "
                  "its help and default")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="megaseq", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Fine-tune MoE and hybrid-attention language models on million-token sequences.",
        epilog="verbs:\n" + "\n".join(f"  {k:<8} {v}" for k, v in VERBS.items())
        + "\n\n`megaseq VERB --help` lists the verb's options and examples; `megaseq config` every setting;"
        " `megaseq --version` the version.",
    )
    sub = p.add_subparsers(dest="verb", metavar="VERB", help="one of the verbs below")
    fmt = argparse.RawDescriptionHelpFormatter
    for verb, help_text in VERBS.items():
        sp = sub.add_parser(verb, description=help_text, formatter_class=fmt,
                            epilog=_epilog(verb))
        if verb in ("train", "plan", "bench", "verify", "tune"):
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
            sp.add_argument("--allow-lora", action="store_true",
                            help="let the search choose LoRA on a frozen base where full fine-tuning does not fit")
            sp.add_argument("--max-len", action="store_true",
                            help="the longest length that fits on 1, 8 and 64 GPUs (or --gpus), and how")
            sp.add_argument("--as-given", action="store_true",
                            help="only the plan of the settings as given, without searching for what fits")
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
            sp.add_argument("--routing", default="auto",
                            help="MoE routing: auto (balanced for an MoE on random weights and random tokens, "
                                 "natural for genome windows and loaded checkpoints), balanced (each token's "
                                 "top-k spread evenly over the experts, the router's weights kept) or natural")
            sp.add_argument("--profile", action="store_true",
                            help="one more step per length under torch.profiler: its ops by device time in "
                                 "OUT_profile_SOURCE_TOKENS.txt")
            sp.add_argument("--profile-first", action="store_true",
                            help="each length's first step under torch.profiler: its ops by host time in "
                                 "OUT_first_profile_SOURCE_TOKENS.txt and its Python calls by cumulative time in "
                                 "OUT_first_profile_SOURCE_TOKENS_python.txt (where a first step's time beyond a "
                                 "warm one goes; that step's time is then not a figure)")
        if verb == "tune":
            sp.add_argument("--seq-lens", default=None, help="comma-separated lengths, e.g. 8K,32K (default: "
                            "data.seq_len); nearby lengths share a power-of-two bucket")
            sp.add_argument("--out", default=None, help="the tuned table to write (default: this user's, "
                            "~/.cache/megaseq/autotune/<gpu>.json; src/megaseq/ops/tuned/<gpu>.json to ship it)")
            sp.add_argument("--kernels-out", default=None, help="also add the recipe's kernel manifest (the Triton "
                            "kernels its steps compiled, precompiled before a later run's first step) to this "
                            "directory; src/megaseq/ops/tuned/kernels to ship it")
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
        if verb == "config":
            sp.add_argument("section", nargs="?", help="one section (model, data, parallel, memory, optim, moe, "
                            "lora, train, eval, log); none: every one")
        if verb == "export":
            sp.add_argument("src", help="a megaseq run directory (its newest checkpoint) or a checkpoint directory")
            sp.add_argument("dst", help="output directory")
            sp.add_argument("--merged", action="store_true",
                            help="the HF checkpoint with the adapters folded into the base, not the PEFT adapter")
    return p


def _epilog(verb: str) -> str:
    """A verb's examples; the settings it takes (``train``: every one, listed; the others: where to find them)."""
    text = "examples:\n" + "\n".join(f"  {e}" for e in EXAMPLES[verb])
    if verb == "train":
        return text + "\n\n" + config_help()
    if verb in ("plan", "bench", "verify", "eval", "tune"):
        return text + "\n\n" + CONFIG_POINTER
    return text


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    show_logs()  # the library logs; the command shows its lines on stdout / stderr as they come
    p = parser()
    if not argv or argv[0] in ("-h", "--help"):
        p.print_help()  # `megaseq` alone prints this; `megaseq train` runs the embedded default job
        return 0
    if argv[0] in ("-V", "--version"):
        print(f"megaseq {package_version()}")
        return 0
    argv, settings = take_overrides(argv)  # before argparse sees the verb's own options
    args, unknown = p.parse_known_args(argv)
    rest = unknown + [f"--{s}" for s in settings]
    if args.verb is None:
        p.print_help()
        return 2
    from megaseq.train.guard import RunStopped

    name = "plan_max_len" if args.verb == "plan" and args.max_len else args.verb
    fn: Callable[[argparse.Namespace, list[str]], int] = getattr(verbs, f"cmd_{name}")
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


def package_version() -> str:
    """The installed package's version (pyproject.toml's, from a source checkout without an install)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("megaseq")
    except PackageNotFoundError:
        return "0.1.0 (source checkout, not installed)"


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
