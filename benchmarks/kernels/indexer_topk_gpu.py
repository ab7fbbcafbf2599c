"""Op ``indexer_topk`` on the GPU: ``triton`` (tensor-core scoring + exact re-check) vs ``torch_fp32`` (the
reference ``select_pools`` with its default chunking), GLM-5.3-Flash indexer shape (32 heads x 128, 16-token
pools, top 2048 tokens = 128 pools).

    python benchmarks/kernels/indexer_topk_gpu.py --out $OUT/indexer_topk.json           # about 1-2 min on an H200
    python benchmarks/kernels/indexer_topk_gpu.py --smoke --out /tmp/indexer_topk.json   # CPU interpreter, tiny

Inputs come from a randomly initialised indexer (``Indexer``'s layers, rebuilt here so the script does not
depend on the model code) on random hidden states with some structure (a topic per 2K-token segment plus
noise): keys ``LayerNorm(wk x)`` pooled by the softmax gate, queries ``wq_b(q_resid)`` in bf16 and head
weights ``weights_proj(x) / sqrt(I)`` in fp32, as under bf16 autocast. Cases:

- ``32k``: Q = S = 32768, P = 2048 (the glm5-flash-1gpu 32K step), with q/keys dtypes bf16/fp32 (autocast),
  bf16/bf16 and fp32/fp32, and without the bf16 hi/lo split;
- ``1m_segment``: Q = 8192 queries at the end of a 1M-token sequence, P = 65536, margins 16/32/64;
- ``1m_full``: 1M causal queries extrapolated from chunks of 8192 queries at a few positions (time is
  linear in the visible pools per chunk: fitted, summed over the 128 chunks).

Per case: ms (median of warm calls), effective TFLOP/s (2 * I * Di per (query, visible pool)), rows whose
(sel, ok) differ from the reference (expected 0), fallback and few-pool rows, peak memory above the inputs,
and the kernel scores' max error against float64 relative to the certificate's bound ``e`` (must be < 1).
The JSON is rewritten after every case.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

if "--smoke" in sys.argv and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from megaseq.ops.indexer import scoring as indexer_scoring  # noqa: E402
from megaseq.ops.indexer import topk as indexer_topk  # noqa: E402
from megaseq.ops.indexer import topk_kernel as kern  # noqa: E402

MIB = 2**20


class Shape:
    def __init__(self, smoke: bool) -> None:
        self.H, self.R, self.I, self.Di, self.kp, self.topk = (64, 48, 4, 16, 4, 32) if smoke else \
            (2048, 1536, 32, 128, 16, 2048)
        self.K = self.topk // self.kp


def make_keys(shape: Shape, S: int, dev, gen) -> torch.Tensor:
    """Pooled indexer keys ``[S // kp, Di]`` fp32 of a random indexer on structured hidden states."""
    H, Di, kp = shape.H, shape.Di, shape.kp
    wk = torch.empty(Di, H, device=dev).uniform_(-H**-0.5, H**-0.5, generator=gen)
    topics = torch.randn(64, H, device=dev, generator=gen)
    keys = []
    step = 1 << 16
    for s in range(0, S, step):
        n = min(step, S - s)
        seg = torch.randint(0, 64, (n // 2048 + 1,), device=dev, generator=gen).repeat_interleave(2048)[:n]
        x = (0.6 * torch.randn(n, H, device=dev, generator=gen) + 0.8 * topics[seg]).bfloat16()
        k = torch.nn.functional.layer_norm((x @ wk.T.bfloat16()).float(), (Di,), eps=1e-6)
        gate = x.float().sum(-1)  # F.linear(x, ones(Di, H)): one logit per token for every channel
        probs = gate.view(-1, kp, 1).softmax(dim=1)
        keys.append((probs * k.view(-1, kp, Di)).sum(1))
    return torch.cat(keys)


def make_queries(shape: Shape, Q: int, dev, gen) -> tuple[torch.Tensor, torch.Tensor]:
    """Indexer queries ``[Q, I, Di]`` bf16 and head weights ``[Q, I]`` fp32."""
    H, R, I, Di = shape.H, shape.R, shape.I, shape.Di
    wq = torch.empty(I * Di, R, device=dev).uniform_(-R**-0.5, R**-0.5, generator=gen).bfloat16()
    ww = torch.empty(I, H, device=dev).uniform_(-H**-0.5, H**-0.5, generator=gen).bfloat16()
    topics = torch.randn(64, R, device=dev, generator=gen)
    seg = torch.randint(0, 64, (Q // 2048 + 1,), device=dev, generator=gen).repeat_interleave(2048)[:Q]
    q_resid = 0.6 * torch.randn(Q, R, device=dev, generator=gen) + 0.8 * topics[seg]
    q_resid = (q_resid * q_resid.pow(2).mean(-1, keepdim=True).rsqrt()).bfloat16()  # q_a_layernorm
    x = torch.randn(Q, H, device=dev, generator=gen).bfloat16()
    return (q_resid @ wq.T).view(Q, I, Di), (x @ ww.T).float() * I**-0.5


def timed(fn, dev, reps: int) -> tuple[float, object]:
    """Median ms of ``reps`` warm calls (one warm-up), and the last result."""
    out = fn()
    times = []
    for _ in range(reps):
        if dev.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            out = fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        else:
            t0 = time.perf_counter()
            out = fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[len(times) // 2], out


def peak_mib(fn, dev) -> float:
    if dev.type != "cuda":
        return 0.0
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / MIB


def visible_pairs(ends_P: torch.Tensor, q_pos_Q: torch.Tensor) -> int:
    return int(torch.searchsorted(ends_P, q_pos_Q, right=True).sum())


def bound_ratio(args, scale: float, rows: int = 256) -> float:
    """max over (row, visible pool) of |L - R| / e: kernel scores vs float64, against the bound (< 1)."""
    q, w, keys, ends, pdoc, pos, qdoc = args
    q, w, pos, qdoc = q[-rows:], w[-rows:], pos[-rows:], qdoc[-rows:]
    n = int(torch.searchsorted(ends, pos.max(), right=True))
    L = kern.index_scores(q, w, keys, ends, pdoc, pos, qdoc, n, scale, torch.finfo(torch.float32).min)
    exact = torch.einsum("qid,pd->qip", q.double(), keys[:n].double()).mul(scale).relu()
    exact = torch.einsum("qi,qip->qp", w.double(), exact)
    vis = (ends[None, :n] <= pos[:, None]) & (pdoc[None, :n] == qdoc[:, None])
    kmax = float(torch.linalg.vector_norm(keys.float(), dim=-1).max())
    e = indexer_topk.score_error_bound(q, w, keys.dtype, kmax, scale, indexer_topk.SPLIT)
    return float(((L.double() - exact).abs() * vis / e[:, None]).max())


def breakdown(args, scale: float, K: int, dev, reps: int) -> dict:
    """ms of the steps on the whole case as one chunk: the kernel, the candidates' topk (the rest is the
    re-check, the certificate and the bookkeeping)."""
    q, w, keys, ends, pdoc, pos, qdoc = args
    n = max(K, int(torch.searchsorted(ends, pos.max(), right=True)))
    floor = torch.finfo(torch.float32).min
    t_kernel, L = timed(lambda: kern.index_scores(q, w, keys, ends, pdoc, pos, qdoc, n, scale, floor), dev, reps)
    t_topk, _ = timed(lambda: L.topk(min(K + indexer_topk.MARGIN, n), dim=-1), dev, reps)
    return {"ms_kernel": t_kernel, "ms_topk": t_topk}


def profile(args, scale: float, K: int, dev, label: str) -> None:
    """The device kernels of one ``triton`` call, by total time (``--profile``)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    with torch_profile(activities=acts) as prof:
        indexer_topk.indexer_topk_triton(*args, K, scale)
        if dev.type == "cuda":
            torch.cuda.synchronize()
    sort = "cuda_time_total" if dev.type == "cuda" else "cpu_time_total"
    print(f"profile {label}\n" + prof.key_averages().table(sort_by=sort, row_limit=10, max_name_column_width=40),
          flush=True)


def near_ties(args, scale: float, sel, sel_ref, rows) -> list[dict]:
    """Differing rows: the pools only one side picked and their float64 scores, with the relative gap
    between the two sides' sets (an fp32-level tie when ~1e-7)."""
    q, w, keys = args[0], args[1], args[2]
    out = []
    for r in rows.tolist():
        a, b = set(sel[r].tolist()), set(sel_ref[r].tolist())
        pools = torch.tensor(sorted(a ^ b), device=q.device)
        s = torch.einsum("id,pd->ip", q[r].double(), keys[pools].double()).mul(scale).relu()
        e64 = (w[r].double() @ s).tolist()
        only = {int(p): v for p, v in zip(pools.tolist(), e64)}
        fa = [v for p, v in only.items() if p in a]
        fb = [v for p, v in only.items() if p in b]
        gap = abs(max(fa + fb) - min(fa + fb)) / max(abs(max(fa + fb)), 1e-30)
        out.append({"row": r, "only_triton": [p for p in only if p in a], "only_ref": [p for p in only if p in b],
                    "float64": only, "relative_gap": gap})
    return out


def compare(args, scale, K, dev, reps, ref_reps, ref=None, **kw) -> tuple[dict, tuple]:
    """One case: both implementations timed (the reference's ``(ms, result, peak)`` reused when given),
    their results compared, the fast path's counters."""
    ref_fn = lambda: indexer_scoring.select_pools(*args, K, scale)  # noqa: E731
    fast_fn = lambda: indexer_topk.indexer_topk_triton(*args, K, scale, **kw)  # noqa: E731
    if ref is None:
        t_ref, out_ref = timed(ref_fn, dev, ref_reps)
        ref = (t_ref, out_ref, peak_mib(ref_fn, dev))
    t_ref, out_ref, peak_ref = ref
    indexer_topk.STATS.reset()
    fast = fast_fn()
    st = indexer_topk.STATS
    row = {"fallback_rows": st.fallback_rows, "few_pool_rows": st.few_pool_rows, "exact_rows": st.exact_rows,
           "band_max": st.band_max, "rows": st.rows}
    t_fast, _ = timed(fast_fn, dev, reps)
    diff_Q = (fast[0] != out_ref[0]).any(-1) | (fast[1] != out_ref[1]).any(-1)
    diff = diff_Q.sum()
    if int(diff):
        row["differences"] = near_ties(args, scale, fast[0], out_ref[0], torch.nonzero(diff_Q).squeeze(-1)[:4])
    flops = 2 * args[0].shape[1] * args[0].shape[2] * visible_pairs(args[3], args[5])
    row.update({"ms_triton": t_fast, "ms_torch_fp32": t_ref, "speedup": t_ref / t_fast,
                "tflops_triton": flops / t_fast / 1e9, "tflops_torch_fp32": flops / t_ref / 1e9,
                "differing_rows": int(diff), "peak_mib_triton": peak_mib(fast_fn, dev),
                "peak_mib_torch_fp32": peak_ref})
    return row, ref


def case_32k(shape, dev, gen, smoke, reps, prof=False) -> dict:
    """The 1gpu preset's 32K step: Q = S, one document, autocast dtypes and the other operand dtypes."""
    S = 256 if smoke else 32768
    keys = make_keys(shape, S, dev, gen)
    q, w = make_queries(shape, S, dev, gen)
    ends = torch.arange(keys.shape[0], device=dev) * shape.kp + shape.kp - 1
    pos = torch.arange(S, device=dev)
    zeros_P, zeros_Q = torch.zeros_like(ends), torch.zeros_like(pos)
    scale = shape.Di**-0.5
    out = {}
    variants = {"q_bf16_keys_fp32": (q, keys, {}), "q_bf16_keys_bf16": (q, keys.bfloat16(), {}),
                "q_fp32_keys_fp32": (q.float(), keys, {}), "q_bf16_keys_fp32_nosplit": (q, keys, {"split": False,
                                                                                              "margin": 256})}
    ref = None
    for name, (qv, kv, kw) in variants.items():
        args = (qv, w, kv, ends, zeros_P, pos, zeros_Q)
        same_ref = name.endswith("nosplit") or name == "q_bf16_keys_fp32"
        out[name], r = compare(args, scale, shape.K, dev, reps, 2, ref=ref if same_ref else None, **kw)
        ref = r if name == "q_bf16_keys_fp32" else ref
        out[name]["bound_ratio"] = bound_ratio(args, scale) if not kw else None
        out[name].update(breakdown(args, scale, shape.K, dev, reps) if not kw else {})
        if prof and name == "q_bf16_keys_fp32":
            profile(args, scale, shape.K, dev, f"32k {name}")
        print("32k", name, _fmt(out[name]), {k: out[name].get(k) for k in ("bound_ratio", "ms_kernel", "ms_topk")},
              flush=True)
    return out


def case_1m(shape, dev, gen, smoke, reps, prof=False) -> tuple[dict, dict]:
    """One sequence segment (8192 queries at the end of 1M tokens) and the full 1M extrapolated."""
    S, Q = (2048, 128) if smoke else (1 << 20, 8192)
    keys = make_keys(shape, S, dev, gen)
    q, w = make_queries(shape, Q, dev, gen)
    ends = torch.arange(keys.shape[0], device=dev) * shape.kp + shape.kp - 1
    zeros_P, zeros_Q = torch.zeros_like(ends), torch.zeros(Q, dtype=torch.long, device=dev)
    scale = shape.Di**-0.5
    seg, ref = {}, None
    args = (q, w, keys, ends, zeros_P, torch.arange(S - Q, S, device=dev), zeros_Q)
    for margin in (32, 16, 64):
        seg[f"margin_{margin}"], ref = compare(args, scale, shape.K, dev, reps, 2, ref=ref, margin=margin)
        print("1m_segment", margin, _fmt(seg[f"margin_{margin}"]), flush=True)
    seg["nosplit_margin_256"], _ = compare(args, scale, shape.K, dev, reps, 2, ref=ref, margin=256, split=False)
    print("1m_segment nosplit 256", _fmt(seg["nosplit_margin_256"]), flush=True)
    seg["margin_32"]["bound_ratio"] = bound_ratio(args, scale)
    seg["margin_32"].update(breakdown(args, scale, shape.K, dev, reps))
    if prof:
        profile(args, scale, shape.K, dev, "1m_segment")
    print("1m_segment", {k: seg["margin_32"][k] for k in ("bound_ratio", "ms_kernel", "ms_topk")}, flush=True)
    full = {"chunks": []}
    for start in (S // 8, S // 2):
        args = (q, w, keys, ends, zeros_P, torch.arange(start, start + Q, device=dev), zeros_Q)
        row, _ = compare(args, scale, shape.K, dev, reps, 1)
        full["chunks"].append({"start": start, "pairs": visible_pairs(ends, args[5]), **row})
        print("1m_full chunk", start, _fmt(row), flush=True)
    full["chunks"].append({"start": S - Q, "pairs": visible_pairs(ends, torch.arange(S - Q, S, device=dev)),
                           **seg["margin_32"]})
    for impl in ("triton", "torch_fp32"):
        full[f"s_{impl}"] = _extrapolate(full["chunks"], f"ms_{impl}", ends, S, Q) / 1e3
    full["speedup"] = full["s_torch_fp32"] / full["s_triton"]
    print("1m_full", {k: v for k, v in full.items() if k != "chunks"}, flush=True)
    return seg, full


def _extrapolate(chunks, key, ends, S, Q) -> float:
    """Sum over the S / Q chunks of ``a + b * pairs``, fitted by least squares on the measured chunks."""
    x = torch.tensor([float(c["pairs"]) for c in chunks], dtype=torch.float64)
    y = torch.tensor([c[key] for c in chunks], dtype=torch.float64)
    A = torch.stack([torch.ones_like(x), x], 1)
    a, b = torch.linalg.lstsq(A, y[:, None]).solution[:, 0].tolist()
    pairs = [visible_pairs(ends, torch.arange(s, s + Q, device=ends.device)) for s in range(0, S, Q)]
    return sum(max(a + b * p, 0.0) for p in pairs)


def _fmt(row: dict) -> str:
    keys = ("ms_triton", "ms_torch_fp32", "speedup", "tflops_triton", "differing_rows", "fallback_rows",
            "peak_mib_triton", "peak_mib_torch_fp32")
    return " ".join(f"{k}={row[k]:.4g}" if isinstance(row[k], float) else f"{k}={row[k]}" for k in keys)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (the CPU under the Triton interpreter)")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--profile", action="store_true", help="print the kernels of one call per main case")
    args = ap.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    shape = Shape(args.smoke)
    gen = torch.Generator(device=dev).manual_seed(0)
    t0 = time.perf_counter()
    res: dict = {"gpu": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu", "torch": torch.__version__,
                 "allow_tf32": torch.backends.cuda.matmul.allow_tf32, "margin": indexer_topk.MARGIN,
                 "shape": vars(shape)}
    out = Path(args.out)
    save = lambda: out.write_text(json.dumps(res, indent=1))  # noqa: E731
    res["32k"] = case_32k(shape, dev, gen, args.smoke, args.reps, args.profile)
    save()
    res["1m_segment"], res["1m_full"] = case_1m(shape, dev, gen, args.smoke, args.reps, args.profile)
    res["seconds"] = time.perf_counter() - t0
    save()
    print(f"done in {res['seconds']:.0f} s -> {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
