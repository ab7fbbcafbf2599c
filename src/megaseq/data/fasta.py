"""FASTA reading (plain, .gz, .xz) into compact uint8 arrays of DNA token ids, and train/held-out splits.

The reader streams the file in blocks of complete lines and maps bytes to ids with one table
lookup per block (``tokenizer.byte_lut``), so a 5 Mb genome loads in well under a second and a
record costs one byte per base (plus one transient copy while its pieces are joined).
A record's id is the first word of its header. Splits hold out whole files (``data.heldout``)
or whole records of the training files (``data.heldout_records``), like a held-out chromosome.
"""

from __future__ import annotations

import glob
import gzip
import importlib.resources
import lzma
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import numpy as np

from megaseq.data.tokenizer import AMBIGUOUS, ILLEGAL, SKIP, byte_lut

_BLOCK_BYTES = 1 << 23
_NL, _GT, _HASH = ord("\n"), ord(">"), ord("#")
_AMINO_ONLY = set("EFILPQJZO*")  # letters no nucleotide code uses: a protein sequence read as DNA


def default_genome_path() -> Path:
    """The lambda phage genome shipped with megaseq (48,502 bases, one record)."""
    path = Path(str(importlib.resources.files("megaseq").joinpath("assets/lambda_phage.fa.gz")))
    assert path.is_file(), f"package asset missing: {path}"
    return path


@dataclass
class FastaRecord:
    """One sequence: ``tokens`` is ``[L]`` token ids (uint8 DNA ids from ``read_fasta``)."""

    id: str
    tokens: np.ndarray
    source: str = ""
    description: str = ""

    def __len__(self) -> int:
        return len(self.tokens)


def open_maybe_compressed(path: Path) -> IO[bytes]:
    """Open by magic bytes, not suffix, so a misnamed .gz still reads."""
    with open(path, "rb") as fh:
        magic = fh.read(6)
    if magic[:2] == b"\x1f\x8b":
        return gzip.open(path, "rb")
    if magic == b"\xfd7zXZ\x00":
        return lzma.open(path, "rb")
    return open(path, "rb")


def _read_block(fh: IO[bytes], path: Path) -> bytes:
    try:
        return fh.read(_BLOCK_BYTES)
    except (OSError, EOFError, lzma.LZMAError) as e:
        raise ValueError(f"FASTA file {path}: could not decompress ({e}); is the file truncated?") from None


