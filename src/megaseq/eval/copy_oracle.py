"""A copy oracle by bucket: what long context could gain on the held-out windows at all.

Shapes: L window tokens (inputs plus the last label), S = L - 1 scored positions, NB buckets.

For each scored position p (its label is token p + 1), the oracle asks whether the k-mer ending at p
(tokens ``p-k+1 .. p``, A/C/G/T only) occurred more than ``min_distance`` tokens earlier in the window;
if so it predicts the token that followed the latest such occurrence. Reported per bucket: the share of
positions with a far copy, how often the copied token is right, and the bits of a simple copy model
(the right token with the oracle's own accuracy where there is a copy, uniform 2 bits elsewhere). A
model cannot gain from long context where this oracle finds nothing to copy.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from megaseq.data.tokenizer import A_ID
from megaseq.eval.by_position import scored_mask

POS_BITS = 21  # window positions below 2**21 (2M tokens) share an int64 key with a k-mer code of 2k <= 40 bits


def kmer_codes(tokens_L: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """(code of the k-mer ending at each position ``[L]`` int64, valid ``[L]``: k A/C/G/T bases end there)."""
    b = np.asarray(tokens_L, np.int64) - A_ID
    bad = (b < 0) | (b > 3)
    clean = np.where(bad, 0, b)
    L = len(b)
    code = np.zeros(L, np.int64)
    for j in range(k):  # code[p] holds tokens p-k+1 .. p, the oldest in the high bits
        shifted = np.zeros(L, np.int64)
        shifted[k - 1 - j:] = clean[:L - (k - 1 - j)] if k - 1 - j < L else 0
        code = (code << 2) | shifted
    bad_run = np.concatenate([[0], np.cumsum(bad)])
    valid = np.zeros(L, bool)
    valid[k - 1:] = (bad_run[k:] - bad_run[:L - k + 1]) == 0
    return code, valid


def far_copy(tokens_L: np.ndarray, k: int, min_distance: int) -> np.ndarray:
    """For each position p, the token after the latest earlier occurrence q of the k-mer ending at p with
    ``p - q > min_distance``; -1 where there is none ``[L]``."""
    L = len(tokens_L)
    if L >= 1 << POS_BITS or k > 20:
        raise ValueError(f"copy oracle: windows up to {1 << POS_BITS} tokens and k <= 20 (got {L}, k={k})")
    code, valid = kmer_codes(tokens_L, k)
    pos = np.flatnonzero(valid[:-1])  # an occurrence needs a following token to copy
    keys = np.sort((code[pos] << POS_BITS) | pos)
    out = np.full(L, -1, np.int64)
    query = np.flatnonzero(valid & (np.arange(L) > min_distance))
    if not len(query) or not len(keys):
        return out
    q_key = (code[query] << POS_BITS) | (query - min_distance - 1)
    idx = np.searchsorted(keys, q_key, side="right") - 1
    ok = idx >= 0
    hit = keys[np.maximum(idx, 0)]
    ok &= (hit >> POS_BITS) == code[query]
    src = hit & ((1 << POS_BITS) - 1)
    out[query[ok]] = np.asarray(tokens_L)[src[ok] + 1]
    return out


def copy_oracle(batches: Iterable[dict[str, Any]], bucket_width: int, k: int = 20, min_distance: int = 16384,
                score_ids: Sequence[int] | None = None) -> dict[str, Any]:
    """The oracle's block over held-out batches: per bucket the scored tokens, the share with a far copy, the
    copy's accuracy and the copy model's bits per base."""
    have = right = total = None
    for batch in batches:
        mask_BS = scored_mask(batch, score_ids)
        ids, labels = batch["input_ids"].cpu().numpy(), batch["labels"].cpu().numpy()
        S = mask_BS.shape[1]
        bucket_S = np.arange(S) // bucket_width
        nb = -(-S // bucket_width)
        if total is None:
            have, right, total = np.zeros(nb), np.zeros(nb), np.zeros(nb)
        for b in range(len(ids)):
            tokens = np.concatenate([ids[b], labels[b, -1:]])  # labels are the inputs shifted by one
            tokens[-1] = tokens[-1] if labels[b, -1] >= 0 else -1
            pred_S = far_copy(tokens, k, min_distance)[:S]
            m = mask_BS[b]
            has = m & (pred_S >= 0)
            total += np.bincount(bucket_S, weights=m, minlength=nb)
            have += np.bincount(bucket_S, weights=has, minlength=nb)
            right += np.bincount(bucket_S, weights=has & (pred_S == labels[b]), minlength=nb)
    if total is None:
        raise ValueError("copy oracle: no held-out windows")
    acc = right.sum() / max(have.sum(), 1)
    p = min(max(acc, 1e-6), 1 - 1e-6)  # the copy model: the copied token with the oracle's own accuracy
    right_bits, wrong_bits = -math.log2(p), -math.log2((1 - p) / 3)
    with np.errstate(invalid="ignore", divide="ignore"):
        bits = (right * right_bits + (have - right) * wrong_bits + (total - have) * 2.0) / total
        share, bucket_acc = have / total, right / have
    clean = lambda a: [float(v) if np.isfinite(v) else None for v in a]  # noqa: E731
    return {"k": k, "min_distance": min_distance, "accuracy": float(acc) if have.sum() else None,
            "share_with_copy": clean(share), "copy_accuracy": clean(bucket_acc), "bits_per_base": clean(bits),
            "bucket_tokens": [int(v) for v in total],
            "overall_bits_per_base": float((right.sum() * right_bits + (have.sum() - right.sum()) * wrong_bits
                                            + (total.sum() - have.sum()) * 2.0) / max(total.sum(), 1)),
            "overall_share_with_copy": float(have.sum() / max(total.sum(), 1))}
