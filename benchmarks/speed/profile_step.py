"""Where one training step of a recipe spends its GPU time: torch.profiler over one step after a warm-up.

    python benchmarks/speed/profile_step.py recipes/glm5-flash-1gpu.yaml 32K [--source genome] [--json PATH]
        [--routing balanced|natural] [--section.key value ...]

MoE routers route ``balanced`` (the bench's default on random weights: ``docs/benchmarks.md``) unless
``--routing natural``; genome windows (``--source genome``) should take ``natural``.

Prints three tables and the step's wall time:

- the 30 costliest kernels (self CUDA time);
- GPU time by module: every forward of a decoder layer's parts (``self_attn``, ``mlp``, the hyper-connections,
  norms, and inside an MoE its router, experts and shared experts) runs under a ``record_function`` label
  ``fwd:<part>:<Class>``; a kernel counts for the innermost label around it, so a recomputed forward inside a
  backward counts as forward work;
- GPU time by backward function (``autograd::engine::evaluate_function: <Node>``), exclusive of the forwards
  recomputed inside it; the engine's own ops beside a node (the sums of a tensor's uses' gradients, sum_to,
  casts) are a row of their own, ``ENGINE``;
- GPU time by aten op and input shapes (which tensors the elementwise kernels run over).

and, from the step's trace, where the GPU sat idle between kernels: the idle time by what the host was
doing when it launched the kernel after each gap (its innermost label and aten op), the longest gaps, and the
host syncs (``cudaStreamSynchronize`` and kin: ``.item()``, ``.tolist()``, ``nonzero``) with where they ran.

``--json`` writes the tables. Writes nothing else.

    python benchmarks/speed/profile_step.py recipes/glm5-flash-1gpu.yaml 8K --host 10 [--json PATH]

instead measures the host's side of warm steps, without torch.profiler: per step, the wall time and the time the
step's last read-back (``.tolist()`` of the loss and gradient norm) waits for the GPU; all ``.tolist()`` read-backs
(the DSA selection reads counts too) are counted and timed beside it. A step whose last read-back waits little
is bound by the host's launches, not by the GPU. Then the same steps under ``cProfile``,
its 40 costliest functions by own time and by cumulative time (``cProfile`` slows the host: its shares, not its
seconds, are the figure).

    python benchmarks/speed/profile_step.py recipes/glm5-flash-1gpu.yaml 8K --syncs [--json PATH]

instead runs one warm step under ``torch.cuda.set_sync_debug_mode("warn")`` and lists every host sync it made
(``.item()``, ``.tolist()``, ``nonzero``, copies to pageable host memory, stream syncs inside an op) by the
Python frames that called it, with counts.
"""

from __future__ import annotations

import json
import os
import re
import sys
import tempfile
import time
from collections import defaultdict

import torch

from megaseq.bench.measure import cfg_for, plan_on, planned_step
from megaseq.config import load_config, parse_size, split_overrides

# (name pattern relative to the model, label part): the parts of a decoder layer that get a label
_PARTS = re.compile(r"^(?:model\.)?layers\.\d+\.([^.]+(?:\.(?:gate|experts|shared_experts|indexer))?)$")
_BACKWARD = "autograd::engine::evaluate_function: "
ENGINE = "(autograd engine: gradient sums, sum_to, casts)"
# aten ops that only call other aten ops (their GPU time is their children's, listed under those)
_COMPOSITE = {"aten::to", "aten::_to_copy", "aten::matmul", "aten::linear", "aten::reshape", "aten::contiguous",
              "aten::type_as", "aten::einsum", "aten::chunk", "aten::split", "aten::expand_as", "aten::view_as"}


def annotate(model: torch.nn.Module) -> list:
    """Forward pre/post hooks that open and close a ``record_function`` per labelled part; their handles."""
    handles = []
    for name, mod in model.named_modules():
        m = _PARTS.match(name)
        if not m:
            continue
        label = f"fwd:{m.group(1)}:{type(mod).__name__}"
        stack: list = []

        def pre(_mod, _args, label=label, stack=stack):
            rf = torch.autograd.profiler.record_function(label)
            rf.__enter__()
            stack.append(rf)

        def post(_mod, _args, _out, stack=stack):
            if stack:
                stack.pop().__exit__(None, None, None)

        handles.append(mod.register_forward_pre_hook(pre))
        handles.append(mod.register_forward_hook(post))
    return handles


