"""Held-out loss per window and position bucket, so that a difference can be told from noise.

Shapes: W windows, S window length (tokens scored per window), NB = ceil(S / bucket_width) buckets.

``PositionLoss`` (``by_position``) keeps sums over every window; this module keeps them per window
(``WindowBuckets``), so a bucket's standard error is the spread of its per-window bits across windows
(``std / sqrt(W)``), not a per-token error that treats the correlated tokens of one window as
independent. Two models scored on the same windows are compared window by window (``paired_gain``):
the error of their difference is the spread of the per-window differences.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from megaseq.eval.by_position import LossFn, PositionLoss, scored_mask

BITS = 1.0 / math.log(2)


@dataclass
class WindowBuckets:
    """Per-window sums and counts of per-token loss (nats) by position bucket."""

    bucket_width: int
    seq_len: int
    sum_nats: list[np.ndarray] = field(default_factory=list)  # W x [NB] float64
    count: list[np.ndarray] = field(default_factory=list)  # W x [NB] int64

    @property
    def num_buckets(self) -> int:
        return -(-self.seq_len // self.bucket_width)

    def add(self, loss_BS: np.ndarray, mask_BS: np.ndarray) -> None:
        """One batch: loss where ``mask`` holds, each row a window of its own."""
        B, S = loss_BS.shape
        assert S == self.seq_len, f"window length {S} != {self.seq_len}"
        bucket_S = np.arange(S) // self.bucket_width
        for b in range(B):
            row = np.where(mask_BS[b], loss_BS[b], 0.0)
            self.sum_nats.append(np.bincount(bucket_S, weights=row, minlength=self.num_buckets))
            self.count.append(np.bincount(bucket_S, weights=mask_BS[b], minlength=self.num_buckets).astype(np.int64))

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """(sum_nats ``[W, NB]``, count ``[W, NB]``)."""
        if not self.sum_nats:
            raise ValueError("no held-out windows were scored: set data.heldout or data.heldout_records")
        return np.stack(self.sum_nats), np.stack(self.count)

    def window_bits(self, buckets: Sequence[int] | None = None) -> np.ndarray:
        """Bits per base of each window over ``buckets`` (all: None) ``[W]``; NaN for a window with no token."""
        s_WN, n_WN = self.arrays()
        sel = slice(None) if buckets is None else list(buckets)
        s_W, n_W = s_WN[:, sel].sum(axis=1), n_WN[:, sel].sum(axis=1)
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(n_W > 0, s_W / np.maximum(n_W, 1), np.nan) * BITS

    def bucket_window_bits(self) -> np.ndarray:
        """Bits per base of each window in each bucket ``[W, NB]`` (NaN where a window scores no token)."""
        s_WN, n_WN = self.arrays()
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(n_WN > 0, s_WN / np.maximum(n_WN, 1), np.nan) * BITS

    def position_loss(self) -> PositionLoss:
        """The same scores summed over windows, for ``by_position.compare`` and its report."""
        s_WN, n_WN = self.arrays()
        out = PositionLoss(self.bucket_width, self.seq_len)
        out.sum_nats, out.count, out.num_windows = s_WN.sum(axis=0), n_WN.sum(axis=0), len(s_WN)
        out.sum_sq_nats = None  # per-token squares are not kept: the spread here is across windows
        out.groups = {"heldout": [float(s_WN.sum()), int(n_WN.sum())]}
        return out

    def summary(self) -> dict[str, Any]:
        """``bits_per_base`` and ``bucket_bits_per_base`` (token-weighted, as ``PositionLoss``), each bucket's
        standard error across windows, and the per-window values behind them."""
        s_WN, n_WN = self.arrays()
        n_N = n_WN.sum(axis=0)
        with np.errstate(invalid="ignore", divide="ignore"):
            bucket = np.where(n_N > 0, s_WN.sum(axis=0) / np.maximum(n_N, 1), np.nan) * BITS
        per_window = self.bucket_window_bits()
        overall = self.window_bits()
        return {
            "bits_per_base": float(s_WN.sum() / max(int(n_N.sum()), 1) * BITS),
            "bits_per_base_se": _se(overall),
            "bucket_bits_per_base": _clean(bucket), "bucket_se": [_se(per_window[:, i]) for i in range(len(n_N))],
            "bucket_tokens": [int(v) for v in n_N], "num_windows": int(len(s_WN)),
            "window_bits_per_base": _clean(overall), "window_bucket_bits_per_base": [_clean(r) for r in per_window],
        }


def _clean(a: np.ndarray) -> list[float | None]:
    return [float(v) if np.isfinite(v) else None for v in np.asarray(a, np.float64)]


def _se(values_W: np.ndarray) -> float | None:
    """Standard error of the mean across windows (None with fewer than two finite values)."""
    v = np.asarray(values_W, np.float64)
    v = v[np.isfinite(v)]
    return float(v.std(ddof=1) / math.sqrt(len(v))) if len(v) >= 2 else None


def paired_gain(base_W: np.ndarray, model_W: np.ndarray) -> tuple[float | None, float | None]:
    """``base - model`` averaged over the windows both score, and its standard error across windows."""
    d = np.asarray(base_W, np.float64) - np.asarray(model_W, np.float64)
    d = d[np.isfinite(d)]
    if not len(d):
        return None, None
    return float(d.mean()), _se(d)


def beyond_noise(value: float | None, se: float | None) -> bool:
    """A difference counts when it is more than two standard errors from zero."""
    return value is not None and se is not None and abs(value) > 2 * se


def window_buckets(per_token_loss: LossFn, batches: Iterable[dict[str, Any]] | Mapping[str, Iterable[dict]],
                   bucket_width: int, score_ids: Sequence[int] | None = None,
                   name: str = "model") -> WindowBuckets:
    """Run ``per_token_loss`` over held-out batches (a list, or a dict group -> batches), window by window."""
    groups = batches if isinstance(batches, Mapping) else {"heldout": batches}
    out: WindowBuckets | None = None
    for group, group_batches in groups.items():
        for batch in group_batches:
            mask = scored_mask(batch, score_ids)
            with torch.no_grad():
                loss = per_token_loss(batch)
            loss = loss.detach().double().cpu().numpy() if isinstance(loss, torch.Tensor) else np.asarray(loss)
            if loss.shape != mask.shape:
                raise ValueError(f"{name}: per_token_loss gave shape {loss.shape}, expected {mask.shape}")
            if not np.isfinite(loss[mask]).all():
                raise ValueError(f"{name}: non-finite loss at scored positions of group {group!r}")
            if out is None:
                out = WindowBuckets(bucket_width, mask.shape[1])
            out.add(loss, mask)
    if out is None:
        raise ValueError("no held-out windows to evaluate: set data.heldout or data.heldout_records")
    return out
