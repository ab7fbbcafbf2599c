"""Which code holds the GPU memory at a run's peak: ``megaseq train ARGS`` in this process with CUDA's memory
history on, then the blocks live at the highest point of the recorded allocations from the first training step on
(``--from-frame``), summed by the innermost megaseq frame that allocated them (else torch's), and the largest
blocks with their stacks.

    python benchmarks/memory/peak_by_frame.py --out $OUT/peak.txt -- train recipes/qwen3-30b-a3b-lora.yaml \\
        --data.seq_len 96K --train.steps 1 --train.eval_after false

It answers where a step's measured peak (``gpu_peak_gib`` in ``metrics.jsonl``) departs from the plan's
components. The history costs time on the CPU side (Python stacks for every allocation); keep the run short.
Without CUDA it runs the command and writes no analysis.
"""

from __future__ import annotations

import argparse
import collections
import sys
from collections.abc import Iterable
from pathlib import Path

GIB = 2**30
# a block stops counting when its free is requested, as ``max_memory_allocated`` counts it (a block used on a side
# stream, ``record_stream``, completes its free only once that stream's work is done); a trace without the request
# event frees it on completion
FREES = ("free_requested", "free_completed")


def peak_blocks(trace: Iterable[dict], start_frame: str = "") -> tuple[int, list[dict]]:
    """(peak bytes, the blocks live at the peak) of one device's trace of ``torch.cuda.memory._snapshot()``:
    its ``alloc`` and free events replayed in order (a free of a block allocated before the
    recorded window is skipped). ``start_frame``: the peak is taken from the first allocation made inside a
    function of that name on (blocks made before it and still live count; what was freed before it does not)."""
    events = list(trace)
    start = 0
    if start_frame:
        start = next((i for i, e in enumerate(events) if e["action"] == "alloc"
                      and any(f["name"] == start_frame for f in e.get("frames", []))), len(events))
    live: dict[int, dict] = {}
    cur = peak = peak_i = 0
    for i, e in enumerate(events):
        if e["action"] == "alloc":
            live[e["addr"]] = e
            cur += e["size"]
            if i >= start and cur > peak:
                peak, peak_i = cur, i + 1
        elif e["action"] in FREES and e["addr"] in live:
            cur -= live.pop(e["addr"])["size"]
    live = {}
    for e in events[:peak_i]:
        if e["action"] == "alloc":
            live[e["addr"]] = e
        elif e["action"] in FREES:
            live.pop(e["addr"], None)
    return peak, list(live.values())


def frame_key(block: dict, depth: int) -> str:
    """The block's innermost ``depth`` megaseq frames (torch's where none is megaseq's), as ``file:line:name``."""
    frames = block.get("frames", [])
    ours = [f for f in frames if "megaseq" in f["filename"]] or [f for f in frames if "torch" in f["filename"]]
    return " < ".join(f"{f['filename'].rsplit('/src/', 1)[-1]}:{f['line']}:{f['name']}" for f in ours[:depth]) \
        or "(no Python frame)"


def report(peak: int, blocks: list[dict], top: int = 30) -> list[str]:
    """The analysis as lines: the peak, the live bytes by frame (depth 1 and 4), the largest blocks."""
    lines = [f"peak of the recorded allocations: {peak / GIB:.2f} GiB in {len(blocks)} live blocks"]
    for depth in (1, 4):
        size: collections.Counter[str] = collections.Counter()
        count: collections.Counter[str] = collections.Counter()
        for b in blocks:
            size[frame_key(b, depth)] += b["size"]
            count[frame_key(b, depth)] += 1
        lines.append(f"\nlive at the peak by frame (depth {depth}):")
        lines += [f"{v / GIB:9.3f} GiB  x{count[k]:<5d} {k}" for k, v in size.most_common(top)]
    lines.append(f"\nthe {top} largest live blocks:")
    lines += [f"{b['size'] / GIB:9.3f} GiB  {frame_key(b, 6)}" for b in sorted(blocks, key=lambda b: -b["size"])[:top]]
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="the analysis, as text")
    p.add_argument("--max-entries", type=int, default=3_000_000, help="allocation events CUDA keeps")
    p.add_argument("--from-frame", default="train_step",
                   help="take the peak from the first allocation inside this function on (default: the training "
                        "steps, not the model's build); '' for the whole process")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- then the megaseq command and its arguments")
    args = p.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    import torch

    from megaseq.cli.main import main as megaseq_main

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.memory._record_memory_history(max_entries=args.max_entries, stacks="python")
    rc = megaseq_main(command)
    if not cuda:
        print("no CUDA device: ran the command, no analysis")
        return rc
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    trace = snap["device_traces"][torch.cuda.current_device()]
    if len(trace) >= args.max_entries:
        print(f"the history kept its last {args.max_entries} events only: raise --max-entries", file=sys.stderr)
    lines = [f"command: megaseq {' '.join(command)} (exit status {rc})", *report(*peak_blocks(trace, args.from_frame))]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines[:40]))
    return rc


if __name__ == "__main__":
    sys.exit(main())