def _device_us(evt) -> float:
    return float(getattr(evt, "device_time_total", 0) or 0)


def by_label(events, time_of=_device_us) -> tuple[dict[str, float], dict[str, float]]:
    """``(forward parts, backward functions)``: GPU microseconds (``time_of``) exclusive of nested labels.

    Only the labels' CPU-side events count: each ``record_function`` range also comes back as a GPU-side
    annotation of the same name, whose ``device_time_total`` is the range's elapsed time on the GPU (idle
    gaps included), not kernels. Counting both would read the forward parts about twice
    their kernels (and "outside any label" came out negative)."""
    excl: dict[str, float] = defaultdict(float)
    for evt in events:
        name = evt.name
        if getattr(evt, "device_type", torch.autograd.DeviceType.CPU) != torch.autograd.DeviceType.CPU:
            continue
        up = evt.cpu_parent
        if name.startswith("aten::") and up is not None and up.name.startswith(_BACKWARD):
            # an aten op right under the engine's evaluate_function, beside the node's own event: the engine's
            # glue (the sum of a tensor's uses' gradients into its input buffer, sum_to, casts), not the node:
            # a profile reads such adds of the mHC streams as "ViewBackward0 8.3 ms"
            excl[_BACKWARD + ENGINE] += time_of(evt)
            excl[up.name] -= time_of(evt)
            continue
        if not (name.startswith("fwd:") or name.startswith(_BACKWARD)):
            continue
        t = time_of(evt)
        excl[name] += t
        parent = evt.cpu_parent
        while parent is not None and not (parent.name.startswith("fwd:") or parent.name.startswith(_BACKWARD)):
            parent = parent.cpu_parent
        if parent is not None:
            excl[parent.name] -= t
    fwd = {k: v for k, v in excl.items() if k.startswith("fwd:")}
    bwd = {k[len(_BACKWARD):]: v for k, v in excl.items() if k.startswith(_BACKWARD)}
    return fwd, bwd


def _table(title: str, rows: dict[str, float], total_us: float, limit: int) -> list[str]:
    out = [f"\n{title}", f"{'GPU ms':>10} {'share':>7}  name"]
    for name, us in sorted(rows.items(), key=lambda kv: -kv[1])[:limit]:
        out.append(f"{us / 1e3:10.1f} {100 * us / max(total_us, 1):6.1f}%  {name}")
    return out


_GPU_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}
_SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")


def _nest(events: list[dict]) -> None:
    """Per host thread, each event's ``parent`` (the innermost event that encloses it) by one sweep."""
    by_thread: dict = defaultdict(list)
    for e in events:
        by_thread[(e.get("pid"), e.get("tid"))].append(e)
    for evs in by_thread.values():
        evs.sort(key=lambda e: (e["ts"], -e.get("dur", 0)))
        stack: list[dict] = []
        for e in evs:
            while stack and stack[-1]["ts"] + stack[-1].get("dur", 0) < e["ts"] + e.get("dur", 0):
                stack.pop()
            e["parent"] = stack[-1] if stack else None
            stack.append(e)


def _where(e: dict | None) -> str:
    """The innermost label (a part's forward, a backward function) and aten op around a host event."""
    op = label = None
    while e is not None:
        name = e["name"]
        if op is None and name.startswith("aten::"):
            op = name
        if name.startswith("fwd:") or name.startswith(_BACKWARD):
            label = name.replace(_BACKWARD, "bwd:")
            break
        e = e["parent"]
    return f"{label or '(no label)'} > {op or '-'}"


def _outer_op(e: dict | None) -> str:
    """The outermost aten op around a host event (``aten::stack`` where ``_where`` names its ``aten::cat``)."""
    op = "-"
    while e is not None:
        if e["name"].startswith("aten::"):
            op = e["name"]
        e = e["parent"]
    return op


