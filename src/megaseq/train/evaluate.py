"""``megaseq eval``: held-out loss by position for a run (before vs after) or named checkpoints.

    megaseq eval runs/r1                                  # the start vs the newest checkpoint of the run
    megaseq eval runs/r1 --data held-out.fa --by-position 32K
    megaseq eval runs/a/checkpoints/step_000000,runs/a/checkpoints/step_000300

The data settings come from the run's resolved config (``RUN/config.yaml``), so the held-out split
and tokenizer are the ones the run used; ``--data`` replaces the held-out files.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch
import yaml

from megaseq.config import build_config, default_recipe
from megaseq.train import checkpoint as ckpt
from megaseq.train.family_settings import resolve_eval


def _checkpoints(targets: list[Path]) -> tuple[dict[str, Path], dict[str, Any]]:
    """The checkpoints to evaluate by name, and ``compare``'s arguments: the before/after pair only
    between real models (a random initialisation is shown, never a 'before'), what each name is, notes."""
    from megaseq.train.heldout import RANDOM_INIT_NOTE

    if len(targets) == 1 and (targets[0] / "config.yaml").is_file():
        found = ckpt.list_complete(targets[0])
        if not found:
            raise ValueError(f"run directory {targets[0]} has no complete checkpoint to evaluate")
        out, kw = {}, {"descriptions": {"after": f"step {found[-1][0]}"}, "notes": []}
        if found[0][0] == 0 and len(found) > 1:
            if ckpt.is_random_init(ckpt.read_meta(found[0][1])):
                kw["notes"].append(RANDOM_INIT_NOTE)
            else:
                out["before"] = found[0][1]
                kw["descriptions"]["before"] = "step 0, the checkpoint fine-tuning started from"
        elif found[0][0] != 0:
            run_cfg = yaml.safe_load((targets[0] / "config.yaml").read_text()) or {}
            started = (run_cfg.get("model") or {}).get("init_from")
            kw["notes"].append(RANDOM_INIT_NOTE if not started else
                               f"No 'before' column: the run kept no step-0 checkpoint of {started}.")
        out["after"] = found[-1][1]
        return out, kw
    metas = {t.name: ckpt.read_meta(t) for t in targets}  # refuses incomplete or foreign directories
    real = [n for n, m in metas.items() if not ckpt.is_random_init(m)]
    kw = {"descriptions": {n: "random initialisation" for n in metas if n not in real}, "notes": []}
    if len(real) >= 2:
        kw["before"], kw["after"] = real[0], real[-1]
    return {t.name: t for t in targets}, kw


def evaluate_targets(targets: list[str], data: list[str] | None = None, overrides: list[str] | None = None,
                     out: str | None = None) -> str:
    from megaseq.data import build_data
    from megaseq.eval import markdown_table, report_by_position
    from megaseq.eval.loss import per_token_loss_fn
    from megaseq.train.convert import load_megaseq_checkpoint
    from megaseq.train.parallel_env import ParallelEnv

    paths = [Path(t) for t in targets]
    for p in paths:
        if not p.exists():
            raise ValueError(f"eval: {p} does not exist")
    run_dir = ckpt.run_dir_of(paths[0])
    if run_dir is None:
        if not data:
            raise ValueError(f"{paths[0]} is not inside a run directory, so it has no held-out data: pass --data")
        raw: dict[str, Any] = yaml.safe_load(Path(default_recipe()).read_text())
    else:
        raw = yaml.safe_load((run_dir / "config.yaml").read_text())
    extra = list(overrides or [])
    if data:
        extra += [f"data.heldout={','.join(data)}", "data.heldout_records=[]", "data.heldout_tail=0"]
    cfg = build_config(raw, extra)
    cfg = dataclasses.replace(cfg, eval=resolve_eval(cfg.eval, cfg.data))  # what is unset follows the data
    device = "cuda" if torch.cuda.is_available() else "cpu"
    env = ParallelEnv(torch.device(device))
    autocast = torch.bfloat16 if device == "cuda" and cfg.model.dtype == "bf16" else None
    # a run trained in sequence segments is evaluated in them too (its plan says how long)
    plan_file = run_dir / "plan.json" if run_dir is not None else None
    segment = cfg.memory.model_segment_tokens
    if plan_file is not None and plan_file.is_file():
        segment = int(json.loads(plan_file.read_text()).get("memory", {}).get("model_segment_tokens") or segment)
    models, spec = {}, None
    targets_by_name, compare_kw = _checkpoints(paths)
    for name, path in targets_by_name.items():
        model, spec, _ = load_megaseq_checkpoint(path, device=device)
        models[name] = per_token_loss_fn(model.eval(), env, autocast, cfg.memory.loss_chunk_tokens, segment)
    dataset = build_data(cfg.data, cfg.eval, vocab_size=spec.vocab_size)
    if not dataset.heldout:
        raise ValueError("eval: no held-out data; pass --data FILE or set data.heldout in the run's config")
    out_dir = Path(out) if out else (run_dir or paths[0].parent.parent) / "eval"
    report = report_by_position(models, dataset, cfg.eval, out_dir, **compare_kw)
    stem = out_dir / "eval_by_position"
    return markdown_table(report) + f"\nwrote {stem}.json, .md, .png"
