"""The documents a data-parallel rank reads from a stream, and their order: its own share, shuffled in a buffer.

Streamed data (conversations, text in columnar files) is read as documents (records) in file order. Rank r of
W reads documents r, r + W, r + 2W, ... (``DocOrder.share``), before any of them is rendered or tokenized: the
ranks' shares together are the stream, each document in exactly one share, and a rank never renders the
others'. A document's number in its rank's share is its *share position*. Each rank packs its share into its
own windows, one pass after another.

``data.shuffle_buffer`` K > 0 (``shuffled``): the share passes through a buffer of K documents; once it is full,
each incoming document takes the place of one drawn at random, which is read next; at the end the buffer is read
in a random order. The generator is seeded by (data.seed, pass, rank), so every pass has its own order.

Resume: ``Shuffle.state()`` is the order's state after the last document drawn: how many documents of the share
it has read, the share positions the buffer holds (in buffer order) and the generator's state. ``PassDocs``
restarts a pass there by reading only those documents again (and any drawn but not yet packed ones), then the
share from where the buffer stopped reading; nothing before is rendered or tokenized, and the order that
follows is the uninterrupted run's. Memory: K documents (raw records, or rendered conversations) per rank.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import numpy as np

T = TypeVar("T")
# read(wanted, start): (share position, document) for the positions ``wanted`` (all below ``start``, in increasing
# order), then for every position from ``start`` on
Reader = Callable[[Sequence[int], int], Iterator[tuple[int, Any]]]


class Shuffle(Generic[T]):
    """``items`` (a share, from position ``consumed`` on) through a shuffle buffer of ``buffer`` (0 or 1: in
    order), drawn by a generator seeded by ``seed``; ``last`` is the share position of the item read last."""

    def __init__(self, items: Iterable[T], buffer: int, seed: tuple[int, ...]) -> None:
        self.items, self.buffer = iter(items), buffer
        self.rng = np.random.default_rng(list(seed)) if buffer > 1 else None
        self.held: list[tuple[int, T]] = []  # (share position, item), in buffer order
        self.drain: list[tuple[int, T]] | None = None  # the buffer in its final random order, once items end
        self.consumed, self.last = 0, -1

    def __iter__(self) -> Shuffle[T]:
        return self

    def __next__(self) -> T:
        if self.rng is None:
            item = next(self.items)
            self.last, self.consumed = self.consumed, self.consumed + 1
            return item
        while self.drain is None:
            item = next(self.items, _END)
            if item is _END:
                self.drain = [self.held[k] for k in self.rng.permutation(len(self.held))][::-1]
                self.held = []
                break
            pos, self.consumed = self.consumed, self.consumed + 1
            if len(self.held) < self.buffer:
                self.held.append((pos, item))
                continue
            k = int(self.rng.integers(self.buffer))
            (self.last, out), self.held[k] = self.held[k], (pos, item)
            return out
        if not self.drain:
            raise StopIteration
        self.last, out = self.drain.pop()
        return out

    def state(self) -> dict[str, Any]:
        """Where the order stands after the item read last (JSON: ints and lists)."""
        if self.rng is None:
            return {"consumed": self.consumed}
        drain = None if self.drain is None else [p for p, _ in reversed(self.drain)]
        return {"consumed": self.consumed, "held": [p for p, _ in self.held], "drain": drain,
                "rng": self.rng.bit_generator.state}

    def restore(self, state: dict[str, Any], fetched: dict[int, T], rest: Iterator[T]) -> Shuffle[T]:
        """Continue from ``state``: ``fetched`` holds the buffer's documents by share position, ``rest`` the share
        from position ``state['consumed']`` on."""
        self.items, self.consumed = rest, int(state["consumed"])
        if self.rng is not None:
            self.rng.bit_generator.state = state["rng"]
            self.held = [(p, fetched[p]) for p in state["held"]]
            self.drain = None if state["drain"] is None else [(p, fetched[p]) for p in reversed(state["drain"])]
        return self


_END: Any = object()


def shuffled(items: Iterable[T], buffer: int, seed: tuple[int, ...]) -> Shuffle[T]:
    """``items`` through a shuffle buffer of ``buffer`` (0 or 1: in order), drawn by a generator seeded by ``seed``."""
    return Shuffle(items, buffer, seed)


def buffered_positions(state: dict[str, Any]) -> list[int]:
    """The share positions a saved order holds (its buffer, or what is left of its final drain)."""
    return list(state.get("held") or []) + list(state.get("drain") or [])


@dataclass(frozen=True)
class DocOrder:
    """Which documents of a stream rank ``rank`` of ``world_size`` reads, and in which order (module docstring)."""

    rank: int = 0
    world_size: int = 1
    buffer: int = 0
    seed: int = 0

    def __post_init__(self) -> None:
        assert 0 <= self.rank < self.world_size and self.buffer >= 0

    def share(self, items: Iterable[T]) -> Iterator[T]:
        """This rank's documents: every ``world_size``-th from number ``rank`` on."""
        return itertools.islice(items, self.rank, None, self.world_size)

    def shuffle(self, items: Iterable[T], pass_number: int) -> Iterator[T]:
        """This rank's documents (already its share) in the order of pass ``pass_number``."""
        return shuffled(items, self.buffer, (self.seed, pass_number, self.rank))

    def __call__(self, items: Iterable[T], pass_number: int) -> Iterator[T]:
        return self.shuffle(self.share(items), pass_number)

    def numbers(self, wanted: Sequence[int] = (), start: int = 0) -> Iterator[tuple[int, int]]:
        """(share position, number in the whole stream) of the positions ``wanted`` below ``start``, in order, then
        of every position from ``start`` on (endless): what a reader must decode, found without reading."""
        numbers, pos = self.share(itertools.count()), 0

        def at(target: int) -> int:
            nonlocal pos
            number = next(itertools.islice(numbers, target - pos, None))
            pos = target + 1
            return number

        for p in sorted({p for p in wanted if p < start}):
            yield p, at(p)
        for p in itertools.count(start):
            yield p, at(p)


class PassDocs:
    """This rank's documents of pass ``pass_number`` in its order, as (share position, document), from the pass's
    start (``saved`` None) or from a saved order state, after the ``pending`` documents (drawn before the save and
    not yet all in windows), which come first. ``state()``: the order's state after the document read last."""

    def __init__(self, order: DocOrder, read: Reader, pass_number: int, saved: dict[str, Any] | None = None,
                 pending: Sequence[int] = ()) -> None:
        self.shuffle: Any = order.shuffle((doc for _, doc in read((), 0)) if saved is None else iter(()),
                                          pass_number)
        self.pending, self.fetched, self.last = list(pending), {}, -1
        if saved is not None:
            wanted = sorted(set(self.pending) | set(buffered_positions(saved)))
            found = read(wanted, int(saved["consumed"]))
            self.fetched = dict(itertools.islice(found, len(wanted)))
            self.shuffle.restore(saved, self.fetched, (doc for _, doc in found))

    def __iter__(self) -> Iterator[tuple[int, Any]]:
        for pos in self.pending:
            self.last = pos
            yield pos, self.fetched[pos]
        self.fetched = {}
        for doc in self.shuffle:
            self.last = self.shuffle.last
            yield self.last, doc

    def state(self) -> dict[str, Any]:
        return self.shuffle.state()
