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
``index * batch_size ...``. Each window comes with the ``StreamPosition`` of the window after it, and a
checkpoint keeps each rank's: the pass, the order's state (``doc_order.Shuffle.state``), the documents drawn
but not yet all in windows (for packed conversations the one that starts the next window, with the offset of
its piece when it is cut into several), and for text windows the document id the next window starts with. A
resume opens the stream there: it reads the documents the position names and the share after them
(``seek.read_share``), so its work is the shuffle buffer and one window, whatever the step. A checkpoint
without positions (or taken on other files: refused, see ``load_state_dict``) replays the rank's passes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from megaseq.data.doc_order import PassDocs
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


def _pieces(ids: np.ndarray, targets: np.ndarray, L: int, stats: PackStats,
            skip: int = 0) -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
    """(offset, ids, targets) of the window-sized pieces of a document, from token ``skip`` (a piece's offset)."""
    stats.docs += 1
    stats.longest = max(stats.longest, len(ids))
    stats.targets += int(targets[1:].sum())  # the first token of a document is never a label
    stats.tokens += len(ids)
    if len(ids) > L:
        stats.split += 1
    for s in range(skip, len(ids), L):
        yield s, ids[s:s + L], targets[s:s + L]


def pack_whole(docs: Iterable[tuple[np.ndarray, np.ndarray]], seq_len: int, pad_id: int,
               stats: PackStats | None = None, one_per_window: bool = False) -> Iterator[Window]:
    """Windows of ``seq_len + 1`` tokens holding whole documents (see the module docstring);
    ``one_per_window``: each document (piece) alone in its window (held-out conversations, scored by
    their own positions)."""
    for window, _ in _pack(docs, seq_len + 1, pad_id, stats if stats is not None else PackStats(), one_per_window):
        yield window


def _pack(docs: Iterable[tuple[np.ndarray, np.ndarray]], L: int, pad_id: int, stats: PackStats,
          one_per_window: bool = False, skip: int = 0) -> Iterator[tuple[Window, int | None]]:
    """``pack_whole``'s windows, each with the offset in the document read last of the piece that starts the
    next window (None: the documents ended); ``skip``: tokens of the first document already in earlier windows."""
    parts: list[tuple[np.ndarray, np.ndarray]] = []
    used = 0
    for ids, targets in docs:
        for s, p_ids, p_targets in _pieces(np.asarray(ids, np.int32), np.asarray(targets, bool), L, stats, skip):
            if parts and (used + len(p_ids) > L or one_per_window):
                yield _window(parts, L, pad_id), s
                parts, used = [], 0
            parts.append((p_ids, p_targets))
            used += len(p_ids)
        skip = 0
    if parts:
        yield _window(parts, L, pad_id), None


@dataclass(frozen=True)
class StreamPosition:
    """Where a rank's window stream goes on (the module docstring): pass ``pass_number``; ``order``: the order's
    state after the last document drawn (None: the pass's start); ``pending``: share positions of documents drawn
    and not yet all in windows, in order; ``offset``: tokens of the first of them in earlier windows;
    ``doc_id``: its document id in text windows (which number documents over the pass)."""

    pass_number: int = 0
    order: dict[str, Any] | None = None
    pending: tuple[int, ...] = ()
    offset: int = 0
    doc_id: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {"pass": self.pass_number, "order": self.order, "pending": list(self.pending),
                "offset": self.offset, "doc_id": self.doc_id}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> StreamPosition:
        return cls(int(d["pass"]), d["order"], tuple(int(p) for p in d["pending"]), int(d["offset"]),
                   int(d["doc_id"]))


Positioned = Iterator[tuple[Window, StreamPosition]]


