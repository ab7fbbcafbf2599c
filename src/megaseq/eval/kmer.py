"""Order-k Markov baseline for DNA: the number a long-context model has to beat.

P(x_t | c), c = the k bases before x_t, over A C G T, from counts on the training records.
Smoothing ``interpolated`` (default; deleted interpolation)::

    P_j(x | c_j) = lam_j[n(c_j)] * n(c_j, x) / n(c_j) + (1 - lam_j[n(c_j)]) * P_{j-1}(x | c_{j-1})
    P_j = P_{j-1} where n(c_j) = 0;     P_{-1} = 1/4

(c_j: the j bases before x). The weights lam_j depend on the order and on the context count's
power-of-two bucket, and are fit by EM on a sample of the training positions with each position's
own count left out (leave-one-out), so no data is set aside. Where long contexts only repeat by
chance, lam goes to 0 and a large k costs nothing; where they repeat for real (repeats, related
strains), lam goes to 1. ``add_alpha`` uses only the longest context: (n(c, x) + a) / (n(c) + 4 a).
A position uses the longest context inside its sequence (window) with no N, up to k.

Counting works on integer codes of (j+1)-mers, code = sum_i base[t - i] * 4**i (the target in
the lowest digit, so code >> 2 is the context, and the oldest base is the highest digit):
one ``np.bincount`` into a 4**(d+1) table at order d = min(k, dense_max_order); every lower order
is that table summed over its oldest base, plus the few targets whose clean context is exactly
j bases long (after an N or a record start). Orders above d keep sorted int64 keys. Targets that
are not A/C/G/T get NaN loss: evaluation scores only A/C/G/T labels.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
import torch

from megaseq.data.tokenizer import A_ID, C_ID, G_ID, T_ID, reverse_complement

_NOT_BASE = 4
_BASE_OF_ID = np.full(256, _NOT_BASE, dtype=np.int64)
_BASE_OF_ID[[A_ID, C_ID, G_ID, T_ID]] = [0, 1, 2, 3]
_CHUNK = 1 << 22  # targets per pass: bounds the int64 temporaries whatever the record length
_NUM_BUCKETS = 40  # context-count buckets floor(log2 n): 2**40 bases is plenty
_LAM_MAX = 0.999  # keeps an unseen continuation of a seen context from costing infinite loss


def _bases(tokens: Any) -> np.ndarray:
    """DNA ids -> 0..3 for A C G T, 4 for anything else ``[L]`` int64."""
    t = np.asarray(tokens).astype(np.int64)
    return np.where((t >= 0) & (t < 256), _BASE_OF_ID[np.clip(t, 0, 255)], _NOT_BASE)


def _chunks(b: np.ndarray, k: int, first: int) -> Iterator[tuple[np.ndarray, int, int]]:
    """Targets b[first:] in chunks with up to k bases of history each: (piece, first in piece, start in b)."""
    for start in range(first, len(b), _CHUNK):
        lo = max(start - k, 0)
        yield b[lo:start + _CHUNK], start - lo, start


def _orders(b: np.ndarray, k: int, first: int) -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
    """For targets b[first:], per order j = 0..k: (j, (j+1)-mer codes, run), run = clean bases ending at
    each target, itself included (the target counts at order j where run >= j + 1). ``codes`` is
    updated in place for the next order: use it before asking for the next."""
    n = len(b)
    idx = np.arange(n)
    run = (idx - np.maximum.accumulate(np.where(b == _NOT_BASE, idx, -1)))[first:]
    clean = np.where(b == _NOT_BASE, 0, b)
    code = clean[first:].copy()
    for j in range(k + 1):
        if j:
            lo = max(j - first, 0)  # code[i] += clean[first + i - j] << 2j where that index exists
            code[lo:] += clean[first + lo - j:n - j] << (2 * j)
        yield j, code, run


def _key_dtype(order: int) -> type:
    return np.uint32 if 2 * (order + 1) <= 32 else np.int64


def _runs(sorted_values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Distinct values of a sorted array and the index where each run starts."""
    if not len(sorted_values):
        return sorted_values, np.zeros(0, np.int64)
    starts = np.concatenate([[0], np.flatnonzero(sorted_values[1:] != sorted_values[:-1]) + 1])
    return sorted_values[starts], starts


