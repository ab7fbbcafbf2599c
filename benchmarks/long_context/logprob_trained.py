"""Correctness on trained weights: per-token log-probs of megaseq as it trains against an fp32 reference.

    python benchmarks/long_context/logprob_trained.py RUN_DIR --lengths 128K,256K --out OUT/logprob_trained

RUN_DIR is a finished megaseq run (its Hugging Face export ``RUN/hf`` and ``config.yaml``). For each
length L, one window of L + 1 bases of the run's first held-out genome (its middle) is scored by:

- **megaseq as it trains**: the weights in fp32, bf16 autocast on a GPU (fp32 on the CPU, as the
  trainer does there), the memory fixes the planner chooses for L applied by the family's
  ``parallelize``, the loss per token through ``eval.loss.per_token_loss_fn`` (chunked, in sequence
  segments where the plan uses them);
- **the fp32 reference**: transformers' own class for the export, fp32 weights, SDPA attention, where it
  runs (vocabulary 16: its logits are small); megaseq in fp32 with no fix beyond that, marked so.

Random weights give near-uniform log-probs whose errors say little; a trained model's
log-probs spread over tens of nats, so this is the check that counts. Reports mean and max absolute
difference of log p(next base) per length (target: mean <= 0.04 at 128K and longer), and the
bits per base each side gives. Results: OUT.json and OUT.md, rewritten after every length.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import platform
import sys
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch
import yaml

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))

from megaseq.config import build_config, parse_size  # noqa: E402


def window(cfg, length: int) -> torch.Tensor:
    """[1, L + 1] ids: the middle of the run's first held-out genome (its training data when none)."""
    from megaseq.data.fasta import load_dna_split

    split = load_dna_split(cfg.data)
    recs = next(iter(split.heldout.values()), None) or split.train
    rec = max(recs, key=len)
    if len(rec) < length + 1:
        raise ValueError(f"the held-out genome {rec.id} has {len(rec)} bases, fewer than {length + 1}")
    start = (len(rec) - length - 1) // 2
    return torch.from_numpy(rec.tokens[start:start + length + 1].astype(np.int64))[None]


def megaseq_logprobs(cfg, hf: Path, ids: torch.Tensor, device: torch.device,
                     planned: bool) -> tuple[torch.Tensor, dict]:
    """(log p(next token) [L], the memory settings used) of megaseq: as it trains (``planned``: bf16
    autocast on a GPU + the plan's fixes), or plain fp32 with no fix."""
    from megaseq.config import MemorySettings
    from megaseq.eval.loss import per_token_loss_fn
    from megaseq.models.build import build_model
    from megaseq.models.hf_io import load_hf_checkpoint
    from megaseq.models.registry import parallelize
    from megaseq.models.spec import from_hf_config
    from megaseq.parallel.env import ParallelEnv
    from megaseq.plan.planner import plan_from_config

    spec = from_hf_config(hf)
    model = build_model(spec, dtype=torch.float32, device="cpu")
    load_hf_checkpoint(hf, model=model, spec=spec)
    model = model.to(device).eval()
    c = copy.deepcopy(cfg)
    c.data.seq_len = ids.shape[1] - 1
    memory, autocast = MemorySettings(), None
    if planned:
        gpu = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None
        memory = MemorySettings.from_dict(plan_from_config(c, world_size=1, gpu_bytes=gpu).memory)
        autocast = torch.bfloat16 if device.type == "cuda" and cfg.model.dtype == "bf16" else None
    applied = parallelize(model, memory, None)
    try:
        fn = per_token_loss_fn(model, ParallelEnv(device), autocast, memory.loss_chunk_tokens,
                               memory.model_segment_tokens)
        batch = {"input_ids": ids[:, :-1], "labels": ids[:, 1:], "doc_ids": None}
        with torch.no_grad():
            return -fn(batch)[0].float().cpu(), memory.to_dict()
    finally:
        applied.release()


