"""The figures of ``benchmarks/speed/speed_gpu.sh`` in one JSON: per bench result and length, megaseq's and the peer's
tokens/s, MFU, peak GPU memory, first and warm step, the routing and its max/mean load, and the ratio.

    python benchmarks/speed/speed_summary.py OUT.json BENCH.json [BENCH.json ...]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

KEEP = ("status", "tokens_per_s", "mfu", "measured_gpu_gib", "predicted_gpu_tensors_gib", "step_s", "first_step_s",
        "routing", "moe_load_max", "moe_load_mean", "fixes", "first_step_compiles", "first_step_tunings", "precompile",
        "build_s", "pool_grown_gib", "error")
PEER_KEEP = ("status", "tokens_per_s", "mfu", "measured_gpu_gib", "step_s", "first_step_s", "routing", "peer",
             "trained_params", "error")


def summarize(result: dict[str, Any]) -> dict[str, Any]:
    """One bench result's rows, the peer's beside megaseq's at each length, and the ratio."""
    peer = {r["seq_len"]: r for r in result.get("reference_rows", [])}
    rows = []
    for r in result["rows"]:
        row = {"seq_len": r["seq_len"], "source": r["source"], **{k: r.get(k) for k in KEEP}}
        if r.get("first_step_s") and r.get("step_s"):
            row["first_over_warm"] = r["first_step_s"] / r["step_s"]
        p = peer.get(r["seq_len"]) if r["source"] == "random" else None
        if p is not None:
            row["peer"] = {k: p.get(k) for k in PEER_KEEP}
            if p.get("tokens_per_s") and r.get("tokens_per_s"):
                row["megaseq_over_peer"] = r["tokens_per_s"] / p["tokens_per_s"]
        rows.append(row)
    return {"meta": result["meta"], "rows": rows, "longest": result.get("longest")}


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    out, paths = Path(argv[0]), [Path(p) for p in argv[1:]]
    summary = {p.stem: summarize(json.loads(p.read_text())) for p in paths if p.is_file()}
    out.write_text(json.dumps(summary, indent=1, default=str) + "\n")
    print(json.dumps(summary, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
