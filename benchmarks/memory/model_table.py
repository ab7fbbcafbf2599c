"""The README's model table: what fits on 1, 8 and 64 H200s, full fine-tuning and LoRA, from ``megaseq plan``'s
advisor (``megaseq.plan.advisor``: the fastest configuration that fits, searched over weights dtype, FSDP, cp,
ep and the memory fixes). Pure Python, planned, not measured.

    python benchmarks/memory/model_table.py --out benchmarks/results/memory/model_table.md   # about 20 minutes
    python benchmarks/memory/model_table.py --models qwen3-30b-a3b --gpus 8                    # one row

Each cell is the longest of the lengths (default 1M, 512K, 128K, 32K) at which the advisor finds a configuration, with
that configuration in short: ``bf16 dp_cp cp 8`` is bf16 weights, ``parallel.fsdp dp_cp``, ``parallel.cp 8``
(LoRA: ``bf16 base``, the frozen base stored in bf16).
"""

from __future__ import annotations

import argparse
import datetime
import sys
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))

from megaseq.config import parse_size  # noqa: E402
from megaseq.plan.advisor import Choice, Hardware, Source, advise  # noqa: E402

MODELS = ("olmoe-1b-7b-0924", "qwen3-30b-a3b", "mixtral-8x7b-v0.1", "kimi-linear-48b-a3b-instruct",
          "qwen3-next-80b-a3b-instruct", "glm-4.5-air", "glm-4.5", "deepseek-v3", "deepseek-v3.2-exp",
          "gpt-oss-20b", "gpt-oss-120b")
GLM5_FLASH = "glm5-flash"  # the preset of recipes/glm5-flash.yaml


def _short(c: Choice) -> str:
    s = c.settings
    parts = ["bf16 base" if c.lora else s["weights"]] + ([s["fsdp"]] if s["fsdp"] != "off" else [])
    parts += [f"cp {s['cp']}"] * (s["cp"] > 1)
    return " ".join(parts + [f"ep {s['ep']}"] * (s["ep"] > 1))


def _size(n: int) -> str:
    return f"{n >> 20}M" if n >= 1 << 20 else f"{n >> 10}K"


def cell(src: Source, gpus: int, lengths: list[int], lora: bool) -> str:
    """The longest of ``lengths`` (longest first) that fits on ``gpus`` H200s, and how."""
    for n in lengths:
        a = advise(src, Hardware(gpus), n, allow_lora=lora, explain=False)
        if a.choice is not None and a.choice.lora == lora:
            return f"{_size(n)} ({_short(a.choice)})"
    return f"< {_size(lengths[-1])}"


def row(name: str, gpus_list: list[int], lengths: list[int]) -> str:
    path = str(ROOT / "recipes" / ("glm5-flash.yaml" if name == GLM5_FLASH else f"{name}/config.json"))
    full_src = Source(path, [])
    cells = []
    for gpus in gpus_list:
        full = cell(full_src, gpus, lengths, lora=False)
        lora_src = Source(path, ["lora.rank=16", "lora.alpha=32", "lora.targets=all"])
        cells += [full, cell(lora_src, gpus, lengths, lora=True)]
    return f"| {name} | " + " | ".join(cells) + " |"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=",".join((GLM5_FLASH, *MODELS)))
    ap.add_argument("--gpus", default="1,8,64")
    ap.add_argument("--lengths", default="1M,512K,128K,32K", help="longest first")
    ap.add_argument("--out", default=None, help="markdown file (default: print)")
    args = ap.parse_args()
    warnings.simplefilter("ignore")  # the checkpoints' notes (MTP layers skipped) are not the table's
    gpus_list = [int(g) for g in args.gpus.split(",")]
    lengths = sorted((parse_size(s) for s in args.lengths.split(",")), reverse=True)
    head = " | ".join(f"{g} H200{'s' if g > 1 else ''} {kind}" for g in gpus_list for kind in ("full", "LoRA"))
    lines = [f"Planned with `megaseq plan`'s advisor on {datetime.date.today().isoformat()} "
             f"(`python benchmarks/memory/model_table.py`): the longest of {', '.join(map(_size, lengths))} tokens a "
             "sequence that fits, and the configuration (weights dtype, FSDP mode, cp, ep). Planned, not measured.",
             "", f"| model | {head} |", "|---" * (1 + 2 * len(gpus_list)) + "|"]
    for name in args.models.split(","):
        lines.append(row(name, gpus_list, lengths))
        print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
