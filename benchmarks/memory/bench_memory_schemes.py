"""Measure each exact memory scheme against its plain version, in one process, on one GPU.

    python benchmarks/memory/bench_memory_schemes.py --out benchmarks/results/memory/memory_schemes.json
    python benchmarks/memory/bench_memory_schemes.py --smoke --out /tmp/smoke.json     # CPU, tiny shapes

Sections (each bounded in time; the whole run is meant to finish in under 8 minutes on an H200):
  vocab_loss     32K tokens x H 4096 x V 154,880 bf16: plain vs chunked (vs Liger's fused linear CE if
                 importable): peak extra memory (max_memory_allocated delta) and fwd+bwd time; predicted
                 bytes from ``vocab_loss_bytes``
  chunked_long   the chunked loss at 128K and 1M tokens against its stated bound
  tiled_moe      glm5-flash-1gpu MoE layer at 128K tokens, tiled vs untiled, with three routings: random
                 hidden states, the embeddings of a real E. coli window (``--genome``; DNA tokens through the
                 model's random-init embedding: few distinct rows, so routing is as uneven as real data gets)
                 and a forced worst case (every token to expert 0)
  indexer        the DSA indexer's chunked scoring (``memory/indexer_scoring.py``, glm5-flash-1gpu indexer:
                 32 heads x 128, 16-token pools, top 128 pools) at 128K, 512K and 1M tokens: peak memory and
                 time; indices identical to one-chunk scoring at 32K and to a 8x larger chunk at 128K
  sco            a stack of mHC-shaped layers under recompute: boundaries on the GPU vs SCO offload
                 (GPU peak drop vs offloaded bytes, step time, pinned bytes)
  offload_adam   OffloadStreamAdamW on ~2B parameters vs the same without overlap and vs
                 SequentialOffloadAdamW (CPU AdamW): step time and GPU staging memory
Writes one JSON (``--out``) and a markdown table beside it (same name, ``.md``).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from megaseq.memory.offload import BoundaryOffloader, checkpoint_layers
from megaseq.memory.offload_adam import OffloadStreamAdamW, SequentialOffloadAdamW
from megaseq.memory.tiling import enable_tiling
from megaseq.memory.vocab_loss import chunked_linear_cross_entropy
from megaseq.models.common.mlp import MLP
from megaseq.models.common.moe import FP32_PARAM_SUFFIXES, MoE
from megaseq.models.common.norm import RMSNorm
from megaseq.models.glm5.spec import glm5_flash_1gpu, glm5_flash_tiny
from megaseq.ops.vocab_loss.reference import plain_linear_cross_entropy
from megaseq.plan.activations import layer_input_bytes as boundary_bytes
from megaseq.plan.activations import sco_plan, vocab_loss_bytes
from megaseq.plan.components import offload_adam_bytes

GIB = 2**30
FULL = dict(vocab=(32768, 4096, 154880, 8192), long=(131072, 1048576), moe_tokens=131072, moe_tile=16384,
            sco=(8, 65536, 2048, 12288), adam=(80, 4096, 6144, 100_000_000),
            indexer=(32768, 131072, (131072, 524288, 1048576)))
SMOKE = dict(vocab=(512, 64, 1000, 128), long=(1024, 2048), moe_tokens=256, moe_tile=64,
             sco=(3, 128, 32, 64), adam=(8, 64, 96, 10_000), indexer=(256, 512, (512, 1024)))


# ---- measuring -------------------------------------------------------------------------------------
class Meter:
    def __init__(self, device: torch.device) -> None:
        self.device, self.cuda = device, device.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def run(self, fn: Callable[[], Any], repeat: int = 1) -> dict[str, Any]:
        """Peak bytes allocated above what was live before (CUDA only) and mean seconds per call."""
        gc.collect()
        self.sync()
        if self.cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)
            base = torch.cuda.memory_allocated(self.device)
        t0 = time.perf_counter()
        try:
            for _ in range(repeat):
                fn()
            self.sync()
        except torch.OutOfMemoryError as e:
            return {"oom": str(e).splitlines()[0]}
        out: dict[str, Any] = {"seconds": (time.perf_counter() - t0) / repeat}
        if self.cuda:
            out["peak_extra_bytes"] = torch.cuda.max_memory_allocated(self.device) - base
        return out


def _gib(x: Any) -> str:
    return f"{x / GIB:.2f} GiB" if isinstance(x, (int, float)) else "-"


def _sec(x: Any) -> str:
    return f"{x:.3f} s" if isinstance(x, (int, float)) else "-"


# ---- vocabulary loss -------------------------------------------------------------------------------
def _loss_inputs(N: int, H: int, V: int, device, dtype):
    g = torch.Generator(device=device).manual_seed(0)
    hidden = (torch.randn(N, H, device=device, dtype=dtype, generator=g) * 0.5).requires_grad_(True)
    weight = (torch.randn(V, H, device=device, dtype=dtype, generator=g) * 0.02).requires_grad_(True)
    labels = torch.randint(0, V, (N,), device=device, generator=g)
    return hidden, weight, labels


def _loss_step(fn: Callable, hidden, weight, labels) -> Callable[[], None]:
    def step() -> None:
        fn(hidden, weight, labels).backward()
        hidden.grad = weight.grad = None
    return step


def bench_vocab(m: Meter, cfg: dict, dtype) -> dict[str, Any]:
    N, H, V, C = cfg["vocab"]
    hidden, weight, labels = _loss_inputs(N, H, V, m.device, dtype)
    d = hidden.element_size()
    chunked = lambda h, w, y: chunked_linear_cross_entropy(h, w, y, chunk_tokens=C)  # noqa: E731
    res = {"shape": {"N": N, "H": H, "V": V, "chunk_tokens": C, "dtype": str(dtype)},
           "predicted": vocab_loss_bytes(N, H, V, C, d)}
    small = lambda h, w, y: chunked_linear_cross_entropy(h, w, y, chunk_tokens=C // 4)  # noqa: E731
    methods = {"chunked": chunked, "chunked_quarter_chunk": small, "plain": plain_linear_cross_entropy}
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
    except ImportError as e:
        res["liger"] = {"skipped": f"not importable: {e}"}
    else:
        if hidden.is_cuda:
            liger = LigerFusedLinearCrossEntropyLoss()
            methods["liger"] = lambda h, w, y: liger(w, h, y)
        else:  # a Triton kernel: off a GPU only Triton's interpreter runs it, which its loss does not support
            res["liger"] = {"skipped": f"Liger's kernel runs on a GPU; the tensors are on {hidden.device}"}
    for name, fn in methods.items():
        m.run(_loss_step(fn, hidden, weight, labels))  # warm-up (kernels, autotuning, allocator)
        res[name] = m.run(_loss_step(fn, hidden, weight, labels), repeat=2)
    res["predicted_quarter_chunk"] = vocab_loss_bytes(N, H, V, C // 4, d)["chunked"]
    return res


def bench_chunked_long(m: Meter, cfg: dict, dtype) -> dict[str, Any]:
    _, H, V, C = cfg["vocab"]
    res = {}
    for N in cfg["long"]:
        hidden, weight, labels = _loss_inputs(N, H, V, m.device, dtype)
        chunked = lambda h, w, y: chunked_linear_cross_entropy(h, w, y, chunk_tokens=C)  # noqa: E731
        got = m.run(_loss_step(chunked, hidden, weight, labels))
        got["predicted_bytes"] = vocab_loss_bytes(N, H, V, C, hidden.element_size())["chunked"]
        res[str(N)] = got
        del hidden, weight, labels
    return res


# ---- tiled MoE -------------------------------------------------------------------------------------
def _moe(spec, device, dtype) -> MoE:
    moe = MoE(spec).to(device=device, dtype=dtype)
    for name, t in list(moe.named_parameters()) + list(moe.named_buffers()):
        if ("mlp." + name).endswith(FP32_PARAM_SUFFIXES):  # HF keeps the router in fp32
            t.data = t.data.float()
    return moe


def _moe_step(moe: MoE, x: torch.Tensor, dy: torch.Tensor) -> Callable[[], None]:
    def step() -> None:
        moe(x).backward(dy)
        x.grad = None
        moe.zero_grad(set_to_none=True)
    return step


def _genome_embeddings(spec, N: int, device, dtype, genome: str | None) -> tuple[torch.Tensor, str] | None:
    """``[1, N, H]``: a real DNA window of ``N`` bases through a HF-initialised embedding (std 0.02)."""
    if not genome:
        return None
    from megaseq.data.fasta import read_fasta

    recs = read_fasta(genome)
    rec = max(recs, key=len)
    ids = torch.from_numpy(rec.tokens[:N].astype("int64"))
    ids = ids.repeat(-(-N // ids.numel()))[:N].to(device)
    g = torch.Generator(device=device).manual_seed(0)
    emb = torch.randn(spec.vocab_size, spec.hidden_size, device=device, dtype=dtype, generator=g) * 0.02
    return emb[ids][None].contiguous(), f"{Path(genome).name}:{rec.id}[:{N}]"


def bench_tiled_moe(m: Meter, cfg: dict, dtype, smoke: bool, genome: str | None = None) -> dict[str, Any]:
    spec = glm5_flash_tiny() if smoke else glm5_flash_1gpu()
    N, T = cfg["moe_tokens"], cfg["moe_tile"]
    g = torch.Generator(device=m.device).manual_seed(0)
    x_rand = torch.randn(1, N, spec.hidden_size, device=m.device, dtype=dtype, generator=g)
    dy = torch.randn(1, N, spec.hidden_size, device=m.device, dtype=dtype, generator=g)
    res: dict[str, Any] = {"shape": {"tokens": N, "tile_tokens": T, "hidden": spec.hidden_size,
                                     "experts": spec.num_experts, "top_k": spec.num_experts_per_tok}}
    inputs = {"random": x_rand, "skewed": x_rand}
    real = _genome_embeddings(spec, N, m.device, dtype, genome)
    if real is not None:
        inputs["genome"], res["genome_window"] = real
    for routing, x0 in inputs.items():
        x = x0.detach().clone().requires_grad_(True)
        moe = _moe(spec, m.device, dtype)
        if routing == "skewed":  # expert 0 takes every token (the real-data imbalance, at its worst)
            moe.gate.e_score_correction_bias[0] = 1e3
        step = _moe_step(moe, x, dy)
        m.run(step)  # warm-up
        row = {"untiled": m.run(step)}
        counts = moe.last_tokens_per_expert.float()
        row["max_tokens_per_expert"] = int(counts.max())
        row["max_over_mean"] = float(counts.max() / counts.mean())
        enable_tiling(moe, T)
        m.run(step)
        row["tiled"] = m.run(step)
        res[routing] = row
        del moe, step, x
    return res


# ---- DSA indexer scoring ---------------------------------------------------------------------------
def _indexer_inputs(spec, S: int, device, gen: torch.Generator):
    """Indexer tensors of one sequence of ``S`` tokens (bf16 queries as the model makes them)."""
    I, D, kp = spec.index_n_heads, spec.index_head_dim, spec.index_kpool
    P = S // kp
    q = torch.randn(S, I, D, device=device, dtype=torch.bfloat16, generator=gen)
    w = torch.randn(S, I, device=device, dtype=torch.bfloat16, generator=gen) * I**-0.5
    keys = torch.randn(P, D, device=device, dtype=torch.bfloat16, generator=gen)
    pos = torch.arange(S, device=device)
    ends = torch.arange(P, device=device) * kp + kp - 1
    zeros_P, zeros_S = torch.zeros(P, dtype=torch.int64, device=device), torch.zeros_like(pos)
    return q, w, keys, ends, zeros_P, pos, zeros_S


def bench_indexer(m: Meter, cfg: dict, smoke: bool) -> dict[str, Any]:
    from megaseq.ops.indexer.scoring import indexer_scoring_bytes, resolve_query_chunk, select_pools

    spec = glm5_flash_tiny() if smoke else glm5_flash_1gpu()
    K = spec.index_topk // spec.index_kpool
    scale = spec.index_head_dim**-0.5
    small, mid, lengths = cfg["indexer"]
    res: dict[str, Any] = {"shape": {"heads": spec.index_n_heads, "head_dim": spec.index_head_dim,
                                     "kpool": spec.index_kpool, "select_pools": K}}
    gen = torch.Generator(device=m.device).manual_seed(0)
    out: dict[str, torch.Tensor] = {}

    def run(S: int, chunk: int | None, key: str) -> dict[str, Any]:
        held = [_indexer_inputs(spec, S, m.device, gen.manual_seed(S))]

        def call() -> None:
            out[key] = select_pools(*held[0], num_select=K, scale=scale, query_chunk=chunk)[0]

        m.run(call)  # warm-up
        row = m.run(call)
        P = S // spec.index_kpool
        c = resolve_query_chunk(chunk, P, spec.index_n_heads, K)
        row.update(query_chunk=c, predicted_chunk_bytes=indexer_scoring_bytes(c, P, spec.index_n_heads, K))
        held.clear()
        return row

    # identical indices: one chunk vs the default chunk at `small`; a chunk 8x larger at `mid`
    res[f"{small}_one_chunk"] = run(small, small, "one")
    res[f"{small}_chunked"] = run(small, None, "chunked")
    res[f"{small}_identical"] = bool("one" in out and "chunked" in out and torch.equal(out["one"], out["chunked"]))
    out.clear()
    default = resolve_query_chunk(None, mid // spec.index_kpool, spec.index_n_heads, K)
    res[f"{mid}_chunk_x8"] = run(mid, default * 8, "big")
    for S in lengths:
        res[str(S)] = run(S, None, "chunked")
        if S == mid:
            res[f"{mid}_identical_to_x8"] = bool("big" in out and torch.equal(out["big"], out["chunked"]))
            out.pop("big", None)
        out.pop("chunked", None)
        if "oom" in res[str(S)]:
            break
    return res


# ---- SCO -------------------------------------------------------------------------------------------
class _StreamLayer(torch.nn.Module):
    """An mHC-shaped layer ``h [B,S,4,H] -> h``: stream mean, norm, SwiGLU MLP, back to the streams."""

    def __init__(self, hidden: int, inter: int) -> None:
        super().__init__()
        self.norm = RMSNorm(hidden)
        self.mlp = MLP(hidden, inter)
        self.post = torch.nn.Parameter(torch.ones(4))

    def forward(self, h: torch.Tensor, ctx: Any = None) -> torch.Tensor:
        y = self.mlp(self.norm(h.mean(dim=2)))
        return h + y[:, :, None, :] * self.post[:, None].to(y.dtype)


def bench_sco(m: Meter, cfg: dict, dtype) -> dict[str, Any]:
    L, S, H, I = cfg["sco"]
    layers = torch.nn.ModuleList(_StreamLayer(H, I) for _ in range(L)).to(device=m.device, dtype=dtype)
    gen = torch.Generator(device=m.device).manual_seed(0)
    h0 = torch.randn(1, S, 4, H, device=m.device, dtype=dtype, generator=gen).requires_grad_(True)
    bb = boundary_bytes(S, H, 4, h0.element_size())

    def step() -> None:
        h = h0
        for layer in layers:
            h = layer(h)
        h.float().square().mean().backward()
        h0.grad = None
        layers.zero_grad(set_to_none=True)

    shape = {"layers": L, "tokens": S, "hidden": H, "streams": 4, "boundary_bytes": bb}
    res: dict[str, Any] = {"shape": shape}
    checkpoint_layers(layers, None)
    m.run(step)
    res["recompute_on_gpu"] = m.run(step, repeat=2)
    off = BoundaryOffloader(host_budget=L * bb)
    checkpoint_layers(layers, off)
    m.run(step)  # plans and pins the pool
    off.num_offloaded = 0
    res["sco_all_offloaded"] = m.run(step, repeat=2)
    plan = sco_plan(L, bb, L * bb)
    res["sco_all_offloaded"].update(offloaded_per_step=off.num_offloaded // 2, pinned_bytes=off.host_bytes,
                                    pinned_exact=off.pool.pinned, planned_pinned_bytes=plan.host_pinned_bytes)
    # The recompute peak is at the first backward layer: boundaries of layers 1..L-1 (layer 0's is the
    # caller's input) + one layer's parameter gradients g. The SCO peak moves to the last layers, where
    # at most 2 boundaries are back but the gradients of the layers above have piled up:
    # (L-1) bb + g - (2 bb + (L-1) g) = (L-3) bb - (L-2) g, the working set being the same in both.
    g = sum(p.numel() * p.element_size() for p in layers[0].parameters())
    res["param_grad_bytes_per_layer"] = g
    res["predicted_peak_drop_bytes"] = (L - 3) * bb - (L - 2) * g
    res["predicted_gpu_boundary_bytes"] = {"recompute": L * bb, "sco": plan.gpu_boundary_bytes}
    off.release()
    return res


# ---- optimizer -------------------------------------------------------------------------------------
def bench_offload_adam(m: Meter, cfg: dict, dtype) -> dict[str, Any]:
    count, rows, cols, bucket = cfg["adam"]
    g = torch.Generator(device=m.device).manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(rows, cols, device=m.device, dtype=dtype, generator=g) * 0.02)
              for _ in range(count)]
    grads = [torch.randn(rows, cols, device=m.device, dtype=dtype, generator=g) * 1e-3 for _ in range(count)]
    total = count * rows * cols
    res: dict[str, Any] = {"params": total, "bucket_params": bucket,
                           "predicted": offload_adam_bytes(total, bucket)}

    def stepper(opt) -> Callable[[], None]:
        def step() -> None:
            for p, gr in zip(params, grads):
                p.grad = gr.clone()
            opt.step()
            opt.zero_grad()
        return step

    for name, make in (("stream", lambda: OffloadStreamAdamW(params, lr=1e-4, bucket_params=bucket)),
                       ("stream_no_overlap",
                        lambda: OffloadStreamAdamW(params, lr=1e-4, bucket_params=bucket, overlap=False)),
                       ("sequential_cpu_adamw", lambda: SequentialOffloadAdamW(params, lr=1e-4))):
        t0 = time.perf_counter()
        opt = make()
        setup = time.perf_counter() - t0
        m.run(stepper(opt))  # warm-up: staging buffers, CPU state
        row = m.run(stepper(opt), repeat=2)
        row["setup_seconds"] = setup
        if isinstance(opt, OffloadStreamAdamW):
            row.update(host_bytes=opt.host_bytes, staging_bytes=opt.staging_bytes)
        res[name] = row
        del opt
        gc.collect()
    return res


# ---- report ----------------------------------------------------------------------------------------
def _ratio(a: dict, b: dict, key: str) -> str:
    if key in a and key in b and b[key]:
        return f"{a[key] / b[key]:.2f}x"
    return "-"


def markdown(results: dict[str, Any]) -> str:
    lines = ["| measurement | baseline | scheme | scheme / baseline | note |", "|---|---|---|---|---|"]
    r = results.get("vocab_loss", {})
    if "plain" in r:
        p, c = r["plain"], r["chunked"]
        for key, fmt in (("peak_extra_bytes", _gib), ("seconds", _sec)):
            lines.append(f"| vocab loss {r['shape']['N']} tok, {key} | {fmt(p.get(key, p.get('oom')))} | "
                         f"{fmt(c.get(key))} | {_ratio(c, p, key)} | "
                         f"predicted plain {_gib(r['predicted']['plain'])}"
                         f", chunked {_gib(r['predicted']['chunked'])}; liger {fmt(r['liger'].get(key))} |")
    for n, row in results.get("chunked_long", {}).items():
        if not isinstance(row, dict):
            continue
        lines.append(f"| chunked loss {n} tok | - | {_gib(row.get('peak_extra_bytes'))}, "
                     f"{_sec(row.get('seconds'))} | - | bound {_gib(row.get('predicted_bytes'))} |")
    for routing in ("random", "genome", "skewed"):
        row = results.get("tiled_moe", {}).get(routing)
        if row:
            for key, fmt in (("peak_extra_bytes", _gib), ("seconds", _sec)):
                lines.append(f"| MoE {routing} routing, {key} | {fmt(row['untiled'].get(key))} | "
                             f"{fmt(row['tiled'].get(key))} | {_ratio(row['tiled'], row['untiled'], key)} | "
                             f"busiest expert {row['max_tokens_per_expert']} tokens "
                             f"({row.get('max_over_mean', 0):.1f}x the mean) |")
    ix = results.get("indexer", {})
    for key, row in ix.items():
        if isinstance(row, dict) and ("seconds" in row or "oom" in row):
            lines.append(f"| indexer scoring {key} | - | {_gib(row.get('peak_extra_bytes', row.get('oom')))}, "
                         f"{_sec(row.get('seconds'))} | - | chunk {row.get('query_chunk')} rows, predicted "
                         f"{_gib(row.get('predicted_chunk_bytes'))} per chunk |")
    for key, v in ix.items():
        if key.endswith(("identical", "identical_to_x8")):
            lines.append(f"| indexer indices {key} | - | {v} | - | selections compared with torch.equal |")
    s = results.get("sco", {})
    if "recompute_on_gpu" in s:
        a, b = s["recompute_on_gpu"], s["sco_all_offloaded"]
        drop = a.get("peak_extra_bytes", 0) - b.get("peak_extra_bytes", 0)
        lines.append(f"| SCO peak | {_gib(a.get('peak_extra_bytes'))} | {_gib(b.get('peak_extra_bytes'))} | "
                     f"{_ratio(b, a, 'peak_extra_bytes')} | drop {_gib(drop)}, predicted "
                     f"{_gib(s['predicted_peak_drop_bytes'])} (boundaries on GPU "
                     f"{_gib(s['predicted_gpu_boundary_bytes']['recompute'])} -> "
                     f"{_gib(s['predicted_gpu_boundary_bytes']['sco'])}); pinned {_gib(b['pinned_bytes'])} |")
        lines.append(f"| SCO step time | {_sec(a.get('seconds'))} | {_sec(b.get('seconds'))} | "
                     f"{_ratio(b, a, 'seconds')} | "
                     f"{b['offloaded_per_step']} boundaries offloaded per step |")
    o = results.get("offload_adam", {})
    if "stream" in o:
        for base in ("sequential_cpu_adamw", "stream_no_overlap"):
            lines.append(f"| optimizer step, {o['params'] / 1e9:.2f}B params | "
                         f"{base} {_sec(o[base].get('seconds'))} | "
                         f"{_sec(o['stream'].get('seconds'))} | {_ratio(o['stream'], o[base], 'seconds')} | "
                         f"staging {_gib(o['stream'].get('staging_bytes'))} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="JSON output path (a .md table is written beside it)")
    ap.add_argument("--smoke", action="store_true",
                    help="tiny shapes on the CPU: checks that the script runs")
    ap.add_argument("--only", default="", help="comma-separated sections to run (default: all)")
    ap.add_argument("--genome", default="", help="FASTA file whose first window routes the tiled-MoE section")
    args = ap.parse_args(argv)
    device = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    cfg = SMOKE if args.smoke else FULL
    if args.smoke:
        torch.set_num_threads(1)  # tiny shapes: threads only contend
    m = Meter(device)
    sections = {
        "vocab_loss": lambda: bench_vocab(m, cfg, dtype),
        "chunked_long": lambda: bench_chunked_long(m, cfg, dtype),
        "tiled_moe": lambda: bench_tiled_moe(m, cfg, dtype, args.smoke, args.genome),
        "indexer": lambda: bench_indexer(m, cfg, args.smoke),
        "sco": lambda: bench_sco(m, cfg, dtype),
        "offload_adam": lambda: bench_offload_adam(m, cfg, dtype),
    }
    wanted = [s for s in args.only.split(",") if s] or list(sections)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    meta = {"device": name,
            "torch": torch.__version__, "python": platform.python_version(), "smoke": args.smoke,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": " ".join([Path(sys.argv[0]).name] + (argv if argv is not None else sys.argv[1:]))}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {}
    for name in wanted:
        t0 = time.perf_counter()
        try:
            results[name] = sections[name]()
        except Exception as e:  # a failed section is reported, the others still run
            results[name] = {"error": f"{type(e).__name__}: {e}"}
        results[name]["section_seconds"] = time.perf_counter() - t0
        print(f"[{name}] {results[name]['section_seconds']:.1f} s", flush=True)
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        # written after every section, so a run stopped at its time limit keeps what it measured
        out.write_text(json.dumps({"meta": meta, "results": results}, indent=2))
    table = markdown(results)
    out.with_suffix(".md").write_text(f"# Memory schemes ({meta['device']}, torch {meta['torch']}, "
                                      f"{meta['date']})\n\n`{meta['command']}`\n\n{table}")
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
