"""Documents kept whole in fixed windows, and a training source that streams them from disk.

Shapes: L = seq_len + 1 window tokens. A document is ``(ids [n], targets [n] bool)``: ``targets`` marks
the tokens the loss counts (a conversation's assistant turns).

``pack_whole`` fills windows in document order: a document that fits the room left in the window goes
there, else the window is padded (pad tokens are their own document and never targets) and the document
starts the next one. A document longer than a window is cut into window-sized pieces, each starting a
window (``PackStats.split`` counts them; its later pieces lose the context of the earlier ones, so the
builder warns and names data.seq_len). ``doc_ids`` count from 0 in each window; ``make_batch`` keeps
attention inside each document and masks the labels of non-targets and at document boundaries.

``StreamWindows`` is the training source for streamed data (conversations, and any columnar file): it
reads windows in file order, one pass after another, never holding more than one window batch of data;
window number n of the global order is read by rank ``(n // batch_size) % world_size``, and a resume
replays the stream up to its position (reading, not training).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from megaseq.data.windows import EvalWindow, StepWindows, make_batch

Window = tuple[np.ndarray, np.ndarray, np.ndarray]  # tokens [L] int32, doc_ids [L] int32, targets [L] bool


@dataclass
class PackStats:
    """What packing did: documents read, documents cut into pieces, target tokens, and tokens in all."""

    docs: int = 0
    split: int = 0
    longest: int = 0
    targets: int = 0
    tokens: int = 0


def _pieces(ids: np.ndarray, targets: np.ndarray, L: int, stats: PackStats) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    stats.docs += 1
    stats.longest = max(stats.longest, len(ids))
    stats.targets += int(targets[1:].sum())  # the first token of a document is never a label
    stats.tokens += len(ids)
    if len(ids) > L:
        stats.split += 1
    for s in range(0, len(ids), L):
        yield ids[s:s + L], targets[s:s + L]


def pack_whole(docs: Iterable[tuple[np.ndarray, np.ndarray]], seq_len: int, pad_id: int,
               stats: PackStats | None = None, one_per_window: bool = False) -> Iterator[Window]:
    """Windows of ``seq_len + 1`` tokens holding whole documents (see the module docstring);
    ``one_per_window``: each document (piece) alone in its window (held-out conversations, scored by
    their own positions)."""
    L = seq_len + 1
    stats = stats if stats is not None else PackStats()
    parts: list[tuple[np.ndarray, np.ndarray]] = []
    used = 0
    for ids, targets in docs:
        for p_ids, p_targets in _pieces(np.asarray(ids, np.int32), np.asarray(targets, bool), L, stats):
            if parts and (used + len(p_ids) > L or one_per_window):
                yield _window(parts, L, pad_id)
                parts, used = [], 0
            parts.append((p_ids, p_targets))
            used += len(p_ids)
    if parts:
        yield _window(parts, L, pad_id)


def _window(parts: list[tuple[np.ndarray, np.ndarray]], L: int, pad_id: int) -> Window:
    used = sum(len(p) for p, _ in parts)
    tokens = np.concatenate([p for p, _ in parts] + [np.full(L - used, pad_id, np.int32)])
    targets = np.concatenate([t for _, t in parts] + [np.zeros(L - used, bool)])
    doc_ids = np.repeat(np.arange(len(parts) + 1, dtype=np.int32), [len(p) for p, _ in parts] + [L - used])
    return tokens, doc_ids, targets


class StreamWindows(StepWindows):
    """Training windows read in order from ``make_stream()`` (an iterator of ``Window``), pass after pass."""

    def __init__(self, make_stream: Callable[[], Iterator[Window]], seq_len: int, *, batch_size: int = 1,
                 seed: int = 0, rank: int = 0, world_size: int = 1, what: str = "data.train") -> None:
        assert 0 <= rank < world_size and batch_size >= 1
        self.make_stream, self.seq_len, self.what = make_stream, seq_len, what
        self.batch_size, self.seed, self.rank, self.world_size = batch_size, seed, rank, world_size
        self.index = 0
        self._it: Iterator[Window] | None = None
        self._next = 0  # the global number of the window self._it yields next

    def _window(self, n: int) -> Window:
        if self._it is None or n < self._next:
            self._it, self._next = self.make_stream(), 0
        while True:
            got = next(self._it, None)
            if got is None:
                if self._next == 0:
                    raise ValueError(f"{self.what} holds no windows to train on")
                self._it = self.make_stream()  # the next pass over the data
                continue
            self._next += 1
            if self._next - 1 == n:
                return got

    def next_batch(self) -> dict[str, Any]:
        windows = [self._window(n) for n in self.step_windows()]
        return make_batch([w[0] for w in windows], [w[1] for w in windows], targets=[w[2] for w in windows])

    def state_dict(self) -> dict[str, int]:
        return {"seed": self.seed, "index": self.index, "seq_len": self.seq_len, "batch_size": self.batch_size,
                "global_batch": self.batch_size * self.world_size}

    def load_state_dict(self, state: dict[str, int]) -> None:
        for key, mine in (("seq_len", self.seq_len), ("global_batch", self.batch_size * self.world_size)):
            if key in state and state[key] != mine:
                raise ValueError(f"cannot resume the data stream: {key} was {state[key]} in the checkpoint and is "
                                 f"{mine} now; resume with the same data.seq_len and train.batch_size x "
                                 "parallel.dp, or start a new run")
        self.seed, self.index = int(state["seed"]), int(state["index"])
        self._it = None


def eval_windows(windows: Iterable[Window], max_windows: int = 0) -> list[EvalWindow]:
    """Held-out windows (the first ``max_windows``; 0: all) as ``EvalWindow``s."""
    out = []
    for i, (tokens, doc_ids, targets) in enumerate(windows):
        if max_windows and i >= max_windows:
            break
        out.append(EvalWindow(f"window {i}", 0, tokens, doc_ids, targets=targets))
    return out
