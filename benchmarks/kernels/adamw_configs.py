"""MasterAdamW's Triton step (``ops.adamw.fused``) timed per launch configuration (BLOCK, num_warps).

glm5-flash-1gpu-sized: 2.3B parameters as bf16 weights and gradients with fp32 masters and moments (28 bytes an
element moved), in tensors of the model's sizes (32 x [2048, 2048] expert stacks stand in as 64M-element
tensors). Warm: each configuration runs once untimed, then the median of ``--reps`` timed calls.

    python3 benchmarks/kernels/adamw_configs.py --out adamw_configs.json
"""

from __future__ import annotations

import argparse
import json

import torch
from _timing import median_ms

from megaseq.ops.adamw import fused as triton_adamw

CONFIGS = [(1024, 4), (2048, 4), (2048, 8), (4096, 4), (4096, 8), (8192, 8), (8192, 16), (16384, 16)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--elements", type=float, default=2.3e9)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev = "cuda"
    sizes, left = [], int(args.elements)
    for n in (64 << 20, 4 << 20, 2048 * 1024, 2048 * 128, 2048):  # big stacks first, then the small tail
        while left >= n and (n != 64 << 20 or left > 256 << 20):
            sizes.append(n)
            left -= n
    ws = [torch.randn(n, device=dev).to(torch.bfloat16) for n in sizes]
    gs = [torch.randn(n, device=dev).to(torch.bfloat16) * 1e-3 for n in sizes]
    ms = [w.float() for w in ws]
    As = [torch.zeros(n, device=dev) for n in sizes]
    Ss = [torch.zeros(n, device=dev) for n in sizes]
    steps = [torch.zeros((), device=dev) for _ in sizes]
    coef = torch.tensor(0.5, device=dev)
    total = sum(sizes)
    rows = []
    for block, warps in CONFIGS:
        triton_adamw.BLOCK, triton_adamw.NUM_WARPS = block, warps

        def step() -> None:
            triton_adamw.master_adamw_(ws, gs, ms, As, Ss, steps, coef, 1e-4, 0.9, 0.95, 1e-8, 0.01)

        step()
        torch.cuda.synchronize()
        t = median_ms(step, args.reps)
        rows.append({"block": block, "num_warps": warps, "ms": t, "tb_per_s": 28 * total / t / 1e9})
        print(f"BLOCK {block:6d} warps {warps:2d}: {t:7.2f} ms  {rows[-1]['tb_per_s']:.2f} TB/s", flush=True)
    res = {"elements": total, "tensors": len(sizes), "device": torch.cuda.get_device_name(),
           "torch": torch.__version__, "configs": rows}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
