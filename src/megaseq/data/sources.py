"""Records from data files, one at a time: JSON lines, and columnar files (``data.columnar``).

``iter_records(path, column)`` yields ``(where, record)``: ``where`` names the file and line (or row) for
messages, ``record`` is a dict holding at least ``column``. Nothing is read ahead of what the caller
consumes, so a file larger than host memory streams through. ``record_chunks`` gives the same records as
chunks that can be skipped without decoding them (a JSON line, a parquet row group, an Arrow record batch):
a resumed stream reads only the records it needs (``seek.read_share``).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from megaseq.data.fasta import expand_paths, open_maybe_compressed

COLUMNAR_SUFFIXES = (".parquet", ".arrow")


def is_columnar(path: Path) -> bool:
    """Parquet, Arrow, or a directory written by ``datasets``' ``save_to_disk``."""
    return path.is_dir() or path.name.lower().endswith(COLUMNAR_SUFFIXES)


def data_paths(patterns: list[str], setting: str) -> list[Path]:
    """Files (globs expand) and directories (a ``datasets`` or parquet directory is one source) of ``setting``."""
    dirs = [p for p in patterns if Path(p).expanduser().is_dir()]
    files = expand_paths([p for p in patterns if p not in dirs], setting)
    return [Path(p).expanduser() for p in dirs] + files


def is_jsonl(path: Path) -> bool:
    name = path.name.lower()
    for suffix in (".gz", ".xz"):
        name = name.removesuffix(suffix)
    return name.endswith(".jsonl")


def iter_jsonl(path: Path, what: str = "a JSON object") -> Iterator[tuple[str, Any]]:
    """(``'FILE line N'``, object) per non-empty line; a line that is not JSON is one ValueError."""
    with open_maybe_compressed(path) as fh:
        for num, raw in enumerate(fh, start=1):
            if raw.strip():
                yield from _parse_line(raw, f"{path} line {num}", what)


def _check_jsonl(path: Path, setting: str) -> None:
    """A file that is neither columnar (checked first) nor JSONL: one ValueError naming ``setting``."""
    if not is_jsonl(path):
        raise ValueError(f"{setting}: {path} is not .jsonl (optionally .gz/.xz), .parquet, .arrow or a datasets "
                         "directory")


def iter_records(path: Path, column: str, extra: tuple[str, ...] = (), what: str = "a JSON object",
                 setting: str = "data.train") -> Iterator[tuple[str, Any]]:
    """Records of a JSONL or columnar file (``extra``: other columns to read when a columnar file has them)."""
    if is_columnar(path):
        from megaseq.data.columnar import iter_rows

        yield from iter_rows(path, column, extra, setting)
        return
    _check_jsonl(path, setting)
    yield from iter_jsonl(path, what)


# (number of records, decode): decode(rows) yields (where, record) of the chunk's rows ``rows`` (increasing)
Chunk = tuple[int, Callable[[list[int]], Iterator[tuple[str, Any]]]]


def record_chunks(path: Path, column: str, extra: tuple[str, ...] = (), what: str = "a JSON object",
                  setting: str = "data.train") -> Iterator[Chunk]:
    """The records of ``iter_records`` as chunks: only the rows asked for are parsed or decoded."""
    if is_columnar(path):
        from megaseq.data.columnar import row_chunks

        yield from row_chunks(path, column, extra, setting)
        return
    _check_jsonl(path, setting)
    with open_maybe_compressed(path) as fh:
        for num, raw in enumerate(fh, start=1):
            if raw.strip():
                yield 1, lambda rows, raw=raw, num=num: _parse_line(raw, f"{path} line {num}", what)


def _parse_line(raw: bytes | str, where: str, what: str) -> Iterator[tuple[str, Any]]:
    try:
        yield where, json.loads(raw)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not valid JSON ({e.msg}); each line must be {what}") from None
