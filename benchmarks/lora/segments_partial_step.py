"""The peak GPU memory of a planned sequence-segments step within one device call: the forward of every
segment, then the loss and backward of the last ``--backward-segments`` segments, then the step is stopped.

    python benchmarks/lora/segments_partial_step.py 1M --forward-loss --out $OUT/kimi_1m_partial.json   # one H200
    python benchmarks/lora/segments_partial_step.py 256 --smoke --check-full --out /tmp/seg.json        # CPU, tiny

Why: under sequence segments (``memory.model_segment_tokens``) a step runs the forward of every segment
without a graph, then each segment again in reverse with its loss and backward. A whole step of
Kimi-Linear-48B-A3B LoRA at 1M tokens is longer than one 10-minute device call. The last segment's backward
has the largest working set of the backward pass (its attention joins the keys of every earlier token), so
the forward pass and the last segments' backward bound the step's peak.

The model and step are the planner's own (``train.build.build_planned_model`` with the plan's memory
settings, ``memory.stream_base`` and ``memory.segment_kv_host`` included; ``train.step.train_step``), after
a warm-up step on the first ``--warm-tokens`` of the window (the optimizer's state then exists). The step's
``progress`` hook, told before each segment, reads the memory and the clock and stops the step:

- ``forward_peak_gib``: ``max_memory_allocated`` over the forward of every segment (no graph);
- ``backward_peak_gib``: over the last segments' rerun with a graph, loss and backward (the peak counter is reset
  between): the window the plan's phases describe (``plan_vs_measured_backward``);
- ``forward_segment_s`` / ``backward_segment_s``: the time of each segment (synchronised);
- ``estimate_step_s``: an estimate, not a measurement: the forward time plus each segment's forward time
  scaled by the measured backward-to-forward ratio of the last segments (``estimate_step_upper_s``: every
  segment's backward as long as the last ones'). The optimizer step is not included.
- ``forward_loss``: with ``--forward-loss``, the loss of every segment computed from its final hidden states
  during the forward pass (the step's own loss function): the whole step's loss without its backward
  (``--check-full`` also runs a whole step after it and records its loss, ``full_step_loss``).

``OUT.progress.jsonl`` (beside ``--out``) gets a line once the model is built and once it is warm (the time
and the process's peak host memory, also printed) and one as each segment starts (the time so far and the
peak since the last reset): a run stopped by its time limit still says how far it got.

The peaks are compared with the plan's tensors peak (``plan.peak_gpu_tensors``) and its phase peaks.

A forward pass longer than one device call runs in two processes on the same machine (``Carry``):

    python benchmarks/lora/segments_partial_step.py 1M --forward-loss --forward-for 530 --carry /root/carry --out A.json
    python benchmarks/lora/segments_partial_step.py 1M --forward-loss --resume /root/carry --out B.json

The first stops at the first segment start after ``--forward-for`` seconds (or ``--forward-until`` segments)
and saves what the step has carried so far (the segment store: every earlier token's K/V or latents, each
linear layer's state at every segment start, on the GPU or in host memory as the plan keeps them), the
trainable weights and router state after its warm-up, and its measurements. The second builds the same
model on the same data, loads those, skips the segments already run and goes on; its row joins both
processes' forward times, losses and peaks. The store is restored where the plan keeps it, so the second
process's memory holds what the first one's did at that segment.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import time
from collections.abc import Iterator
from typing import Any

import torch

GIB = 1024**3


class StopStep(Exception):
    """Raised from the step's progress hook once the last segments' backward has run (or, with a ``Carry``,
    once the forward of the segments this process runs has)."""


def should_stop(backward_done: int, k: int) -> bool:
    """Whether the step stops before the next segment's backward, ``backward_done`` segments' having run."""
    return backward_done >= k


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("length")
    ap.add_argument("--recipe", default="recipes/kimi-linear-48b-a3b-lora.yaml")
    ap.add_argument("--backward-segments", type=int, default=2,
                    help="segments whose backward runs, from the last (the last has no gradient accumulators yet; "
                         "the one before it holds them, as every earlier one does: the step's peak)")
    ap.add_argument("--warm-tokens", type=int, default=4096, help="length of the warm-up step")
    ap.add_argument("--forward-loss", action="store_true",
                    help="compute each segment's loss in the forward pass (adds the loss's working set to it)")
    ap.add_argument("--check-full", action="store_true", help="then run a whole step and record its loss")
    ap.add_argument("--smoke", action="store_true",
                    help="CPU: kimi-linear-tiny LoRA, 64-token segments, K/V in host memory, the base streamed")
    ap.add_argument("--source", choices=("random", "genome"), default="random",
                    help="random tokens, or windows of data.train's genome (real data routes unevenly)")
    ap.add_argument("--forward-until", type=int, default=0,
                    help="stop before the forward of this segment and save the carried state to --carry")
    ap.add_argument("--forward-for", type=float, default=0.0,
                    help="stop at the first segment start after this many seconds of the process; save to --carry")
    ap.add_argument("--carry", help="directory for the state --forward-until / --forward-for save")
    ap.add_argument("--resume", help="directory a --carry run saved: its segments are not run again")
    ap.add_argument("--history", action="store_true",
                    help="CUDA: record the allocations of the backward (from the end of the forward pass) and write "
                         "the blocks live at its peak by the code that made them to OUT.history.txt")
    ap.add_argument("--out", required=True)
    ap.add_argument("overrides", nargs="*", help="config overrides key=value")
    return ap.parse_intermixed_args(argv)


SMOKE = ["model.name=kimi-linear-tiny", "model.dtype=fp32", "memory.auto=false",
         "memory.model_segment_tokens=64", "memory.segment_kv_host=true", "memory.stream_base=true"]


def build(cfg: Any, device: torch.device, plan: Any) -> tuple:
    """``(model, applied, next_batch, state)``: the trainer's data, model, optimizer and step state with
    ``plan``'s memory settings, as ``megaseq train`` builds them (``bench.measure.planned_step``)."""
    from megaseq.config import MemorySettings
    from megaseq.data import build_data
    from megaseq.models.presets import resolve_spec
    from megaseq.train.build import build_planned_model, dtypes
    from megaseq.train.parallel_env import ParallelEnv
    from megaseq.train.step import StepState

    spec = resolve_spec(cfg.model.name)
    autocast = dtypes(cfg, device)[1]
    data = build_data(cfg.data, None, batch_size=cfg.train.batch_size, vocab_size=spec.vocab_size)
    memory = MemorySettings.from_dict(plan.memory)
    env = ParallelEnv(device)
    model, applied, opt, sched = build_planned_model(cfg, spec, device, memory, 2, env=env)
    return model, applied, data.train.next_batch, StepState.of(cfg, model, opt, sched, env, memory, autocast)


