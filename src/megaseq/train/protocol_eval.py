"""``megaseq eval before=A,after=B,control=C``: the long-context protocol's evaluation of named models.

    megaseq eval before=runs/start,after=runs/long,control=runs/control --ablation-cut-to 16K

Each name points at a run directory (its newest complete checkpoint) or a checkpoint directory. The
held-out data, window length and buckets come from the resolved config of the run ``after`` belongs to
(else the first run named), so every model is scored on the same held-out windows; ``--data`` replaces
the held-out files. Writes ``eval_protocol.{json,md,png}`` and ``eval_by_position.{json,md,png}``
(``eval.protocol_run``).
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


def parse_named(targets: list[str]) -> dict[str, Path]:
    """['before=runs/a', 'after=runs/b'] -> {'before': Path('runs/a'), ...}; every target must be named."""
    out: dict[str, Path] = {}
    for t in targets:
        name, sep, path = t.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"eval: {t!r} is not NAME=PATH; name every model (before=RUN,after=RUN,control=RUN) "
                             "or none")
        if name in out:
            raise ValueError(f"eval: the name {name!r} is given twice")
        if not Path(path).exists():
            raise ValueError(f"eval: {name}={path} does not exist")
        out[name] = Path(path)
    return out


def _checkpoint(path: Path) -> Path:
    if (path / ckpt.META).is_file():
        return path
    found = ckpt.list_complete(path)
    if not found:
        raise ValueError(f"eval: {path} is neither a checkpoint nor a run directory with a complete checkpoint")
    return found[-1][1]


def _segment(run_dir: Path | None, default: int) -> int:
    plan = run_dir / "plan.json" if run_dir is not None else None
    if plan is not None and plan.is_file():
        return int(json.loads(plan.read_text()).get("memory", {}).get("model_segment_tokens") or default)
    return default


def evaluate_protocol(targets: list[str], data: list[str] | None = None, overrides: list[str] | None = None,
                      out: str | None = None, **settings: Any) -> str:
    """Score the named models (``parse_named``) on the held-out windows; ``settings``: ``ProtocolSettings``'
    ablation and oracle fields. Returns the markdown report and where the files are."""
    from megaseq.data import build_data
    from megaseq.eval.loss import per_token_loss_fn
    from megaseq.eval.protocol_report import STEM, protocol_markdown
    from megaseq.eval.protocol_run import ProtocolSettings, run_protocol
    from megaseq.train.convert import load_megaseq_checkpoint
    from megaseq.train.parallel_env import ParallelEnv

    named = {n: _checkpoint(p) for n, p in parse_named(targets).items()}
    source = named.get("after", next(iter(named.values())))
    run_dir = ckpt.run_dir_of(source)
    if run_dir is None and not data:
        raise ValueError(f"{source} is not inside a run directory, so it has no held-out data: pass --data")
    raw: dict[str, Any] = yaml.safe_load((run_dir / "config.yaml" if run_dir else Path(default_recipe())).read_text())
    extra = list(overrides or [])
    if data:
        extra += [f"data.heldout={','.join(data)}", "data.heldout_records=[]", "data.heldout_tail=0"]
    cfg = build_config(raw, extra)
    cfg = dataclasses.replace(cfg, eval=resolve_eval(cfg.eval, cfg.data))  # what is unset follows the data
    probe = ProtocolSettings(bucket_width=cfg.eval.by_position, batch_size=cfg.eval.batch_size,
                             kmer_k=cfg.eval.kmer_k, **settings)  # bad settings fail before any model loads
    device = "cuda" if torch.cuda.is_available() else "cpu"
    env = ParallelEnv(torch.device(device))
    autocast = torch.bfloat16 if device == "cuda" and cfg.model.dtype == "bf16" else None
    segment = _segment(run_dir, cfg.memory.model_segment_tokens)
    models, descriptions, spec = {}, {}, None
    for name, path in named.items():
        model, spec, _ = load_megaseq_checkpoint(path, device=device)
        models[name] = per_token_loss_fn(model.eval(), env, autocast, cfg.memory.loss_chunk_tokens, segment)
        descriptions[name] = f"{path} (step {ckpt.read_meta(path).get('step', '?')})"
    dataset = build_data(cfg.data, cfg.eval, vocab_size=spec.vocab_size)
    out_dir = Path(out) if out else (run_dir or source.parent.parent) / "eval"
    result = run_protocol(models, dataset, probe, out_dir, descriptions)
    return protocol_markdown(result) + f"\nwrote {out_dir / STEM}.json, .md, .png and eval_by_position.json, .md, .png"
