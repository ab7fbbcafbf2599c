"""GPU smoke test of the fast GLM-5.3-Flash path on one H200: kernels against their references, the
dispatcher's choices, and one decoder layer of each kind at long context.

    python benchmarks/kernels/gpu_smoke.py --out $OUT/gpu_smoke.json            # < 6 minutes on an H200
    python benchmarks/kernels/gpu_smoke.py --quick --out $OUT/gpu_smoke.json    # layers at 32K and 128K only
    python benchmarks/kernels/gpu_smoke.py --smoke --out /tmp/gpu_smoke.json    # CPU, tiny shapes

Sections:
  kda         op kda: fla ``chunk_kda`` vs the torch reference run in float64 on the same inputs
              (bf16 and fp32 inputs, two documents): max abs / relative error of the output and of the
              gradients of q, k, v, g, beta; the fla causal conv likewise
  sparse_mla  op sparse_attention: ``absorbed`` vs ``torch_masked`` (float64 reference), fp32 and bf16
              autocast, glm5-flash-1gpu head shapes; fwd+bwd time of each in bf16
  dispatch    the per-layer table of which implementation ran in a glm5-flash-1gpu forward (bf16 autocast)
  layers      forward + backward of one glm5-flash-1gpu decoder layer of each kind (KDA + MoE, DSA + MoE)
              with ``token_tile`` and bf16 autocast at 32K, 128K, 512K tokens: peak memory
              (``max_memory_allocated``), the input's share of it, and time; an out-of-memory length is
              recorded and the longer ones of that kind are skipped
Writes one JSON (``--out``, rewritten after every section) and prints a compact table.

Time: every section runs under an alarm (``SECTION_SECONDS``) and records ``timeout`` instead of hanging
the run. fla's kernels are Triton-autotuned over dozens of configs each on their first call, minutes on
a fresh machine; ``--autotune one`` (the default) keeps one conservative config per kernel (fewest
stages, smallest blocks), so the first call compiles each kernel once: fla's timings are then a lower
bound. ``--autotune full`` tunes as fla does; set ``TRITON_CACHE_DIR`` to a folder that survives the
machine to pay that once.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import platform
import signal
import time
from pathlib import Path
from typing import Any

import torch

from megaseq.memory.tiling import tile_layer
from megaseq.models.build import build_model
from megaseq.models.common.context import SeqContext
from megaseq.models.glm5.model import Glm5DecoderLayer, Glm5Model
from megaseq.models.glm5.spec import glm5_flash_1gpu, glm5_flash_tiny
from megaseq.ops import dispatch
from megaseq.ops.kda import fla as fla_kda
from megaseq.ops.kda.reference import causal_conv_reference, kda_reference
from megaseq.ops.sparse_mla import absorbed as sparse_mla
from megaseq.ops.sparse_mla.reference import sparse_mla_reference

GIB = 2**30
K = 1024
FULL = dict(kda=(4096, 4, 128), sparse=(4096, 512), dispatch_tokens=8192, lengths=(32 * K, 128 * K, 512 * K),
            warmup=4096, tile=16384)
QUICK = dict(FULL, lengths=(32 * K, 128 * K))
SECTION_SECONDS = {"sparse_mla": 40, "kda": 110, "dispatch": 50, "layers": 150}  # about 6 minutes in all
SMOKE = dict(kda=(200, 2, 16), sparse=(97, 24), dispatch_tokens=64, lengths=(96, 160), warmup=32, tile=64)


def _errs(a: torch.Tensor, b: torch.Tensor) -> dict[str, float]:
    a, b = a.double(), b.double()
    diff = (a - b).abs().max().item()
    return {"max_abs": diff, "rel": diff / max(b.abs().max().item(), 1e-300)}


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


# ---- kda ------------------------------------------------------------------------------------------------
def bench_kda(out: dict[str, Any], dev: torch.device, cfg: dict) -> None:
    S, H, D = cfg["kda"]
    gen = torch.Generator().manual_seed(0)
    base = [torch.randn(1, S, H, D, generator=gen) for _ in range(3)]
    base += [-5.0 * torch.sigmoid(torch.randn(1, S, H, D, generator=gen)), torch.rand(1, S, H, generator=gen)]
    cu = torch.tensor([0, S // 3, S], device=dev)
    out["shape"] = {"S": S, "heads": H, "head_dim": D, "documents": 2}
    for dtype in (torch.bfloat16, torch.float32):
        inputs = [t.to(dev, dtype if i != 3 else torch.float32).requires_grad_() for i, t in enumerate(base)]
        why = fla_kda.kda_fla_supports(*inputs, cu)
        if why is not None:
            out[str(dtype)] = {"skipped": why}
            continue
        ref_in = [t.detach().double().requires_grad_() for t in inputs]
        ref = kda_reference(*ref_in, cu, chunk_size=64)
        fast = fla_kda.kda_fla(*inputs, cu)
        w = torch.randn(ref.shape, generator=gen).to(dev)
        g_ref = torch.autograd.grad((ref * w.double()).sum(), ref_in)
        g_fast = torch.autograd.grad((fast.float() * w).sum(), inputs)
        res = {"out": _errs(fast, ref)}
        res.update({f"grad_{n}": _errs(a, b) for n, a, b in zip(("q", "k", "v", "g", "beta"), g_fast, g_ref)})
        out[str(dtype)] = res
    x = torch.randn(1, S, 3 * H * D, generator=gen).to(dev)
    wt = torch.randn(3 * H * D, 4, generator=gen).to(dev)
    why = fla_kda.conv_fla_supports(x, wt, "silu", cu)
    out["causal_conv_fp32"] = {"skipped": why} if why else {
        "out": _errs(fla_kda.conv_fla(x, wt, "silu", cu), causal_conv_reference(x.double(), wt.double(), "silu", cu))}


# ---- sparse MLA -----------------------------------------------------------------------------------------
def _selection(S: int, width: int, dev: torch.device, gen: torch.Generator) -> torch.Tensor:
    """Random causal selection ``[1, S, width]`` of distinct keys, -1 where a query sees fewer."""
    r = torch.rand(S, S, generator=gen).to(dev)
    r = r.masked_fill(torch.ones(S, S, dtype=torch.bool, device=dev).triu(1), float("-inf"))
    top = r.topk(width, dim=-1)
    return top.indices.masked_fill(top.values == float("-inf"), -1).to(torch.int32)[None]


def _fwd_bwd_time(fn, args, dev) -> float:
    _sync(dev)
    t0 = time.perf_counter()
    out = fn(*args)
    out.float().square().sum().backward()
    _sync(dev)
    return time.perf_counter() - t0


def bench_sparse(out: dict[str, Any], dev: torch.device, cfg: dict, spec) -> None:
    S, width = cfg["sparse"]
    Hh, Dn, Dv, R = spec.num_attention_heads, spec.qk_nope_head_dim, spec.v_head_dim, spec.kv_lora_rank
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(1, S, Hh, Dn, generator=gen).to(dev)
    c = torch.randn(1, S, R, generator=gen).to(dev)
    w = (torch.randn(Hh * (Dn + Dv), R, generator=gen) * R**-0.5).to(dev)
    idx = _selection(S, width, dev, gen)
    scale = Dn**-0.5
    ref_in = [t.double().requires_grad_() for t in (q, c, w)]
    ref = sparse_mla_reference(*ref_in, idx, scale)
    g_ref = torch.autograd.grad(ref.square().sum(), ref_in)
    out["shape"] = {"S": S, "W": width, "heads": Hh, "nope": Dn, "v": Dv, "kv_lora": R}
    autocast = (False, True) if dev.type == "cuda" else (False,)
    for ac in autocast:
        for name, fn in (("absorbed", sparse_mla.sparse_mla), ("torch_masked", sparse_mla_reference)):
            x = [t.detach().float().requires_grad_() for t in (q, c, w)]
            if dev.type == "cpu":
                x = [t.detach().double().requires_grad_() for t in x]
            with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=ac):
                why = sparse_mla.sparse_mla_supports(*x, idx, scale) if name == "absorbed" else None
                if why:
                    out[f"{name}_{'bf16' if ac else 'fp32'}"] = {"skipped": why}
                    continue
                o = fn(*x, idx, scale)
            g = torch.autograd.grad(o.to(x[0].dtype).square().sum(), x)
            res = {"out": _errs(o, ref), **{f"grad_{n}": _errs(a, b) for n, a, b in zip("qcw", g, g_ref)}}
            if ac or dev.type == "cpu":
                with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=ac):
                    res["fwd_bwd_seconds"] = _fwd_bwd_time(fn, (*x, idx, scale), dev)
            out[f"{name}_{'bf16' if ac else 'fp32'}"] = res


# ---- dispatcher table -----------------------------------------------------------------------------------
def bench_dispatch(out: dict[str, Any], dev: torch.device, cfg: dict, spec) -> None:
    model = build_model(spec, dtype=torch.float32, device=dev, seed=0)
    ids = torch.randint(1, spec.vocab_size, (1, cfg["dispatch_tokens"]), device=dev)
    dispatch.reset_records()
    with torch.no_grad(), torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
        model(ids)
    out["tokens"] = cfg["dispatch_tokens"]
    out["records"] = [{"layer": layer, "op": r.op, "impl": r.impl, "why": r.reason} for layer, r in dispatch.records()]
    out["table"] = dispatch.format_table()


# ---- one layer at long context --------------------------------------------------------------------------
def _layer(spec, idx: int, dev: torch.device, tile: int) -> Glm5DecoderLayer:
    torch.manual_seed(idx)
    with torch.device(dev):
        layer = Glm5DecoderLayer(spec, idx)
    Glm5Model.reset_parameters(layer)  # HF init, applied to this layer's modules only
    tile_layer(layer, tile)
    return layer


def _layer_step(layer, S: int, spec, dev: torch.device) -> dict[str, Any]:
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)
    start = torch.cuda.memory_allocated(dev) if dev.type == "cuda" else 0
    h = out = None
    try:
        h = torch.randn(1, S, spec.hc_mult, spec.hidden_size, device=dev).requires_grad_()
        _sync(dev)
        t0 = time.perf_counter()
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
            out = layer(h, SeqContext())
        _sync(dev)
        t1 = time.perf_counter()
        out.sum().backward()
        _sync(dev)
        t2 = time.perf_counter()
    except torch.OutOfMemoryError as e:
        return {"oom": str(e).splitlines()[0][:200]}
    finally:
        del h, out
        layer.zero_grad(set_to_none=True)
    res: dict[str, Any] = {"fwd_seconds": t1 - t0, "bwd_seconds": t2 - t1, "tokens_per_second": S / (t2 - t0)}
    if dev.type == "cuda":
        res["peak_bytes"] = torch.cuda.max_memory_allocated(dev)
        res["params_bytes"] = start
        res["input_bytes"] = S * spec.hc_mult * spec.hidden_size * 4
    return res


def bench_layers(out: dict[str, Any], dev: torch.device, cfg: dict, spec) -> None:
    out.update(token_tile=cfg["tile"], autocast="bf16" if dev.type == "cuda" else None)
    kinds = {"kda_moe": next(i for i, t in enumerate(spec.layer_types) if t == "kda" and spec.mlp_types[i] == "moe"),
             "dsa_moe": next(i for i, t in enumerate(spec.layer_types) if t == "dsa" and spec.mlp_types[i] == "moe")}
    for kind, idx in kinds.items():
        layer = _layer(spec, idx, dev, cfg["tile"])
        _layer_step(layer, cfg["warmup"], spec, dev)  # Triton autotuning and compilation, not timed
        out[kind] = {"layer_index": idx}
        for S in cfg["lengths"]:
            res = _layer_step(layer, S, spec, dev)
            out[kind][str(S)] = res
            print(f"  {kind:8} {S:>8}: {_row(res)}", flush=True)
            if "oom" in res:
                break
        del layer


def _row(res: dict[str, Any]) -> str:
    if "oom" in res:
        return "OOM"
    mem = f"peak {res['peak_bytes'] / GIB:6.1f} GiB  " if "peak_bytes" in res else ""
    return (f"{mem}fwd {res['fwd_seconds']:7.3f} s  bwd {res['bwd_seconds']:7.3f} s  "
            f"{res['tokens_per_second']:9.0f} tok/s")


# ---- main -----------------------------------------------------------------------------------------------
def _env(dev: torch.device) -> dict[str, Any]:
    env = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "torch": torch.__version__,
           "python": platform.python_version(), "device": str(dev)}
    if dev.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(dev)
        for mod in ("triton", "fla", "transformers"):
            try:
                env[mod] = __import__(mod).__version__
            except Exception as e:  # noqa: BLE001  (a missing package is a finding, not an error)
                env[mod] = f"unavailable: {type(e).__name__}"
    return env


class SectionTimeout(Exception):
    pass


def _on_alarm(signum, frame):
    raise SectionTimeout


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="JSON file to write")
    ap.add_argument("--quick", action="store_true", help="layers at 32K and 128K only")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny shapes (checks that it runs)")
    ap.add_argument("--autotune", choices=("one", "full"), default="one", help="Triton autotuning of fla kernels")
    ap.add_argument("--only", default="sparse_mla,kda,dispatch,layers", help="comma-separated sections")
    args = ap.parse_args()
    dev = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    cfg = SMOKE if args.smoke else QUICK if args.quick else FULL
    spec = glm5_flash_tiny() if args.smoke else glm5_flash_1gpu()
    if dev.type == "cuda" and args.autotune == "one" and fla_kda.fla_available() is None:
        fla_kda.limit_autotune()
    result: dict[str, Any] = {"env": _env(dev), "autotune": args.autotune,
                              "mode": "smoke" if args.smoke else "quick" if args.quick else "full"}
    sections = {"kda": lambda o: bench_kda(o, dev, cfg), "sparse_mla": lambda o: bench_sparse(o, dev, cfg, spec),
                "dispatch": lambda o: bench_dispatch(o, dev, cfg, spec),
                "layers": lambda o: bench_layers(o, dev, cfg, spec)}
    signal.signal(signal.SIGALRM, _on_alarm)
    t_all = time.perf_counter()
    for name in args.only.split(","):
        t0 = time.perf_counter()
        print(f"[{name}]", flush=True)
        result[name] = out = {}
        signal.alarm(SECTION_SECONDS[name] * (10 if args.smoke else 1))
        try:
            sections[name](out)
        except SectionTimeout:
            out["timeout"] = f"stopped after {SECTION_SECONDS[name]} s (what finished is kept)"
        except Exception as e:  # noqa: BLE001  (record and go on: the other sections still inform)
            out["error"] = f"{type(e).__name__}: {e}"[:2000]
        finally:
            signal.alarm(0)
        out["section_seconds"] = time.perf_counter() - t0
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1, default=str))
        _print_section(name, out)
    result["total_seconds"] = time.perf_counter() - t_all
    Path(args.out).write_text(json.dumps(result, indent=1, default=str))
    print(f"total {result['total_seconds']:.1f} s -> {args.out}")


def _print_section(name: str, res: dict[str, Any]) -> None:
    for bad in ("error", "timeout"):
        if bad in res:
            print(f"  {bad.upper()} {res[bad][:500]}")
    if name == "dispatch" and "table" in res:
        print(res["table"])
    elif name in ("kda", "sparse_mla"):
        for key, v in res.items():
            if isinstance(v, dict) and key != "shape":
                errs = {k: f"{e['rel']:.1e}" for k, e in v.items() if isinstance(e, dict)}
                extra = f"  {v['fwd_bwd_seconds']:.3f} s" if "fwd_bwd_seconds" in v else v.get("skipped", "")
                print(f"  {key:22} rel err {errs} {extra}")
    print(f"  ({res['section_seconds']:.1f} s)", flush=True)


if __name__ == "__main__":
    main()
