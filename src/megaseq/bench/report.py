"""The tables and plot of a ``megaseq bench`` result: markdown, JSON and a PNG, written atomically after
every measurement (a run stopped early keeps what it measured)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def fix_names(r: dict[str, Any]) -> str:
    """A row's fixes as the table shows them: recompute with the layers that keep attention's output."""
    plan = r.get("memory_plan") or {}
    kept, host = plan.get("keep_attention_layers", 0), plan.get("keep_attention_host_layers", 0)
    how = f"{kept} keep attention" + (f", {host} of them in host memory" if host else "")
    names = [f"recompute ({how})" if f == "recompute" and kept else f for f in r.get("fixes", [])]
    return ", ".join(names) or "-"


def markdown(result: dict[str, Any]) -> str:
    m = result["meta"]
    setting = f", kernels {m['kernels']}, weights {m['weights']}" if "kernels" in m else ""
    lines = [f"# megaseq bench: {m['model']} on {m['gpu']} (torch {m['torch']}, {m['date']}{setting})", "",
             "GPU: planned tensor peak vs `max_memory_allocated` (with `--steps 0` the one step is the first, "
             "so the plan's first-step peak, without the optimizer state its update creates); host: planned vs "
             "the process's peak RSS (VmHWM).",
             "",
             "| length | source | status | fixes | pred GPU GiB | meas GPU GiB | err | pred host GB | host GB | err "
             "| tok/s | MFU | MoE max/mean (routing) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        meas = r.get("measured_gpu_gib")
        pred = r.get("predicted_gpu_tensors_gib", r["predicted_gpu_gib"])
        err = f"{(pred - meas) / meas:+.1%}" if meas else "-"
        host = r.get("measured_host_gib")
        herr = f"{(r['predicted_host_gib'] - host) / host:+.1%}" if host else "-"
        moe = r.get("moe_max_over_mean") or {}
        load = r.get("moe_load_max") or (max(moe.values()) if moe else 0)
        mfu = "-" if r.get("mfu") is None else f"{r['mfu']:.1%}"
        lines.append(
            f"| {r['seq_len']:,} | {r['source']} | {r['status']} | {fix_names(r)} | "
            f"{pred:.1f} | {meas if meas is None else f'{meas:.1f}'} | {err} | {r['predicted_host_gib']:.1f} | "
            f"{host or 0:.1f} | {herr} | {r.get('tokens_per_s', 0) or 0:,.0f} | "
            f"{mfu} | {load:.2f} ({r.get('routing', 'natural')}) |")
    lines += first_step_lines(result["rows"])
    lines += reference_lines(result)
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


STATUS = {"ok": "ok", "oom": "out of memory"}


def first_step_lines(rows: list[dict[str, Any]]) -> list[str]:
    """The first step (compilation, autotuning, the allocator) against a warm step, per length that had both, with
    the Triton compiles it ran and the autotuner timings it waited for where the row counted them. The rows ran in
    one process, in their order: only the first row's first step is what a new process meets."""
    both = [r for r in rows if r.get("first_step_s") and r.get("step_s") and isinstance(r.get("timed_steps"), int)]
    if not both:
        return []

    def compiles(r: dict[str, Any]) -> str:
        c, t = r.get("first_step_compiles"), r.get("first_step_tunings")
        parts = ([f"{c['count']} Triton kernels built in {c['seconds']:.1f} s"] if c and c.get("count") else []) + (
            [f"{t['count']} autotuned kernels timed in {t['seconds']:.1f} s"] if t and t.get("count") else [])
        return f" ({', '.join(parts)})" if parts else ""

    def before(r: dict[str, Any]) -> str:  # the first call's wall time: the build, the precompile's wait, the step
        if r.get("build_s") is None:
            return ""
        pre = r.get("precompile") or {}
        wait, warm = pre.get("wait_s") or 0.0, (pre.get("op_warmup") or {}).get("seconds")
        ops = f" (of it the op warm-up {warm:.1f} s)" if warm else ""
        return (f", after the model's build {r['build_s']:.1f} s and the precompile's wait {wait:.1f} s{ops}: "
                f"{r['build_s'] + wait + r['first_step_s']:.1f} s to the first step's end")

    def capture(r: dict[str, Any]) -> str:  # the second step captured the CUDA graphs (train.layer_graphs)
        g = r.get("cuda_graphs") or {}
        if r.get("capture_step_s") is not None and g.get("failed"):
            return f"; the second step {r['capture_step_s']:.2f} s, its layers eager (CUDA graphs: {g['failed']})"
        if r.get("capture_step_s") is None or not g.get("layers"):
            return ""
        pool = f", their memory {g['pool_gib']:.2f} GiB" if g.get("pool_gib") else ""
        return (f"; the second step {r['capture_step_s']:.2f} s, capturing {len(g['layers'])} layers as CUDA graphs "
                f"in {g['capture_s']:.2f} s{pool}")

    def later(r: dict[str, Any]) -> str:  # the rows run in one process: a later row reuses the kernels built before
        i = next(i for i, x in enumerate(rows) if x is r)
        return (f" (in the process after the {rows[i - 1]['seq_len']:,} ({rows[i - 1]['source']}) row, whose kernels "
                "it reuses: not a new process's first step)") if i else ""

    return ["", "first step against a warm step: " + "; ".join(
        f"{r['seq_len']:,} ({r['source']}) {r['first_step_s']:.1f} s / {r['step_s']:.2f} s = "
        f"{r['first_step_s'] / r['step_s']:.1f}x{compiles(r)}{before(r)}{capture(r)}{later(r)}" for r in both)]


def reference_lines(result: dict[str, Any]) -> list[str]:
    """The peer's table beside megaseq's random-token rows: status, tokens/s, peak, MFU and the ratio; what the
    peer ran; the longest of the requested lengths each reached."""
    ref = {r["seq_len"]: r for r in result.get("reference_rows", [])}
    if not ref:
        return []
    lines = ["", "| length | reference status | reference tok/s | reference GPU GiB | reference MFU | "
             "megaseq / reference tok/s |",
             "|---|---|---|---|---|---|"]
    for L, b in sorted(ref.items()):
        r = next((r for r in result["rows"] if r["seq_len"] == L and r["source"] == "random"), {})
        ratio = (r.get("tokens_per_s") or 0) / b["tokens_per_s"] if b.get("tokens_per_s") else None
        gib, mfu = b.get("measured_gpu_gib"), b.get("mfu")
        lines.append(f"| {L:,} | {STATUS.get(b['status'], b['status'])} | {b.get('tokens_per_s', 0) or 0:,.0f} | "
                     f"{'-' if gib is None else f'{gib:.1f}'} | {'-' if mfu is None else f'{mfu:.1%}'} | "
                     f"{'-' if ratio is None else f'{ratio:.2f}x'} |")
    peer = next((b["peer"] for b in ref.values() if b.get("peer")), None)
    if peer:
        lines += ["", "reference (the peer): " + "; ".join(f"{k}: {v}" for k, v in peer.items())]
    longest = result.get("longest")
    if longest:
        lines += ["", f"longest of the requested lengths that trained: megaseq {longest.get('megaseq') or 'none'}, "
                  f"reference {longest.get('reference') or 'none'}"]
    return lines


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