class Carry:
    """One forward pass over two processes (see the module docstring): the first (``until`` segments or
    ``seconds`` of the process) saves, the second (``resume``) loads and goes on from the saved segment. While
    ``patched()``, the step's ``SegmentStore`` registers itself here (and, resuming, is filled from the save) and
    its forward pass skips the segments already run."""

    def __init__(self, directory: str, device: torch.device, until: int = 0, seconds: float = 0.0,
                 t0: float = 0.0, resume: bool = False) -> None:
        self.dir, self.device, self.until, self.seconds, self.t0 = directory, device, until, seconds, t0
        self.resume, self.store, self.saved = resume, None, False
        self.meta: dict[str, Any] = {}
        if resume:
            path = os.path.join(directory, "meta.json")
            if not os.path.exists(path):
                raise SystemExit(f"--resume {directory}: no meta.json (the first run did not finish saving, or ran "
                                 "on another machine): run it again with --forward-for and --carry")
            with open(path) as f:
                self.meta = json.load(f)
        self.first = int(self.meta.get("segments_done", 0))

    def due(self, done: int) -> bool:
        """Whether the first process stops before the forward of segment ``done``."""
        if self.resume or done == 0:
            return False
        return bool((self.until and done >= self.until)
                    or (self.seconds and time.perf_counter() - self.t0 >= self.seconds))

    @contextlib.contextmanager
    def patched(self) -> Iterator[None]:
        from megaseq.memory import model_segments as ms

        base_store, base_run, carry = ms.SegmentStore, ms.run_chunks, self

        class Store(base_store):  # type: ignore[misc,valid-type]
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                super().__init__(*args, **kwargs)
                carry.store = self
                if carry.resume:
                    carry._load(self)

        def run_chunks(chunks: list, run: Any, modules: Any) -> None:  # the segments not yet run, numbered as before
            first = carry.first
            base_run(chunks[first:], lambda j, c: run(j + first, c), modules)

        ms.SegmentStore, ms.run_chunks = Store, run_chunks
        try:
            yield
        finally:
            ms.SegmentStore, ms.run_chunks = base_store, base_run

    # ---- the first process: save ------------------------------------------------------------------------
    def _put(self, name: str, obj: Any) -> str:
        torch.save(obj, os.path.join(self.dir, name))
        return name

    def save(self, done: int, bounds: list[tuple[int, int]], model: torch.nn.Module, input_sha: str,
             measured: dict[str, Any]) -> None:
        """The store's rows ``[0, s)`` (``s`` the start of segment ``done``) and states, the trainable weights
        and small buffers, and ``measured``; ``meta.json`` written last (a partial save is never resumed)."""
        st, s = self.store, bounds[done][0]
        assert st is not None, "no segment store was made"
        os.makedirs(self.dir, exist_ok=True)
        meta_path = os.path.join(self.dir, "meta.json")
        if os.path.exists(meta_path):
            os.remove(meta_path)

        def cut(t: torch.Tensor) -> torch.Tensor:  # rows [0, s) in a tensor of their own (not the whole storage)
            return t[:, :s].to("cpu", copy=True)

        files: dict[str, Any] = {"cache": {}, "carried": {}, "host": {}}
        for i, (name, t) in enumerate(st.cache.items()):
            files["cache"][name] = [self._put(f"cache{i}.pt", cut(t)), list(t.shape), str(t.dtype)]
        for i, (key, per) in enumerate(st.carried.items()):
            got = {j: (c[0].cpu(), c[1].cpu()) for j, c in enumerate(per) if c is not None}
            files["carried"][key] = self._put(f"carried{i}.pt", got)
        if st.host is not None:
            for i, (name, t) in enumerate(st.host.rows.items()):
                files["host"][name] = [self._put(f"host{i}.pt", cut(t)), list(t.shape), str(t.dtype)]
            files["host_names"], files["host_order"] = st.host.names, st.host.order
        files["kept"] = self._put("kept.pt", {f"{k}\t{j}": t.cpu() for (k, j), t in st.kept.items()})
        files["docs"] = None if st.docs is None else [self._put("docs.pt", cut(st.docs)), list(st.docs.shape),
                                                       str(st.docs.dtype)]
        files["weights"] = self._put("weights.pt", weights_of(model))
        meta = {"segments_done": done, "rows": s, "segments": len(bounds), "input_sha256": input_sha,
                "files": files, "measured": measured}
        with open(meta_path + ".tmp", "w") as f:
            json.dump(meta, f, default=str)
        os.replace(meta_path + ".tmp", meta_path)
        self.saved = True

    # ---- the second process: load ------------------------------------------------------------------------
    def _get(self, name: str) -> Any:
        return torch.load(os.path.join(self.dir, name), weights_only=True)

    def _full(self, entry: list, device: torch.device | None = None, make: Any = None) -> torch.Tensor:
        """A saved ``[name, shape, dtype]``: the whole tensor (``make(shape, dtype)``, else empty on ``device``)
        with its saved rows ``[0, s)`` in place."""
        name, shape, dtype = entry[0], tuple(entry[1]), getattr(torch, entry[2].removeprefix("torch."))
        rows = self._get(name)
        full = make(shape, dtype) if make is not None else torch.empty(shape, dtype=dtype, device=device)
        full[:, :rows.shape[1]].copy_(rows)
        return full

    def _load(self, st: Any) -> None:
        m, files, dev = self.meta, self.meta["files"], self.device
        if m["segments"] != st.n:
            raise SystemExit(f"--resume {self.dir}: saved for {m['segments']} segments, this step has {st.n}")
        for name, entry in files["cache"].items():
            st.cache[name] = self._full(entry, dev)
        for key, name in files["carried"].items():
            per: list = [None] * st.n
            for j, (halo, state) in self._get(name).items():
                per[int(j)] = (halo.to(dev), state.to(dev))
            st.carried[key] = per
        if files["host"]:
            if st.host is None:
                raise SystemExit(f"--resume {self.dir}: saved with memory.segment_kv_host, which this plan does "
                                 "not use")
            on_cuda = dev.type == "cuda"
            for name, entry in files["host"].items():
                st.host.rows[name] = self._full(entry, make=lambda shape, dtype: st.host._host(shape, dtype, on_cuda))
            st.host.names = {k: list(v) for k, v in files["host_names"].items()}
            st.host.order = list(files["host_order"])
        st.kept = {(k.split("\t")[0], int(k.split("\t")[1])): t.to(dev) for k, t in self._get(files["kept"]).items()}
        if files["docs"] is not None:
            st.docs = self._full(files["docs"], dev)

    def load_weights(self, model: torch.nn.Module, input_sha: str) -> None:
        """The first process's trainable weights and small buffers (after its warm-up), on the same data."""
        if self.meta["input_sha256"] != input_sha:
            raise SystemExit(f"--resume {self.dir}: the first run's batch differs from this one's (same recipe, "
                             "length, --source and overrides?)")
        saved, own = self._get(self.meta["files"]["weights"]), weights_of(model)
        if set(saved) != set(own):
            raise SystemExit(f"--resume {self.dir}: the saved weights are not this model's "
                             f"({sorted(set(saved) ^ set(own))[:3]} ...)")
        named = dict(model.named_parameters()) | dict(model.named_buffers())
        with torch.no_grad():
            for name, t in saved.items():
                named[name].copy_(t)