@dataclass
class _Parser:
    """Parse state carried across blocks: the open record and the line count so far."""

    path: Path
    lut: np.ndarray
    alphabet: str = "dna"  # names the alphabet in messages: "dna" or "protein" (which also skips '#' lines)
    line: int = 0  # lines in the blocks already parsed
    rec_id: str | None = None
    rec_desc: str = ""
    pieces: list[np.ndarray] = field(default_factory=list)
    seen: dict[str, int] = field(default_factory=dict)  # id -> header line

    def feed(self, data: bytes) -> Iterator[FastaRecord]:
        """Parse a block of complete lines; yields the records it closes."""
        buf = np.frombuffer(data, dtype=np.uint8)
        newlines = np.flatnonzero(buf == _NL)
        gt = np.flatnonzero(buf == _GT)
        heads = gt[(gt == 0) | (buf[gt - 1] == _NL)]  # '>' at a line start (blocks start at a line start)
        # a header ends at the next newline; the last line of the file may lack one
        ends = np.append(newlines, len(buf))[np.searchsorted(newlines, heads)]
        mapped = self.lut[buf]
        for h, e in zip(heads, ends):
            mapped[h:e] = SKIP
        if self.alphabet == "protein":  # A3M files may open with '#' lines (HHblits / ColabFold cardinality)
            hashes = np.flatnonzero(buf == _HASH)
            hashes = hashes[(hashes == 0) | (buf[hashes - 1] == _NL)]
            for h, e in zip(hashes, np.append(newlines, len(buf))[np.searchsorted(newlines, hashes)]):
                mapped[h:e] = SKIP
        self._check_illegal(buf, mapped, newlines, heads, ends)
        prev = 0
        for h, e in zip(heads.tolist(), ends.tolist()):
            self._append(mapped[prev:h], buf, prev, newlines)
            yield from self.close()
            line = self.line + int(np.searchsorted(newlines, h)) + 1
            self._open_record(bytes(data[h + 1:e]).decode("utf-8", errors="replace").strip(), line)
            prev = e
        self._append(mapped[prev:], buf, prev, newlines)
        self.line += len(newlines)

    def _append(self, seg: np.ndarray, buf: np.ndarray, offset: int, newlines: np.ndarray) -> None:
        keep = seg[seg != SKIP]
        if not keep.size:
            return
        if self.rec_id is None:
            first = offset + int(np.flatnonzero(seg != SKIP)[0])
            line = self.line + int(np.searchsorted(newlines, first)) + 1
            raise ValueError(f"FASTA file {self.path} line {line}: sequence data before the first '>' "
                             f"header; is this a FASTA file?")
        self.pieces.append(keep)

    def _open_record(self, header: str, line: int) -> None:
        rec_id = header.split()[0] if header else ""
        if not rec_id:
            raise ValueError(f"FASTA file {self.path} line {line}: empty header '>' (a record needs an id)")
        if rec_id in self.seen:
            raise ValueError(f"FASTA file {self.path} line {line}: record id {rec_id!r} repeats the record "
                             f"at line {self.seen[rec_id]}; record ids must be unique within a file")
        self.seen[rec_id] = line
        self.rec_id, self.rec_desc = rec_id, header[len(rec_id):].strip()

    def close(self) -> Iterator[FastaRecord]:
        if self.rec_id is None:
            return
        tokens = np.concatenate(self.pieces) if self.pieces else np.zeros(0, np.uint8)
        rec = FastaRecord(self.rec_id, tokens, str(self.path), self.rec_desc)
        self.rec_id, self.pieces = None, []
        yield rec

    def _check_illegal(self, buf: np.ndarray, mapped: np.ndarray, newlines: np.ndarray,
                       heads: np.ndarray, ends: np.ndarray) -> None:
        bad = np.flatnonzero((mapped == ILLEGAL) | (mapped == AMBIGUOUS))
        if not bad.size:
            return
        i = int(bad[0])
        line = self.line + int(np.searchsorted(newlines, i)) + 1
        before = np.flatnonzero(heads < i)
        record = self.rec_id
        if before.size:
            record = _header_id(buf, int(heads[before[-1]]), int(ends[before[-1]]))
        char = chr(buf[i])
        where = f"record {record!r}" if record is not None else "before the first '>' header"
        if mapped[i] == AMBIGUOUS:
            raise ValueError(f"FASTA file {self.path}, {where}, line {line}: IUPAC ambiguity code "
                             f"{char!r} rejected by data.non_acgt=error; set data.non_acgt=n to read it as N")
        raise ValueError(f"FASTA file {self.path}, {where}, line {line}: illegal character {char!r} "
                         f"(byte 0x{buf[i]:02x}); {_allowed(self.alphabet, char)}")


def _allowed(alphabet: str, char: str) -> str:
    """What the sequence lines of ``alphabet`` may hold, and the fix for ``char``."""
    if alphabet == "protein":
        return ("protein sequence lines may hold the 20 amino acids, B Z X U O, '-' (gap), and '.' or '*' "
                "(skipped), in either case; replace it (X: an unknown residue) or remove the record")
    hint = "; for protein sequences set --data.alphabet protein" if char.upper() in _AMINO_ONLY else ""
    return f"sequence lines may hold only IUPAC nucleotide codes{hint}"


def _header_id(buf: np.ndarray, start: int, end: int) -> str:
    words = bytes(buf[start + 1:end]).decode("utf-8", errors="replace").split()
    return words[0] if words else ""


