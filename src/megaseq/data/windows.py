"""Training windows, held-out windows and random tokens, all in one batch format.

Shapes: B batch, S seq_len, L = S + 1 window tokens (inputs are window[:-1], labels window[1:]).

A batch is a dict::

    input_ids [B, S] int64
    labels    [B, S] int64   (-100: not scored, e.g. a label that would cross a document boundary)
    doc_ids   [B, S] int32 or None   (equal within a document, counting from 0 in each row)

``WindowSampler`` draws window number n from a generator seeded by (seed, n) alone, so its whole
state is (seed, index): a resumed run draws exactly the windows an uninterrupted one would, and
with data parallelism rank r of W takes windows (index * W + r) * B + b. A window is a numpy view
of its record; the batch costs one uint8 copy and two int64 copies of the window, never the genome.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from megaseq.data.tokenizer import complement_lut

IGNORE_INDEX = -100


class TokenRecord(Protocol):
    """A FastaRecord, or a packed text stream (which also carries ``doc_ids``)."""

    id: str
    tokens: np.ndarray
    source: str


def _doc_ids(rec: TokenRecord) -> np.ndarray | None:
    return getattr(rec, "doc_ids", None)


def make_batch(windows: list[np.ndarray], docs: list[np.ndarray] | None = None,
               score_from: list[int] | None = None, targets: list[np.ndarray] | None = None) -> dict[str, Any]:
    """Windows of L tokens (and their per-token document ids) -> the batch dict above. ``score_from``:
    per window, the first token that is a scored target (the ones before are context only: -100).
    ``targets``: per window ``[L]`` bool, whether each token is a target the loss counts (a conversation's
    assistant tokens); a token that is not is the label -100 of the token before it."""
    w_BL = np.stack(windows)
    input_ids = torch.from_numpy(w_BL[:, :-1].astype(np.int64))
    labels = torch.from_numpy(w_BL[:, 1:].astype(np.int64))
    for b, first in enumerate(score_from or []):
        labels[b, :max(first - 1, 0)] = IGNORE_INDEX
    if targets is not None:
        labels[torch.from_numpy(~np.stack(targets)[:, 1:].astype(bool))] = IGNORE_INDEX
    doc_ids = None
    if docs is not None:
        d_BL = np.stack(docs).astype(np.int64)
        d_BL -= d_BL[:, :1]  # count from 0 in each row
        # the last token of a document does not predict the next document's first token
        labels[torch.from_numpy(d_BL[:, 1:] != d_BL[:, :-1])] = IGNORE_INDEX
        doc_ids = torch.from_numpy(d_BL[:, :-1].astype(np.int32))
    return {"input_ids": input_ids, "labels": labels, "doc_ids": doc_ids}


def _too_short(records: Sequence[TokenRecord], seq_len: int, setting: str) -> ValueError:
    if not records:
        return ValueError(f"{setting}={seq_len}: there are no sequences to draw windows from")
    longest = max(records, key=len)
    return ValueError(
        f"{setting}={seq_len} needs sequences of at least {seq_len + 1} tokens (inputs + next-token labels), "
        f"but the longest is {len(longest)} tokens (record {longest.id!r} in {longest.source or 'memory'}); "
        f"lower {setting} or use longer sequences")


def draw_position(cum: np.ndarray, g: int) -> tuple[int, int]:
    """Global start position ``g`` over records whose start positions add up as ``cum`` (``np.cumsum``)
    -> (record index, start within that record)."""
    r = int(np.searchsorted(cum, g, side="right"))
    return r, g - (int(cum[r - 1]) if r else 0)


class StepWindows:
    """What the training samplers share: step ``index`` reads windows ``[(index * world_size + rank) *
    batch_size, ... + batch_size)``, each a pure function of its number (so every rank, and a resume, sees the
    same), and iterating yields ``next_batch()`` forever."""

    index: int
    rank: int
    world_size: int
    batch_size: int

    def step_windows(self) -> range:
        """This step's window numbers on this rank; moves to the next step."""
        first = (self.index * self.world_size + self.rank) * self.batch_size
        self.index += 1
        return range(first, first + self.batch_size)

    def next_batch(self) -> dict[str, Any]:
        raise NotImplementedError

    def __iter__(self) -> Iterator[dict[str, Any]]:
        while True:
            yield self.next_batch()