def weights_of(model: torch.nn.Module, limit: int = 1 << 24) -> dict[str, torch.Tensor]:
    """What differs between two builds of the same seeded model after a warm-up step: the trainable weights
    and the buffers (router state), on the CPU; buffers larger than ``limit`` elements (rope tables) are left."""
    out = {n: p.detach().cpu() for n, p in model.named_parameters() if p.requires_grad}
    out |= {n: b.detach().cpu() for n, b in model.named_buffers() if b.numel() <= limit}
    return out


def input_sha(batch: dict[str, torch.Tensor]) -> str:
    return hashlib.sha256(batch["input_ids"].cpu().contiguous().numpy().tobytes()).hexdigest()


class Probe:
    """The step's ``progress`` hook: the clock and the memory at each segment, the stop after ``k`` backward
    segments; with ``labels`` the loss of each segment's forward (a forward hook on the model)."""

    def __init__(self, device: torch.device, k: int, bounds: list[tuple[int, int]], state: Any,
                 labels: torch.Tensor | None, log: str | None = None, carry: Carry | None = None,
                 sha: str = "") -> None:
        self.device, self.k, self.bounds, self.state, self.labels = device, k, bounds, state, labels
        self.log = log  # a JSON line per segment (a run stopped by its time limit still says how far it got)
        self.carry, self.sha = carry, sha  # the forward pass split over two processes
        self.history: str | None = None  # --history: where the backward's live blocks at its peak go
        self.first = carry.first if carry is not None else 0  # segments a first process ran
        self.cuda = device.type == "cuda"
        self.marks: dict[str, Any] = {"forward_segment_s": [], "backward_segment_s": []}
        self.j: int | None = None
        self.t = self.t0 = time.perf_counter()
        self.loss_sum: torch.Tensor | None = None

    def _tick(self) -> float:
        if self.cuda:
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        dt, self.t = now - self.t, now
        return dt

    def __call__(self, phase: str, done: int, total: int) -> None:
        self._record(phase, done, total)
        m = self.marks
        if phase == "forward":
            if done > self.first:
                m["forward_segment_s"].append(self._tick())
            else:
                self._tick()
            self.j = done
            if self.carry is not None and self.carry.due(done):
                self._save(done)
            return
        if done == 0:  # the forward of every segment has run
            m["forward_segment_s"].append(self._tick())
            m["forward_s"] = self.t - self.t0
            self.j = None
            if self.cuda:
                m["forward_peak"] = torch.cuda.max_memory_allocated(self.device)
                m["after_forward"] = torch.cuda.memory_allocated(self.device)
                torch.cuda.reset_peak_memory_stats(self.device)
                if self.history is not None:
                    torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="python")
        else:
            m["backward_segment_s"].append(self._tick())
        if should_stop(done, self.k):
            if self.cuda:
                m["backward_peak"] = torch.cuda.max_memory_allocated(self.device)
                if self.history is not None:
                    self._write_history()
            m["backward_segments_run"] = done
            raise StopStep(f"stopped after the backward of {done} of {total} segments")

    def _write_history(self) -> None:
        """The blocks the backward allocated that are live at its peak, by frame (``peak_by_frame``'s report)."""
        import sys
        from pathlib import Path

        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "memory"))
        import peak_by_frame

        snap = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        trace = snap["device_traces"][self.device.index or 0]
        before = self.marks["after_forward"]
        lines = [f"allocated when the backward began: {before / GIB:.2f} GiB (not in the trace below)",
                 *peak_by_frame.report(*peak_by_frame.peak_blocks(trace))]
        assert self.history is not None
        Path(self.history).write_text("\n".join(lines) + "\n")

    def _save(self, done: int) -> None:
        """The first process of a split forward pass: save before segment ``done`` and stop."""
        m = self.marks
        m["forward_s"] = self.t - self.t0
        if self.cuda:
            m["forward_peak"] = torch.cuda.max_memory_allocated(self.device)
        measured = {"forward_segment_s": m["forward_segment_s"], "forward_s": m["forward_s"],
                    "forward_peak": m.get("forward_peak"),
                    "loss_sum": None if self.loss_sum is None else float(self.loss_sum)}
        t = time.perf_counter()
        assert self.carry is not None
        self.carry.save(done, self.bounds, self.state.model, self.sha, measured)
        m["carry_save_s"] = time.perf_counter() - t
        m["segments_done"] = done
        raise StopStep(f"stopped before the forward of segment {done} of {len(self.bounds)}; "
                       f"saved to {self.carry.dir}")

    def joined(self) -> None:
        """The second process of a split forward pass: the first's forward measurements joined to its own."""
        if self.carry is None or not self.carry.resume:
            return
        before, m = self.carry.meta["measured"], self.marks
        m["forward_segment_s"] = list(before["forward_segment_s"]) + m["forward_segment_s"]
        if "forward_s" in m:
            m["forward_s"] += before["forward_s"]
        if "forward_peak" in m and before.get("forward_peak") is not None:
            m["forward_peak"] = max(m["forward_peak"], before["forward_peak"])
        if before.get("loss_sum") is not None and self.loss_sum is not None:
            self.loss_sum = self.loss_sum + before["loss_sum"]

    def _record(self, phase: str, done: int, total: int) -> None:
        if self.log is None:
            return
        if self.cuda:
            torch.cuda.synchronize(self.device)
        line = {"phase": phase, "done": done, "total": total, "s": time.perf_counter() - self.t0,
                "peak_since_reset_gib": torch.cuda.max_memory_allocated(self.device) / GIB if self.cuda else None}
        with open(self.log, "a") as f:
            f.write(json.dumps(line) + "\n")

    def on_hidden(self, _mod: Any, _args: Any, hidden: torch.Tensor) -> None:
        """The loss of the forward pass's segment ``j`` (no graph), as the step computes a segment's loss."""
        if self.j is None or torch.is_grad_enabled() or self.labels is None:
            return
        from megaseq.train.step import _loss_sum

        st = self.state
        s, e = self.bounds[self.j]
        chunk = st.memory.loss_chunk_tokens if st.memory.chunked_loss else None
        loss = _loss_sum(st.model, hidden, self.labels[:, s:e].to(hidden.device), st.env, st.autocast, chunk)
        self.loss_sum = loss.double() if self.loss_sum is None else self.loss_sum + loss.double()


