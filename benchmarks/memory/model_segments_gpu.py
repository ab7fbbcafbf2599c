"""Sequence segments on the GPU: the whole model a segment at a time against the plain step, in bf16.

    python benchmarks/memory/model_segments_gpu.py --out $OUT/model_segments.json          # about a minute, H200
    python benchmarks/memory/model_segments_gpu.py --smoke --out /tmp/model_segments.json  # CPU, tiny, fp32

The model is ``glm5-flash-1gpu`` with 4 layers (3 KDA + 1 DSA with its indexer, dense + MoE), fp32
weights under bf16 autocast as ``megaseq train`` runs it, fla's KDA and the absorbed sparse MLA. One
step's loss and every parameter gradient at S tokens, plain (one forward + backward, nothing else) and
in segments of T tokens (``memory/model_segments.py``): their relative difference (per-parameter norm
ratio) is two orders of summation in bf16, so a few 1e-3 is the expected scale; the plain step run a
second time is reported beside it. Also each one's peak ``max_memory_allocated`` above the model and its
time. The float64 exactness is tests/memory/test_model_segments.py.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from megaseq.memory.model_segments import segmented_loss_backward
from megaseq.memory.vocab_loss import linear_cross_entropy
from megaseq.models.build import build_model
from megaseq.models.glm5.spec import glm5_flash_1gpu, glm5_flash_tiny

GIB = 2**30


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def _differs(a: torch.Tensor, b: torch.Tensor) -> float:
    """Fraction of queries whose selected key sets (sorted rows, -1 padded) differ."""
    W = max(a.shape[-1], b.shape[-1])
    a, b = (torch.nn.functional.pad(t, (W - t.shape[-1], 0), value=-1).sort(dim=-1).values for t in (a, b))
    return float((a != b).any(dim=-1).float().mean())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--seq-len", type=int, default=16384)
    ap.add_argument("--segment", type=int, default=4096)
    ap.add_argument("--topk-all", action="store_true",
                    help="index_topk = seq_len: every pool selected, so no near-tie can flip the selection")
    ap.add_argument("--fp32", action="store_true",
                    help="no autocast, the reference KDA (fla refuses fp32 on an H200): the exactness check at fp32")
    args = ap.parse_args()
    dev = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    spec = glm5_flash_tiny() if args.smoke else glm5_flash_1gpu()
    spec = spec.replace(num_layers=4, layer_types=spec.layer_types[:4], mlp_types=spec.mlp_types[:4],
                        indexer_types=spec.indexer_types[:4])
    S, T = (300, 64) if args.smoke else (args.seq_len, args.segment)
    if args.topk_all:
        spec = spec.replace(index_topk=-(-S // spec.index_kpool) * spec.index_kpool)
    model = build_model(spec, dtype=torch.float32, device=dev, seed=0)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, spec.vocab_size, (1, S + 1), generator=g).to(dev)
    ids, labels = ids[:, :-1], ids[:, 1:]
    half = dev.type == "cuda" and not args.fp32
    amp = torch.autocast(dev.type, dtype=torch.bfloat16, enabled=half)
    if args.fp32:
        from megaseq.ops import dispatch

        dispatch.configure(preferred={"kda": ["reference"]})

    def loss_fn(hidden, lab):
        head = model.lm_head.weight
        if half:
            hidden, head = hidden.to(torch.bfloat16), head.to(torch.bfloat16)
        return linear_cross_entropy(hidden.reshape(-1, hidden.shape[-1]), head, lab.reshape(-1),
                                    chunk_tokens=4096, reduction="sum")

    # the DSA selections of each run's first forward (the segmented step's forward pass, in order)
    from megaseq.models.common.mla_dsa import Indexer

    picks: list[torch.Tensor] = []
    real_forward = Indexer.forward

    def spy(self, *a, **k):
        out = real_forward(self, *a, **k)
        picks.append(out)
        return out

    Indexer.forward = spy

    def selection(segmented: bool) -> torch.Tensor:
        n = -(-S // T) if segmented else 1
        W = max(t.shape[-1] for t in picks[:n])  # early segments have fewer pools to choose from
        got = torch.cat([torch.nn.functional.pad(t, (0, W - t.shape[-1]), value=-1) for t in picks[:n]], dim=1)
        picks.clear()
        return got.sort(dim=-1).values  # as sets

    def run(segmented: bool):
        picks.clear()
        model.zero_grad(set_to_none=True)
        if dev.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        t0 = time.perf_counter()
        with amp:
            if segmented:
                loss = segmented_loss_backward(model, ids, labels, loss_fn, 1.0 / S, T)
            else:
                loss = loss_fn(model(ids), labels)
                (loss / S).backward()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        peak = (torch.cuda.max_memory_allocated() - base) / GIB if dev.type == "cuda" else None
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
        return float(loss.detach()) / S, grads, dt, peak, selection(segmented)

    res: dict = {"gpu": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu", "torch": torch.__version__,
                 "model": f"{'glm5-flash-tiny' if args.smoke else 'glm5-flash-1gpu'}, 4 layers (3 KDA + 1 DSA)",
                 "seq_len": S, "segment_tokens": T,
                 "dtype": "fp32 weights, bf16 autocast" if half else "fp32 (reference KDA)"}
    run(False)  # warm-up (kernels, autotune)
    l0, g0, t0, m0, s0 = run(False)
    l1, g1, t1, m1, s1 = run(True)
    l2, g2, t2, m2, s2 = run(False)
    rel = {n: _rel(g1[n], g0[n]) for n in g0}
    again = {n: _rel(g2[n], g0[n]) for n in g0}
    worst = max(rel, key=rel.get)
    res.update(loss_plain=l0, loss_segmented=l1, loss_rel_diff=abs(l1 - l0) / abs(l0),
               grad_rel_diff_median=sorted(rel.values())[len(rel) // 2], grad_rel_diff_max=rel[worst],
               grad_rel_diff_max_param=worst, plain_again_median=sorted(again.values())[len(again) // 2],
               plain_again_max=max(again.values()), same_param_set=g1.keys() == g0.keys(),
               plain_s=t0, segmented_s=t1, plain_peak_gib=m0, segmented_peak_gib=m1,
               index_topk=spec.index_topk,
               # queries whose selected key set differs from the plain step's (near-ties in the indexer's
               # scores: the segments compute its queries and keys in other GEMM shapes)
               selection_differs_frac=_differs(s1, s0),
               selection_differs_plain_again_frac=_differs(s2, s0))
    Path(args.out).write_text(json.dumps(res, indent=2))
    print(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
