"""Run the protocol's evaluation on held-out data: every model, the k-mer baseline, the ablation, the oracle.

``run_protocol(models, data, settings, out_dir)`` scores named per-token loss functions (``before``,
``after``, ``control``: ``eval.loss.per_token_loss_fn`` of each checkpoint) on ``data``'s held-out
windows, writes ``eval_protocol.{json,md,png}`` and, beside them, the classic ``eval_by_position`` report
of the same scores (``by_position.compare``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from megaseq.eval.ablation import ablation_block, score_ablation
from megaseq.eval.by_position import LossFn, compare
from megaseq.eval.copy_oracle import copy_oracle
from megaseq.eval.protocol import protocol_result
from megaseq.eval.protocol_report import write_protocol_report
from megaseq.eval.report import write_report
from megaseq.eval.spread import WindowBuckets, window_buckets


@dataclass
class ProtocolSettings:
    """What the protocol's evaluation measures beside the models' bits by position."""

    bucket_width: int  # position bucket width (eval.by_position)
    batch_size: int = 1  # held-out windows per forward pass
    kmer_k: int = 8  # order of the k-mer baseline fitted on the training genomes (0: none)
    ablation_cut_to: int = 0  # context ablation: tokens of context the cut arm keeps (0: no ablation)
    ablation_chunk: int = 0  # tokens scored per forward of the cut arm (0: ablation_cut_to // 2)
    ablation_model: str = "after"  # the model whose context is cut
    oracle_k: int = 20  # copy oracle: k-mer length (0: no oracle)
    oracle_distance: int = 16384  # copy oracle: how far back the earlier occurrence must be

    def __post_init__(self) -> None:
        for name in ("bucket_width", "batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"eval protocol: {name} must be >= 1, got {getattr(self, name)}")
        if self.ablation_cut_to < 0 or self.ablation_chunk < 0:
            raise ValueError("--ablation-cut-to and --ablation-chunk must be >= 0 (0: no ablation / cut_to // 2)")
        if not 0 <= self.oracle_k <= 20:
            raise ValueError(f"--oracle-k must be in 0..20 (0: no copy oracle), got {self.oracle_k}")

    @property
    def chunk(self) -> int:
        return self.ablation_chunk or max(self.ablation_cut_to // 2, 1)


def _merge(parts: list[WindowBuckets]) -> WindowBuckets:
    """The windows of several groups as one set (every group scored at the same length and buckets)."""
    out = WindowBuckets(parts[0].bucket_width, parts[0].seq_len)
    for p in parts:
        out.sum_nats += p.sum_nats
        out.count += p.count
    return out


@dataclass
class _Scored:
    """One group's scores: every model, the baseline, the ablation's two arms."""

    models: dict[str, WindowBuckets]
    baseline: tuple[str, WindowBuckets] | None
    ablation: tuple[WindowBuckets, WindowBuckets, list[int]] | None


def _score(models: Mapping[str, LossFn], kmer: Any, batches: list[dict[str, Any]], settings: ProtocolSettings,
           score_ids: Any) -> _Scored:
    width = settings.bucket_width
    scores = {name: window_buckets(fn, batches, width, score_ids, name) for name, fn in models.items()}
    baseline = (kmer.name, window_buckets(kmer.batch_loss, batches, width, score_ids)) if kmer is not None else None
    ablation = None
    if settings.ablation_cut_to:
        ablation = score_ablation(models[settings.ablation_model], batches, width, settings.ablation_cut_to,
                                  settings.chunk, score_ids)
    return _Scored(scores, baseline, ablation)


def _result(s: _Scored, batches: list[dict[str, Any]], settings: ProtocolSettings, score_ids: Any,
            descriptions: Mapping[str, str] | None) -> dict[str, Any]:
    ablation = None
    if s.ablation is not None:
        ablation = ablation_block(*s.ablation, settings.ablation_cut_to, settings.chunk, settings.ablation_model)
    oracle = None
    if settings.oracle_k:
        oracle = copy_oracle(batches, settings.bucket_width, settings.oracle_k, settings.oracle_distance, score_ids)
    return protocol_result(s.models, s.baseline, ablation, oracle, descriptions)


def run_protocol(models: Mapping[str, LossFn], data: Any, settings: ProtocolSettings, out_dir: str | Path,
                 descriptions: Mapping[str, str] | None = None, kmer: Any = None) -> dict[str, Any]:
    """Score ``models`` on ``data``'s held-out windows (a ``megaseq.data.Data``), write both reports to
    ``out_dir``, and return the protocol's result."""
    from megaseq.eval import build_kmer_baseline

    if data.unit != "base":
        raise ValueError("the long-context protocol evaluates DNA (data.kind fasta, data.tokenizer dna)")
    if settings.ablation_cut_to and settings.ablation_model not in models:
        raise ValueError(f"--ablation-model {settings.ablation_model!r} is not among the models {list(models)}")
    groups = {g: list(b) for g, b in data.heldout_batches(settings.batch_size).items()}
    if not any(groups.values()):
        raise ValueError("eval: no held-out data; pass --data FILE or set data.heldout in the run's config")
    kmer = kmer if kmer is not None else build_kmer_baseline(data, settings.kmer_k)
    scored = {g: _score(models, kmer, b, settings, data.score_ids) for g, b in groups.items() if b}
    parts = list(scored.values())
    merged = _Scored({n: _merge([p.models[n] for p in parts]) for n in models},
                     (parts[0].baseline[0], _merge([p.baseline[1] for p in parts])) if kmer is not None else None,
                     None if parts[0].ablation is None else
                     (_merge([p.ablation[0] for p in parts]), _merge([p.ablation[1] for p in parts]),
                      parts[0].ablation[2]))
    result = _result(merged, [b for bs in groups.values() for b in bs], settings, data.score_ids, descriptions)
    if len(scored) > 1:  # each held-out group on its own (e.g. a genome after its relatives, and alone)
        result["groups"] = {g: _result(s, groups[g], settings, data.score_ids, descriptions)
                            for g, s in scored.items()}
    baseline, scores = merged.baseline, merged.models
    write_protocol_report(result, out_dir)
    def by_group(pick: Any) -> Any:  # the classic report's accumulator, its per-group sums kept
        pl = pick(merged).position_loss()
        pl.groups = {g: [float(np.sum(pick(s).sum_nats)), int(np.sum(pick(s).count))] for g, s in scored.items()}
        return pl

    classic = compare({n: by_group(lambda s, n=n: s.models[n]) for n in scores},
                      (baseline[0], by_group(lambda s: s.baseline[1])) if baseline else None, "base",
                      descriptions=descriptions)
    write_report(classic, out_dir)
    return result
