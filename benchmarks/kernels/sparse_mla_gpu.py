"""Fused Triton sparse MLA (``sparse_attention=triton``) vs ``absorbed`` on the GPU: errors, then timings.

    python benchmarks/kernels/sparse_mla_gpu.py --out $OUT/sparse_mla.json              # H200: about 1-2 minutes
    python benchmarks/kernels/sparse_mla_gpu.py --out $OUT/sparse_mla.json --autotune   # + tune the Triton configs
    python benchmarks/kernels/sparse_mla_gpu.py --smoke --out /tmp/sparse_mla.json      # CPU interpreter, tiny, fp32

Check (glm5-flash-1gpu DSA shapes: R = 512, Dn = Dv = 256, W = 2063, causal 16-token pool selections):
errors (max abs, and max abs / max |ref|) of out, dq, dc, dW for triton bf16 vs absorbed bf16, both vs the
fp32 reference ``torch_masked`` (so triton's error can be read against absorbed's), and triton fp32 vs
the fp32 reference; Hh = 16 and 64 at Q = S = 4096.

Timing (CUDA events, warm calls, median): forward, backward (``autograd.grad`` on a retained graph) and
forward + backward of both implementations in bf16 at (Hh=16, Q=S=32768), (Hh=16, the last 8192 queries
of S=1M keys: a sequence segment), (Hh=64, Q=S=32768). Attention TFLOP/s count the dots over all W slots
(empty ones included): forward ``4 Hh W R Q`` (scores, p @ c), backward ``10 Hh W R Q`` (scores again,
dp, dq, and the latent gradient's two), the GEMMs with W_uk / W_uv left out; ``matrix_floor_ms`` is
that count at 790 TFLOP/s. The kernels are not matrix-bound at 16 heads: each query reads its W * R
latents (2 MiB bf16) for 16 heads' dots (32 flop/byte, from L2 at 32K keys, from HBM at 1M), and the
backward adds W * R fp32 atomics per query and head block. Each measurement is written
to the JSON as it completes; a failure is recorded and the script goes on.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

SCALE = 256**-0.5
BF16_TFLOPS = 790  # dense bf16 GEMM TFLOP/s measured on an H200: the attention dots' floor


def _errors(a: dict, b: dict) -> dict:
    out = {}
    for k in a:
        d = (a[k].double() - b[k].double()).abs().max().item()
        out[k] = {"max_abs": d, "rel": d / max(b[k].double().abs().max().item(), 1e-300)}
    return out


def _inputs(Hh: int, Q: int, S: int, dtype, dev, seed: int = 0, small: bool = False):
    from megaseq.ops.sparse_mla.fused import causal_pool_selection

    R, D, kp, pools = (32, 16, 4, 6) if small else (512, 256, 16, 128)
    gen = torch.Generator(device=dev).manual_seed(seed)
    q = torch.randn(1, Q, Hh, D, device=dev, generator=gen, dtype=dtype)
    c = torch.randn(1, S, R, device=dev, generator=gen, dtype=dtype)
    w = (torch.randn(Hh * 2 * D, R, device=dev, generator=gen) * R**-0.5).to(dtype)
    idx = causal_pool_selection(1, Q, S, kpool=kp, pools=pools, generator=gen, device=dev)
    g = torch.randn(1, Q, Hh, D, device=dev, generator=gen, dtype=dtype)
    return [t.requires_grad_() for t in (q, c, w)], idx, g


def _run(fn, leaves, idx, g) -> dict:
    out = fn(*leaves, idx, SCALE)
    dq, dc, dw = torch.autograd.grad(out, leaves, g.to(out.dtype))
    return {"out": out.detach(), "dq": dq, "dc": dc, "dW": dw}


def check(Hh: int, Q: int, dev, small: bool) -> dict:
    from megaseq.ops.sparse_mla.absorbed import sparse_mla
    from megaseq.ops.sparse_mla.fused import triton_sparse_mla
    from megaseq.ops.sparse_mla.reference import sparse_mla_reference

    leaves, idx, g = _inputs(Hh, Q, Q, torch.bfloat16, dev, seed=Hh, small=small)
    f32 = [t.detach().float().requires_grad_() for t in leaves]
    ref = _run(sparse_mla_reference, f32, idx, g.float())
    res = {"shape": {"Hh": Hh, "Q": Q, "S": Q, "W": idx.shape[-1]}}
    if dev.type == "cuda":
        tri, absd = _run(triton_sparse_mla, leaves, idx, g), _run(sparse_mla, leaves, idx, g)
        res["bf16: triton vs absorbed"] = _errors(tri, absd)
        res["bf16 triton vs fp32 reference"] = _errors(tri, ref)
        res["bf16 absorbed vs fp32 reference"] = _errors(absd, ref)
    res["fp32: triton vs fp32 reference"] = _errors(_run(triton_sparse_mla, f32, idx, g.float()), ref)
    return res


def _median_ms(fn, dev, budget_s: float = 2.0, max_reps: int = 10) -> float:
    fn()  # warm-up (and compilation)
    if dev.type != "cuda":
        t = time.perf_counter()
        fn()
        return 1e3 * (time.perf_counter() - t)
    torch.cuda.synchronize()
    times = []
    while len(times) < max_reps and (len(times) < 3 or sum(times) < 1e3 * budget_s):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def time_impl(fn, leaves, idx, g, dev) -> dict:
    def fwd():
        return fn(*leaves, idx, SCALE)

    graph = {"out": fwd()}  # one forward whose graph the backward timings replay

    def bwd():
        torch.autograd.grad(graph["out"], leaves, g, retain_graph=True)

    def both():
        torch.autograd.grad(fwd(), leaves, g)

    res = {"forward_ms": _median_ms(fwd, dev), "backward_ms": _median_ms(bwd, dev)}
    graph.clear()
    res["fwd_bwd_ms"] = _median_ms(both, dev)
    if dev.type == "cuda":
        res["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    return res


def timings(Hh: int, Q: int, S: int, dev, small: bool) -> dict:
    from megaseq.ops.sparse_mla.absorbed import sparse_mla
    from megaseq.ops.sparse_mla.fused import triton_sparse_mla

    leaves, idx, g = _inputs(Hh, Q, S, torch.bfloat16 if dev.type == "cuda" else torch.float32, dev, small=small)
    W, R = idx.shape[-1], leaves[1].shape[-1]
    flops = {"forward_ms": 4 * Hh * W * R * Q, "backward_ms": 10 * Hh * W * R * Q, "fwd_bwd_ms": 14 * Hh * W * R * Q}
    res = {"shape": {"Hh": Hh, "Q": Q, "S": S, "W": W, "R": R},
           "matrix_floor_ms": {k: v / (BF16_TFLOPS * 1e9) for k, v in flops.items()}}
    for name, fn in (("triton", triton_sparse_mla), ("absorbed", sparse_mla)):
        if dev.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        try:
            t = time_impl(fn, leaves, idx, g, dev)
            t.update({k.replace("_ms", "_tflops"): flops[k] / (t[k] * 1e9) for k in flops})
            res[name] = t
        except Exception as e:  # noqa: BLE001  (record and go on: one failing shape must not hide the rest)
            res[name] = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc(limit=4)}
    if "forward_ms" in res["triton"] and "forward_ms" in res["absorbed"]:
        res["speedup"] = {k: res["absorbed"][k] / res["triton"][k] for k in flops}
    return res


def _table(res: dict) -> str:
    lines = [f"{'shape':<28} {'impl':<9} {'fwd ms':>8} {'bwd ms':>8} {'f+b ms':>8} {'fwd TF/s':>9} "
             f"{'bwd TF/s':>9} {'f+b x':>6}"]
    for r in res.get("timings", []):
        s = r["shape"]
        label = f"Hh={s['Hh']} Q={s['Q']} S={s['S']}"
        for name in ("triton", "absorbed"):
            t = r.get(name, {})
            if "error" in t:
                lines.append(f"{label:<28} {name:<9} ERROR {t['error'][:80]}")
                continue
            x = r.get("speedup", {}).get("fwd_bwd_ms", float("nan")) if name == "triton" else 1.0
            lines.append(f"{label:<28} {name:<9} {t['forward_ms']:8.2f} {t['backward_ms']:8.2f} "
                         f"{t['fwd_bwd_ms']:8.2f} {t['forward_tflops']:9.1f} {t['backward_tflops']:9.1f} {x:6.2f}")
    for r in res.get("checks", []):
        for k, v in r.items():
            if k != "shape" and isinstance(v, dict) and "out" in v:
                worst = max(e["rel"] for e in v.values())
                lines.append(f"check Hh={r['shape']['Hh']} Q={r['shape']['Q']} {k:<34} worst rel {worst:.2e}")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--smoke", action="store_true", help="CPU, Triton's interpreter, tiny shapes, fp32")
    ap.add_argument("--autotune", action="store_true", help="tune the kernels' configs (MEGASEQ_MLA_AUTOTUNE=1)")
    args = ap.parse_args()
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton
    if args.autotune:
        os.environ["MEGASEQ_MLA_AUTOTUNE"] = "1"
    from megaseq.ops.sparse_mla import fused as triton_sparse_mla
    from megaseq.ops.sparse_mla import kernels as triton_sparse_mla_kernels

    dev = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    if dev.type == "cpu":
        if not args.smoke:
            print("no GPU: run with --smoke for the CPU interpreter", file=sys.stderr)
            return 2
        triton_sparse_mla.CPU_INTERPRETER = True
        torch.set_num_threads(1)
    import triton

    res: dict = {"gpu": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu (interpreter)",
                 "torch": torch.__version__, "triton": triton.__version__, "autotune": args.autotune,
                 "default_configs": {f"{k} Hh={h}": str(triton_sparse_mla_kernels.default_config(k, h, 512,
                                                                                               torch.bfloat16))
                                     for k in ("fwd", "bwd") for h in (16, 64)},
                 "checks": [], "timings": []}
    out = Path(args.out)
    save = lambda: out.write_text(json.dumps(res, indent=1))  # noqa: E731
    t0 = time.perf_counter()
    checks = [(4, 40)] if args.smoke else [(16, 4096), (64, 4096)]
    for Hh, Q in checks:
        try:
            res["checks"].append(check(Hh, Q, dev, args.smoke))
        except Exception as e:  # noqa: BLE001
            res["checks"].append({"shape": {"Hh": Hh, "Q": Q}, "error": f"{type(e).__name__}: {e}",
                                  "trace": traceback.format_exc(limit=4)})
        print(f"check Hh={Hh} Q={Q} done at {time.perf_counter() - t0:.0f} s", flush=True)
        save()
    shapes = [(4, 40, 40), (4, 24, 200)] if args.smoke else [(16, 32768, 32768), (16, 8192, 1 << 20),
                                                               (64, 32768, 32768)]
    for Hh, Q, S in shapes:
        res["timings"].append(timings(Hh, Q, S, dev, args.smoke))
        print(f"timing Hh={Hh} Q={Q} S={S} done at {time.perf_counter() - t0:.0f} s", flush=True)
        save()
    res["tuned_configs"] = {str(k): str(v) for k, v in triton_sparse_mla_kernels._TUNED.items()}
    res["wall_s"] = time.perf_counter() - t0
    save()
    print(_table(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
