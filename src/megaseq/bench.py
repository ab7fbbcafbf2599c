"""``megaseq bench``: measured peak memory, tokens/s and MFU per sequence length, next to the plan.

For each length the planner chooses the fixes (as ``megaseq train`` would), the model runs real
training steps (forward, backward, optimizer) on random tokens and/or real genome windows, and the
result records predicted vs measured peak GPU and host memory, tokens/s, model FLOPs utilization
(model FLOPs only: attention and indexer included, recompute not), the fixes used and the MoE load
imbalance seen. ``--find-max`` searches the longest length that trains; ``--baseline`` runs the
transformers reference of the same architecture and weights (gradient checkpointing on, its best
attention) so every table carries the megaseq / reference ratios.

Outputs: ``OUT.json``, ``OUT.md`` and ``OUT.png`` (memory and throughput against length).
"""

from __future__ import annotations

import copy
import json
import platform
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from megaseq.config import Config

GIB = 2**30
H200_BF16_FLOPS = 989e12  # dense bf16 peak of the H100/H200 SXM datasheet (MFU denominator)


def host_rss_peak_reset() -> None:
    """Reset the kernel's peak-RSS counter (VmHWM) so each length reports its own host peak."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def host_rss_peak() -> int:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _cfg_for(cfg: Config, seq_len: int, source: str) -> Config:
    c = copy.deepcopy(cfg)
    c.data.seq_len = seq_len
    if source == "random":
        c.data.kind = "random"
    elif source == "genome" and c.data.kind == "random":
        c.data.kind = "fasta"  # data.train (or the built-in genome) through the DNA tokenizer
    c.train.eval_after = False
    c.train.export_hf = False
    return c


def plan_on(c: Config, device: torch.device) -> Any:
    """The plan ``megaseq train`` would make for ``c`` on this one device (its real memory on a GPU)."""
    from megaseq.plan.planner import plan_from_config

    gpu_bytes = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None
    return plan_from_config(c, world_size=1, gpu_bytes=gpu_bytes)


def planned_step(c: Config, spec: Any, device: torch.device, plan: Any, total_steps: int) -> tuple:
    """``(model, applied memory, next_batch(), step(batch))``: the trainer's data, model, optimizer and step
    with ``plan``'s fixes applied, as ``megaseq train`` runs them."""
    from megaseq.data import build_data
    from megaseq.train.parallel_env import ParallelEnv
    from megaseq.train.trainer import build_planned_model, dtypes, train_step

    autocast = dtypes(c, device)[1]
    data = build_data(c.data, None, batch_size=c.train.batch_size, vocab_size=spec.vocab_size)
    memory = dict(plan.memory)
    model, applied, opt, sched = build_planned_model(c, spec, device, memory, total_steps)
    env = ParallelEnv(device)

    def step(batch: dict[str, torch.Tensor]) -> None:
        train_step(model, [batch], opt, sched, c, env, autocast, memory)

    return model, applied, data.train.next_batch, step


def measure_megaseq(cfg: Config, seq_len: int, steps: int, source: str) -> dict[str, Any]:
    """Warm-up step + ``steps`` timed steps of megaseq at ``seq_len`` (``steps`` 0: the one step, timed cold);
    an OOM is a result, not an error."""
    from megaseq.models.presets import resolve_spec
    from megaseq.train.metrics import moe_load
    from megaseq.train.trainer import resolve_device

    c = _cfg_for(cfg, seq_len, source)
    device = resolve_device(c)
    spec = resolve_spec(c.model.name)
    plan = plan_on(c, device)
    row: dict[str, Any] = {"seq_len": seq_len, "source": source, "system": "megaseq",
                           "fixes": [f[0] if isinstance(f, (list, tuple)) else str(f) for f in plan.fixes],
                           "predicted_gpu_gib": plan.peak_gpu / GIB,
                           "predicted_gpu_tensors_gib": plan.peak_gpu_tensors / GIB,
                           "predicted_host_gib": plan.peak_host / 1e9, "memory_plan": dict(plan.memory),
                           "plan_fits": plan.fits}
    model = applied = None
    try:
        model, applied, next_batch, step = planned_step(c, spec, device, plan, steps + 1)
        _sync(device)
        host_rss_peak_reset()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        times = timed_steps(lambda: step(next_batch()), steps, device)
        row["timed_steps"] = len(times) if steps else "1 (cold: includes the warm-up)"
        if not steps:  # the one step ran without the optimizer state (made by its update): compare with that
            row["predicted_gpu_tensors_gib"] = plan.first_step_gpu_tensors / GIB
            row["predicted_is_first_step"] = True
        dt = sum(times) / len(times)
        tokens = c.train.batch_size * seq_len
        row.update(status="ok", step_s=dt, tokens_per_s=tokens / dt,
                   mfu=tokens / dt * plan.flops["per_token"] / H200_BF16_FLOPS if device.type == "cuda" else None,
                   measured_gpu_gib=torch.cuda.max_memory_allocated(device) / GIB if device.type == "cuda" else None,
                   measured_gpu_reserved_gib=(torch.cuda.max_memory_reserved(device) / GIB
                                              if device.type == "cuda" else None),
                   measured_host_gib=host_rss_peak() / 1e9, moe_max_over_mean=moe_load(model))
    except torch.OutOfMemoryError as e:
        row.update(status="oom", error=str(e).splitlines()[0][:200])
    finally:
        if applied is not None:
            applied.release()
        del model
        _free(device)
    return row


