"""Step time and peak memory of the DSA indexer's KL objective: the same run with and without
``model.train_indexer`` (the sparse stage), one warm-up step then one timed step each, on one GPU.

    python benchmarks/long_context/indexer_objective_cost.py                        # glm5-flash-1gpu at 32K
    python benchmarks/long_context/indexer_objective_cost.py --seq-len 1M           # the 1M step (sequence segments)
    python benchmarks/long_context/indexer_objective_cost.py --seq-len 16K --reference-kl  # + the torch KL row

Each row runs in a process of its own (a GPU's memory and allocator start empty for it, as for ``megaseq
train``: in one process a row's peak also counted what the row before it left allocated). Both rows run the
recipe's own settings (``--recipe``, default recipes/glm5-flash-1gpu.yaml: bf16 weights with
fp32 masters) on random tokens, with ``model.train_indexer`` off and on. The objective's rows run op ``indexer_kl``
as ``model.kernels`` picks it (``fast``: the Triton kernel); ``--reference-kl`` adds a third row with its torch
reference preferred, written to ``indexer_objective_<model>_<len>_reference_kl.json``. Each row names the
``indexer_kl`` implementations that ran and why (a kernel that declined says so there).

Writes ``benchmarks/results/long_context/indexer_objective_<model>_<len>.json`` (both rows as ``megaseq
bench`` measures them: step time, measured and planned peak) and prints the ratios. The aim: the objective
costs at most 5% of the step, and the plan stays within 5% of the measured peak.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path

import torch

from megaseq.bench.measure import measure_megaseq
from megaseq.config import load_config, parse_size
from megaseq.ops import dispatch

OUT = Path(__file__).parent / "results" / "long_context"


@contextlib.contextmanager
def preferring(op: str, impl: str) -> Iterator[None]:
    """Runs set up as ``megaseq train`` sets them up (``train.build.kernel_settings``), with ``impl`` put first
    for ``op``."""
    from megaseq.train import build

    real = build.kernel_settings

    def settings(cfg, device):
        out = real(cfg, device)
        return {**out, "preferred": {**out["preferred"], op: [impl]}}

    build.kernel_settings = settings
    try:
        yield
    finally:
        build.kernel_settings = real


RUNS = [("without", False), ("with_objective", True), ("with_objective_reference_kl", True)]


def measure_row(a: argparse.Namespace, S: int, name: str) -> dict:
    """One row (``RUNS``) measured as ``megaseq bench`` measures a length, in this process."""
    on = dict(RUNS)[name]
    cfg = load_config(a.recipe, {"model.train_indexer": on, "data.kind": "random", "data.seq_len": S,
                                 "train.steps": a.steps + 1})
    model = cfg.model.name
    prof = Path(a.out) / f"indexer_objective_{model}_{a.seq_len}_{name}.profile.txt" if a.profile else None
    with preferring("indexer_kl", "torch_gather") if name.endswith("reference_kl") else contextlib.nullcontext():
        row = measure_megaseq(cfg, S, a.steps, "random", profile=prof)
    row.update(name=name, overrides=[f"model.train_indexer={str(on).lower()}"],
               indexer_kl={r.impl: r.reason for _, r in dispatch.records() if r.op == "indexer_kl"})
    return row


ROW_FIELDS = ("status", "step_s", "measured_gpu_gib", "predicted_gpu_gib", "predicted_gpu_tensors_gib", "indexer_kl")


def row_in_own_process(name: str) -> dict:
    """``measure_row`` in a fresh Python process (this script with ``--row``), its row read back; a process that
    ends without one (killed, out of host memory) is a row with ``status`` "error" and its exit status."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "row.json"
        rc = subprocess.call([sys.executable, __file__, *sys.argv[1:], "--row", name, "--row-out", str(out)])
        row = (json.loads(out.read_text()) if out.exists() else
               {"name": name, "status": "error", "error": f"the row's process ended with exit status {rc} and no row"})
    # each row's figures printed as it ends, so a job cut short by its timeout still shows the rows it finished
    print(f"row {name}: " + json.dumps({k: row.get(k) for k in ROW_FIELDS}, default=str), flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--recipe", default="recipes/glm5-flash-1gpu.yaml")
    ap.add_argument("--seq-len", default="32K")
    ap.add_argument("--steps", type=int, default=1, help="timed steps after the warm-up step")
    ap.add_argument("--out", default=str(OUT))
    ap.add_argument("--profile", action="store_true",
                    help="one more step of each row under torch.profiler, its table beside the JSON")
    ap.add_argument("--reference-kl", action="store_true",
                    help="a third row: the objective with op indexer_kl's torch reference preferred")
    ap.add_argument("--row", choices=[name for name, _ in RUNS], help=argparse.SUPPRESS)  # one row, in this process
    ap.add_argument("--row-out", help=argparse.SUPPRESS)
    a = ap.parse_args()
    S = parse_size(a.seq_len, "--seq-len")
    if a.row:
        Path(a.row_out).write_text(json.dumps(measure_row(a, S, a.row), default=str))
        return
    runs = RUNS if a.reference_kl else RUNS[:2]
    rows = {name: row_in_own_process(name) for name, _ in runs}
    cfg = load_config(a.recipe, {"data.kind": "random", "data.seq_len": S})
    model = cfg.model.name
    base, obj = rows["without"], rows["with_objective"]
    summary = {}
    if base.get("status") == "ok" and obj.get("status") == "ok":
        summary = {"step_time_ratio": obj["step_s"] / base["step_s"]}
        if obj.get("measured_gpu_gib"):
            # the plan's tensors against max_memory_allocated (like for like); its total (CUDA context and the
            # allocator's reserve added) against what the allocator reserved
            summary.update(peak_gib_delta=obj["measured_gpu_gib"] - base["measured_gpu_gib"],
                           plan_over_measured=obj["predicted_gpu_tensors_gib"] / obj["measured_gpu_gib"],
                           plan_total_over_reserved=obj["predicted_gpu_gib"] / obj["measured_gpu_reserved_gib"],
                           plan_delta_gib=obj["predicted_gpu_gib"] - base["predicted_gpu_gib"])
    ref = rows.get("with_objective_reference_kl", {})
    if summary and ref.get("status") == "ok":
        summary.update(reference_kl_step_time_ratio=ref["step_s"] / base["step_s"],
                       reference_kl_over_kernel=ref["step_s"] / obj["step_s"])
        if ref.get("measured_gpu_gib"):
            summary.update(reference_kl_peak_gib_delta=ref["measured_gpu_gib"] - base["measured_gpu_gib"])
    # as ``megaseq bench`` writes its results (``meta`` + a list of rows), each row with the overrides it ran
    # under: benchmarks/memory/planner_error.py plans every row again
    meta = {"model": model, "recipe": a.recipe,
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
            "torch": torch.__version__, "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "lengths": [S], "steps": a.steps, "source": "random", "routing": "natural", "dtype": cfg.model.dtype,
            "kernels": cfg.model.kernels, "weights": cfg.model.weights}
    result = {"meta": meta, "rows": list(rows.values()), "summary": summary}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"indexer_objective_{model}_{a.seq_len}{'_reference_kl' if a.reference_kl else ''}.json"
    path.write_text(json.dumps(result, indent=1, default=str))
    print(json.dumps({k: {f: v.get(f) for f in ROW_FIELDS}
                      for k, v in rows.items()}, indent=1))
    print(json.dumps(summary, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
