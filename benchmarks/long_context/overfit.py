"""The overfit test on real weights: can megaseq's planned training step memorise one long window?

    python benchmarks/long_context/overfit.py RUN_DIR --seq-len 128K --steps 30 --out OUT/overfit_128k

One window of ``seq_len + 1`` bases is the whole training set: a ``--period``-base region of the run's
first held-out genome (its middle) repeated to the window's length (``--period 0``: the window itself,
unrepeated). The run starts from the run's trained weights (``RUN/hf``) with its recipe (bf16 on a GPU,
the planned fixes for that length), a constant learning rate after 2 warm-up steps and no weight decay.
A step whose gradients are right drives the loss of a fixed sequence towards 0 (the reference system:
1.65 to 0.17 nats in 20 steps); a wrong gradient (a scheme that drops or double-counts a term) stalls.
The repetition keeps what is to be memorised small (a 256-base region; 128K fresh bases hold 256 Kbit,
more than 30 steps can store, so a correct step could fail there) while every one of the window's tokens
still runs through the long-sequence step. Passes when the last loss is at most ``--target`` times the
first. Results: OUT.json and OUT.md.

Calibrated on the CPU (stage 1's weights, 4K windows, float32): a 2K region stays
flat (1.309 -> 1.295 nats in 15 steps at lr 1e-3; 1.309 -> 1.320 in 11 at 3e-3, as on the H200); a
256-base region falls, slowly at first and then fast: 1.285 -> 0.378 nats in 20 steps at lr 1e-3 (29%),
0.457 at 2e-3. Hence the defaults: 256 bases, lr 1e-3, 30 steps. The region is the calibrated one at every
length (``--start`` picks another).

Measured on an H200 (``benchmarks/results/lora/runs/2026-12-02_48-layers-128k/``): at 4K the test passes (14.6% in
bf16, 13.2% in fp32) and follows the CPU's float32 curve step for step; at 16K and 128K the same region falls
only to 74-80% in 30 steps, in bf16 and fp32 and with or without the memory fixes, and a CPU run at 16K
gives the H200's first losses to 3-4 digits. So at 16K and more the test's 20% is a property of this model
and task at that length, not a check of the long-sequence step's gradients (those are the float64 exactness
tests'). ``--set SECTION.KEY=VALUE`` changes a setting of the run (``model.dtype=fp32``,
``memory.auto=false``).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path

import torch
import yaml

ROOT = Path(__file__).resolve().parents[2]
CALIBRATION_WINDOW = 4096  # the region starts where a 4K window centred in the genome does (the CPU calibration)
sys.path.insert(0, str(ROOT / "src"))

from megaseq.config import build_config, parse_size  # noqa: E402


def _region(run_dir: Path, start: int | None) -> tuple[dict, object, int]:
    """``(raw config, record, start)``: the run's config as read, its first held-out genome (else its longest
    training one) and the region's first base (the calibrated one unless ``start`` is given)."""
    from megaseq.data.fasta import load_dna_split

    raw = yaml.safe_load((run_dir / "config.yaml").read_text())
    split = load_dna_split(build_config(raw).data)
    rec = max(next(iter(split.heldout.values()), None) or split.train, key=len)
    start = (len(rec) - CALIBRATION_WINDOW - 1) // 2 if start is None else start  # one region at every length
    return raw, rec, start