def idle_gaps(trace: dict, min_us: float = 2.0) -> dict:
    """Where the GPU sat idle in a chrome trace of one step: ``{"idle_ms", "busy_ms", "by_where", "longest",
    "syncs"}``. A gap is the time between the end of the GPU work so far and the next kernel's start; it counts
    for the host context that launched that kernel (``_where``). Each of the longest also names where the kernel
    that ended last before it was launched (``after``) and the next launch's outermost aten op (``outer``)."""
    evs = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "ts" in e]
    gpu = sorted((e for e in evs if e.get("cat") in _GPU_CATS), key=lambda e: e["ts"])
    host = [e for e in evs if e.get("cat") not in _GPU_CATS]
    _nest(host)
    # runtime launches (cudaLaunchKernel: aten's kernels) and driver ones (cuLaunchKernel: Triton's)
    launch = {e["args"]["correlation"]: e for e in host
              if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
    by_where: dict[str, float] = defaultdict(float)
    longest, idle, busy_end, last = [], 0.0, None, None
    busy = 0.0
    for k in gpu:
        start, end = k["ts"], k["ts"] + k.get("dur", 0)
        if busy_end is not None and start - busy_end >= min_us:
            gap = start - busy_end
            idle += gap
            here = launch.get(k.get("args", {}).get("correlation"))
            where = _where(here)
            by_where[where] += gap
            before = _where(launch.get(last.get("args", {}).get("correlation")))
            longest.append((gap, where, k["name"][:60], before, _outer_op(here)))
        busy += max(0.0, end - max(start, busy_end or start))
        if busy_end is None or end >= busy_end:
            busy_end, last = end, k
    syncs: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for e in host:
        if e.get("cat") == "cuda_runtime" and e["name"].startswith(_SYNCS):
            s = syncs[f"{e['name']} in {_where(e['parent'])}"]
            s[0] += 1
            s[1] += e.get("dur", 0) / 1e3
    longest.sort(key=lambda g: -g[0])
    return {"idle_ms": idle / 1e3, "busy_ms": busy / 1e3,
            "by_where": {k: v / 1e3 for k, v in sorted(by_where.items(), key=lambda kv: -kv[1])},
            "longest": [{"us": g, "where": w, "next_kernel": n, "after": a, "outer": o}
                        for g, w, n, a, o in longest[:25]],
            "syncs": {k: {"count": c, "host_ms": t} for k, (c, t) in sorted(syncs.items(), key=lambda kv: -kv[1][0])}}


def gap_lines(g: dict, limit: int = 30) -> list[str]:
    out = [f"\nGPU idle between kernels: {g['idle_ms']:.1f} ms (busy {g['busy_ms']:.1f} ms), by the host context that"
           " launched the kernel after the gap", f"{'idle ms':>10}  where"]
    out += [f"{ms:10.2f}  {w}" for w, ms in list(g["by_where"].items())[:limit]]
    out += ["\nlongest gaps", f"{'us':>10}  where [outermost op]  (next kernel)  after: the last kernel's where"]
    out += [f"{x['us']:10.0f}  {x['where']} [{x.get('outer', '-')}]  ({x['next_kernel']})  after: {x.get('after', '-')}"
            for x in g["longest"]]
    out += ["\nhost syncs", f"{'count':>6} {'host ms':>8}  call in where"]
    out += [f"{v['count']:6d} {v['host_ms']:8.2f}  {k}" for k, v in list(g["syncs"].items())[:limit]]
    return out


def host_side(step, next_batch, sync, device, n: int) -> dict:
    """``n`` warm steps timed on the host (see the module doc), then ``n`` under ``cProfile``."""
    import cProfile
    import io
    import pstats

    waits: list[float] = []
    tolist = torch.Tensor.tolist

    def timed_tolist(self):  # the step's read-back: how long it waits for the GPU
        t = time.perf_counter()
        out = tolist(self)
        waits.append(time.perf_counter() - t)
        return out

    rows = []
    torch.Tensor.tolist = timed_tolist
    try:
        for _ in range(n):
            batch = next_batch()
            sync(device)
            waits.clear()
            t0 = time.perf_counter()
            step(batch)
            sync(device)
            wall = time.perf_counter() - t0
            rows.append({"wall_s": wall, "last_readback_wait_s": waits[-1] if waits else 0.0,
                         "readbacks_wait_s": sum(waits), "readbacks": len(waits)})
    finally:
        torch.Tensor.tolist = tolist
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(n):
        step(next_batch())
    sync(device)
    prof.disable()
    tables = {}
    for key in ("tottime", "cumulative"):
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats(key).print_stats(40)
        tables[key] = buf.getvalue()
    return {"steps": rows, "cprofile": tables}


def host_syncs(step, next_batch, sync, device) -> dict[str, int]:
    """One step's host syncs by where they were called (the innermost five Python frames), with counts."""
    import traceback
    import warnings
    from collections import Counter

    seen: Counter = Counter()

    def show(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" not in str(message):  # the mode's own notice that it is a prototype: not a sync
            return
        frames = traceback.extract_stack()[:-1]
        seen[" < ".join(f"{os.path.basename(f.filename)}:{f.lineno} {f.name}" for f in reversed(frames[-5:]))] += 1

    batch = next_batch()
    sync(device)
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = show
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step(batch)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    sync(device)
    return dict(seen.most_common())


def host_lines(h: dict) -> list[str]:
    import statistics as st

    walls = [r["wall_s"] for r in h["steps"]]
    last = [r["last_readback_wait_s"] for r in h["steps"]]
    waits = [r["readbacks_wait_s"] for r in h["steps"]]
    out = [f"{len(walls)} warm steps: wall median {st.median(walls):.4f} s (min {min(walls):.4f}, "
           f"max {max(walls):.4f}); the last read-back waits {st.median(last):.4f} s (median); all "
           f"{h['steps'][0]['readbacks']} read-backs {st.median(waits):.4f} s"]
    out += ["\ncProfile by own time", h["cprofile"]["tottime"], "\ncProfile by cumulative time",
            h["cprofile"]["cumulative"]]
    return out


def _write(json_path: str | None, recipe: str, length: str, device: torch.device, payload: dict) -> None:
    """``payload`` beside the recipe, the length, the device and torch's version, as JSON (``--json``)."""
    if not json_path:
        return
    with open(json_path, "w") as f:
        json.dump({"recipe": recipe, "seq_len": length, **payload,
                   "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                   "torch": torch.__version__}, f, indent=1)


def main(argv: list[str]) -> int:
    from megaseq.models.common.moe import set_routing
    from megaseq.models.presets import resolve_spec
    from megaseq.train import host_gc
    from megaseq.train.build import kernels_for, resolve_device

    recipe, length, *rest = argv
    source, json_path, host_steps, routing, syncs = "random", None, 0, None, False
    while rest[:1] in (["--source"], ["--json"], ["--host"], ["--routing"], ["--syncs"]):  # before any overrides
        if rest[0] == "--syncs":
            syncs, rest = True, rest[1:]
            continue
        if rest[0] == "--source":
            source = rest[1]
        elif rest[0] == "--routing":
            routing = rest[1]
        elif rest[0] == "--host":
            host_steps = int(rest[1])
        else:
            json_path = rest[1]
        rest = rest[2:]
    routing = routing or ("natural" if source == "genome" else "balanced")
    cfg = cfg_for(load_config(recipe, split_overrides(rest)), parse_size(length), source)
    device = resolve_device(cfg)
    if syncs and device.type != "cuda":
        raise SystemExit("--syncs lists a GPU step's host syncs: run it on a GPU")
    plan = plan_on(cfg, device)
    print("fixes:", [f[0] for f in plan.fixes], dict(plan.memory))
    # the dispatcher as `megaseq train` sets it up (--model.kernels fast), Python's collector as its steps keep it
    with kernels_for(cfg, device), host_gc.steps():
        model, applied, next_batch, step = planned_step(cfg, resolve_spec(cfg.model.name), device, plan,
                                                        3 + 2 * host_steps)
        set_routing(model, routing)
        step(next_batch())  # warm-up
        if getattr(step, "graphs", None) is not None:
            step(next_batch())  # the CUDA graphs' capture (train.layer_graphs)
        sync = torch.cuda.synchronize if device.type == "cuda" else (lambda _d: None)
        sync(device)
        if syncs:
            found = host_syncs(step, next_batch, sync, device)
            print(f"{sum(found.values())} host syncs in one warm step, by where they were called (innermost first)")
            print("\n".join(f"{n:5d}  {where}" for where, n in found.items()))
            _write(json_path, recipe, length, device, {"syncs": found})
            applied.release()
            return 0
        if host_steps:
            h = host_side(step, next_batch, sync, device, host_steps)
            print("\n".join(host_lines(h)))
            _write(json_path, recipe, length, device, h)
            applied.release()
            return 0
        handles = annotate(model)
        activities = [torch.profiler.ProfilerActivity.CPU]
        if device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        with torch.profiler.profile(activities=activities, record_shapes=True) as prof:
            t0 = time.perf_counter()
            step(next_batch())
            sync(device)
            wall = time.perf_counter() - t0
        for h in handles:
            h.remove()
    averages = prof.key_averages()
    if device.type == "cuda":
        # the labels (record_function ranges) come back as GPU-side annotations too: not kernels
        cpu_names = {k.key for k in averages if k.device_type == torch.autograd.DeviceType.CPU}
        kernels = {k.key: float(k.self_device_time_total) for k in averages
                   if k.device_type == torch.autograd.DeviceType.CUDA and k.key not in cpu_names
                   and not k.key.startswith("fwd:")}
        fwd, bwd = by_label(prof.events())
        shapes = {f"{k.key} {k.input_shapes}": float(k.device_time_total)
                  for k in prof.key_averages(group_by_input_shape=True)
                  if k.device_type == torch.autograd.DeviceType.CPU and k.key.startswith("aten::")
                  and k.key not in _COMPOSITE}
    else:  # a smoke run on the CPU: CPU time in the same tables
        kernels = {k.key: float(k.self_cpu_time_total) for k in prof.key_averages() if k.key.startswith("aten::")}
        fwd, bwd = by_label(prof.events(), time_of=lambda e: float(e.cpu_time_total))
        shapes = {}
    total = sum(kernels.values())
    lines = [f"step wall {wall:.3f} s under the profiler; GPU kernel time {total / 1e6:.3f} s"]
    lines += _table("kernels (self GPU time)", kernels, total, 30)
    lines += _table("forward by part (recomputed forwards included)", fwd, total, 40)
    lines += _table("backward by autograd function (exclusive of recomputed forwards)", bwd, total, 40)
    lines += _table("aten ops by input shapes (GPU time of the kernels each launched)", shapes, total, 40)
    rest_us = total - sum(fwd.values()) - sum(bwd.values())
    lines.append(f"\noutside any label (embedding, loss, optimizer, stream glue): {rest_us / 1e3:.1f} ms "
                 f"({100 * rest_us / max(total, 1):.1f}%)")
    gaps = {}
    if device.type == "cuda":
        with tempfile.TemporaryDirectory() as tmp:
            prof.export_chrome_trace(os.path.join(tmp, "trace.json"))
            with open(os.path.join(tmp, "trace.json")) as f:
                gaps = idle_gaps(json.load(f))
        lines += gap_lines(gaps)
    print("\n".join(lines))
    _write(json_path, recipe, length, device,
           {"wall_s": wall, "gpu_kernel_s": total / 1e6, "kernels_ms": {k: v / 1e3 for k, v in kernels.items()},
            "forward_ms": {k: v / 1e3 for k, v in fwd.items()}, "backward_ms": {k: v / 1e3 for k, v in bwd.items()},
            "aten_by_shape_ms": {k: v / 1e3 for k, v in sorted(shapes.items(), key=lambda kv: -kv[1])[:300]},
            "gaps": gaps})
    applied.release()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
