"""Evaluation: held-out loss by position, bits per base, the k-mer Markov baseline, reports.

Typical use at the end of a run (the trainer supplies ``per_token_loss`` from the model)::

    data = build_data(cfg.data, cfg.eval)
    batches = data.heldout_batches()
    before = position_loss(loss_fn, batches, cfg.eval.by_position, data.score_ids, "before")
    ...train...
    after = position_loss(loss_fn, batches, cfg.eval.by_position, data.score_ids, "after")
    kmer = build_kmer_baseline(data, cfg.eval.kmer_k)
    base = (kmer.name, position_loss(kmer.batch_loss, batches, ...)) if kmer else None
    write_report(compare({"before": before, "after": after}, base, data.unit), run_dir)

"before" belongs in a report only when it is a real model (the checkpoint fine-tuning started from):
the drop from random weights (4 bits per base, uniform over 16 symbols) to anything says nothing.
``compare`` adds each model's gain over the baseline and the verdict in words (``eval.verdict``).
"""

from __future__ import annotations

from typing import Any

from megaseq.eval.by_position import PositionLoss, compare, evaluate_by_position, position_loss, scored_mask
from megaseq.eval.kmer import KmerModel
from megaseq.eval.report import markdown_table, plot_by_position, write_atomic, write_json, write_report

__all__ = [
    "KmerModel", "PositionLoss", "build_kmer_baseline", "compare", "evaluate_by_position", "markdown_table",
    "report_by_position",
    "plot_by_position", "position_loss", "scored_mask", "write_atomic", "write_json", "write_report",
]


def build_kmer_baseline(data: Any, k: int, reverse_complement_too: bool | None = None) -> KmerModel | None:
    """The k-mer baseline fit on ``data.train_records`` (a ``megaseq.data.Data``); None when k is 0 or the
    data are not single-nucleotide DNA. Both strands are counted when the training windows use them
    (``data.train.complement``), unless ``reverse_complement_too`` says otherwise."""
    if k <= 0 or data.unit != "base" or not data.train_records:
        return None
    if reverse_complement_too is None:
        reverse_complement_too = getattr(data.train, "complement", None) is not None
    return KmerModel(k).fit(data.train_records, reverse_complement_too=reverse_complement_too)


def report_by_position(models: dict[str, Any], data: Any, eval_cfg: Any, out_dir: Any, kmer: Any = None,
                       **compare_kw: Any) -> dict[str, Any]:
    """Evaluate named per-token loss functions on ``data``'s held-out windows beside the k-mer baseline
    (DNA; ``kmer``: one already fitted, else fit here), and write the JSON, markdown and PNG report to
    ``out_dir``; returns the result. ``compare_kw``: ``compare``'s before, after, descriptions, notes."""
    assert eval_cfg.by_position is not None and eval_cfg.kmer_k is not None, "eval settings resolved for the data first"
    kmer = kmer if kmer is not None else build_kmer_baseline(data, eval_cfg.kmer_k)
    baseline = (kmer.name, kmer.batch_loss) if kmer is not None else None
    compare_kw["notes"] = [*compare_kw.get("notes", ()), *getattr(data, "notes", ())]
    report = evaluate_by_position(models, data.heldout_batches(eval_cfg.batch_size), eval_cfg.by_position,
                                  baseline, data.score_ids, data.unit, **compare_kw)
    write_report(report, out_dir)
    return report