def _repeated(rec, start: int, period: int, length: int) -> list[int]:
    """``length + 1`` tokens: the ``period``-token region at ``start`` repeated (0: the window itself)."""
    piece = rec.tokens[start:start + (period or length + 1)].tolist()
    return (piece * (-(-(length + 1) // len(piece))))[:length + 1]


def _settings(raw: dict, lr: float, overrides: tuple[str, ...]) -> dict:
    """``raw`` with the test's optimiser (a constant ``lr`` after 2 warm-up steps, no weight decay) and the
    ``--set`` overrides (``section.key=value``, the value read as YAML)."""
    raw = {**raw, "optim": {**raw["optim"], "lr": lr, "warmup_steps": 2, "min_lr_ratio": 1.0, "weight_decay": 0.0}}
    for item in overrides:
        key, _, value = item.partition("=")
        section, _, name = key.partition(".")
        raw[section] = {**raw.get(section, {}), name: yaml.safe_load(value)}
    return raw


def _init(run_dir: Path) -> str | None:
    return str(run_dir / "hf") if (run_dir / "hf").is_dir() else None


def _device() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def _write(out: Path, row: dict, md: str) -> dict:
    """``row`` with the machine and date, as OUT.json; ``md`` as OUT.md, printed."""
    row = {**row, "gpu": _device(), "torch": torch.__version__, "python": platform.python_version(),
           "date": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(row, indent=2) + "\n")
    out.with_suffix(".md").write_text(md)
    print(md)
    return row


def overfit(run_dir: Path, seq_len: int, steps: int, lr: float, target: float, out: Path, period: int = 256,
            start: int | None = None, overrides: tuple[str, ...] = ()) -> dict:
    from megaseq.train.trainer import run_training

    raw, rec, start = _region(run_dir, start)
    bases = "".join("ACGTN"[i - 4] if 4 <= i <= 8 else "N" for i in _repeated(rec, start, period, seq_len))
    with tempfile.TemporaryDirectory() as tmp:
        fa = Path(tmp) / "window.fa"
        fa.write_text(f">{rec.id}:{start}\n{bases}\n")
        raw["data"] = {**raw["data"], "train": [str(fa)], "heldout": [], "heldout_records": [], "heldout_tail": 0.0,
                       "seq_len": seq_len, "related": 0, "reverse_complement": False}
        raw["train"] = {**raw["train"], "steps": steps, "run_dir": f"{tmp}/run", "eval_after": False,
                        "eval_every": 0, "export_hf": False, "resume": False, "overwrite": False, "save_every": 0,
                        "batch_size": 1, "grad_accum": 1, "time_limit": ""}
        raw["model"] = {**raw["model"], "init_from": _init(run_dir)}
        raw["log"] = {**raw.get("log", {}), "tensorboard": False}
        raw = _settings(raw, lr, overrides)
        result = run_training(build_config(raw))
    losses = result.losses
    row = {"seq_len": seq_len, "steps": steps, "lr": lr, "losses": losses, "first": losses[0], "last": losses[-1],
           "ratio": losses[-1] / losses[0], "passed": losses[-1] <= target * losses[0], "target": target,
           "init": raw["model"]["init_from"] or "random", "overrides": list(overrides),
           "window": f"{rec.id}:{start}", "period": period}
    rep = f", a {period:,}-base region repeated" if period else ""
    rep += f", settings {', '.join(overrides)}" if overrides else ""
    md = (f"Overfit test, one window of {seq_len:,} bases ({row['window']}{rep}), {steps} steps at lr {lr} from "
          f"{row['init']} on {_device()}: loss {row['first']:.4f} -> {row['last']:.4f} nats "
          f"({row['ratio']:.1%} of the first; target <= {target:.0%}): {'passed' if row['passed'] else 'FAILED'}.\n")
    return _write(out, row, md)


def _train_on(cfg, init_from: str | None, batch: dict, steps: int) -> list[float]:
    """``steps`` planned training steps of ``cfg`` on one fixed ``batch``, as ``megaseq train`` runs them (the
    planner's fixes, the kernels, the MoE balancing), from ``init_from``: the losses."""
    from megaseq.bench.measure import plan_on
    from megaseq.config import MemorySettings
    from megaseq.models.presets import resolve_spec
    from megaseq.train.balance import Balancer, resolve_balance
    from megaseq.train.build import build_planned_model, dtypes, kernels_for, resolve_device
    from megaseq.train.parallel_env import ParallelEnv
    from megaseq.train.step import StepState, train_step

    device = resolve_device(cfg)
    spec = resolve_spec(cfg.model.name)
    plan = plan_on(cfg, device)
    memory = MemorySettings.from_dict(plan.memory)
    env = ParallelEnv(device)
    losses = []
    with kernels_for(cfg, device):
        model, applied, opt, sched = build_planned_model(cfg, spec, device, memory, steps, init_from=init_from,
                                                         env=env)
        balancer = Balancer(model, resolve_balance(cfg.moe, spec), env, 1)
        state = StepState.of(cfg, model, opt, sched, env, memory, dtypes(cfg, device)[1], balancer)
        try:
            for i in range(steps):
                loss, _ = train_step(state, [batch])
                losses.append(float(loss))
                print(f"step {i + 1}/{steps} | loss {losses[-1]:.4f} | {cfg.data.seq_len:,} tokens", flush=True)
        finally:
            applied.release()
    return losses


def packed(run_dir: Path, seq_len: int, doc_len: int, steps: int, lr: float, target: float, out: Path,
           period: int = 256, start: int | None = None, overrides: tuple[str, ...] = ()) -> dict:
    """The overfit test with a task that is the same at every length: one window of ``doc_len`` tokens (the
    repeated region), and a window of ``seq_len`` tokens packed with ``seq_len / doc_len`` copies of it as
    separate documents (``doc_ids``: attention stays inside each, positions restart). Both windows' mean
    losses and gradients are the same, so the long run must follow the short one step for step, up to
    rounding: what the long step's memory fixes (chunked loss, tiling, recompute, offload) do to training
    shows as the difference. Attention over one long document is not exercised (each document is short)."""
    if seq_len % doc_len:
        raise SystemExit(f"--packed {doc_len}: the length {seq_len} must be a multiple of it")
    raw, rec, start = _region(run_dir, start)
    doc = torch.tensor(_repeated(rec, start, period, doc_len), dtype=torch.int64)
    init = _init(run_dir)
    runs = {}
    for name, length in (("short", doc_len), ("packed", seq_len)):
        n = length // doc_len
        batch = {"input_ids": doc[:-1].repeat(n)[None], "labels": doc[1:].repeat(n)[None],
                 "doc_ids": torch.arange(n, dtype=torch.int32).repeat_interleave(doc_len)[None]}
        r = {**raw, "data": {**raw["data"], "seq_len": length}, "model": {**raw["model"], "init_from": None}}
        runs[name] = _train_on(build_config(_settings(r, lr, overrides)), init, batch, steps)
    short, long_ = runs["short"], runs["packed"]
    diff = max(abs(a - b) for a, b in zip(short, long_))
    row = {"seq_len": seq_len, "doc_len": doc_len, "documents": seq_len // doc_len, "steps": steps, "lr": lr,
           "losses_short": short, "losses_packed": long_, "max_abs_diff": diff,
           "ratio_short": short[-1] / short[0], "ratio_packed": long_[-1] / long_[0], "target": target,
           "passed": long_[-1] <= target * long_[0], "init": init or "random", "overrides": list(overrides),
           "window": f"{rec.id}:{start}", "period": period}
    md = (f"Packed overfit test: {seq_len:,} tokens as {row['documents']} documents of the same {doc_len:,}-token "
          f"window ({row['window']}, a {period}-base region repeated), {steps} steps at lr {lr} from {row['init']} "
          f"on {_device()}: loss {long_[0]:.4f} -> {long_[-1]:.4f} ({row['ratio_packed']:.1%} of the first; "
          f"target <= {target:.0%}: {'passed' if row['passed'] else 'FAILED'}); the {doc_len:,}-token window alone "
          f"{short[0]:.4f} -> {short[-1]:.4f} ({row['ratio_short']:.1%}); largest step difference {diff:.4f} nats.\n")
    return _write(out, row, md)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("run_dir", type=Path)
    p.add_argument("--seq-len", default="128K")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--target", type=float, default=0.2, help="pass when last loss <= target x first loss")
    p.add_argument("--period", default="256", help="repeat a region of this many bases (0: no repetition)")
    p.add_argument("--start", type=int, default=None,
                   help="the region's first base in the genome (default: the calibrated one, at every length)")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/long_context/overfit"))
    p.add_argument("--packed", default=None, metavar="DOC",
                   help="the same task at every length: the window packed with copies of one DOC-token window as "
                        "separate documents, beside a run of that window alone (e.g. --packed 4K)")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="a setting of the run's config (repeatable), e.g. model.dtype=fp32")
    a = p.parse_args()
    if a.packed:
        packed(a.run_dir, parse_size(a.seq_len), parse_size(a.packed), a.steps, a.lr, a.target, a.out,
               parse_size(a.period), a.start, tuple(a.set))
        return
    overfit(a.run_dir, parse_size(a.seq_len), a.steps, a.lr, a.target, a.out, parse_size(a.period), a.start,
            tuple(a.set))


if __name__ == "__main__":
    main()
