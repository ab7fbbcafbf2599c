"""Every launch configuration of the fused sparse MLA kernels, timed at glm5-flash-1gpu's DSA shapes (GPU).

    python benchmarks/kernels/sparse_mla_configs.py --out $OUT/sparse_mla_configs.json     # H200: about 3 minutes
    python benchmarks/kernels/sparse_mla_configs.py --defaults-only --out $OUT/sparse_mla_pool.json  # the pool pass
    python benchmarks/kernels/sparse_mla_configs.py --defaults-only --pool-blocks 0,512,1024,2048 --out ...  # its order
    python benchmarks/kernels/sparse_mla_configs.py --defaults-only --no-pool-grid --saved 32:4:2,64:4:2 --out ...

The kernels (``ops/sparse_mla/kernels.py``) run a default configuration that was chosen by registers
and shared memory, never by time. This script times each configuration of a grid (slots per loop step BW,
warps, pipeline stages; BH = 16 heads per program, glm5-flash-1gpu's Hh) on the kernels alone, bf16, W = 2063
slots of causal 16-token pools drawn uniformly (``causal_pool_selection``), at three shapes:

- Q = S = 8K and 32K (one DSA layer of an 8K and a 32K step);
- the last 32K queries of S = 256K keys (one 32K sequence segment of a 256K step).

After the grid, the backward with the latent gradient summed key-major per pool is timed beside the atomics'
with the default slot-pass configuration and compared with their result: ``dc="pool"`` (the scores computed
again) at each of its launch configurations (``--no-pool-grid``: the default alone) and query blocks
(``--pool-blocks``), and ``dc="saved"`` (from the slot pass's saved p and ds, the default) at
the configurations ``--saved`` names.

Each configuration's outputs are compared with the default's on the same inputs (max abs difference over
max abs of the default: ``o_lat``, ``lse2``, ``dq_abs``, ``dc``). They compute the same sums in another order,
so a configuration that differs by more than the order can explain is wrong, not fast. Timings are CUDA-event
medians of warm calls (``sparse_mla_gpu._median_ms``). A
configuration over the GPU's registers or shared memory is recorded as such. Results go to the JSON as each
one completes.
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
import traceback
from pathlib import Path

import torch
from sparse_mla_gpu import _median_ms  # this directory's: CUDA-event median of warm calls

SCALE = 256**-0.5
SHAPES = ((8192, 8192), (32768, 32768), (32768, 262144))  # (Q, S): queries at the end of S keys
HH, RANK = 16, 512  # glm5-flash-1gpu's heads and kv_lora_rank


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    fin = torch.isfinite(b)
    d = (a.double() - b.double())[fin].abs().max().item()
    return d / max(b.double()[fin].abs().max().item(), 1e-300)


def run_shape(K, row: dict, dev, dt, R: int, pools: int, fwd_space, bwd_space, save, pool_space=(),
              pool_blocks=(), saved_space=()) -> None:
    """Time every config of both spaces at ``row``'s (Q, S), latent rank ``R``; each entry into ``row`` as it
    completes."""
    from triton.compiler.errors import CompilationError
    from triton.runtime.errors import OutOfResources

    from megaseq.ops.sparse_mla.fused import causal_pool_selection

    Q, S = row["Q"], row["S"]
    gen = torch.Generator(device=dev).manual_seed(Q + S)
    q = (torch.randn(HH, Q, R, device=dev, generator=gen) * R**-0.25).to(dt)
    c = (torch.randn(1, S, R, device=dev, generator=gen) * R**-0.25).to(dt)
    do = torch.randn(HH, Q, R, device=dev, generator=gen).to(dt)
    idx = causal_pool_selection(1, Q, S, pools=pools, generator=gen, device=dev)
    row.update({"W": idx.shape[-1], "fwd": [], "bwd": []})
    o_ref, lse_ref = K.forward(q, c, idx, SCALE, config=K.default_config("fwd", HH, R, dt))
    dq_ref, dc_ref = K.backward(q, do, o_ref, lse_ref, c, idx, SCALE, config=K.default_config("bwd", HH, R, dt))
    for kind, space in (("fwd", fwd_space), ("bwd", bwd_space)):
        for cfg in space:
            entry: dict = {"config": str(cfg), "default": cfg == K.default_config(kind, HH, R, dt)}
            try:
                if kind == "fwd":
                    o, lse = K.forward(q, c, idx, SCALE, config=cfg)
                    entry["rel_diff"] = {"o_lat": _rel(o, o_ref), "lse2": _rel(lse, lse_ref)}
                    entry["ms"] = _median_ms(lambda cfg=cfg: K.forward(q, c, idx, SCALE, config=cfg), dev)
                else:
                    dq, dc = K.backward(q, do, o_ref, lse_ref, c, idx, SCALE, config=cfg)
                    entry["rel_diff"] = {"dq_abs": _rel(dq, dq_ref), "dc": _rel(dc, dc_ref)}
                    entry["ms"] = _median_ms(
                        lambda cfg=cfg: K.backward(q, do, o_ref, lse_ref, c, idx, SCALE, config=cfg), dev)
            except (OutOfResources, CompilationError) as e:
                entry["error"] = f"{type(e).__name__}: {str(e)[:200]}"
            except Exception as e:  # noqa: BLE001  (record and go on)
                entry["error"] = f"{type(e).__name__}: {e}"
                entry["trace"] = traceback.format_exc(limit=3)
            row[kind].append(entry)
            save()
            ms = f"{entry['ms']:8.2f} ms" if "ms" in entry else entry["error"][:60]
            diff = max(entry.get("rel_diff", {0: 0}).values())
            print(f"Q={Q} S={S} {kind} {cfg} {'(default)' if entry['default'] else ''}: {ms} "
                  f"rel diff {diff:.1e}", flush=True)
    # the latent gradient summed key-major per selected pool with the default config, against the atomics' result
    # and time (the whole backward: both passes and the pool sort)
    row["atomic_ms"] = _median_ms(lambda: K.backward(q, do, o_ref, lse_ref, c, idx, SCALE, dc="atomic"), dev)
    # the pool pass that computes the scores again (``dc="pool"``) at each (rows, warps, stages) and query block, then
    # the one from the slot pass's saved p and ds (``dc="saved"``) at each (rows, warps, stages)
    row["bwd_pool"], row["bwd_saved"] = [], []
    default_block = K.POOL_QUERY_BLOCK
    runs = ([("pool", default_block, pc) for pc in pool_space] + [("pool", b, K.POOL_CONFIG) for b in pool_blocks]
            + [("saved", default_block, pc) for pc in saved_space])
    for mode, block, pc in runs:
        K.POOL_QUERY_BLOCK = block
        entry = {"config": str(K.default_config("bwd", HH, R, dt)), "dc": mode, "pool_config": list(pc)}
        if mode == "pool":
            entry.update(query_block="picked" if block is None else block,
                         default=pc == K.POOL_CONFIG and block == default_block)
        else:
            entry["default"] = pc == K.POOL_SAVED_CONFIG
        try:
            dq, dc = K.backward(q, do, o_ref, lse_ref, c, idx, SCALE, dc=mode, pool_config=pc)
            entry["rel_diff"] = {"dq_abs": _rel(dq, dq_ref), "dc": _rel(dc, dc_ref)}
            entry["ms"] = _median_ms(
                lambda m=mode, pc=pc: K.backward(q, do, o_ref, lse_ref, c, idx, SCALE, dc=m, pool_config=pc), dev)
        except Exception as e:  # noqa: BLE001  (record and go on: over the registers or shared memory, say)
            entry["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        row[f"bwd_{mode}"].append(entry)
        save()
        what = f"Q={Q} S={S} bwd dc={mode} {pc}" + (f" query block {block}" if mode == "pool" else "")
        if "ms" in entry:
            print(f"{what}: {entry['ms']:.2f} ms (atomic {row['atomic_ms']:.2f}), rel diff dq_abs "
                  f"{entry['rel_diff']['dq_abs']:.1e} dc {entry['rel_diff']['dc']:.1e}", flush=True)
        else:
            print(f"{what}: {entry['error'][:200]}", flush=True)
    K.POOL_QUERY_BLOCK = default_block


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--shapes", default=None, help="Q:S,... (default: 8K, 32K and a 32K segment of 256K)")
    ap.add_argument("--smoke", action="store_true", help="CPU, Triton's interpreter, tiny shapes: the script runs")
    ap.add_argument("--defaults-only", action="store_true",
                    help="only the default configs (and the pool pass beside the atomics)")
    ap.add_argument("--pool-blocks", default="",
                    help="query blocks of the pool pass's program order to time too (POOL_QUERY_BLOCK, beside the "
                         "picked one; 0: one block, the programs in pool order), e.g. 0,512,1024,2048")
    ap.add_argument("--no-pool-grid", action="store_true",
                    help="the pool pass (dc=pool) in its default (rows, warps, stages) only, not the grid of 12")
    ap.add_argument("--saved", default="",
                    help="(rows:warps:stages,...) of the pool pass from the saved p and ds (dc=saved) to time, e.g. "
                         "32:4:2,64:4:2; 'default': POOL_SAVED_CONFIG alone")
    args = ap.parse_args()
    R = RANK
    if args.smoke:
        import os

        os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton
        R = 32
    from megaseq.ops.sparse_mla import kernels as K

    shapes = SHAPES if not args.shapes else tuple(tuple(int(x) for x in s.split(":")) for s in args.shapes.split(","))
    dev, dt, pools = torch.device("cuda"), torch.bfloat16, 128
    fwd_space = [K.Config(16, bw, nw, st) for bw, nw, st in itertools.product((32, 64, 128), (4, 8), (1, 2, 3))]
    bwd_space = [K.Config(16, bw, nw, st) for bw, nw, st in itertools.product((16, 32, 64), (4, 8), (1, 2))]
    pool_space = list(itertools.product((16, 32, 64), (4, 8), (1, 2)))
    if args.defaults_only:
        fwd_space, bwd_space = [K.default_config("fwd", HH, R, dt)], [K.default_config("bwd", HH, R, dt)]
    if args.no_pool_grid:
        pool_space = [K.POOL_CONFIG]
    if args.smoke:
        from megaseq.ops.sparse_mla import fused as triton_sparse_mla

        triton_sparse_mla.CPU_INTERPRETER = True
        dev, dt, pools, shapes = torch.device("cpu"), torch.float32, 4, ((64, 96),)
        fwd_space, bwd_space, pool_space = fwd_space[:2], bwd_space[:2], [K.POOL_CONFIG, (32, 4, 1)]
    import triton

    res: dict = {"gpu": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu (interpreter)",
                 "torch": torch.__version__, "triton": triton.__version__,
                 "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "Hh": HH, "R": R,
                 "default": {k: str(K.default_config(k, HH, R, dt)) for k in ("fwd", "bwd")}, "shapes": []}
    out = Path(args.out)
    save = lambda: out.write_text(json.dumps(res, indent=1))  # noqa: E731
    for Q, S in shapes:
        row: dict = {"Q": Q, "S": S}
        res["shapes"].append(row)
        saved_space = ([K.POOL_SAVED_CONFIG] if args.saved == "default" else
                       [tuple(int(x) for x in c.split(":")) for c in args.saved.split(",") if c])
        run_shape(K, row, dev, dt, R, pools, fwd_space, bwd_space, save, pool_space,
                  [int(b) for b in args.pool_blocks.split(",") if b], saved_space)
        torch.cuda.empty_cache()
    for row in res["shapes"]:
        for kind in ("fwd", "bwd"):
            ok = [e for e in row[kind] if "ms" in e]
            if ok:
                best = min(ok, key=lambda e: e["ms"])
                dflt = next((e for e in ok if e["default"]), None)
                print(f"Q={row['Q']} S={row['S']} {kind}: best {best['config']} {best['ms']:.2f} ms"
                      + (f", default {dflt['ms']:.2f} ms" if dflt else ""))
    save()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
