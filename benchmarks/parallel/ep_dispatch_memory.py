"""The expert dispatch's memory, measured from the tensors it allocates, plain EP vs PipelinedLLEP (CPU, gloo).

    python benchmarks/parallel/ep_dispatch_memory.py --out benchmarks/results/parallel/ep_dispatch_memory.json

P processes each hold E / P experts and N tokens; one MoE dispatch (forward + backward) runs under torch's
``MemTracker`` on every rank (every storage torch creates during the call, freed when it is; the inputs made
before it not counted) and the table reports the busiest rank's peak, for routings from even to adversarial:
``balanced`` (random), ``genome`` (glm5-flash-tiny's router on lambda phage), ``skew95`` (95% of tokens choose
expert 0), ``one_gpu`` (every token chooses rank 0's experts: plain EP sends every row to one GPU);
glm5-flash-tiny's MoE shapes throughout. Modes: ``plain`` (one all-to-all, the graph kept), ``pipelined``
(chunks, LLEP off: the structural bound alone) and ``pipelined_llep``. Beside each: the rows the busiest rank
received at once, the bound ``2 * ep * k * c_eff * H * bytes`` on the dispatch buffer, and the planner's
working set (``plan.expert.dispatch_terms`` at that bound). float32; shapes are small so that it runs on a
laptop: the ratios, not the bytes, are what compares with the paper's matched-component result (dispatch peak
52.7 -> 21.4 GiB, -59.3%, at 65K tokens on GPUs: docs/expert_parallel.md). Writes the JSON and a markdown table beside
it (same name, ``.md``).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megaseq.config import ExpertDispatchSettings
from megaseq.models.common.moe import Experts
from megaseq.models.presets import get_preset
from megaseq.parallel.expert import EPDispatch, shard_experts
from megaseq.parallel.launch import spawn_local
from megaseq.parallel.llep import dispatch_buffer_bound
from megaseq.plan.expert import dispatch_terms
from megaseq.plan.mesh import Mesh, precision_for

ROUTINGS = ("balanced", "genome", "skew95", "one_gpu")
MODES = ("plain", "pipelined", "pipelined_llep")
# glm5-flash-tiny's MoE (E 8, k 2, H 64, I 32), so that the genome routing is its own router's
FULL = {"P": 4, "N": 4096, "E": 8, "K": 2, "H": 64, "I": 32, "chunk": 256}
SMOKE = {"P": 4, "N": 128, "E": 8, "K": 2, "H": 64, "I": 32, "chunk": 32}


def spec_for(dims: dict[str, int]):
    spec = get_preset("glm5-flash-tiny")
    assert (spec.num_experts, spec.num_experts_per_tok, spec.hidden_size, spec.moe_intermediate_size) == \
        (dims["E"], dims["K"], dims["H"], dims["I"]), "the shapes are glm5-flash-tiny's MoE"
    return spec


def settings_for(mode: str, dims: dict[str, int]) -> ExpertDispatchSettings:
    name = "plain" if mode == "plain" else "pipelined_llep"
    threshold = 1e9 if mode == "pipelined" else 1.3  # LLEP off: chunks alone
    return ExpertDispatchSettings(mode=name, chunk_tokens=dims["chunk"], max_chunks=64, alpha=1.1,
                                  threshold=max(threshold, 1.1), min_tokens=8)


def routing(kind: str, dims: dict[str, int]) -> torch.Tensor:
    """``[P * N, K]`` expert ids for every rank's tokens."""
    P, N, E, K = dims["P"], dims["N"], dims["E"], dims["K"]
    g = torch.Generator().manual_seed(11)
    scores = torch.rand(P * N, E, generator=g)
    if kind == "skew95":
        chosen = torch.rand(P * N, generator=g) < 0.95
        scores[chosen, 0], scores[~chosen, 0] = 2.0, -1.0
    elif kind == "one_gpu":
        scores[:, E // P:] -= 2.0
    elif kind == "genome":
        return genome_routing(dims)
    return torch.topk(scores, K, dim=-1).indices


def genome_routing(dims: dict[str, int]) -> torch.Tensor:
    """The first MoE layer's router of glm5-flash-tiny (random init) on ``P * N`` bases of lambda phage."""
    from megaseq.data.fasta import default_genome_path, read_fasta
    from megaseq.models.build import build_model

    spec = spec_for(dims)
    P, N = dims["P"], dims["N"]
    ids = torch.from_numpy(read_fasta(default_genome_path())[0].tokens[1000:1000 + P * N].astype("int64"))
    model = build_model(spec, dtype=torch.float32, seed=0)
    captured: dict[str, torch.Tensor] = {}
    model.layers[1].mlp.gate.register_forward_hook(lambda m, a, out: captured.update(ids=out[1]))  # returns None
    with torch.no_grad():
        model(ids.unsqueeze(0))
    return captured["ids"]


def _rank(rank: int, dims: dict[str, int], cases: list[tuple[str, str]], routings: dict, out_dir: str) -> None:
    from torch.distributed._tools.mem_tracker import MemTracker

    dist.init_process_group("gloo")
    try:
        P, N, E, H, I, K = (dims[k] for k in ("P", "N", "E", "H", "I", "K"))
        results = []
        for kind, mode in cases:
            torch.manual_seed(0)
            experts = Experts(E, H, I, 10.0)
            shard_experts(experts, P, rank)
            d = EPDispatch(group=dist.group.WORLD, ep=P, rank=rank, settings=settings_for(mode, dims))
            g = torch.Generator().manual_seed(rank)
            x = torch.randn(N, H, generator=g, requires_grad=True)
            w = torch.rand(N, K, generator=g, requires_grad=True)
            grad = torch.randn(N, H, generator=g)
            mine = routings[kind][rank * N:(rank + 1) * N]
            tracker = MemTracker()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                with tracker:
                    out, _ = d(experts, x, mine, w)
                    out.backward(grad)
            results.append({"peak": tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"], **d.last})
            del out, x, w
        Path(out_dir, f"{rank}.json").write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()


def measure(dims: dict[str, int], cases: list[tuple[str, str]]) -> list[dict[str, Any]]:
    """Per case ``(routing, mode)``: the busiest rank's peak bytes and received rows, the bound and the
    planner's figure (every case in one process group)."""
    routings = {kind: routing(kind, dims) for kind in dict.fromkeys(k for k, _ in cases)}
    with tempfile.TemporaryDirectory() as tmp:
        spawn_local(_rank, dims["P"], args=(dims, cases, routings, tmp))
        ranks = [json.loads(Path(tmp, f"{r}.json").read_text()) for r in range(dims["P"])]
    spec, prec, mesh = spec_for(dims), precision_for("fp32"), Mesh(ep=dims["P"])
    rows = []
    for i, (kind, mode) in enumerate(cases):
        per_rank = [r[i] for r in ranks]
        idx = routings[kind]
        per_gpu = torch.bincount(idx.reshape(-1) // (dims["E"] // dims["P"]), minlength=dims["P"]).double()
        busiest = max(per_rank, key=lambda r: r["peak"])
        row = {"routing": kind, "mode": mode, "gpu_imbalance": round(float(per_gpu.max() / per_gpu.mean()), 3),
               "peak_bytes": busiest["peak"], "max_rows_in": max(r["max_rows_in"] for r in per_rank),
               "chunks": busiest["chunks"], "c_eff": busiest["c_eff"],
               "spilled_experts": sum(r["foreign_experts"] for r in per_rank)}
        if mode != "plain":
            t = dispatch_terms(spec, dims["N"], mesh, settings_for(mode, dims), 4, prec, 4.0)
            row["buffer_bound"] = dispatch_buffer_bound(dims["P"], dims["K"], t.c_eff, dims["H"], 4)
            row["rows_in_bound"] = t.rows_in_bound
            row["planned_bytes"] = plan_total(t, dims)
        rows.append(row)
    return rows


def plan_total(t: Any, dims: dict[str, int]) -> int:
    """The planner's bytes for what the measurement sees: saved inputs + the larger pass's temporaries + the
    output ``[N, H]`` the caller holds until backward."""
    return sum(t.saved.values()) + max(t.fwd_temp, t.bwd_temp) + dims["N"] * dims["H"] * 4


def report(rows: list[dict[str, Any]], dims: dict[str, int]) -> str:
    mib = 2**20
    lines = [f"# Expert dispatch memory, measured (CPU, gloo, float32, MemTracker on each of {dims['P']} ranks)",
             "", f"E {dims['E']}, k {dims['K']}, H {dims['H']}, I {dims['I']}, {dims['N']} tokens per rank, "
             f"ep_chunk_tokens {dims['chunk']}; the busiest rank's peak over one forward + backward.", "",
             "| routing | busiest GPU / mean (plain) | mode | peak MiB | rows in at once | chunks | bound "
             "2·ep·k·c_eff·H·b MiB | planned MiB | spilled experts |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['routing']} | {r['gpu_imbalance']} | {r['mode']} | {r['peak_bytes'] / mib:.2f} | "
                     f"{r['max_rows_in']} | {r['chunks']} | "
                     f"{r.get('buffer_bound', 0) / mib:.2f} | {r.get('planned_bytes', 0) / mib:.2f} | "
                     f"{r['spilled_experts']} |")
    worst = {m: max(r["peak_bytes"] for r in rows if r["mode"] == m) for m in MODES}
    cut = 1 - worst["pipelined_llep"] / worst["plain"]
    lines += ["", "| | plain EP peak | PipelinedLLEP peak | change |", "|---|---|---|---|",
              f"| this run, worst routing (CPU, tiny shapes) | {worst['plain'] / mib:.2f} MiB | "
              f"{worst['pipelined_llep'] / mib:.2f} MiB | -{100 * cut:.1f}% |",
              "| the paper, matched component at 65K (GPUs) | 52.7 GiB | 21.4 GiB | -59.3% |", "",
              "The pipelined peak stays under the planned bytes for every routing (it does not grow with the "
              "imbalance); plain EP's grows with the rows its busiest GPU receives. Not a GPU measurement."]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="benchmarks/results/parallel/ep_dispatch_memory.json")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (seconds)")
    args = ap.parse_args()
    dims = SMOKE if args.smoke else FULL
    torch.set_num_threads(1)
    rows = measure(dims, [(kind, mode) for kind in ROUTINGS for mode in MODES])
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"dims": dims, "torch": torch.__version__, "rows": rows}, indent=2))
    out.with_suffix(".md").write_text(report(rows, dims))
    print(report(rows, dims))


if __name__ == "__main__":
    main()