def timed_steps(run_step: Callable[[], None], steps: int, device: torch.device) -> list[float]:
    """Seconds of each measured step: ``steps + 1`` runs of ``run_step``, the first a warm-up (kernels,
    autotune, the allocator) left out; ``steps`` 0: the one (cold) step."""
    times = []
    for i in range(steps + 1):
        t0 = time.perf_counter()
        run_step()
        _sync(device)
        if i > 0 or steps == 0:
            times.append(time.perf_counter() - t0)
    return times


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _free(device: torch.device) -> None:
    import gc

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def find_max(measure, start: int, granularity: int, limit: int = 4 << 20) -> tuple[int | None, list[dict[str, Any]]]:
    """Double from ``start`` until a length fails (or passes ``limit``: then ``limit`` is the answer),
    then bisect to ``granularity``; returns (max ok, rows)."""
    rows, ok, bad, L = [], None, None, start
    while bad is None:
        if L > limit:
            return ok, rows
        r = measure(L)
        rows.append(r)
        if r["status"] == "ok":
            ok, L = L, L * 2
        else:
            bad = L
        if ok is None and bad is not None and L <= granularity:
            return None, rows
    lo = ok or 0
    while bad - lo > granularity:
        mid = (lo + bad) // 2 // granularity * granularity
        if mid <= lo:
            break
        r = measure(mid)
        rows.append(r)
        lo, bad = (mid, bad) if r["status"] == "ok" else (lo, mid)
    return (lo or None), rows


def _direct(fn, *args) -> dict[str, Any]:
    return fn(*args)


def isolated(fn, *args) -> dict[str, Any]:
    """``fn(*args)`` in a fresh spawned process: each length starts from an empty GPU, an empty pinned-memory
    cache and its own peak RSS (one length's offload buffers must not count against the next)."""
    import multiprocessing as mp

    with mp.get_context("spawn").Pool(1) as pool:
        try:
            return pool.apply(fn, args)
        except Exception as e:  # noqa: BLE001  (a crashed length is a result, the next still runs)
            return {"status": "error", "error": f"{type(e).__name__}: {e}"[:300]}


