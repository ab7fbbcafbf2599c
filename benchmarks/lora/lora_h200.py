"""LoRA on a frozen bf16 base, on one H200: Qwen3-30B-A3B at its published shapes (random weights: speed and
memory need no trained weights), training steps at 128K and at the longest length the planner fits.

    python benchmarks/lora/lora_h200.py --out $OUT/lora_h200            # one H200; about 20-30 minutes
    python benchmarks/lora/lora_h200.py --lengths 128K --steps 1 --out $OUT/lora_h200_128k
    python benchmarks/lora/lora_h200.py --smoke --out /tmp/lora_smoke    # CPU, qwen3-moe-tiny, seconds

Results of an H200 run: benchmarks/results/lora/runs/2026-12-01_bf16-weights/README.md.
Each length runs as ``megaseq bench`` does (``bench.run.run_bench``: the
planner picks the fixes, ``megaseq train``'s model/optimizer/step with the adapters applied by the family's
``parallelize``, each length in its own process), so each row has the planned and measured peak GPU memory
(``max_memory_allocated``), host RSS, tokens/s and MFU. The target: measured peak within 5% of the plan,
and at least 512K tokens for Qwen3-30B-A3B.

MFU: ``mfu`` is ``bench``'s (model FLOPs of full fine-tuning, 3x the forward), the convention peers report.
A frozen matmul weight gets no weight gradient, so a LoRA step does less: ``lora_flops_per_token`` removes
those GEMMs (2 FLOPs per frozen matmul weight each token reaches: the routed experts at K/E, the head) and
adds the adapters' own (6 per adapter parameter each token reaches); ``mfu_lora`` uses it.

Outputs: ``OUT.json`` / ``OUT.md`` / ``OUT.png`` (``bench.report``) and ``OUT_lora.json`` (the planned
longest length, the adapter settings, both FLOP counts and each row's peak error against the plan).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from truncated_config import truncated_config

from megaseq.config import AdapterSettings, Config, load_config, parse_size
from megaseq.models.adapters import projections, resolve_targets, trainable_names
from megaseq.models.presets import resolve_spec
from megaseq.plan.flops import H200_BF16_DENSE, step_flops
from megaseq.plan.params import param_table, trained_counts
from megaseq.plan.planner import plan_from_config

RECIPE = "recipes/qwen3-30b-a3b-lora.yaml"
GRANULE = 8192  # the longest planned length, in multiples of this


def planned_longest(cfg: Config, gpu_bytes: int | None, limit: int = 4 << 20) -> int:
    """The longest multiple of ``GRANULE`` tokens the planner fits on this one GPU (0: none)."""

    def fits(n: int) -> bool:
        cfg.data.seq_len = n
        return plan_from_config(cfg, world_size=1, gpu_bytes=gpu_bytes).fits

    lo, hi = 0, limit // GRANULE
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid * GRANULE) else (lo, mid - 1)
    cfg.data.seq_len = lo * GRANULE
    return lo * GRANULE


def lora_flops_per_token(cfg: Config, seq_len: int) -> dict[str, float]:
    """Full fine-tuning's model FLOPs per token (``plan.flops``) and a LoRA step's: the weight-gradient GEMMs
    of the frozen matmul weights removed, the adapters' forward + backward added."""
    spec = resolve_spec(cfg.model.name)
    adapters = AdapterSettings.of(cfg)
    full = step_flops(spec, seq_len).per_token
    table = param_table(spec)
    tr = trained_counts(spec, adapters)
    trained = trainable_names(table, adapters.trainable) if tr is not None else set()
    reach = spec.num_experts_per_tok / spec.num_experts if spec.num_experts else 1.0
    frozen = sum(p.numel * (reach if p.kind == "experts" else 1.0) for p in table
                 if p.kind in ("linear", "experts") and p.name not in trained and ".indexer." not in p.name)
    lora = adapters.lora
    adapter = 0.0
    if lora.enabled:
        for proj in resolve_targets(projections(table), lora.targets, table):
            adapter += proj.adapter_params(lora.rank) * (reach if proj.kind == "experts" else 1.0)
    return {"full_ft_per_token": full, "lora_per_token": full - 2 * frozen + 6 * adapter,
            "frozen_matmul_params_per_token": frozen, "adapter_params_per_token": adapter}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", default=RECIPE)
    ap.add_argument("--lengths", default="128K,max", help="comma-separated; max: the longest planned length")
    ap.add_argument("--steps", type=int, default=2, help="timed steps per length after one warm-up (0: one cold)")
    ap.add_argument("--smoke", action="store_true", help="CPU: qwen3-moe-tiny, 512 tokens (checks the script)")
    ap.add_argument("--layers", type=int, default=0,
                    help="measure only the first N decoder layers (the same shapes; the lengths, 'max' included, "
                         "are still the full model's): a step at 512K+ of all 48 layers takes longer than one "
                         "device call. The planner is compared with the truncated model it measures.")
    ap.add_argument("--out", default="benchmarks/results/lora/lora_h200")
    ap.add_argument("overrides", nargs="*", help="config overrides key=value (e.g. lora.targets=attention)")
    args = ap.parse_args()
    over = list(args.overrides)
    if args.smoke:
        over += ["model.name=qwen3-moe-tiny", "model.dtype=fp32", "memory.auto=false"]
    cfg = load_config(args.recipe, over)
    from megaseq.bench.run import run_bench

    gpu = torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else None
    longest = 512 if args.smoke else planned_longest(load_config(args.recipe, over), gpu)
    lengths = sorted({longest if s == "max" else parse_size(s) for s in args.lengths.split(",") if s})
    if args.smoke:
        lengths = sorted({min(n, 512) for n in lengths})
    lengths = [n for n in lengths if n > 0]
    full_layers = None
    if args.layers:
        dst, full_layers = truncated_config(cfg.model.name, args.layers)
        cfg = load_config(args.recipe, over + [f"model.name={dst}"])
    if not lengths:
        raise SystemExit(f"{args.recipe}: the planner fits no length on this GPU; nothing to measure")
    result = run_bench(cfg, lengths, steps=args.steps, out=args.out)
    rows = []
    for r in result["rows"]:
        f = lora_flops_per_token(cfg, r["seq_len"])
        row = {"seq_len": r["seq_len"], "status": r["status"], **f,
               **{k: r[k] for k in ("error", "fixes", "predicted_gpu_tensors_gib", "measured_gpu_gib") if k in r}}
        if r["status"] == "ok":
            row["tokens_per_s"] = r["tokens_per_s"]
            row["mfu"] = r.get("mfu")
            row["mfu_lora"] = r["tokens_per_s"] * f["lora_per_token"] / H200_BF16_DENSE if gpu else None
            if r.get("measured_gpu_gib"):
                row["peak_vs_plan"] = r["measured_gpu_gib"] / r["predicted_gpu_tensors_gib"] - 1
                row["within_5pct"] = abs(row["peak_vs_plan"]) <= 0.05
        rows.append(row)
    summary = {"recipe": args.recipe, "overrides": over, "planned_longest": longest,
               "layers_measured": args.layers or None, "layers_full": full_layers,
               "lora": {k: getattr(cfg.lora, k) for k in ("rank", "alpha", "targets")}, "rows": rows}
    Path(f"{args.out}_lora.json").write_text(json.dumps(summary, indent=2, default=str))
    print(json.dumps(summary, indent=2, default=str))


if __name__ == "__main__":
    main()