def partial_step(state: Any, batch: dict[str, torch.Tensor], probe: Probe) -> str | None:
    """The planned step on ``batch`` until the probe stops it; returns the stop's message."""
    from megaseq.train.step import train_step

    hook = state.model.register_forward_hook(probe.on_hidden)
    if probe.cuda:
        torch.cuda.reset_peak_memory_stats(probe.device)
    probe.t = probe.t0 = time.perf_counter()
    split = probe.carry.patched() if probe.carry is not None else contextlib.nullcontext()
    try:
        with split:
            train_step(state, [batch], progress=probe)
    except StopStep as e:
        return str(e)
    finally:
        hook.remove()
        probe.joined()
    return None


def estimates(marks: dict[str, Any], n: int) -> dict[str, float | None]:
    """The whole step's time, estimated (not measured) from the forward pass and the last segments' backward."""
    fwd, bwd = marks["forward_segment_s"], marks["backward_segment_s"]
    if not bwd or len(fwd) != n:
        return {"estimate_step_s": None, "estimate_step_upper_s": None}
    ratio = sum(bwd) / sum(fwd[n - len(bwd):])  # the backward (rerun + backward) of a segment over its forward
    return {"backward_to_forward_ratio": ratio, "estimate_step_s": sum(fwd) * (1 + ratio),
            "estimate_step_upper_s": sum(fwd) + n * max(bwd)}


