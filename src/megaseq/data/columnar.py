"""Columnar data: parquet, Arrow and ``datasets`` directories, read a record batch at a time.

Sources (``pyarrow``, the ``data`` extra: ``pip install 'megaseq[data]'``):

- ``.parquet``: row groups read as record batches of the needed columns only;
- ``.arrow``: Arrow IPC, file or stream format (what ``datasets`` caches hold);
- a directory written by ``datasets.Dataset.save_to_disk`` (``state.json`` lists its Arrow files, read
  in order; ``datasets`` itself is not needed), or any directory of .parquet / .arrow files (sorted).

One column holds the data (``data.column``): text for ``data.kind text``, a messages list for ``chat``,
a residue string per protein for ``data.alphabet protein``. At most one record batch is decoded at a
time, so a dataset larger than host memory streams through training (``packing.StreamWindows``).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from megaseq.data.packing import Window

BATCH_ROWS = 1024


def _pyarrow() -> Any:
    try:
        import pyarrow
        import pyarrow.ipc
        import pyarrow.parquet
    except ImportError:
        raise ImportError("parquet, Arrow and datasets directories are read with pyarrow: "
                          "pip install 'megaseq[data]'") from None
    return pyarrow


def columnar_files(path: Path) -> list[Path]:
    """The data files of ``path``: itself, the Arrow files a ``save_to_disk`` directory lists, or the sorted
    .parquet / .arrow files of a directory."""
    if not path.is_dir():
        return [path]
    state = path / "state.json"
    if state.is_file():
        files = [path / f["filename"] for f in json.loads(state.read_text()).get("_data_files", [])]
    else:
        files = sorted(p for p in path.rglob("*") if p.suffix in (".parquet", ".arrow"))
    if not files:
        raise ValueError(f"{path}: a directory holding no .parquet or .arrow files (and no datasets state.json)")
    return files


def _batches(path: Path, columns: list[str]) -> Iterator[Any]:
    pa = _pyarrow()
    if path.suffix == ".parquet":
        yield from pa.parquet.ParquetFile(str(path)).iter_batches(batch_size=BATCH_ROWS, columns=columns)
        return
    with pa.memory_map(str(path)) as source:
        try:
            reader = pa.ipc.open_file(source)
            batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
        except pa.ArrowInvalid:
            source.seek(0)
            batches = iter(pa.ipc.open_stream(source))
        for batch in batches:
            yield batch.select(columns)


def _schema_names(path: Path) -> list[str]:
    pa = _pyarrow()
    if path.suffix == ".parquet":
        return list(pa.parquet.read_schema(str(path)).names)
    with pa.memory_map(str(path)) as source:
        try:
            return list(pa.ipc.open_file(source).schema.names)
        except pa.ArrowInvalid:
            source.seek(0)
            return list(pa.ipc.open_stream(source).schema.names)


def _columns(file: Path, column: str, extra: tuple[str, ...], setting: str) -> list[str]:
    """The columns to read from ``file``: ``column`` (which it must have) and the ``extra`` ones it has."""
    try:
        names = _schema_names(file)
    except (OSError, ValueError) as e:
        raise ValueError(f"{setting}: {file} is not a readable parquet or Arrow file ({e})") from None
    if column not in names:
        raise ValueError(f"{setting}: {file} has no column {column!r} (columns: {', '.join(names)}); set "
                         "--data.column to the column holding the data")
    return [column] + [c for c in extra if c in names and c != column]


def iter_rows(path: Path, column: str, extra: tuple[str, ...] = (),
              setting: str = "data.train") -> Iterator[tuple[str, dict[str, Any]]]:
    """(``'FILE row N'``, {column: value, and the ``extra`` columns the file has}) per row, in order."""
    for file in columnar_files(Path(path)):
        row = 0
        for batch in _batches(file, _columns(file, column, extra, setting)):
            for record in batch.to_pylist():
                yield f"{file} row {row}", record
                row += 1


def row_chunks(path: Path, column: str, extra: tuple[str, ...] = (),
               setting: str = "data.train") -> Iterator[tuple[int, Any]]:
    """The rows of ``iter_rows`` as (row count, decode) per parquet row group or Arrow record batch
    (``sources.record_chunks``): a chunk none of whose rows is asked for is not read (parquet) or not decoded
    (Arrow, memory-mapped); of the others only the rows asked for become records."""
    pa = _pyarrow()
    for file in columnar_files(Path(path)):
        columns, first = _columns(file, column, extra, setting), 0
        if file.suffix == ".parquet":
            pf = pa.parquet.ParquetFile(str(file))
            for g in range(pf.num_row_groups):
                n = pf.metadata.row_group(g).num_rows
                yield n, lambda rows, pf=pf, g=g, cols=columns, file=file, first=first: _picked(
                    pf.iter_batches(batch_size=BATCH_ROWS, row_groups=[g], columns=cols), rows, file, first)
                first += n
            continue
        for batch in _batches(file, columns):
            yield batch.num_rows, lambda rows, batch=batch, file=file, first=first: _picked([batch], rows, file, first)
            first += batch.num_rows


def _picked(batches: Any, rows: list[int], file: Path, first: int) -> Iterator[tuple[str, dict[str, Any]]]:
    """(``'FILE row N'``, record) of the rows ``rows`` (increasing, counted from the first batch) of ``batches``."""
    start, k = 0, 0
    for batch in batches:
        end = start + batch.num_rows
        mine = []
        while k < len(rows) and rows[k] < end:
            mine.append(rows[k] - start)
            k += 1
        if mine:
            for r, record in zip(mine, batch.take(mine).to_pylist()):
                yield f"{file} row {first + start + r}", record
        if k == len(rows):
            return
        start = end


class _TextBuffer:
    """Tokenized documents (each followed by the end-of-document token) cut into consecutive windows of
    ``seq_len + 1`` tokens that share one token, so every token is a label once. Resumed at a position: its first
    document starts at token ``skip`` and has document id ``doc_id``."""

    def __init__(self, seq_len: int, eos_id: int | None, doc_id: int = 0, skip: int = 0) -> None:
        self.seq_len, self.eos = seq_len, np.asarray([] if eos_id is None else [eos_id], np.int32)
        self.ids, self.docs, self.next_doc, self.skip = np.zeros(0, np.int32), np.zeros(0, np.int32), doc_id, skip
        self.spans: list[tuple[int, int, int]] = []  # (share position, index of its token 0 in ids, doc id)

    def add(self, token_docs: list[tuple[int, np.ndarray]]) -> Iterator[tuple[Window, tuple[int, ...], int, int]]:
        """Windows, each with what starts the next: the share positions of the documents from the one holding its
        first token on, the offset of that token in it, and that document's id."""
        parts = [(pos, np.concatenate([d.astype(np.int32), self.eos])) for pos, d in token_docs if len(d)]
        at = len(self.ids) - self.skip
        for k, (pos, part) in enumerate(parts):
            self.spans.append((pos, at, self.next_doc + k))
            at += len(part)
        if parts and self.skip:
            parts[0], self.skip = (parts[0][0], parts[0][1][self.skip:]), 0
        docs = [np.full(len(p), self.next_doc + k, np.int32) for k, (_, p) in enumerate(parts)]
        self.next_doc += len(parts)
        ids, doc_ids = np.concatenate([self.ids, *(p for _, p in parts)]), np.concatenate([self.docs, *docs])
        L, start, k = self.seq_len + 1, 0, 0
        while len(ids) - start >= L:
            window = ids[start:start + L], doc_ids[start:start + L], np.ones(L, bool)
            start += self.seq_len
            while k + 1 < len(self.spans) and self.spans[k + 1][1] <= start:
                k += 1
            yield window, tuple(p for p, _, _ in self.spans[k:]), start - self.spans[k][1], self.spans[k][2]
        while k + 1 < len(self.spans) and self.spans[k + 1][1] <= start:
            k += 1
        self.spans = [(p, first - start, d) for p, first, d in self.spans[k:]]
        self.ids, self.docs = ids[start:], doc_ids[start:]