def pack_docs(docs: PassDocs, to_doc: Callable[[Any], tuple[np.ndarray, np.ndarray]], seq_len: int, pad_id: int,
              at: StreamPosition) -> Positioned:
    """The windows of ``pack_whole`` over the documents ``docs`` (``to_doc`` renders one), from position ``at``,
    each with the position of the window after it."""
    rendered = (to_doc(doc) for _, doc in docs)
    for window, s in _pack(rendered, seq_len + 1, pad_id, PackStats(), skip=at.offset):
        yield window, (StreamPosition(at.pass_number + 1) if s is None else
                       StreamPosition(at.pass_number, docs.state(), (docs.last,), s))


def _window(parts: list[tuple[np.ndarray, np.ndarray]], L: int, pad_id: int) -> Window:
    used = sum(len(p) for p, _ in parts)
    tokens = np.concatenate([p for p, _ in parts] + [np.full(L - used, pad_id, np.int32)])
    targets = np.concatenate([t for _, t in parts] + [np.zeros(L - used, bool)])
    doc_ids = np.repeat(np.arange(len(parts) + 1, dtype=np.int32), [len(p) for p, _ in parts] + [L - used])
    return tokens, doc_ids, targets


class StreamWindows(StepWindows):
    """This rank's training windows, read in order from ``open_stream(position)`` (an iterator of (``Window``, the
    position after it) over the rank's share of the documents), pass after pass. ``fingerprint``: of the files
    the stream reads (``seek.fingerprint``); a checkpoint taken on other files is refused. ``scan``: what the
    builder's read of the whole set found (conversations: ``chat_build.summary``), kept in the state so that a
    resume on the same files can use it instead of reading them again; None: nothing to keep."""

    scan: dict[str, Any] | None = None

    def __init__(self, open_stream: Callable[[StreamPosition], Positioned], seq_len: int, *, batch_size: int = 1,
                 seed: int = 0, rank: int = 0, world_size: int = 1, shuffle_buffer: int = 0,
                 what: str = "data.train", fingerprint: str = "") -> None:
        assert 0 <= rank < world_size and batch_size >= 1
        self.open_stream, self.seq_len, self.what = open_stream, seq_len, what
        self.batch_size, self.seed, self.rank, self.world_size = batch_size, seed, rank, world_size
        self.shuffle_buffer, self.fingerprint = shuffle_buffer, fingerprint
        self.index = 0
        self._it: Positioned | None = None
        self._pass = 0  # the pass self._it reads
        self._next = 0  # the number (on this rank, over all passes) of the window self._it yields next
        self._pass_start: int | None = 0  # the number of the first window of self._pass (None: before a resume)
        self._after: StreamPosition | None = StreamPosition()  # the position of window self._next

    def make_stream(self, pass_number: int) -> Iterator[Window]:
        """The windows of pass ``pass_number`` from its start."""
        return (window for window, _ in self.open_stream(StreamPosition(pass_number)))

    def step_windows(self) -> range:
        """This step's window numbers in this rank's own stream; moves to the next step."""
        first = self.index * self.batch_size
        self.index += 1
        return range(first, first + self.batch_size)

    def _window(self, n: int) -> Window:
        if self._it is None and self._after is not None and n >= self._next:
            self._it = self.open_stream(self._after)  # the start, or a resume at a saved position
        elif self._it is None or n < self._next:  # replay from the start
            self._pass, self._next, self._pass_start, self._after = 0, 0, 0, StreamPosition()
            self._it = self.open_stream(self._after)
        while True:
            got = next(self._it, None)
            if got is None:
                if self._next == self._pass_start:
                    raise ValueError(f"{self.what} holds no windows to train on"
                                     + (f" on data-parallel rank {self.rank}" if self.world_size > 1 else ""))
                self._pass, self._pass_start = self._pass + 1, self._next
                self._after = StreamPosition(self._pass)
                self._it = self.open_stream(self._after)  # the next pass over the data
                continue
            window, self._after = got
            self._next += 1
            if self._next - 1 == n:
                return window

    def next_windows(self) -> list[Window]:
        """This step's windows (tokens, doc ids, targets); moves to the next step."""
        return [self._window(n) for n in self.step_windows()]

    def next_batch(self) -> dict[str, Any]:
        windows = self.next_windows()
        return make_batch([w[0] for w in windows], [w[1] for w in windows], targets=[w[2] for w in windows])

    def state_dict(self) -> dict[str, Any]:
        """The step, the settings a resume must keep, and ``positions``: per data-parallel rank, where its stream
        goes on (this rank's only; ``merge_positions`` joins the ranks'), the files' fingerprint, and ``scan``
        where the builder set one."""
        positions: list[dict[str, Any] | None] = [None] * self.world_size
        if self._after is not None and self._next == self.index * self.batch_size:
            positions[self.rank] = self._after.to_dict()
        return {"seed": self.seed, "index": self.index, "seq_len": self.seq_len, "batch_size": self.batch_size,
                "global_batch": self.batch_size * self.world_size, "shards": self.world_size,
                "shuffle_buffer": self.shuffle_buffer, "positions": positions, "fingerprint": self.fingerprint,
                **({"scan": self.scan} if self.scan is not None else {})}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume where ``state`` stopped: at this rank's saved position when it has one, else by replaying the
        rank's passes up to step ``index``."""
        for key, mine in (("seq_len", self.seq_len), ("global_batch", self.batch_size * self.world_size),
                          ("shards", self.world_size), ("shuffle_buffer", self.shuffle_buffer)):
            if key in state and state[key] != mine:
                raise ValueError(f"cannot resume the data stream: {key} was {state[key]} in the checkpoint and is "
                                 f"{mine} now (each data-parallel rank reads its own share of the documents, in an "
                                 "order set by data.shuffle_buffer); resume with the same data.seq_len, "
                                 "data.shuffle_buffer, train.batch_size and parallel.dp, or start a new run")
        check_same_files(state, self.fingerprint, self.what)
        self.seed, self.index = int(state["seed"]), int(state["index"])
        positions = state.get("positions") or []
        mine = positions[self.rank] if len(positions) == self.world_size else None
        self._it = None
        if mine is None:  # a checkpoint without this rank's position: replay
            self._after, self._next = None, 0
            return
        self._after, self._next = StreamPosition.from_dict(mine), self.index * self.batch_size
        self._pass = self._after.pass_number
        self._pass_start = self._next if self._after.order is None else None