class _Counts:
    """n(c, x) and n(c) for one order, from a dense table or from sorted (j+1)-mer codes."""

    def __init__(self, table: np.ndarray | None = None, sorted_codes: np.ndarray | None = None) -> None:
        self.dense = table is not None
        if self.dense:
            self.table, self.ctx_total = table, table.reshape(-1, 4).sum(axis=1)
            return
        self.keys, starts = _runs(sorted_codes)
        self.counts = np.diff(np.append(starts, len(sorted_codes)))
        self.ctx_keys, ctx_starts = _runs(self.keys >> 2)
        self.ctx_total = np.add.reduceat(self.counts, ctx_starts) if len(ctx_starts) else self.counts[:0]

    def lookup(self, codes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(n(c, x), n(c)) for (j+1)-mer codes."""
        if self.dense:
            return self.table[codes], self.ctx_total[codes >> 2]
        codes = codes.astype(self.keys.dtype)  # never the other way: a cast of the keys would copy them
        return _sorted_lookup(self.keys, codes, self.counts), _sorted_lookup(self.ctx_keys, codes >> 2,
                                                                             self.ctx_total)


def _sorted_lookup(keys: np.ndarray, query: np.ndarray, values: np.ndarray) -> np.ndarray:
    """values[keys == query], 0 where absent; queries are sorted first so the search stays in cache."""
    out = np.zeros(len(query), np.int64)
    if not len(keys) or not len(query):
        return out
    order = np.argsort(query)
    q = query[order]
    pos = np.minimum(np.searchsorted(keys, q), len(keys) - 1)
    out[order] = np.where(keys[pos] == q, values[pos], 0)
    return out


def _bucket(n_c: np.ndarray) -> np.ndarray:
    """floor(log2 n) for n >= 1, capped to the bucket count."""
    return np.minimum(np.frexp(n_c.astype(np.float64))[1] - 1, _NUM_BUCKETS - 1)


def _fit_lambdas(ml: np.ndarray, lower: np.ndarray, bucket: np.ndarray, iters: int = 14) -> np.ndarray:
    """Per bucket, the weight in [0, _LAM_MAX] maximizing sum log(lam * ml + (1 - lam) * lower).

    The objective is concave in lam, so its derivative sum d / (lam * d + lower), d = ml - lower,
    falls monotonically: bisect on its sign (all buckets at once). Empty buckets take the nearest
    fitted bucket's weight.
    """
    num = np.bincount(bucket, minlength=_NUM_BUCKETS)
    lo, hi = np.zeros(_NUM_BUCKETS), np.full(_NUM_BUCKETS, _LAM_MAX)
    d = ml - lower
    for _ in range(iters):
        mid = (lo + hi) / 2
        slope = np.bincount(bucket, weights=d / (mid[bucket] * d + lower), minlength=_NUM_BUCKETS)
        lo, hi = np.where(slope > 0, mid, lo), np.where(slope > 0, hi, mid)
    lam = (lo + hi) / 2
    filled = np.flatnonzero(num)
    if len(filled):
        lam = np.interp(np.arange(_NUM_BUCKETS), filled, lam[filled])
    return lam


def _tuning_sample(seqs: list[np.ndarray], num_bases: int, piece: int = 4096) -> np.ndarray:
    """Evenly spaced pieces of the training sequences (DNA ids), joined by a pad id (not a base) so no
    context crosses from one piece to the next."""
    total = sum(len(s) for s in seqs)
    if total <= num_bases:
        parts = seqs
    else:
        cum = np.cumsum([len(s) for s in seqs])
        parts = []
        for g in np.linspace(0, total - 1, max(num_bases // piece, 1)).astype(np.int64).tolist():
            r = int(np.searchsorted(cum, g, side="right"))
            off = g - (int(cum[r - 1]) if r else 0)
            parts.append(seqs[r][off:off + piece])
    out = []
    for p in parts:
        out += [np.asarray(p, dtype=np.int64), np.zeros(1, np.int64)]
    return np.concatenate(out) if out else np.zeros(0, np.int64)


class KmerModel:
    """Order-k Markov model over A C G T; ``fit`` on training records, then per-token log-loss in nats."""

    def __init__(self, k: int, smoothing: str = "interpolated", alpha: float = 1.0, dense_max_order: int = 11,
                 tune_bases: int = 1 << 18) -> None:
        if not 0 <= k <= 30:
            raise ValueError(f"eval.kmer_k must be in 0..30 (codes are 64-bit), got {k}")
        if smoothing not in ("interpolated", "add_alpha"):
            raise ValueError(f"k-mer smoothing must be 'interpolated' or 'add_alpha', got {smoothing!r}")
        if alpha <= 0:
            raise ValueError(f"k-mer alpha must be positive, got {alpha}")
        self.k, self.smoothing, self.alpha, self.tune_bases = k, smoothing, alpha, tune_bases
        self.dense_order = min(k, dense_max_order)
        self.counts: list[_Counts] = []
        self.lambdas = np.full((k + 1, _NUM_BUCKETS), 0.5)
        self.num_bases = 0

    @property
    def name(self) -> str:
        return f"kmer-k{self.k}"

    def fit(self, sequences: Iterable[Any], reverse_complement_too: bool = False) -> KmerModel:
        """Count on DNA id arrays (or records with ``.tokens``); ``reverse_complement_too``: both strands."""
        d, k = self.dense_order, self.k
        table = np.zeros(4 ** (d + 1), dtype=np.int64)
        edges = [np.zeros(4 ** (j + 1), dtype=np.int64) for j in range(d)]  # targets with run == j + 1
        sparse: list[list[np.ndarray]] = [[] for _ in range(k - d)]
        forward = []
        for seq in sequences:
            tokens = np.asarray(getattr(seq, "tokens", seq))
            forward.append(tokens)
            for s in [tokens, reverse_complement(tokens)] if reverse_complement_too else [tokens]:
                b = _bases(s)
                self.num_bases += int((b != _NOT_BASE).sum())
                for piece, first, _ in _chunks(b, k, 0):
                    for j, code, run in _orders(piece, k, first):
                        if j < d:
                            edges[j] += np.bincount(code[run == j + 1], minlength=len(edges[j]))
                        elif j == d:
                            table += np.bincount(code[run >= j + 1], minlength=len(table))
                        else:  # 4-byte keys while they fit: half the memory and a faster sort
                            sparse[j - d - 1].append(code[run >= j + 1].astype(_key_dtype(j)))
        counts: list[_Counts] = [_Counts(table)]
        for j in range(d - 1, -1, -1):  # marginalize the oldest (highest) digit, then add the edge targets
            table = table.reshape(4, -1).sum(axis=0) + edges[j]
            counts.insert(0, _Counts(table))
        for j, codes in enumerate(sparse, start=d + 1):
            codes_all = np.concatenate(codes) if codes else np.zeros(0, _key_dtype(j))
            codes_all.sort()  # in place: the one big sort of a sparse order
            counts.append(_Counts(sorted_codes=codes_all))
        self.counts = counts
        if self.smoothing == "interpolated":
            self._tune(_bases(_tuning_sample(forward, self.tune_bases)))
        return self

    def _tune(self, b: np.ndarray) -> None:
        """Fit the weights on training positions, each position's own count left out."""
        p = np.full(len(b), 0.25)
        for j, code, run in _orders(b, self.k, 0):
            use = run >= j + 1
            n_cx, n_c = self.counts[j].lookup(code[use])
            n_cx, n_c = n_cx - 1, n_c - 1  # leave this position out
            lower = p[use]
            has = n_c > 0
            ml = n_cx[has] / n_c[has]
            bucket = _bucket(n_c[has])
            self.lambdas[j] = lam = _fit_lambdas(ml, lower[has], bucket)
            lower[has] = lam[bucket] * ml + (1 - lam[bucket]) * lower[has]
            p[use] = lower

    def token_loss(self, tokens: Any) -> np.ndarray:
        """Loss (nats) of predicting tokens[1:] from the tokens before each, within this array: ``[L-1]``.

        NaN where the target is not A/C/G/T.
        """
        assert self.counts, "call fit() first"
        b = _bases(tokens)
        p = np.full(max(len(b) - 1, 0), 0.25)
        for piece, first, start in _chunks(b, self.k, 1):
            p_chunk = p[start - 1:start - 1 + len(piece) - first]  # a view: targets b[start:]
            for j, code, run in _orders(piece, self.k, first):
                use = run >= j + 1
                n_cx, n_c = self.counts[j].lookup(code[use])
                if self.smoothing == "add_alpha":
                    p_chunk[use] = (n_cx + self.alpha) / (n_c + 4 * self.alpha)
                    continue
                lower, has = p_chunk[use], n_c > 0
                lam = self.lambdas[j][_bucket(n_c[has])]
                lower[has] = lam * n_cx[has] / n_c[has] + (1 - lam) * lower[has]
                p_chunk[use] = lower
        loss = -np.log(p)
        loss[b[1:] == _NOT_BASE] = np.nan
        return loss

    def batch_loss(self, batch: dict[str, Any]) -> torch.Tensor:
        """``per_token_loss`` for by-position evaluation: ``[B, S]`` float64 nats (NaN where not scored).

        The context of label s is input_ids[s-k+1 .. s] of the same row, as a model sees it.
        """
        ids_BS = batch["input_ids"].cpu().numpy()
        labels_BS = batch["labels"].cpu().numpy()
        scored = labels_BS != -100
        if not np.array_equal(labels_BS[:, :-1][scored[:, :-1]], ids_BS[:, 1:][scored[:, :-1]]):
            raise ValueError("the k-mer baseline needs next-token labels (labels[s] == input_ids[s+1])")
        rows = []
        for ids, labels, ok in zip(ids_BS, labels_BS, scored):
            loss = self.token_loss(np.concatenate([ids, labels[-1:] if ok[-1] else [-1]]))
            loss[~ok] = np.nan
            rows.append(loss)
        return torch.from_numpy(np.stack(rows))

    def bits_per_base(self, sequences: Iterable[Any]) -> float:
        """Mean loss over whole sequences (each from its start), in bits per base."""
        losses = np.concatenate([self.token_loss(getattr(s, "tokens", s)) for s in sequences])
        return float(np.nanmean(losses) / math.log(2))
