"""Windows of related sequences: homologous regions of several strains of one species, one after another.

Shapes: L = seq_len + 1 window tokens; n segments per window (``data.related``), n - 1 separators.

A genome's strongest long-range structure is in its relatives: another strain of the same species
carries the same genes in the same order at 95-99.9% identity. A window holding the homologous
regions of n strains (``[strain 1 | sep | strain 2 | sep | ...]``) lets a model that reads its
context predict strain 2 from strain 1 far better than any short-context statistic can (the k-mer
baseline restarts at each separator); this is the "family of related sequences" kind of data.

Strains are files: a file is one strain, its species the file name up to the first '_'
(``saureus_COL.fa.gz`` -> ``saureus``). The first segment is a uniform random region of a random
strain; each further segment is the homologous region of another strain, found by unique 16-mer
anchors (``KmerIndex``): anchors spread over the region are looked up on both strands of the other
strain, the majority strand wins and the median start of its hits places the segment, read in the
first segment's orientation. A window whose relatives cannot be placed (a region missing from the
other strains) is retried at another region, a pure function of (seed, window number) like
``windows.WindowSampler``, so resume and data parallelism split the stream exactly.

Held-out windows (``heldout_related_windows``): a held-out genome's region comes last, after the
homologous regions of n - 1 training strains of its species, and only its tokens are scored; the same
regions are also scored after the genome's own preceding bases, so the two differ only in the context.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from megaseq.data.fasta import FastaRecord
from megaseq.data.tokenizer import A_ID, N_ID, SEP_ID, complement_lut
from megaseq.data.windows import EvalWindow, StepWindows, draw_position, make_batch

K = 16  # anchor length: 4**16 codes, so a random 16-mer is unique in a 5 Mb genome with high probability
ANCHORS = 12  # anchors per region
MIN_HITS = ANCHORS // 2  # anchors that must hit (uniquely) on the winning strand
TRIES = 64  # regions tried per window before it falls back to one strain


def species_of(source: str) -> str:
    """'path/saureus_COL.fa.gz' -> 'saureus'."""
    return Path(source).name.split("_")[0]


def _codes(tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(16-mer codes ``[len - K + 1]`` uint32 of every position, valid: only A/C/G/T inside); K passes
    over 1-D arrays, so a 5 Mb genome costs a few 40 MB temporaries."""
    n = len(tokens) - K + 1
    if n <= 0:
        return np.zeros(0, np.uint32), np.zeros(0, bool)
    b = np.asarray(tokens).astype(np.int16) - A_ID
    bad = (b < 0) | (b > 3)
    clean = np.where(bad, 0, b).astype(np.uint32)
    code = np.zeros(n, np.uint32)
    for j in range(K):  # uint32 holds 16 bases exactly: the oldest base's bits shift out of nothing
        code = (code << np.uint32(2)) | clean[j:j + n]
    bad_run = np.concatenate([[0], np.cumsum(bad, dtype=np.int64)])
    return code, (bad_run[K:K + n] - bad_run[:n]) == 0


