"""Op ``indexer_target`` (the indexer objective's sparse-stage target) timed: the Triton kernel per launch
configuration against the torch reference, at glm5-flash-1gpu's DSA shape.

One chunk of queries (``--queries``, default 11K: the objective's chunk with the kernel at 32K) of a ``--seq-len``
sequence, 16 heads, C = 512, W = 2063 (128 random pools of 16 and the tail), bf16. Warm: each way runs once
untimed, then the median of ``--reps`` timed calls (CUDA events); the reference runs ``--ref-queries`` queries
(its chunk at 32K, about 840) and is scaled to the same count. Prints one JSON line per way, and the largest
difference of each configuration's result from the default's.

One pass against two: each configuration runs again given the log-sum-exp the fused sparse MLA's forward computes
for the same queries (``triton_one_pass``: its saved ``[Hh, N]`` read through the ``[c, Hh]`` view the op hands
out), as the objective's sparse stage runs it; ``one_pass_speedup`` is the two-pass time over the one-pass time.

    python benchmarks/kernels/indexer_target_configs.py --out indexer_target_configs.json
"""

from __future__ import annotations

import argparse
import json

import torch
from _timing import median_ms

from megaseq.ops.indexer import target as tgt
from megaseq.ops.indexer import target_kernel as K
from megaseq.ops.sparse_mla import kernels as SK
from megaseq.ops.sparse_mla.fused import causal_pool_selection

CONFIGS = [K.Config(16, 32, 4, 2), K.Config(16, 32, 8, 2), K.Config(16, 64, 8, 2), K.Config(16, 64, 8, 3),
           K.Config(16, 128, 8, 2), K.Config(32, 32, 8, 2)]


def timed(fn, reps: int) -> float:
    """Median milliseconds of ``reps`` calls after one untimed."""
    fn()
    return median_ms(fn, reps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seq-len", type=int, default=32768)
    ap.add_argument("--queries", type=int, default=11264)
    ap.add_argument("--ref-queries", type=int, default=840)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    S, c = a.seq_len, a.queries
    idx = causal_pool_selection(1, c, S, generator=gen, device="cuda")[0]
    q = (torch.randn(c, 16, 512, device="cuda", generator=gen) * 3 * 512**-0.25).bfloat16()
    lat = (torch.randn(S, 512, device="cuda", generator=gen) * 512**-0.25).bfloat16()
    rows = []
    r = min(a.ref_queries, c)
    ms = timed(lambda: tgt.indexer_target_reference(q[:r], lat, idx[:r], 1.0), a.reps)
    rows.append({"way": "torch_gather", "queries": r, "ms": ms, "ms_per_1k_queries": ms * 1000 / r})
    default = K.default_config(16, 512, torch.bfloat16)
    want = K.target(q, lat, idx, 1.0, default)[0]
    lse = SK.forward(q.transpose(0, 1).contiguous(), lat[None], idx[None], 1.0)[1].t()  # the attention's, [c, Hh]
    for cfg in [default, *[x for x in CONFIGS if x != default]]:
        for passes, given in ((2, None), (1, lse)):
            ms = timed(lambda cfg=cfg, given=given: K.target(q, lat, idx, 1.0, cfg, lse2=given), a.reps)
            diff = (K.target(q, lat, idx, 1.0, cfg, lse2=given)[0] - want).abs().max().item()
            gbs = passes * c * idx.shape[1] * 512 * 2 / ms / 1e6  # the passes' gathered bytes
            rows.append({"way": "triton" if passes == 2 else "triton_one_pass", "config": cfg.__dict__,
                         "default": cfg == default, "queries": c, "ms": ms, "ms_per_1k_queries": ms * 1000 / c,
                         "gathered_GB_per_s": gbs, "max_diff_from_default": diff})
        rows[-1]["one_pass_speedup"] = rows[-2]["ms"] / rows[-1]["ms"]
    for row in rows:
        print(json.dumps(row))
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"seq_len": S, "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows},
                      f, indent=1)


if __name__ == "__main__":
    main()