def check_row(row: dict[str, Any]) -> list[str]:
    """What the row lacks to be a partial step of the planned segments run (empty: none)."""
    bad = []
    n = row["segments"]
    if n < 2:
        bad.append(f"{n} segment(s): the length must exceed memory.model_segment_tokens")
    ran = row.get("carry_saved_before")  # the first process of a split forward pass: segments [0, ran)
    if ran is not None:
        if len(row["forward_segment_s"]) != ran:
            bad.append(f"the forward ran {len(row['forward_segment_s'])} segments but saved before segment {ran}")
        return bad
    if len(row["forward_segment_s"]) != n:
        bad.append(f"the forward ran {len(row['forward_segment_s'])} of {n} segments")
    if row["backward_segments_run"] < 1 or row["backward_segments_run"] != row["backward_segments"]:
        bad.append(f"the backward ran {row['backward_segments_run']} segments, not {row['backward_segments']}")
    if row["trainable_with_grad"] != row["trainable"]:
        bad.append(f"{row['trainable_with_grad']} of {row['trainable']} trainable tensors have a gradient")
    if row["device"] != "cpu" and row.get("backward_peak_gib") is None:
        bad.append("no backward peak")
    full, fwd = row.get("full_step_loss"), row.get("forward_loss")
    if full is not None and (fwd is None or abs(fwd - full) > 1e-5 * max(1.0, abs(full))):
        bad.append(f"the forward pass's loss {fwd} is not the whole step's {full}")
    return bad