def _row_codes(rows_AK: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Codes of K-long rows ``[A, K]`` of DNA ids: (uint32 codes [A], valid [A])."""
    b = rows_AK.astype(np.int64) - A_ID
    ok = ((b >= 0) & (b <= 3)).all(axis=1)
    code = np.zeros(len(b), np.uint64)
    for j in range(K):
        code = (code << np.uint64(2)) | np.clip(b[:, j], 0, 3).astype(np.uint64)
    return code.astype(np.uint32), ok


class KmerIndex:
    """The unique 16-mers of one sequence (forward strand) and where they are."""

    def __init__(self, tokens: np.ndarray) -> None:
        code, ok = _codes(tokens)
        pos = np.flatnonzero(ok)
        order = np.argsort(code[pos], kind="stable")
        keys, pos = code[pos][order], pos[order]
        dup = np.zeros(len(keys), bool)
        if len(keys) > 1:
            same = keys[1:] == keys[:-1]
            dup[1:] |= same
            dup[:-1] |= same
        self.keys, self.pos, self.length = keys[~dup], pos[~dup].astype(np.int64), len(tokens)

    def find(self, codes: np.ndarray) -> np.ndarray:
        """Position of each code's unique occurrence, -1 where absent or repeated."""
        i = np.minimum(np.searchsorted(self.keys, codes), max(len(self.keys) - 1, 0))
        if not len(self.keys):
            return np.full(len(codes), -1, np.int64)
        return np.where(self.keys[i] == codes, self.pos[i], -1)


def place(region: np.ndarray, index: KmerIndex) -> tuple[int, bool] | None:
    """Where ``region`` sits in the indexed sequence: (start, reverse) such that ``seq[start:start+len]``
    (reverse-complemented when ``reverse``) is its homolog; None when fewer than MIN_HITS anchors agree."""
    length = len(region)
    if length < K:
        return None
    offsets = np.unique(np.linspace(0, length - K, ANCHORS).astype(np.int64))
    rows = np.stack([region[o:o + K] for o in offsets])
    fwd, ok_f = _row_codes(rows)
    rev, ok_r = _row_codes(complement_lut()[rows[:, ::-1]])
    hit_f = np.where(ok_f, index.find(fwd), -1)
    hit_r = np.where(ok_r, index.find(rev), -1)
    starts_f = (hit_f - offsets)[hit_f >= 0]
    starts_r = (hit_r + K + offsets - length)[hit_r >= 0]
    reverse = len(starts_r) > len(starts_f)
    starts = starts_r if reverse else starts_f
    if len(starts) < MIN_HITS:
        return None
    start = int(np.median(starts))
    if start < 0 or start + length > index.length:
        return None
    return start, reverse


def _read(rec: FastaRecord, start: int, length: int, reverse: bool) -> np.ndarray:
    piece = rec.tokens[start:start + length]
    return complement_lut()[piece[::-1]] if reverse else piece


def segment_lengths(total: int, n: int) -> list[int]:
    """n segment lengths filling ``total`` tokens with n - 1 separators between them."""
    base = (total - (n - 1)) // n
    return [base] * (n - 1) + [total - (n - 1) - base * (n - 1)]


def jittered_lengths(total: int, n: int, jitter: float, rng: np.random.Generator) -> list[int]:
    """n random segment lengths filling ``total`` tokens with n - 1 separators, each at least ``1 - jitter`` of
    an equal share; the rest of the tokens split at uniform random cuts. ``jitter`` 0: ``segment_lengths``
    (and ``rng`` untouched)."""
    if not jitter:
        return segment_lengths(total, n)
    free = total - (n - 1)
    low = int(np.ceil((free // n) * (1.0 - jitter)))
    cuts = np.sort(rng.integers(0, free - low * n + 1, size=n - 1))
    extra = np.diff(np.concatenate([[0], cuts, [free - low * n]]))
    return [low + int(e) for e in extra]


class Strains:
    """The training strains grouped by species, each with a lazily built anchor index per record."""

    def __init__(self, records: Sequence[FastaRecord]) -> None:
        self.by_species: dict[str, dict[str, list[FastaRecord]]] = {}
        for r in records:
            self.by_species.setdefault(species_of(r.source), {}).setdefault(r.source, []).append(r)
        self._index: dict[tuple[str, str], KmerIndex] = {}

    def index(self, rec: FastaRecord) -> KmerIndex:
        key = (rec.source, rec.id)
        if key not in self._index:
            self._index[key] = KmerIndex(rec.tokens)
        return self._index[key]

    def homolog(self, region: np.ndarray, strain: str, species: str) -> np.ndarray | None:
        """The homologous region in ``strain`` (any of its records), in ``region``'s orientation."""
        for rec in self.by_species[species][strain]:
            where = place(region, self.index(rec))
            if where is not None:
                return _read(rec, where[0], len(region), where[1])
        return None

    def context(self, seq: np.ndarray, start: int, lengths: list[int], strains: list[str], species: str) -> \
            list[np.ndarray] | None:
        """For each strain, the homolog of ``seq[start:start + lengths[i]]``; None if one is missing."""
        out = []
        for length, strain in zip(lengths, strains):
            region = np.asarray(seq[start:start + length])
            h = self.homolog(region, strain, species) if len(region) == length else None
            if h is None:
                return None
            out.append(h)
        return out


def _join(segments: list[np.ndarray]) -> np.ndarray:
    sep = np.array([SEP_ID], np.uint8)
    parts: list[np.ndarray] = []
    for i, s in enumerate(segments):
        parts += ([sep] if i else []) + [np.asarray(s, np.uint8)]
    return np.concatenate(parts)


class RelatedWindowSampler(StepWindows):
    """Training windows of ``related`` homologous regions from different strains of one species."""

    def __init__(self, records: Sequence[FastaRecord], seq_len: int, related: int, *, batch_size: int = 1,
                 seed: int = 0, reverse_complement: bool = False, rank: int = 0, world_size: int = 1,
                 jitter: float = 0.0) -> None:
        if related < 2:
            raise ValueError(f"data.related must be 0 (off) or >= 2 regions per window, got {related}")
        if not 0.0 <= jitter < 1.0:
            raise ValueError(f"data.related_jitter must be in [0, 1), got {jitter}")
        self.seq_len, self.related, self.batch_size, self.seed = seq_len, related, batch_size, seed
        self.jitter = jitter
        self.rank, self.world_size, self.index = rank, world_size, 0
        self.strains = Strains(records)
        self.lengths = segment_lengths(seq_len + 1, related)
        self.first = [r for r in records if len(r) >= self.lengths[0]]
        if not self.first:
            raise ValueError(f"data.related={related} at data.seq_len={seq_len}: regions of {self.lengths[0]} "
                             f"tokens, longer than every training record; lower data.seq_len or data.related")
        self.complement = complement_lut() if reverse_complement else None
        self._cum = np.cumsum([len(r) - self.lengths[0] + 1 for r in self.first])
        self.num_positions = int(self._cum[-1])
        self.single = 0  # windows of one strain (its species has no other, or no homologs in TRIES regions)

    def _draw(self, rng: np.random.Generator) -> tuple[FastaRecord, int]:
        r, start = draw_position(self._cum, int(rng.integers(self.num_positions)))
        return self.first[r], start

    def _related(self, rng: np.random.Generator) -> np.ndarray | None:
        """One try: a random region and its homologs in up to ``related - 1`` other strains of its species."""
        rec, start = self._draw(rng)
        species = species_of(rec.source)
        others = [s for s in sorted(self.strains.by_species[species]) if s != rec.source]
        if not others:
            return None
        rng.shuffle(others)
        n = min(self.related, 1 + len(others))  # each strain once: fewer, longer regions for small species
        lengths = jittered_lengths(self.seq_len + 1, n, self.jitter, rng)
        head = np.asarray(rec.tokens[start:start + lengths[0]])
        if len(head) < lengths[0]:
            return None
        rest = self.strains.context(rec.tokens, start, lengths[1:], others[:n - 1], species)
        return None if rest is None else _join([head] + rest)

    def tokens(self, n: int) -> np.ndarray:
        """Window number n ``[L]`` uint8: a pure function of (seed, n)."""
        rng = np.random.default_rng([self.seed, n])
        w = None
        for _ in range(TRIES):
            w = self._related(rng)
            if w is not None:
                break
        if w is None:  # a species with one strain, or no homologs found: one region of one record
            self.single += 1
            rec, start = self._draw(rng)
            start = min(start, max(len(rec) - self.seq_len - 1, 0))
            w = rec.tokens[start:start + self.seq_len + 1]
            if len(w) < self.seq_len + 1:
                w = np.concatenate([w, np.full(self.seq_len + 1 - len(w), N_ID, np.uint8)])
        if self.complement is not None and rng.integers(2):
            w = self.complement[w[::-1]]
        return w

    def next_batch(self) -> dict[str, Any]:
        return make_batch([self.tokens(n) for n in self.step_windows()])

    def state_dict(self) -> dict[str, Any]:
        return {"seed": self.seed, "index": self.index, "seq_len": self.seq_len,
                "num_positions": self.num_positions, "batch_size": self.batch_size, "related": self.related,
                **({"jitter": self.jitter} if self.jitter else {})}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if float(state.get("jitter", 0.0)) != self.jitter:
            raise ValueError(f"cannot resume the data sampler: data.related_jitter was {state.get('jitter', 0.0)} "
                             f"in the checkpoint and is {self.jitter} now; resume with the same data settings")
        for key in ("seq_len", "num_positions", "batch_size", "related"):
            if key in state and state[key] != getattr(self, key):
                raise ValueError(f"cannot resume the data sampler: {key} was {state[key]} in the checkpoint and "
                                 f"is {getattr(self, key)} now; resume with the same data settings")
        self.seed, self.index = int(state["seed"]), int(state["index"])


def heldout_related_windows(records: Sequence[FastaRecord], strains: Strains, seq_len: int, related: int,
                            max_windows: int = 0) -> tuple[list[EvalWindow], list[EvalWindow]]:
    """A held-out genome's regions, each scored (``EvalWindow.score_from``) after context, twice: after the
    homologous regions of ``related - 1`` training strains of its species, and after the genome's own
    preceding bases (the same length). The two lists score the same bases, so their difference is what
    the relatives in the window add. Regions tile the genome, evenly spaced with ``max_windows``; a region
    is skipped when a chosen strain has no homolog or too little of the genome precedes it. Both lists
    are empty when the species has fewer than ``related - 1`` other training strains."""
    lengths = segment_lengths(seq_len + 1, related)
    own = lengths[-1]
    ctx_lengths = lengths[:-1]
    before = seq_len + 1 - own  # bases of the genome's own context: the relatives' regions and separators
    if not records:
        return [], []
    species = species_of(records[0].source)
    train = sorted(s for s in strains.by_species.get(species, {}) if s != records[0].source)
    if len(train) < len(ctx_lengths):
        return [], []
    chosen = train[:len(ctx_lengths)]
    slots = [(r, s) for r in records for s in range(before, len(r) - own + 1, own)]
    order = np.arange(len(slots)) if max_windows <= 0 or len(slots) <= max_windows else \
        np.unique(np.linspace(0, len(slots) - 1, max_windows).round().astype(np.int64))
    picked = set(order.tolist())
    tried = order.tolist() + [i for i in range(len(slots)) if i not in picked]  # skipped slots: the next ones
    with_relatives: list[EvalWindow] = []
    alone: list[EvalWindow] = []
    for i in tried:
        if max_windows > 0 and len(with_relatives) >= max_windows:
            break
        rec, start = slots[i]
        rest = strains.context(rec.tokens, start, ctx_lengths, chosen, species)
        if rest is None:
            continue
        w = _join(rest + [rec.tokens[start:start + own]])
        with_relatives.append(EvalWindow(rec.id, start, w, None, score_from=len(w) - own))
        alone.append(EvalWindow(rec.id, start, rec.tokens[start - before:start + own], None, score_from=before))
    key = lambda w: (w.record_id, w.start)  # noqa: E731
    return sorted(with_relatives, key=key), sorted(alone, key=key)
