"""Held-out loss split by position within the window, for checkpoints side by side and a baseline.

Shapes: B batch, S window length (tokens scored per window), NB = ceil(S / bucket_width) buckets.

A model is a callable ``per_token_loss(batch) -> [B, S]`` loss in nats (the trainer builds it from
the model; ``KmerModel.batch_loss`` is one). Position p of a window falls in bucket p // width:
late buckets are the tokens with the longest context, where a long-context model should gain most.
A position counts when its label is not -100 and, for DNA, is an A/C/G/T id (``score_ids``), so
every model and the baseline are scored on exactly the same tokens, also when "before" and
"after" are evaluated at different times. Results are ``PositionLoss`` accumulators (sums and
counts, JSON-serializable) combined by ``compare``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

LossFn = Callable[[dict[str, Any]], Any]


@dataclass
class PositionLoss:
    """Sums and counts of per-token loss (nats) per position bucket and per group (held-out file)."""

    bucket_width: int
    seq_len: int
    sum_nats: np.ndarray = None  # type: ignore[assignment]  # [NB] float64
    count: np.ndarray = None  # type: ignore[assignment]  # [NB] int64
    groups: dict[str, list[float]] = field(default_factory=dict)  # group -> [sum_nats, count]
    num_windows: int = 0
    sum_sq_nats: np.ndarray | None = None  # [NB] float64 sums of squares (standard errors); None: unknown

    def __post_init__(self) -> None:
        if self.bucket_width < 1:
            raise ValueError(f"eval.by_position must be >= 1, got {self.bucket_width}")
        nb = -(-self.seq_len // self.bucket_width)
        fresh = self.sum_nats is None
        self.sum_nats = np.zeros(nb) if fresh else np.asarray(self.sum_nats, np.float64)
        self.count = np.zeros(nb, np.int64) if self.count is None else np.asarray(self.count, np.int64)
        if fresh and self.sum_sq_nats is None:
            self.sum_sq_nats = np.zeros(nb)
        elif self.sum_sq_nats is not None:
            self.sum_sq_nats = np.asarray(self.sum_sq_nats, np.float64)

    def add(self, loss_BS: np.ndarray, mask_BS: np.ndarray, group: str = "heldout") -> None:
        """Accumulate one batch: loss where ``mask`` holds (both ``[B, S]``)."""
        B, S = loss_BS.shape
        assert S == self.seq_len, f"window length {S} != {self.seq_len}"
        bucket_S = np.arange(S) // self.bucket_width
        masked = np.where(mask_BS, loss_BS, 0.0)
        nb = len(self.count)
        self.sum_nats += np.bincount(bucket_S, weights=masked.sum(axis=0), minlength=nb)
        self.count += np.bincount(bucket_S, weights=mask_BS.sum(axis=0), minlength=nb).astype(np.int64)
        if self.sum_sq_nats is not None:
            self.sum_sq_nats += np.bincount(bucket_S, weights=(masked * masked).sum(axis=0), minlength=nb)
        g = self.groups.setdefault(group, [0.0, 0])
        g[0] += float(masked.sum())
        g[1] += int(mask_BS.sum())
        self.num_windows += B

    @property
    def loss(self) -> float:
        """Mean loss (nats) over every scored token."""
        return float(self.sum_nats.sum() / max(int(self.count.sum()), 1))

    def bucket_loss(self) -> np.ndarray:
        """Mean loss (nats) per bucket ``[NB]`` (NaN for a bucket with no scored token)."""
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(self.count > 0, self.sum_nats / np.maximum(self.count, 1), np.nan)

    def to_dict(self) -> dict[str, Any]:
        sq = None if self.sum_sq_nats is None else self.sum_sq_nats.tolist()
        return {"bucket_width": self.bucket_width, "seq_len": self.seq_len, "num_windows": self.num_windows,
                "sum_nats": self.sum_nats.tolist(), "count": self.count.tolist(), "groups": self.groups,
                "sum_sq_nats": sq}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> PositionLoss:
        sq = d.get("sum_sq_nats")  # absent in results written before standard errors were kept
        return cls(d["bucket_width"], d["seq_len"], np.array(d["sum_nats"]), np.array(d["count"]),
                   {k: list(v) for k, v in d["groups"].items()}, d["num_windows"],
                   None if sq is None else np.array(sq))


def _numpy(x: Any) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        return x.detach().to(torch.float64).cpu().numpy()
    return np.asarray(x, np.float64)


def scored_mask(batch: dict[str, Any], score_ids: Sequence[int] | None = None) -> np.ndarray:
    """Which label positions count ``[B, S]`` bool: not -100, and among ``score_ids`` when given."""
    labels = batch["labels"].cpu().numpy()
    mask = labels != -100
    if score_ids is not None:
        mask &= np.isin(labels, np.asarray(score_ids))
    return mask


def _as_groups(batches: Any) -> Mapping[str, Iterable[dict]]:
    return batches if isinstance(batches, Mapping) else {"heldout": batches}


Batches = Mapping[str, Iterable[dict]] | Iterable[dict]


def position_loss(per_token_loss: LossFn, batches: Batches, bucket_width: int,
                  score_ids: Sequence[int] | None = None, name: str = "model") -> PositionLoss:
    """Run ``per_token_loss`` over held-out batches (a list, or a dict group -> batches) and bucket it."""
    out: PositionLoss | None = None
    for group, group_batches in _as_groups(batches).items():
        for batch in group_batches:
            mask = scored_mask(batch, score_ids)
            with torch.no_grad():
                loss = _numpy(per_token_loss(batch))
            if loss.shape != mask.shape:
                raise ValueError(f"{name}: per_token_loss gave shape {loss.shape}, expected {mask.shape}")
            if not np.isfinite(loss[mask]).all():
                raise ValueError(f"{name}: non-finite loss at {int((~np.isfinite(loss[mask])).sum())} scored "
                                 f"positions of group {group!r}")
            if out is None:
                out = PositionLoss(bucket_width, mask.shape[1])
            out.add(loss, mask, group)
    if out is None:
        raise ValueError("no held-out windows to evaluate: set data.heldout or data.heldout_records")
    return out


def _model_entry(r: PositionLoss, unit: str) -> dict[str, Any]:
    per_bit = 1.0 / math.log(2)
    buckets = r.bucket_loss()
    return {
        "loss_nats": r.loss, f"bits_per_{unit}": r.loss * per_bit, "tokens": int(r.count.sum()),
        "bucket_loss_nats": _nan_to_none(buckets), f"bucket_bits_per_{unit}": _nan_to_none(buckets * per_bit),
        "bucket_tokens": r.count.tolist(),
        "groups": {g: {"loss_nats": s / max(n, 1), f"bits_per_{unit}": s / max(n, 1) * per_bit, "tokens": n}
                   for g, (s, n) in r.groups.items()},
    }


def _nan_to_none(a: np.ndarray) -> list[float | None]:
    return [None if not np.isfinite(v) else float(v) for v in a]


def _pick_pair(names: list[str], before: str | None, after: str | None) -> tuple[str, str] | None:
    """The before/after pair: as given, else the models named 'before' and 'after', else none. A caller
    names 'before' only when it is a real model (a checkpoint fine-tuning started from): the drop from
    random weights says nothing about what training learned."""
    if before is None and after is None:
        return ("before", "after") if "before" in names and "after" in names else None
    for n in (before, after):
        if n not in names:
            raise ValueError(f"compare: no results named {n!r}; have {names}")
    return before, after  # type: ignore[return-value]


def compare(results: Mapping[str, PositionLoss], baseline: tuple[str, PositionLoss] | None = None,
            unit: str = "base", before: str | None = None, after: str | None = None,
            descriptions: Mapping[str, str] | None = None, notes: Sequence[str] = ()) -> dict[str, Any]:
    """One JSON-ready result: every model's loss overall and per bucket, the baseline's, each model's
    gain over the baseline (``verdict.baseline_gain``), uniform A/C/G/T for DNA, the relative
    improvement of ``after`` over ``before`` ((before - after) / before) per bucket, and the verdict
    in words. ``descriptions``: what each name is (e.g. 'after 60 steps'); ``notes``: sentences for the report.

    The before/after pair: as given, else the models named 'before' and 'after' (see ``_pick_pair``).
    """
    from megaseq.eval.verdict import UNIFORM_BITS, baseline_gain, relative_change, verdict

    models = dict(results)
    if not models:
        raise ValueError("compare needs at least one model's PositionLoss")
    first = next(iter(models.values()))
    everything = {**models, **({baseline[0]: baseline[1]} if baseline else {})}
    for name, r in everything.items():
        same = (r.bucket_width, r.seq_len) == (first.bucket_width, first.seq_len)
        if not same or not np.array_equal(r.count, first.count):
            raise ValueError(f"{name} was evaluated on other windows or buckets than {next(iter(models))}; "
                             f"evaluate every model on the same held-out windows and eval.by_position")
    width, nb = first.bucket_width, len(first.count)
    out: dict[str, Any] = {
        "unit": unit, "bucket_width": first.bucket_width, "seq_len": first.seq_len,
        "num_windows": first.num_windows, "tokens": int(first.count.sum()),
        "buckets": [[i * width, min((i + 1) * width, first.seq_len)] for i in range(nb)],
        "models": {name: _model_entry(r, unit) for name, r in everything.items()},
        "model_names": list(models), "baseline": baseline[0] if baseline else None,
        "uniform_bits": UNIFORM_BITS.get(unit), "descriptions": dict(descriptions or {}), "notes": list(notes),
    }
    if baseline:
        out["gain_over_baseline"] = {name: baseline_gain(r, baseline[1]) for name, r in models.items()}
    pair = _pick_pair(list(models), before, after)
    if pair:
        b, a = models[pair[0]], models[pair[1]]
        with np.errstate(invalid="ignore", divide="ignore"):
            rel = (b.bucket_loss() - a.bucket_loss()) / b.bucket_loss()
        change = relative_change(b, a)
        out["relative_improvement"] = {"before": pair[0], "after": pair[1], "overall": change["overall"],
                                       "overall_se": change["overall_se"], "buckets": _nan_to_none(rel)}
    out["verdict"] = verdict(out)
    return out


def evaluate_by_position(models: Mapping[str, LossFn], batches: Batches, bucket_width: int,
                         baseline: tuple[str, LossFn] | None = None, score_ids: Sequence[int] | None = None,
                         unit: str = "base", **compare_kw: Any) -> dict[str, Any]:
    """Evaluate several loss functions (and a baseline) on the same batches and ``compare`` them
    (``compare_kw``: its before, after, descriptions, notes).

    ``batches`` must be re-iterable (a list, or ``data.EvalBatches`` per group).
    """
    results = {name: position_loss(fn, batches, bucket_width, score_ids, name) for name, fn in models.items()}
    base = None
    if baseline is not None:
        base = (baseline[0], position_loss(baseline[1], batches, bucket_width, score_ids, baseline[0]))
    return compare(results, base, unit, **compare_kw)