def main(argv: list[str] | None = None) -> int:
    from megaseq.bench.measure import cfg_for, plan_on
    from megaseq.config import load_config, parse_size
    from megaseq.memory.model_segments import segment_bounds
    from megaseq.train.build import kernels_for, resolve_device, use_expandable_segments
    from megaseq.train.metrics import host_peak_bytes
    from megaseq.train.step import train_step

    args = parse(argv)
    splits = bool(args.forward_until or args.forward_for)
    if splits != bool(args.carry) or (args.resume and splits):
        raise SystemExit("--forward-until / --forward-for need --carry DIR, and go without --resume")
    over = (SMOKE if args.smoke else []) + list(args.overrides)  # the user's overrides last: they win
    use_expandable_segments()
    cfg = cfg_for(load_config(args.recipe, over), parse_size(args.length), args.source)
    device = resolve_device(cfg)
    plan = plan_on(cfg, device)
    seg = int(plan.memory.get("model_segment_tokens") or 0)
    if not seg or cfg.data.seq_len <= seg:
        raise SystemExit(f"the plan runs no sequence segments at {cfg.data.seq_len} tokens (segment {seg}): "
                         "use a longer length, or benchmarks/lora/lora_partial_step.py for recompute")
    bounds = segment_bounds(cfg.data.seq_len, seg)
    n, k = len(bounds), min(args.backward_segments, len(bounds) - 1)
    log = args.out + ".progress.jsonl"
    open(log, "w").close()
    t0 = time.perf_counter()
    carry = None
    if splits or args.resume:
        carry = Carry(args.resume or args.carry, device, until=args.forward_until, seconds=args.forward_for, t0=t0,
                      resume=bool(args.resume))

    def setup(stage: str) -> None:  # printed and logged: a run stopped before its first segment says where
        line = {"phase": stage, "s": round(time.perf_counter() - t0, 1),
                "host_peak_gib": round(host_peak_bytes() / GIB, 2)}
        print(json.dumps(line), flush=True)
        with open(log, "a") as f:
            f.write(json.dumps(line) + "\n")

    with kernels_for(cfg, device):
        model, applied, next_batch, state = build(cfg, device, plan)
        setup("built")
        batch = next_batch()
        warm = min(args.warm_tokens, seg)  # one segment or less: the optimizer's state made, not the segments run
        train_step(state, [{key: v[:, :warm] if torch.is_tensor(v) else v for key, v in batch.items()}])
        sha = input_sha(batch)
        if carry is not None and carry.resume:
            carry.load_weights(model, sha)
        build_s = time.perf_counter() - t0
        setup("warmed")
        labels = batch["labels"] if args.forward_loss or args.check_full else None
        probe = Probe(device, k, bounds, state, labels, log=log, carry=carry, sha=sha)
        probe.history = args.out + ".history.txt" if args.history else None
        stopped = partial_step(state, batch, probe)
        marks = probe.marks
        trainable = [p for p in model.parameters() if p.requires_grad]
        with_grad = sum(p.grad is not None for p in trainable)
        total = int((batch["labels"] != -100).sum())
        row: dict[str, Any] = {
            "recipe": args.recipe, "overrides": over, "seq_len": cfg.data.seq_len, "source": args.source,
            "segment_tokens": seg, "segments": n, "backward_segments": k, "stopped": stopped,
            "backward_segments_run": marks.get("backward_segments_run", 0),
            "trainable": len(trainable), "trainable_with_grad": with_grad,
            "fixes": [f[0] for f in plan.fixes], "memory_plan": dict(plan.memory), "plan_fits": plan.fits,
            "planned_peak_tensors_gib": plan.peak_gpu_tensors / GIB, "planned_peak_gpu_gib": plan.peak_gpu / GIB,
            "planned_phase_peaks_gib": {name: v / GIB for name, v in plan.phases.items()},
            "build_and_warm_s": build_s, "forward_s": marks.get("forward_s"),
            "forward_segment_s": marks["forward_segment_s"], "backward_segment_s": marks["backward_segment_s"],
            "estimates_note": "estimate_step_s and estimate_step_upper_s are estimates from the measured phases, "
                              "not a measured step; the optimizer step is not included",
            **estimates(marks, n),
            "forward_loss": None if probe.loss_sum is None else float(probe.loss_sum) / max(total, 1),
            "device": torch.cuda.get_device_name(device) if probe.cuda else "cpu", "torch": torch.__version__}
        if carry is not None and carry.saved:  # the first process of a split forward pass
            row |= {"carry_saved_before": marks["segments_done"], "carry_save_s": marks["carry_save_s"],
                    "forward_peak_gib": marks["forward_peak"] / GIB if probe.cuda else None,
                    "forward_loss": None}  # the second process reports the whole pass's
        elif carry is not None:  # the second: the first's build and segments
            row |= {"resumed_from": carry.first, "first_process": carry.meta["measured"]}
        if probe.cuda and "backward_peak" in marks:
            fp, bp = marks["forward_peak"], marks["backward_peak"]
            planned = plan.peak_gpu_tensors
            row |= {"forward_peak_gib": fp / GIB, "after_forward_gib": marks["after_forward"] / GIB,
                    "backward_peak_gib": bp / GIB, "measured_peak_gib": max(fp, bp) / GIB,
                    "plan_vs_measured": planned / max(fp, bp) - 1}
            # the plan's forward, loss and backward phases are a segment's rerun with a graph, its loss and its
            # backward: all inside the measured backward window. The forward pass without a graph has no phase
            # of its own in the plan (its peak is below the rerun's)
            ph = plan.phases
            if "backward" in ph:
                row["plan_vs_measured_backward"] = max(ph["backward"], ph.get("loss", 0), ph.get("forward", 0)) / bp - 1
        if args.check_full and not (carry is not None and carry.saved):
            # a whole step on the same batch (the partial one updated nothing)
            state.optimizer.zero_grad(set_to_none=True)
            row["full_step_loss"] = train_step(state, [batch])[0]
    row["checks"] = check_row(row)
    with open(args.out, "w") as f:
        json.dump(row, f, indent=2, default=str)
    print(json.dumps(row, indent=2, default=str))
    applied.release()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