def check_same_files(state: dict[str, Any] | None, fingerprint: str, what: str = "data.train") -> None:
    """A ValueError naming ``what`` when the checkpoint's data ``state`` was taken on other files than those whose
    fingerprint (``seek.fingerprint``) is ``fingerprint`` now: its saved position would point elsewhere in them.
    A builder calls it before reading the files; ``StreamWindows.load_state_dict`` calls it again."""
    if state and state.get("fingerprint") and fingerprint and state["fingerprint"] != fingerprint:
        raise ValueError(f"cannot resume the data stream: the files of {what} changed since the checkpoint "
                         "(names, sizes or contents differ), so its saved position would point elsewhere in "
                         f"them; resume with the {what} files the run trained on, or start a new run")


def merge_positions(all_positions: list[list[dict[str, Any] | None]]) -> list[dict[str, Any] | None]:
    """The ranks' ``state_dict()['positions']`` joined: each rank's entry from the rank that has it."""
    return [next((p[r] for p in all_positions if p[r] is not None), None) for r in range(len(all_positions[0]))]


def eval_windows(windows: Iterable[Window], max_windows: int = 0) -> list[EvalWindow]:
    """Held-out windows (the first ``max_windows``; 0: all) as ``EvalWindow``s."""
    out = []
    for i, (tokens, doc_ids, targets) in enumerate(windows):
        if max_windows and i >= max_windows:
            break
        out.append(EvalWindow(f"window {i}", 0, tokens, doc_ids, targets=targets))
    return out