def iter_fasta(path: str | Path, lowercase: str = "upper", non_acgt: str = "n", lut: np.ndarray | None = None,
               alphabet: str = "dna") -> Iterator[FastaRecord]:
    """Stream the records of a FASTA file (plain, gzip or xz), one uint8 id array each. ``lut``: a byte -> id
    table of another alphabet (``alphabet`` names it in messages; default: DNA from lowercase, non_acgt)."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise ValueError(f"FASTA file {path} not found" + (" (it is a directory)" if path.is_dir() else ""))
    parser = _Parser(path, byte_lut(lowercase, non_acgt) if lut is None else lut, alphabet)
    total, count = 0, 0
    with open_maybe_compressed(path) as fh:
        carry = b""
        while True:
            block = _read_block(fh, path)
            total += len(block)
            data = carry + block
            if block:
                cut = data.rfind(b"\n") + 1
                data, carry = data[:cut], data[cut:]
            if data:
                for rec in parser.feed(data):
                    count += 1
                    yield rec
            if not block:
                break
    for rec in parser.close():
        count += 1
        yield rec
    if total == 0:
        raise ValueError(f"FASTA file {path} is empty")
    if count == 0:
        raise ValueError(f"FASTA file {path} holds no FASTA records (no line starts with '>')")


def read_fasta(path: str | Path, lowercase: str = "upper", non_acgt: str = "n") -> list[FastaRecord]:
    """All records of a FASTA file (see ``iter_fasta``)."""
    return list(iter_fasta(path, lowercase, non_acgt))


def expand_paths(patterns: list[str], setting: str) -> list[Path]:
    """Files named by ``setting`` (e.g. 'data.train'); glob patterns expand in sorted order."""
    out: list[Path] = []
    for pattern in patterns:
        text = str(Path(pattern).expanduser())
        if any(c in text for c in "*?["):
            matches = sorted(glob.glob(text))
            if not matches:
                raise ValueError(f"{setting}: pattern {pattern!r} matches no file")
            out.extend(Path(m) for m in matches)
            continue
        p = Path(text)
        if p.is_dir():
            raise ValueError(f"{setting}: {p} is a directory; list its files or use a glob like {p}/*.fa.gz")
        if not p.is_file():
            raise ValueError(f"{setting}: file {p} not found (a relative path in a recipe is relative to the "
                             f"recipe's directory, on the command line to the working directory)")
        out.append(p)
    return out


@dataclass
class DnaSplit:
    """Training records and held-out records grouped by file (each group is evaluated on its own)."""

    train: list[FastaRecord]
    heldout: dict[str, list[FastaRecord]]


def _split_tail(records: list[FastaRecord], fraction: float) -> tuple[list[FastaRecord], list[FastaRecord]]:
    head, tail = [], []
    for r in records:
        cut = int(len(r) * (1.0 - fraction))
        head.append(FastaRecord(r.id, r.tokens[:cut], r.source, r.description))
        tail.append(FastaRecord(f"{r.id}:tail", r.tokens[cut:], r.source, r.description))
    return head, tail


def load_dna_split(data_cfg: Any, heldout_tail: float = 0.0, reader: Any = None) -> DnaSplit:
    """Read ``data.train`` (default: the packaged lambda genome) and ``data.heldout`` into a split.

    ``data.heldout_records`` moves whole records of the training files to the held-out side.
    ``heldout_tail`` (0 <= f < 1) also holds out the last fraction f of every training record, for a
    single-genome demo such as the embedded default; held-out files are the better split.
    ``reader``: path -> records (default: DNA ``read_fasta``; protein families pass their own).
    """
    if reader is None:
        def reader(p: Path) -> list[FastaRecord]:
            return read_fasta(p, data_cfg.lowercase, data_cfg.non_acgt)
    if not 0.0 <= heldout_tail < 1.0:
        raise ValueError(f"heldout_tail must be in [0, 1), got {heldout_tail}")
    train_paths = expand_paths(list(data_cfg.train), "data.train")
    train_paths = train_paths or [default_genome_path()]
    heldout_paths = expand_paths(list(data_cfg.heldout), "data.heldout")
    both = {p.resolve() for p in train_paths} & {p.resolve() for p in heldout_paths}
    if both:
        raise ValueError(f"{sorted(map(str, both))} listed in both data.train and data.heldout; a held-out "
                         f"file must not be trained on (use data.heldout_records to hold out part of a file)")
    wanted = set(data_cfg.heldout_records)
    train: list[FastaRecord] = []
    heldout: dict[str, list[FastaRecord]] = {}
    found: set[str] = set()
    for p in train_paths:
        recs = reader(p)
        out = [r for r in recs if r.id in wanted]
        found |= {r.id for r in out}
        if out:
            heldout[f"{p.name} (held-out records)"] = out
        train.extend(r for r in recs if r.id not in wanted)
    missing = sorted(wanted - found)
    if missing:
        raise ValueError(f"data.heldout_records {missing} not found in data.train files "
                         f"({', '.join(p.name for p in train_paths)}); a record id is the first word of "
                         f"its header")
    if sum(len(r) for r in train) == 0:
        if found:
            raise ValueError("data.heldout_records holds out every record of the training files, leaving no "
                             "training data; keep at least one record for training or add files to data.train")
        first = train[0] if train else None
        where = f": record {first.id!r} of {first.source} has a header and no sequence" if first is not None else ""
        raise ValueError(f"data.train files ({', '.join(map(str, train_paths))}) hold no sequence{where}; add "
                         "the records' sequence lines or give FASTA files with sequence data")
    if heldout_tail > 0:
        train, tail = _split_tail(train, heldout_tail)
        heldout[f"tail {heldout_tail:g} of training records"] = tail
    for p in heldout_paths:
        name = p.name if p.name not in heldout else str(p)
        heldout[name] = reader(p)
    return DnaSplit(train, heldout)
