"""The fused glue ops against their torch references on the GPU (glm5-flash-1gpu shapes), and the loss.

    python benchmarks/kernels/glue_gpu.py --out $OUT/glue.json              # about 1-2 minutes on an H200
    python benchmarks/kernels/glue_gpu.py --out $OUT/glue.json --no-loss    # the ops only
    TRITON_INTERPRET=1 python benchmarks/kernels/glue_gpu.py --smoke --dtypes float32 --out /tmp/glue.json  # CPU check

Per op (hc_mix, hc_weights, hc_collapse, hc_merge, swiglu, rms_norm; Liger's RMSNorm where installed): median
warm time (``triton.testing.do_bench``, L2 flushed between calls) of the forward and of forward + backward,
for the reference and the fused kernel; the memory the forward leaves allocated for the backward (outputs
and saved tensors); and errors: the fused kernel against the reference in the same dtype, and both against
the reference in float64 (fused at or below the reference's own error is the goal: it rounds less).
Loss: megaseq's plain and chunked linear cross-entropy and Liger's fused one (bf16 and fp32 weight-gradient
accumulation) at 32K tokens x vocab 154,880 x hidden 4096 in bf16: time of forward + backward and peak
memory above the inputs (``max_memory_allocated``), errors of loss and gradients against the plain loss.
The JSON is rewritten after every measurement.
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from pathlib import Path

import torch

GIB, MIB = 2**30, 2**20
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _err(got: torch.Tensor, want: torch.Tensor) -> dict:
    d = (got.double() - want.double()).abs()
    return {"max_abs": d.max().item(), "rel": (d.max() / want.double().abs().max().clamp_min(1e-30)).item()}


def _as_tuple(x):
    return x if isinstance(x, tuple) else (x,)


def _run(fn, inputs, grads):
    outs = _as_tuple(fn(*inputs))
    diff = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
    return outs, torch.autograd.grad(outs, diff, grads)


def _held_bytes(fn, inputs) -> int:
    """Bytes the forward leaves allocated (outputs + what autograd saved for the backward)."""
    if DEV != "cuda":
        return 0
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    outs = fn(*inputs)
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated() - before
    del outs
    return held


def _time(fn, inputs, grads) -> dict:
    if DEV != "cuda":  # the CPU smoke run: one call each, no timing
        fn(*inputs), _run(fn, inputs, grads)
        return {"fwd_ms": 0.0, "fwd_bwd_ms": 1.0, "held_MiB": 0.0}
    from triton.testing import do_bench

    fwd = do_bench(lambda: fn(*inputs), warmup=5, rep=40)
    both = do_bench(lambda: _run(fn, inputs, grads), warmup=5, rep=40)
    return {"fwd_ms": fwd, "fwd_bwd_ms": both, "held_MiB": _held_bytes(fn, inputs) / MIB}


def bench_op(name: str, shape: str, ref, fast, inputs, dtype: torch.dtype, extra: dict | None = None) -> dict:
    """Time and check ``fast`` against ``ref`` (and both against ``ref`` in float64)."""
    gen = torch.Generator(device=DEV).manual_seed(0)
    outs = _as_tuple(ref(*inputs))
    grads = [torch.randn(o.shape, generator=gen, device=DEV).to(o.dtype) for o in outs]
    r_out, r_grad = _run(ref, inputs, grads)
    f_out, f_grad = _run(fast, inputs, grads)
    x64 = [t.detach().double().requires_grad_(t.requires_grad) if isinstance(t, torch.Tensor) and t.is_floating_point()
           else t for t in inputs]
    e_out, e_grad = _run(ref, x64, [g.double() for g in grads])
    errors = {}
    for kind, fs, rs, es in (("out", f_out, r_out, e_out), ("grad", f_grad, r_grad, e_grad)):
        for i, (f, r, e) in enumerate(zip(fs, rs, es)):
            errors[f"{kind}{i}"] = {"fused_vs_ref": _err(f, r), "fused_vs_f64": _err(f, e), "ref_vs_f64": _err(r, e)}
    del r_out, r_grad, f_out, f_grad, e_out, e_grad, x64
    res = {"op": name, "shape": shape, "dtype": str(dtype).replace("torch.", ""), "errors": errors,
           "ref": _time(ref, inputs, grads), "fused": _time(fast, inputs, grads)}
    for k, v in (extra or {}).items():
        res[k] = _time(v, inputs, grads)
    res["speedup_fwd_bwd"] = res["ref"]["fwd_bwd_ms"] / res["fused"]["fwd_bwd_ms"]
    return res


def op_cases(S: int, H: int, N: int, dtype: torch.dtype, smoke: bool):
    """(name, shape, ref, fused, inputs, extra implementations) at the given shapes."""
    from megaseq.ops.mhc import mix_fused as hc_mix
    from megaseq.ops.mhc import mix_triton as triton_hc_mix
    from megaseq.ops.mhc import reference as blocks_mhc
    from megaseq.ops.mhc import streams_triton as triton_mhc_streams
    from megaseq.ops.mhc import weights_triton as triton_mhc
    from megaseq.ops.rms_norm import fused as triton_rms_norm
    from megaseq.ops.rms_norm import reference as blocks_norm
    from megaseq.ops.swiglu import fused as triton_swiglu
    from megaseq.ops.swiglu import reference as blocks_mlp

    dev, M, gen = DEV, 2 * N + N * N, torch.Generator(device=DEV).manual_seed(1)

    def rnd(*shape, scale=1.0, dt=torch.float32):
        return (torch.randn(*shape, generator=gen, device=dev) * scale).to(dt).requires_grad_()

    yield ("hc_weights", f"mix [1, {S}, {M}] fp32, iters 20", blocks_mhc.hc_weights_reference,
           triton_mhc.hc_weights_triton, [rnd(1, S, M, scale=2.0), rnd(M, scale=0.5),
                                          (1 + 0.3 * torch.randn(3, generator=gen, device=dev)).requires_grad_(), N, 20,
                                          1e-6], {})
    pre = (torch.rand(1, S, N, generator=gen, device=dev) + 1e-6).requires_grad_()
    h = rnd(1, S, N, H, dt=dtype)
    # the streams' projection as bf16 weights run it (bf16 streams, fp32 fn, no autocast: an fp32 GEMM); the
    # closed-form torch op (``hc_mix_fused``, an opt-in implementation) as an extra
    yield ("hc_mix", f"h [1, {S}, {N}, {H}], fn [{M}, {N * H}] fp32", blocks_mhc.hc_mix_reference,
           triton_hc_mix.hc_mix_triton, [h, rnd(M, N * H, scale=0.02), 1e-6], {"torch_fused": hc_mix.hc_mix_fused})
    yield ("hc_collapse", f"h [1, {S}, {N}, {H}]", blocks_mhc.hc_collapse_reference,
           triton_mhc_streams.hc_collapse_triton, [pre, h], {})
    comb = torch.softmax(torch.randn(1, S, N, N, generator=gen, device=dev), -1).requires_grad_()
    yield ("hc_merge", f"residual [1, {S}, {N}, {H}]", blocks_mhc.hc_merge_reference,
           triton_mhc_streams.hc_merge_triton, [(2 * pre.detach()).requires_grad_(), comb, rnd(1, S, H, dt=dtype), h],
           {})
    for R, I in ((S * 8, 1024), (S, 6144)) if not smoke else ((S, 64),):
        gu = rnd(R, 2 * I, scale=4.0, dt=dtype)
        yield ("swiglu", f"[{R}, {I}] halves of [{R}, {2 * I}], limit 10", blocks_mlp.swiglu,
               triton_swiglu.swiglu_triton, [*gu.chunk(2, -1), 10.0], {})
        del gu
    for R in (S, 4 * S):
        extra = {}
        try:
            from liger_kernel.ops.rms_norm import LigerRMSNormFunction

            extra["liger"] = lambda x, w, eps: LigerRMSNormFunction.apply(x, w, eps, 0.0, "llama", False)
        except ImportError:
            pass
        yield ("rms_norm", f"[{R}, {H}]", blocks_norm.rms_norm_reference, triton_rms_norm.rms_norm_triton,
               [rnd(R, H, dt=dtype), (1 + 0.1 * torch.randn(H, generator=gen, device=dev)).to(dtype).requires_grad_(),
                1e-6], extra)


def bench_loss(N: int, V: int, H: int, chunk_tokens: tuple[int, ...]) -> list[dict]:
    """Plain vs chunked vs Liger linear cross-entropy: time, peak memory above the inputs, errors."""
    from megaseq.memory.vocab_loss import chunked_linear_cross_entropy
    from megaseq.ops.vocab_loss import liger as liger_loss
    from megaseq.ops.vocab_loss.reference import plain_linear_cross_entropy

    gen = torch.Generator(device=DEV).manual_seed(2)
    hidden = (torch.randn(N, H, generator=gen, device=DEV) * 0.5).bfloat16().requires_grad_()
    weight = (torch.randn(V, H, generator=gen, device=DEV) * H**-0.5).bfloat16().requires_grad_()
    labels = torch.randint(0, V, (N,), generator=gen, device=DEV)
    labels[::97] = -100
    impls = {"plain": plain_linear_cross_entropy}
    for c in chunk_tokens:
        impls[f"chunked_{c}"] = lambda h, w, y, c=c: chunked_linear_cross_entropy(h, w, y, c)
    if liger_loss.liger_loss_supports(hidden, weight, labels) is None:
        for accum in (None, torch.float32):
            def run(h, w, y, accum=accum):
                liger_loss.WEIGHT_GRAD_DTYPE = accum
                try:
                    return liger_loss.linear_cross_entropy_liger(h, w, y)
                finally:
                    liger_loss.WEIGHT_GRAD_DTYPE = None
            impls["liger_bf16acc" if accum is None else "liger_fp32acc"] = run
    rows, ref = [], None
    for name, fn in impls.items():
        gc.collect()
        torch.cuda.empty_cache()
        times = []
        for i in range(4):  # the first is the warm-up (Triton compilation, cuBLAS heuristics)
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            loss = fn(hidden, weight, labels)
            g_h, g_w = torch.autograd.grad(loss, (hidden, weight))
            torch.cuda.synchronize()
            if i:
                times.append(time.perf_counter() - t0)
            peak = torch.cuda.max_memory_allocated() - base
        out = (loss.detach().float(), g_h.float(), g_w.float())
        if ref is None:
            ref = out
        row = {"impl": name, "s": sorted(times)[len(times) // 2], "peak_GiB": peak / GIB,
               "errors": {k: _err(a, b) for k, a, b in zip(("loss", "grad_hidden", "grad_weight"), out, ref)}}
        rows.append(row)
        print(f"loss {name:<16} {row['s']:.4f} s  peak {row['peak_GiB']:.2f} GiB  "
              f"grad_w rel {row['errors']['grad_weight']['rel']:.2e}", flush=True)
        del loss, g_h, g_w, out
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes")
    ap.add_argument("--no-loss", action="store_true")
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--only", default="", help="comma-separated op names (default: all)")
    args = ap.parse_args()
    assert DEV == "cuda" or args.smoke, "glue_gpu.py needs a GPU (or --smoke under TRITON_INTERPRET=1)"
    import triton

    S, H, N = (256, 96, 4) if args.smoke else (32768, 2048, 4)
    res: dict = {"gpu": torch.cuda.get_device_name() if DEV == "cuda" else "cpu", "torch": torch.__version__,
                 "triton": triton.__version__, "ops": [], "loss": []}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    for k, dtype in enumerate(getattr(torch, d) for d in args.dtypes.split(",")):
        for name, shape, ref, fast, inputs, extra in op_cases(S, H, N, dtype, args.smoke):
            if (name == "hc_weights" and k > 0) or (args.only and name not in args.only.split(",")):
                continue  # mix is fp32 whatever the model dtype: measured once
            r = bench_op(name, shape, ref, fast, inputs, dtype, extra)
            res["ops"].append(r)
            worst = max(e["fused_vs_ref"]["rel"] for e in r["errors"].values())
            extras = "  ".join(f"{k} {r[k]['fwd_bwd_ms']:.3f}" for k in extra)
            print(f"{name:<12} {r['dtype']:<9} {shape:<44} ref {r['ref']['fwd_bwd_ms']:8.3f} ms  fused "
                  f"{r['fused']['fwd_bwd_ms']:7.3f} ms  x{r['speedup_fwd_bwd']:5.1f}  held {r['ref']['held_MiB']:7.0f}"
                  f" -> {r['fused']['held_MiB']:6.0f} MiB  worst rel {worst:.1e}  {extras}", flush=True)
            out.write_text(json.dumps(res, indent=1))
            del inputs
            gc.collect()
            torch.cuda.empty_cache()
    if not args.no_loss and DEV == "cuda":
        n, v, h = (512, 1000, 64) if args.smoke else (32768, 154880, 4096)
        res["loss_shape"] = {"tokens": n, "vocab": v, "hidden": h, "dtype": "bfloat16"}
        res["loss"] = bench_loss(n, v, h, (4096, 8192) if not args.smoke else (128,))
        out.write_text(json.dumps(res, indent=1))
    res["wall_s"] = time.perf_counter() - t_start
    out.write_text(json.dumps(res, indent=1))
    print(f"wrote {out} ({res['wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
