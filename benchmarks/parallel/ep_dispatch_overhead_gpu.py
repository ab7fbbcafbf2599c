"""The chunked dispatch's overhead on one GPU (ep = 1): PipelinedLLEP's chunks against the plain MoE experts.

    python benchmarks/parallel/ep_dispatch_overhead_gpu.py --out benchmarks/results/parallel/ep_dispatch_overhead.json

With one GPU there is nothing to send, so what is timed is what chunking itself costs: the routing plan
(two integer "gathers" of one rank), the strided token order, per chunk the row sorting, the grouped GEMMs
on a chunk's rows instead of all of them, and in backward the replay of every chunk. The baseline is
``Experts.forward`` (every row in one grouped GEMM, the graph kept). Both under bf16 autocast with fp32
weights (the trainer's mode), GLM-5.3-Flash's expert shapes by default (E 288, k 8, H 4096, I 2048: one
MoE layer's routed experts; ``--experts`` to fit a smaller GPU), routing from a random router; forward +
backward timed (synchronised wall clock) after 2 warm-up calls, median of ``--repeats``, and the peak memory of each.
Writes the JSON (``--out``) and a markdown table beside it. Needs a CUDA GPU; NOT RUN YET (the timing of
dispatch across several GPUs belongs to the multi-GPU issue).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from megaseq.config import ExpertDispatchSettings
from megaseq.models.common.moe import Experts
from megaseq.parallel.expert import EPDispatch


def timed(fn, repeats: int, dev: torch.device) -> tuple[float, int]:
    """(median ms of ``fn()`` = forward + backward, peak bytes above what was allocated before; 0 off a GPU)."""
    cuda = dev.type == "cuda"
    for _ in range(2):
        fn()
    if cuda:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times), (torch.cuda.max_memory_allocated() - base) if cuda else 0


def case(experts: Experts, tokens: int, chunk: int, args: argparse.Namespace) -> dict[str, Any]:
    E, K, H = args.experts, args.top_k, args.hidden
    dev = next(experts.parameters()).device
    torch.manual_seed(0)
    x = torch.randn(tokens, H, device=dev, requires_grad=True)
    w = torch.rand(tokens, K, device=dev, requires_grad=True)
    idx = torch.topk(torch.randn(tokens, E, device=dev), K, dim=-1).indices
    grad = torch.randn(tokens, H, device=dev, dtype=torch.bfloat16)
    d = EPDispatch(group=None, ep=1, rank=0, settings=ExpertDispatchSettings(chunk_tokens=chunk,
                                                                               max_chunks=args.max_chunks))

    def plain() -> None:
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            out, _ = experts(x, idx, w)
        out.backward(grad.to(out.dtype))

    def chunked() -> None:
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            out, _ = d(experts, x, idx, w)
        out.backward(grad.to(out.dtype))

    ms_plain, mem_plain = timed(plain, args.repeats, dev)
    ms_chunked, mem_chunked = timed(chunked, args.repeats, dev)
    return {"tokens": tokens, "chunk_tokens": chunk, "chunks": d.last["chunks"], "plain_ms": ms_plain,
            "chunked_ms": ms_chunked, "overhead": ms_chunked / ms_plain, "plain_peak_gib": mem_plain / 2**30,
            "chunked_peak_gib": mem_chunked / 2**30}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="benchmarks/results/parallel/ep_dispatch_overhead.json")
    ap.add_argument("--tokens", default="16384,65536", help="tokens per call, comma-separated")
    ap.add_argument("--chunks", default="4096,8192,16384", help="ep_chunk_tokens values, comma-separated")
    ap.add_argument("--max-chunks", type=int, default=32)
    ap.add_argument("--experts", type=int, default=288)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--intermediate", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--device", default="cuda", help="cuda (the measurement); cpu only checks the script runs")
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("ep_dispatch_overhead_gpu.py needs a CUDA GPU (--device cpu only checks the script)")
    with torch.device(args.device):  # one set of experts for every case, built where it runs
        experts = Experts(args.experts, args.hidden, args.intermediate, 10.0)
    rows = [case(experts, n, c, args) for n in map(int, args.tokens.split(","))
            for c in map(int, args.chunks.split(","))]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"gpu": torch.cuda.get_device_name() if args.device == "cuda" else "cpu", "torch": torch.__version__,
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "args": vars(args)}
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    lines = [f"# Chunked dispatch overhead, ep = 1 ({meta['gpu']}, torch {meta['torch']})", "",
             "| tokens | ep_chunk_tokens | chunks | plain ms | chunked ms | x | plain peak GiB | chunked peak GiB |",
             "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['tokens']} | {r['chunk_tokens']} | {r['chunks']} | {r['plain_ms']:.1f} | {r['chunked_ms']:.1f} | "
              f"{r['overhead']:.2f} | {r['plain_peak_gib']:.2f} | {r['chunked_peak_gib']:.2f} |" for r in rows]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
