"""Op ``indexer_kl`` (the indexer objective's KL and its gradients) timed: the Triton kernel per launch configuration
against the torch reference, forward and backward, at glm5-flash-1gpu's indexer shape.

One chunk of ``--queries`` queries (default 2048), I = 32 heads of D = 128, K = 512 selected pools (``--pools``
pooled keys, default 4096: 16K tokens in pools of 4), bf16 operands, fp32 head weights and target, about 10% of
the slots not candidates. Each way computes the KL and the gradients of its sum with respect to the queries, head
weights and keys (``torch.autograd.grad``, as ``ChunkedKL`` does). Warm: each way runs once untimed, then the
median of ``--reps`` timed calls (CUDA events). Prints one JSON line per way with its milliseconds, its peak of
allocated bytes above the inputs, and its largest difference from the reference (relative to the reference's
largest value) in the KL and each gradient.

    python benchmarks/kernels/indexer_kl_configs.py --out indexer_kl_configs.json
"""

from __future__ import annotations

import argparse
import json

import torch
from _timing import median_ms

from megaseq.ops.indexer import kl
from megaseq.ops.indexer import kl_kernel as K

CONFIGS = [K.Config(16, 4, 2), K.Config(32, 4, 2), K.Config(32, 8, 2), K.Config(64, 8, 2), K.Config(64, 8, 1),
           K.Config(128, 8, 2)]


def timed(fn, reps: int) -> tuple[float, int]:
    """(median milliseconds of ``reps`` calls after one untimed, peak allocated bytes above the start)."""
    fn()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    ms = median_ms(fn, reps)
    return ms, torch.cuda.max_memory_allocated() - base


def inputs(c: int, P: int, gen: torch.Generator):
    q = (torch.randn(c, 32, 128, device="cuda", generator=gen) * 2 * 128**-0.25).bfloat16()
    w = torch.randn(c, 32, device="cuda", generator=gen) * 32**-0.5
    keys = (torch.randn(P, 128, device="cuda", generator=gen) * 128**-0.25).bfloat16()
    pools = torch.randint(0, P, (c, 512), device="cuda", generator=gen)
    cand = torch.rand(c, 512, device="cuda", generator=gen) < 0.9
    t = torch.rand(c, 512, device="cuda", generator=gen) * cand
    return q, w, keys, pools, t / t.sum(-1, keepdim=True).clamp_min(1e-30), cand


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--queries", type=int, default=2048)
    ap.add_argument("--pools", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    q, w, keys, pools, t, cand = inputs(a.queries, a.pools, torch.Generator(device="cuda").manual_seed(0))
    leaves = [x.detach().requires_grad_(True) for x in (q, w, keys)]

    def run(fn):
        rows = fn(*leaves, pools, t, cand, 0.5)
        return (rows.detach(), *torch.autograd.grad(rows.sum(), leaves))

    ref = run(kl.indexer_kl_reference)
    ways = [("torch_gather", kl.indexer_kl_reference, None), ("triton_default", kl.indexer_kl_triton, None)]
    ways += [(f"triton_{c.BK}_{c.num_warps}_{c.num_stages}", kl.indexer_kl_triton, c) for c in CONFIGS]
    real = K.default_config
    lines = []
    for name, fn, cfg in ways:
        K.default_config = real if cfg is None else (lambda *_, c=cfg: c)
        try:
            ms, peak = timed(lambda f=fn: run(f), a.reps)
            got = run(fn)
        finally:
            K.default_config = real
        err = {n: ((x.double() - r.double()).abs().max() / r.double().abs().max()).item()
               for n, x, r in zip(("kl", "dq", "dw", "dkeys"), got, ref, strict=True)}
        line = {"way": name, "ms": round(ms, 3), "peak_mib": round(peak / 2**20, 1), "rel_err": err,
                "queries": a.queries, "pools": a.pools, "gpu": torch.cuda.get_device_name()}
        print(json.dumps(line), flush=True)
        lines.append(line)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(lines, f, indent=1)


if __name__ == "__main__":
    main()
