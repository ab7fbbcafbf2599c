"""The documents a data-parallel rank reads from a stream, and their order: its own share, shuffled in a buffer.

Streamed data (conversations, text in columnar files) is read as documents (records) in file order. Rank r of
W reads documents r, r + W, r + 2W, ... (``DocOrder.share``), before any of them is rendered or tokenized: the
ranks' shares together are the stream, each document in exactly one share, and a rank never renders the
others'. Each rank packs its share into its own windows, one pass after another.

``data.shuffle_buffer`` K > 0 (``shuffled``): the share passes through a buffer of K documents; once it is full,
each incoming document takes the place of one drawn at random, which is read next; at the end the buffer is read
in a random order. The generator is seeded by (data.seed, pass, rank), so every pass has its own order, and a
pass is the same however often it is read: a resumed run replays its pass up to the step it stopped at and reads
what an uninterrupted run would. Memory: K documents (rendered conversations, or text rows) per rank.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TypeVar

import numpy as np

T = TypeVar("T")


def shuffled(items: Iterable[T], buffer: int, seed: tuple[int, ...]) -> Iterator[T]:
    """``items`` through a shuffle buffer of ``buffer`` (0 or 1: in order), drawn by a generator seeded by ``seed``."""
    if buffer <= 1:
        yield from items
        return
    rng = np.random.default_rng(list(seed))
    held: list[T] = []
    for item in items:
        if len(held) < buffer:
            held.append(item)
            continue
        k = int(rng.integers(buffer))
        yield held[k]
        held[k] = item
    for k in rng.permutation(len(held)):
        yield held[k]


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