def text_windows(paths: list[Path], tokenizer: Any, column: str, seq_len: int, setting: str,
                 order: Any = None, pass_number: int = 0) -> Iterator[Window]:
    """The text documents of a column in windows (``_TextBuffer``), tokenized a record batch at a time; with
    ``order`` (a ``doc_order.DocOrder``) only this rank's share, in the order of pass ``pass_number``."""
    from megaseq.data.doc_order import DocOrder, PassDocs
    from megaseq.data.packing import StreamPosition
    from megaseq.data.seek import read_share

    order = order or DocOrder()
    docs = PassDocs(order, lambda wanted, start: read_share(paths, column, (), "a JSON object", setting, order,
                                                            wanted, start), pass_number)
    return (window for window, _ in positioned_text_windows(docs, tokenizer, column, seq_len,
                                                             StreamPosition(pass_number)))


def positioned_text_windows(docs: Any, tokenizer: Any, column: str, seq_len: int, at: Any) -> Iterator[Any]:
    """``text_windows`` over ``docs`` (a ``doc_order.PassDocs`` of (where, record)) from position ``at`` (a
    ``packing.StreamPosition``), each window with the position of the window after it."""
    buffer = _TextBuffer(seq_len, tokenizer.eos_id, at.doc_id, at.offset)
    batch: list[tuple[int, str]] = []

    def flush() -> Iterator[Any]:
        token_docs = tokenizer.encode_batch([text for _, text in batch])
        for window, pending, offset, doc_id in buffer.add([(p, t) for (p, _), t in zip(batch, token_docs)]):
            yield window, type(at)(at.pass_number, docs.state(), pending, offset, doc_id)

    for pos, (where, record) in docs:
        text = record[column]
        if not isinstance(text, str):
            raise ValueError(f"{where}: column {column!r} holds {type(text).__name__}, expected text; set "
                             "--data.column to a text column")
        batch.append((pos, text))
        if len(batch) == BATCH_ROWS:
            yield from flush()
            batch = []
    if batch:
        yield from flush()


def read_sequences(path: Path, column: str, tokenizer: Any, setting: str) -> list[Any]:
    """Protein records of a column of residue strings (one protein per row; ids from an ``id`` column when
    the file has one, else ``row N``)."""
    from megaseq.data.fasta import FastaRecord

    out = []
    for where, record in iter_rows(path, column, ("id",), setting):
        seq = record[column]
        if not isinstance(seq, str):
            raise ValueError(f"{where}: column {column!r} holds {type(seq).__name__}, expected a residue string; "
                             "set --data.column to the sequence column")
        try:
            tokens = tokenizer.encode(seq)
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
        out.append(FastaRecord(str(record.get("id") or f"row {where.rsplit(' ', 1)[-1]}"), tokens, str(path)))
    return out
