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


def iter_rows(path: Path, column: str, extra: tuple[str, ...] = (),
              setting: str = "data.train") -> Iterator[tuple[str, dict[str, Any]]]:
    """(``'FILE row N'``, {column: value, and the ``extra`` columns the file has}) per row, in order."""
    for file in columnar_files(Path(path)):
        try:
            names = _schema_names(file)
        except (OSError, ValueError) as e:
            raise ValueError(f"{setting}: {file} is not a readable parquet or Arrow file ({e})") from None
        if column not in names:
            raise ValueError(f"{setting}: {file} has no column {column!r} (columns: {', '.join(names)}); set "
                             "--data.column to the column holding the data")
        row = 0
        for batch in _batches(file, [column] + [c for c in extra if c in names and c != column]):
            for record in batch.to_pylist():
                yield f"{file} row {row}", record
                row += 1


class _TextBuffer:
    """Tokenized documents (each followed by the end-of-document token) cut into consecutive windows of
    ``seq_len + 1`` tokens that share one token, so every token is a label once."""

    def __init__(self, seq_len: int, eos_id: int | None) -> None:
        self.seq_len, self.eos = seq_len, np.asarray([] if eos_id is None else [eos_id], np.int32)
        self.ids, self.docs, self.next_doc = np.zeros(0, np.int32), np.zeros(0, np.int32), 0

    def add(self, token_docs: list[np.ndarray]) -> Iterator[Window]:
        parts = [np.concatenate([d.astype(np.int32), self.eos]) for d in token_docs if len(d)]
        docs = [np.full(len(p), self.next_doc + k, np.int32) for k, p in enumerate(parts)]
        self.next_doc += len(parts)
        ids, doc_ids = np.concatenate([self.ids, *parts]), np.concatenate([self.docs, *docs])
        L, start = self.seq_len + 1, 0
        while len(ids) - start >= L:
            yield ids[start:start + L], doc_ids[start:start + L], np.ones(L, bool)
            start += self.seq_len
        self.ids, self.docs = ids[start:], doc_ids[start:]


def text_windows(paths: list[Path], tokenizer: Any, column: str, seq_len: int, setting: str,
                 order: Any = None, pass_number: int = 0) -> Iterator[Window]:
    """The text documents of a column in windows (``_TextBuffer``), tokenized a record batch at a time; with
    ``order`` (a ``doc_order.DocOrder``) only this rank's share, in the order of pass ``pass_number``."""
    buffer = _TextBuffer(seq_len, tokenizer.eos_id)
    batch: list[str] = []
    rows: Iterator[tuple[str, dict[str, Any]]] = (item for path in paths
                                                  for item in iter_rows(path, column, (), setting))
    if order is not None:
        rows = order(rows, pass_number)
    for where, record in rows:
        text = record[column]
        if not isinstance(text, str):
            raise ValueError(f"{where}: column {column!r} holds {type(text).__name__}, expected text; set "
                             "--data.column to a text column")
        batch.append(text)
        if len(batch) == BATCH_ROWS:
            yield from buffer.add(tokenizer.encode_batch(batch))
            batch = []
    if batch:
        yield from buffer.add(tokenizer.encode_batch(batch))


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