def run_bench(cfg: Config, lengths: list[int], steps: int = 3, source: str = "random", find_max_len: bool = False,
              baseline: bool = False, out: str = "benchmarks/results/bench",
              logprob_lengths: list[int] | None = None, max_limit: int = 4 << 20,
              isolate: bool | None = None) -> dict[str, Any]:
    """Every measurement in order; the outputs are rewritten after each, so a run stopped early keeps
    what it measured. ``isolate`` (default: on a GPU) runs each measurement in its own process."""
    from megaseq.train.trainer import use_expandable_segments

    use_expandable_segments()  # the allocator as `megaseq train` sets it
    call = isolated if (torch.cuda.is_available() if isolate is None else isolate) else _direct
    sources = ["random", "genome"] if source == "both" else [source]
    if source not in ("random", "genome", "both"):
        raise ValueError(f"--source must be random, genome or both, got {source!r}")
    if "genome" in sources:  # one clear message before any model is built: is the genome long enough?
        from megaseq.data import build_data

        build_data(_cfg_for(cfg, max(lengths), "genome").data, None)
    rows: list[dict[str, Any]] = []
    result: dict[str, Any] = {"meta": _meta(cfg, lengths, steps, source), "rows": rows}
    path = Path(out)

    def keep(row: dict[str, Any], into: list[dict[str, Any]]) -> dict[str, Any]:
        into.append(row)
        write_outputs(result, path)
        return row

    for s in sources:
        for L in lengths:
            keep(call(measure_megaseq, cfg, L, steps, s), rows)
    if find_max_len:
        result["max_len"] = mx = {"megaseq": None, "search": []}
        mx["megaseq"], _ = find_max(lambda L: keep(call(measure_megaseq, cfg, L, 1, sources[0]), mx["search"]),
                                    max(lengths), max(lengths) // 8, max_limit)
        write_outputs(result, path)
    if baseline:
        from megaseq.bench_reference import measure_reference

        result["reference_rows"] = ref_rows = []
        for L in lengths:
            keep(call(measure_reference, cfg, L, steps), ref_rows)
        if find_max_len:
            mx = result["max_len"]
            mx["reference_search"] = []
            mx["reference"], _ = find_max(lambda L: keep(call(measure_reference, cfg, L, 1), mx["reference_search"]),
                                          min(lengths), max(min(lengths) // 4, 1), max_limit)
    if logprob_lengths:
        from megaseq.bench_reference import logprob_check

        result["logprob_check"] = logprob_check(cfg, logprob_lengths)
    write_outputs(result, path)
    return result


def _meta(cfg: Config, lengths: list[int], steps: int, source: str) -> dict[str, Any]:
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return {"model": cfg.model.name, "gpu": gpu, "torch": torch.__version__, "python": platform.python_version(),
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "lengths": lengths, "steps": steps,
            "source": source, "dtype": cfg.model.dtype}


def markdown(result: dict[str, Any]) -> str:
    m = result["meta"]
    lines = [f"# megaseq bench: {m['model']} on {m['gpu']} (torch {m['torch']}, {m['date']})", "",
             "GPU: planned tensor peak vs `max_memory_allocated` (with `--steps 0` the one step is the first, "
             "so the plan's first-step peak, without the optimizer state its update creates); host: planned vs "
             "the process's peak RSS (VmHWM).",
             "",
             "| length | source | status | fixes | pred GPU GiB | meas GPU GiB | err | pred host GB | host GB | err "
             "| tok/s | MFU | MoE max/mean |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        meas = r.get("measured_gpu_gib")
        pred = r.get("predicted_gpu_tensors_gib", r["predicted_gpu_gib"])
        err = f"{(pred - meas) / meas:+.1%}" if meas else "-"
        host = r.get("measured_host_gib")
        herr = f"{(r['predicted_host_gib'] - host) / host:+.1%}" if host else "-"
        moe = r.get("moe_max_over_mean") or {}
        mfu = "-" if r.get("mfu") is None else f"{r['mfu']:.1%}"
        lines.append(
            f"| {r['seq_len']:,} | {r['source']} | {r['status']} | {', '.join(r['fixes']) or '-'} | "
            f"{pred:.1f} | {meas if meas is None else f'{meas:.1f}'} | {err} | {r['predicted_host_gib']:.1f} | "
            f"{host or 0:.1f} | {herr} | {r.get('tokens_per_s', 0) or 0:,.0f} | "
            f"{mfu} | {max(moe.values()) if moe else 0:.2f} |")
    ref = {r["seq_len"]: r for r in result.get("reference_rows", [])}
    if ref:
        lines += ["", "| length | reference status | reference tok/s | megaseq / reference tok/s |",
                  "|---|---|---|---|"]
        for r in result["rows"]:
            b = ref.get(r["seq_len"]) if r["source"] == "random" else None
            if b is None:
                continue
            ratio = (r.get("tokens_per_s") or 0) / b["tokens_per_s"] if b.get("tokens_per_s") else None
            lines.append(f"| {r['seq_len']:,} | {b['status']} | {b.get('tokens_per_s', 0) or 0:,.0f} | "
                         f"{'-' if ratio is None else f'{ratio:.2f}x'} |")
    if "max_len" in result:
        mx = result["max_len"]
        lines += ["", f"longest length that trains: megaseq {mx.get('megaseq')}, reference {mx.get('reference')}"]
    lp = (result.get("logprob_check") or {}).get("result")
    if lp:
        lines += ["", f"per-token log-probabilities at {lp['seq_len']:,} tokens, megaseq ({lp['megaseq']}) vs "
                  f"reference ({lp['reference']}): mean |diff| {lp['mean_abs_diff']:.4f}, max "
                  f"{lp['max_abs_diff']:.3f} (reference log-probs {lp['ref_logprob_mean']:.2f} ± "
                  f"{lp['ref_logprob_std']:.2f})"]
    return "\n".join(lines) + "\n"


def write_outputs(result: dict[str, Any], out: Path) -> None:
    from megaseq.eval.report import write_atomic

    out.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(out.with_suffix(".json"), json.dumps(result, indent=2, default=str))
    write_atomic(out.with_suffix(".md"), markdown(result))
    ok = [r for r in result["rows"] if r["status"] == "ok"]
    if not ok:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for source in sorted({r["source"] for r in ok}):  # one line per data source (random, genome)
        rows = sorted((r for r in ok if r["source"] == source), key=lambda r: r["seq_len"])
        xs = [r["seq_len"] for r in rows]
        a.plot(xs, [r.get("predicted_gpu_tensors_gib", r["predicted_gpu_gib"]) for r in rows], "o--",
               label=f"planned ({source})")
        if rows[0].get("measured_gpu_gib") is not None:
            a.plot(xs, [r["measured_gpu_gib"] for r in rows], "o-", label=f"measured ({source})")
        b.plot(xs, [r["tokens_per_s"] for r in rows], "o-", label=source)
    a.set(xscale="log", xlabel="tokens per sequence", ylabel="peak GPU GiB (tensors)", title="memory")
    a.legend()
    b.set(xscale="log", xlabel="tokens per sequence", ylabel="tokens/s", title="throughput")
    b.legend()
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=120)
    plt.close(fig)