def reference_logprobs(hf: Path, ids: torch.Tensor, device: torch.device) -> torch.Tensor:
    """log p(next token) [L] of the transformers class of the export, fp32 weights, SDPA."""
    import transformers.integrations.sdpa_attention as hf_sdpa

    from megaseq.bench.hf_model import load_reference_model

    ref = load_reference_model(str(hf), dtype=torch.float32, attn="sdpa", experts="eager").to(device)
    # float32 SDPA with enable_gqa has only the math kernel on CUDA (the S x S scores: 512 GiB at 128K); with
    # it off transformers repeats the KV heads itself and the memory-efficient kernel runs
    use_gqa, hf_sdpa.use_gqa_in_sdpa = hf_sdpa.use_gqa_in_sdpa, lambda *a, **k: False
    try:
        with torch.no_grad():
            logits = ref(input_ids=ids[:, :-1].to(device)).logits[0].float()
            out = logits.log_softmax(-1).gather(-1, ids[0, 1:, None].to(device))[:, 0].cpu()
    finally:
        hf_sdpa.use_gqa_in_sdpa = use_gqa
    del ref, logits
    return out


def compare(lp: torch.Tensor, ref: torch.Tensor) -> dict:
    d = (lp - ref).abs()
    return {"mean_abs_diff": d.mean().item(), "max_abs_diff": d.max().item(),
            "p99_abs_diff": d.quantile(0.99).item() if d.numel() <= 1 << 24 else None,
            "bits_per_base": -lp.mean().item() / math.log(2), "ref_bits_per_base": -ref.mean().item() / math.log(2),
            "ref_logprob_mean": ref.mean().item(), "ref_logprob_std": ref.std().item()}


def markdown(result: dict) -> str:
    lines = [f"Trained-weights log-prob check: {result['meta']['run']} ({result['meta']['gpu']}, "
             f"torch {result['meta']['torch']}, {result['meta']['date']}).", "",
             "| length | megaseq | reference | mean abs diff | max abs diff | bits/base megaseq | bits/base ref |",
             "|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        if r["status"] != "ok":
            lines.append(f"| {r['seq_len']} | {r.get('megaseq', '-')} | - | {r['status']}: {r.get('error', '')} "
                         "| | | |")
            continue
        lines.append(f"| {r['seq_len']:,} | {r['megaseq']} | {r['reference']} | {r['mean_abs_diff']:.3g} | "
                     f"{r['max_abs_diff']:.3g} | {r['bits_per_base']:.4f} | {r['ref_bits_per_base']:.4f} |")
    return "\n".join(lines) + "\n\nTarget: mean abs diff <= 0.04 at 128K and longer.\n"


def run(run_dir: Path, lengths: list[int], out: Path) -> dict:
    import transformers

    hf = run_dir / "hf"
    if not (hf / "config.json").is_file():
        raise SystemExit(f"{run_dir} has no Hugging Face export ({hf}); train with train.export_hf true")
    cfg = build_config(yaml.safe_load((run_dir / "config.yaml").read_text()))
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    result = {"meta": {"run": str(run_dir), "gpu": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                       "torch": torch.__version__, "transformers": transformers.__version__,
                       "python": platform.python_version(),
                       "date": datetime.now(timezone.utc).isoformat(timespec="seconds")}, "rows": []}
    for L in lengths:
        ids = window(cfg, L)
        mode = "bf16 autocast, planned fixes" if device.type == "cuda" else "fp32 (CPU), planned fixes"
        row = {"seq_len": L, "megaseq": mode}
        try:
            lp, memory = megaseq_logprobs(cfg, hf, ids, device, planned=True)
            row["memory"] = {k: v for k, v in memory.items() if v}
            try:
                ref, row["reference"] = reference_logprobs(hf, ids, device), "transformers fp32, SDPA"
            except torch.OutOfMemoryError:
                torch.cuda.empty_cache()
                ref, _ = megaseq_logprobs(cfg, hf, ids, device, planned=False)
                row["reference"] = "megaseq fp32, no fixes (transformers ran out of memory)"
            row.update(status="ok", **compare(lp, ref))
        except torch.OutOfMemoryError as e:
            row.update(status="oom", error=str(e).splitlines()[0][:200])
        result["rows"].append(row)
        if device.type == "cuda":
            torch.cuda.empty_cache()
        out.parent.mkdir(parents=True, exist_ok=True)
        out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
        out.with_suffix(".md").write_text(markdown(result))
        print(markdown(result).splitlines()[-3], flush=True)
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("run_dir", type=Path)
    p.add_argument("--lengths", default="128K,256K", help="comma-separated window lengths")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/long_context/logprob_trained"))
    a = p.parse_args()
    result = run(a.run_dir, [parse_size(s) for s in a.lengths.split(",") if s], a.out)
    print(markdown(result))


if __name__ == "__main__":
    main()
