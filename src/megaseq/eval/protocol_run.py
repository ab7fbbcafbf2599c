"""Run the protocol's evaluation on held-out data: every model, the k-mer baseline, the ablation, the oracle.

``run_protocol(models, data, settings, out_dir)`` scores named per-token loss functions (``before``,
``after``, ``control``: ``eval.loss.per_token_loss_fn`` of each checkpoint) on ``data``'s held-out
windows, writes ``eval_protocol.{json,md,png}`` and, beside them, the classic ``eval_by_position`` report
of the same scores (``by_position.compare``).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megaseq.eval.ablation import ablation_block, score_ablation
from megaseq.eval.by_position import LossFn, compare
from megaseq.eval.copy_oracle import copy_oracle
from megaseq.eval.protocol import protocol_result
from megaseq.eval.protocol_report import write_protocol_report
from megaseq.eval.report import write_report
from megaseq.eval.spread import window_buckets


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


def _flat(batches: Mapping[str, Iterable[dict]]) -> list[dict[str, Any]]:
    return list(itertools.chain.from_iterable(batches.values()))


def run_protocol(models: Mapping[str, LossFn], data: Any, settings: ProtocolSettings, out_dir: str | Path,
                 descriptions: Mapping[str, str] | None = None, kmer: Any = None) -> dict[str, Any]:
    """Score ``models`` on ``data``'s held-out windows (a ``megaseq.data.Data``), write both reports to
    ``out_dir``, and return the protocol's result."""
    from megaseq.eval import build_kmer_baseline

    if data.unit != "base":
        raise ValueError("the long-context protocol evaluates DNA (data.kind fasta, data.tokenizer dna)")
    if settings.ablation_cut_to and settings.ablation_model not in models:
        raise ValueError(f"--ablation-model {settings.ablation_model!r} is not among the models {list(models)}")
    batches = _flat(data.heldout_batches(settings.batch_size))
    if not batches:
        raise ValueError("eval: no held-out data; pass --data FILE or set data.heldout in the run's config")
    scores = {name: window_buckets(fn, batches, settings.bucket_width, data.score_ids, name)
              for name, fn in models.items()}
    kmer = kmer if kmer is not None else build_kmer_baseline(data, settings.kmer_k)
    baseline = None
    if kmer is not None:
        baseline = (kmer.name, window_buckets(kmer.batch_loss, batches, settings.bucket_width, data.score_ids))
    ablation = None
    if settings.ablation_cut_to:
        full, cut, chosen = score_ablation(models[settings.ablation_model], batches, settings.bucket_width,
                                           settings.ablation_cut_to, settings.chunk, data.score_ids)
        ablation = ablation_block(full, cut, chosen, settings.ablation_cut_to, settings.chunk,
                                  settings.ablation_model)
    oracle = None
    if settings.oracle_k:
        oracle = copy_oracle(batches, settings.bucket_width, settings.oracle_k, settings.oracle_distance,
                             data.score_ids)
    result = protocol_result(scores, baseline, ablation, oracle, descriptions)
    write_protocol_report(result, out_dir)
    classic = compare({n: s.position_loss() for n, s in scores.items()},
                      (baseline[0], baseline[1].position_loss()) if baseline else None, "base",
                      descriptions=descriptions)
    write_report(classic, out_dir)
    return result
