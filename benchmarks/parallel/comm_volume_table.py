"""The planner's context-parallel bytes per GPU per step for GLM-5.3-Flash, as a table (pure Python).

    python benchmarks/parallel/comm_volume_table.py --out benchmarks/results/parallel/comm_volume.json

Writes the JSON (``--out``) and a markdown table beside it (same name, ``.md``). Every number comes from
``megaseq.plan.flops.comm_volume`` / ``ring_dtp_volume`` at the trainer's precision (fp32 master weights
under bf16 autocast), one sequence over the whole cp group (dp = 1). Those formulas are checked to the
byte against the collectives of a traced multi-process CPU step by ``tests/parallel/test_parallel_comm_volume.py``.
No torch needed.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from megaseq.models.presets import get_preset
from megaseq.plan.flops import comm_volume, ring_dtp_volume
from megaseq.plan.mesh import GB, Mesh, precision_for

MODEL = "glm5-flash"
SEQ_LENS = {"128K": 128 * 1024, "1M": 1024 * 1024}
CPS = (8, 64)


def row(seq_name: str, seq_len: int, cp: int) -> dict[str, Any]:
    """Bytes one GPU sends in one training step (forward + backward) at ``seq_len`` over ``cp`` GPUs."""
    spec, prec, mesh = get_preset(MODEL), precision_for("bf16"), Mesh(cp=cp)
    vol = comm_volume(spec, seq_len, mesh, batch=1, prec=prec)
    kda, dsa = vol["kda"], vol["dsa"]
    loss = ring_dtp_volume(spec, seq_len, mesh, batch=1, prec=prec)
    kda_step = kda["ulysses"] * kda["layers"]
    out = {
        "seq": seq_name, "seq_len": seq_len, "gpus": cp, "cp": cp, "tokens_per_gpu": seq_len // cp,
        "kda_layers": kda["layers"], "dsa_layers": dsa["layers"],
        "kda_per_layer": kda["ulysses"],
        "dsa_gather_kv_per_layer": dsa["gather_kv"],
        "dsa_ulysses_per_layer": dsa["ulysses"],
        "ring_dtp_loss": loss,
        "step_gather_kv": kda_step + dsa["gather_kv_per_step"] + loss,  # what the runtime runs
        "step_all_ulysses": kda_step + dsa["ulysses"] * dsa["layers"] + loss,
    }
    return {k: round(v) if isinstance(v, float) else v for k, v in out.items()}  # whole bytes


def gb(x: float) -> str:
    return f"{x / GB:.2f} GB" if x < 10 * GB else f"{x / GB:.1f} GB"


def markdown(rows: list[dict[str, Any]]) -> str:
    r0 = rows[0]
    lines = [
        f"# Context-parallel bytes per GPU per step: {MODEL} (planner formulas)",
        "",
        "`python benchmarks/parallel/comm_volume_table.py --out benchmarks/results/parallel/comm_volume.json`.",
        "",
        "- The formulas (`megaseq.plan.flops.comm_volume`, `ring_dtp_volume`) are checked to the byte "
        "against the bytes the collectives really send in a traced multi-process CPU training step "
        "(gloo, float32, glm5-flash-tiny and qwen3-moe-tiny, cp 2 and 4) by "
        "`tests/parallel/test_parallel_comm_volume.py`; the bf16 dtypes they assume are checked there under CPU "
        "autocast for KDA and softmax attention.",
        "- **The H200 time of these collectives was not measured**: no multi-GPU machine was lent. "
        "These are bytes, not seconds.",
        "",
        f"Bytes one GPU *sends*, forward + backward, one sequence over the cp group (dp = 1), fp32 master "
        f"weights under bf16 autocast ({r0['kda_layers']} KDA + {r0['dsa_layers']} DSA layers). An "
        "all-to-all sends `(P-1)/P` of its buffer, an all-gather its shard to `P-1` ranks, a "
        "reduce-scatter `P-1` blocks, a Ring-DTP hop the whole shard. GB = 1e9 bytes. Not included: "
        "the gradient all-reduce over the world (parameters are replicated; it depends on the "
        "parameter count, not on the sequence) and the once-per-step int64 doc-id gather.",
        "",
        "| sequence | GPUs (cp) | tokens/GPU | KDA layer (Ulysses) | DSA layer, gather-KV | "
        "DSA layer, Ulysses | Ring-DTP loss | step, gather-KV | step, all Ulysses |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['seq']} | {r['gpus']} ({r['cp']}) | {r['tokens_per_gpu'] // 1024}K | "
            f"{gb(r['kda_per_layer'])} | {gb(r['dsa_gather_kv_per_layer'])} | "
            f"{gb(r['dsa_ulysses_per_layer'])} | {gb(r['ring_dtp_loss'])} | "
            f"{gb(r['step_gather_kv'])} | {gb(r['step_all_ulysses'])} |"
        )
    lines += [
        "",
        "\"step, gather-KV\" is what the runtime runs (`parallel.mla_mode auto` maps to gather-KV; the "
        "DSA block implements only that mode); \"all Ulysses\" is the alternative for comparison. The "
        "Ring-DTP loss rotates `ceil(V/P)` rows of the fp32 `lm_head.weight` (`V = 154,880`, "
        "`H = 4096`) and an fp32 gradient accumulator: independent of the sequence length.",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/results/parallel/comm_volume.json")
    args = ap.parse_args(argv)
    rows = [row(name, S, cp) for name, S in SEQ_LENS.items() for cp in CPS]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"model": MODEL, "precision": "fp32 params + bf16 autocast", "unit": "bytes sent per GPU",
            "checked_by": "tests/parallel/test_parallel_comm_volume.py", "h200_timing": "not measured"}
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    out.with_suffix(".md").write_text(markdown(rows))
    print(markdown(rows))


if __name__ == "__main__":
    main()
