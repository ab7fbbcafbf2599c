"""Documents kept whole in fixed windows, and a training source that streams them from disk.

Shapes: L = seq_len + 1 window tokens. A document is ``(ids [n], targets [n] bool)``: ``targets`` marks
the tokens the loss counts (a conversation's assistant turns).

``pack_whole`` fills windows in document order: a document that fits the room left in the window goes
there, else the window is padded (pad tokens are their own document and never targets) and the document
starts the next one. A document longer than a window is cut into window-sized pieces, each starting a
window (``PackStats.split`` counts them; its later pieces lose the context of the earlier ones, so the
builder warns and names data.seq_len). ``doc_ids`` count from 0 in each window; ``make_batch`` keeps
attention inside each document and masks the labels of non-targets and at document boundaries.

``StreamWindows`` is the training source for streamed data (conversations, and any columnar file): each
data-parallel rank reads the windows of its own share of the documents (``doc_order.DocOrder``), one pass
after another, never holding more than one window batch of data; step ``index`` reads the rank's windows
``index * batch_size ...``, and a resume replays the rank's passes up to its position (reading, not training).
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
    """This rank's training windows, read in order from ``make_stream(pass_number)`` (an iterator of ``Window``
    over the rank's share of the documents), pass after pass."""

    def __init__(self, make_stream: Callable[[int], Iterator[Window]], seq_len: int, *, batch_size: int = 1,
                 seed: int = 0, rank: int = 0, world_size: int = 1, shuffle_buffer: int = 0,
                 what: str = "data.train") -> None:
        assert 0 <= rank < world_size and batch_size >= 1
        self.make_stream, self.seq_len, self.what = make_stream, seq_len, what
        self.batch_size, self.seed, self.rank, self.world_size = batch_size, seed, rank, world_size
        self.shuffle_buffer = shuffle_buffer
        self.index = 0
        self._it: Iterator[Window] | None = None
        self._pass = 0  # the pass self._it reads
        self._next = 0  # the number (on this rank, over all passes) of the window self._it yields next
        self._pass_start = 0  # the number of the first window of self._pass

    def step_windows(self) -> range:
        """This step's window numbers in this rank's own stream; moves to the next step."""
        first = self.index * self.batch_size
        self.index += 1
        return range(first, first + self.batch_size)

    def _window(self, n: int) -> Window:
        if self._it is None or n < self._next:
            self._pass, self._next, self._pass_start = 0, 0, 0
            self._it = self.make_stream(0)
        while True:
            got = next(self._it, None)
            if got is None:
                if self._next == self._pass_start:
                    raise ValueError(f"{self.what} holds no windows to train on"
                                     + (f" on data-parallel rank {self.rank}" if self.world_size > 1 else ""))
                self._pass, self._pass_start = self._pass + 1, self._next
                self._it = self.make_stream(self._pass)  # the next pass over the data
                continue
            self._next += 1
            if self._next - 1 == n:
                return got

    def next_batch(self) -> dict[str, Any]:
        windows = [self._window(n) for n in self.step_windows()]
        return make_batch([w[0] for w in windows], [w[1] for w in windows], targets=[w[2] for w in windows])

    def state_dict(self) -> dict[str, int]:
        return {"seed": self.seed, "index": self.index, "seq_len": self.seq_len, "batch_size": self.batch_size,
                "global_batch": self.batch_size * self.world_size, "shards": self.world_size,
                "shuffle_buffer": self.shuffle_buffer}

    def load_state_dict(self, state: dict[str, int]) -> None:
        for key, mine in (("seq_len", self.seq_len), ("global_batch", self.batch_size * self.world_size),
                          ("shards", self.world_size), ("shuffle_buffer", self.shuffle_buffer)):
            if key in state and state[key] != mine:
                raise ValueError(f"cannot resume the data stream: {key} was {state[key]} in the checkpoint and is "
                                 f"{mine} now (each data-parallel rank reads its own share of the documents, in an "
                                 "order set by data.shuffle_buffer); resume with the same data.seq_len, "
                                 "data.shuffle_buffer, train.batch_size and parallel.dp, or start a new run")
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