class WindowSampler(StepWindows):
    """Random contiguous windows of ``seq_len + 1`` tokens, uniform over all start positions.

    Records shorter than a window are skipped; a record is drawn in proportion to its number of
    start positions. With ``reverse_complement`` each window is read from either strand (DNA ids).
    """

    def __init__(self, records: Sequence[TokenRecord], seq_len: int, *, batch_size: int = 1, seed: int = 0,
                 reverse_complement: bool = False, rank: int = 0, world_size: int = 1,
                 setting: str = "data.seq_len") -> None:
        assert 0 <= rank < world_size and batch_size >= 1
        if seed < 0:
            raise ValueError(f"data.seed must be >= 0, got {seed}")
        self.seq_len, self.batch_size, self.seed = seq_len, batch_size, seed
        self.rank, self.world_size = rank, world_size
        self.records = [r for r in records if len(r) >= seq_len + 1]
        if not self.records:
            raise _too_short(records, seq_len, setting)
        if reverse_complement and any(_doc_ids(r) is not None for r in self.records):
            raise ValueError("data.reverse_complement applies to DNA only, not to packed text")
        self.complement = complement_lut() if reverse_complement else None
        self._cum = np.cumsum([len(r) - seq_len for r in self.records])  # start positions per record
        self.num_positions = int(self._cum[-1])
        self.index = 0

    def window(self, n: int) -> tuple[int, int, bool]:
        """Window number n -> (record index, start, reverse strand); a pure function of (seed, n)."""
        rng = np.random.default_rng([self.seed, n])
        g = int(rng.integers(self.num_positions))
        rc = self.complement is not None and bool(rng.integers(2))
        return (*draw_position(self._cum, g), rc)

    def tokens(self, n: int) -> tuple[np.ndarray, np.ndarray | None]:
        r, start, rc = self.window(n)
        rec = self.records[r]
        w = rec.tokens[start:start + self.seq_len + 1]
        if rc:
            w = self.complement[w[::-1]]
        docs = _doc_ids(rec)
        return w, None if docs is None else docs[start:start + self.seq_len + 1]

    def next_batch(self) -> dict[str, Any]:
        pairs = [self.tokens(n) for n in self.step_windows()]
        docs = None if pairs[0][1] is None else [d for _, d in pairs]
        return make_batch([w for w, _ in pairs], docs)

    def state_dict(self) -> dict[str, int]:
        return {"seed": self.seed, "index": self.index, "seq_len": self.seq_len,
                "num_positions": self.num_positions, "batch_size": self.batch_size,
                "global_batch": self.batch_size * self.world_size}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Resume at the same windows: a step takes windows ``[index * G, (index + 1) * G)`` of the global batch
        ``G = batch_size x dp``, so another dp size with the same G (a resharded resume) continues exactly."""
        mine = {**self.state_dict(), "global_batch": self.batch_size * self.world_size}
        keys = ("seq_len", "num_positions", "global_batch" if "global_batch" in state else "batch_size")
        for key in keys:
            if key in state and state[key] != mine[key]:
                raise ValueError(f"cannot resume the data sampler: {key} was {state[key]} in the checkpoint "
                                 f"and is {mine[key]} now; resume with the same data files and "
                                 f"data.seq_len (and train.batch_size x parallel.dp), or start a new run")
        self.seed, self.index = int(state["seed"]), int(state["index"])


@dataclass
class EvalWindow:
    """One held-out window: ``tokens`` [L] (a view of its record) and where it came from."""

    record_id: str
    start: int
    tokens: np.ndarray
    doc_ids: np.ndarray | None = None
    score_from: int = 0  # tokens before this one are context only (related strains before a held-out genome)
    targets: np.ndarray | None = None  # [L] bool: tokens the loss counts (assistant turns); None: all


def heldout_windows(records: Sequence[TokenRecord], seq_len: int, max_windows: int = 0,
                    setting: str = "eval.seq_len") -> list[EvalWindow]:
    """Non-overlapping windows of ``seq_len + 1`` tokens, in record order.

    With ``max_windows`` > 0 and more windows available, that many are taken evenly spaced over
    all of them (so a cap still covers the whole genome, not just its start); 0 takes all.
    """
    L = seq_len + 1
    usable = [r for r in records if len(r) >= L]
    if not usable:
        raise _too_short(records, seq_len, setting)
    counts = np.array([len(r) // L for r in usable])
    cum = np.cumsum(counts)
    total = int(cum[-1])
    picks = np.arange(total) if max_windows <= 0 or total <= max_windows else \
        np.unique(np.linspace(0, total - 1, max_windows).round().astype(np.int64))
    out = []
    for slot in picks.tolist():
        r = int(np.searchsorted(cum, slot, side="right"))
        start = (slot - (int(cum[r - 1]) if r else 0)) * L
        docs = _doc_ids(usable[r])
        out.append(EvalWindow(usable[r].id, start, usable[r].tokens[start:start + L],
                              None if docs is None else docs[start:start + L]))
    return out


class EvalBatches:
    """Held-out windows as batches (the last may be smaller), built lazily on each pass."""

    def __init__(self, windows: list[EvalWindow], batch_size: int = 1) -> None:
        assert batch_size >= 1
        self.windows, self.batch_size = windows, batch_size

    def __len__(self) -> int:
        return -(-len(self.windows) // self.batch_size)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for i in range(0, len(self.windows), self.batch_size):
            group = self.windows[i:i + self.batch_size]
            docs = None if group[0].doc_ids is None else [w.doc_ids for w in group]
            targets = None if group[0].targets is None else [w.targets for w in group]
            yield make_batch([w.tokens for w in group], docs, [w.score_from for w in group], targets)


class RandomTokens(StepWindows):
    """Uniform random ids in [low, vocab_size) for memory and speed tests; resumable like WindowSampler."""

    def __init__(self, vocab_size: int, seq_len: int, *, batch_size: int = 1, seed: int = 0, low: int = 0,
                 rank: int = 0, world_size: int = 1) -> None:
        if vocab_size <= low:
            raise ValueError(f"random tokens need vocab_size > {low}, got {vocab_size}")
        if seed < 0:
            raise ValueError(f"data.seed must be >= 0, got {seed}")
        self.vocab_size, self.seq_len, self.batch_size, self.low = vocab_size, seq_len, batch_size, low
        self.seed, self.rank, self.world_size, self.index = seed, rank, world_size, 0

    def next_batch(self) -> dict[str, Any]:
        windows = [np.random.default_rng([self.seed, n]).integers(
            self.low, self.vocab_size, size=self.seq_len + 1, dtype=np.int64) for n in self.step_windows()]
        return make_batch(windows)

    def state_dict(self) -> dict[str, int]:
        return {"seed": self.seed, "index": self.index, "seq_len": self.seq_len}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.seed, self.index = int(state["seed"]), int(state["index"])
