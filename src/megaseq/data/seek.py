"""A rank's share of a streamed data set read from a position, and a fingerprint of the files a position points into.

``read_share`` is the ``doc_order.Reader`` of streamed files: it walks the records in file order as chunks
(``sources.record_chunks``: a JSON line, a parquet row group, an Arrow record batch), works out from the
share's arithmetic (``DocOrder.numbers``) which records it needs, and parses or decodes only those. A JSON
line that is skipped is counted, not parsed; a parquet row group none of whose rows is needed is not read.
So a resume at share position p costs reading p * W lines (or the parquet footers), and rendering or
tokenizing nothing but the documents the saved position names.

``fingerprint``: the files' names, sizes and first and last ``FINGERPRINT_BYTES`` bytes, hashed; a saved
position is used only on the files it was taken on.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from megaseq.data.doc_order import DocOrder
from megaseq.data.sources import is_columnar, record_chunks

FINGERPRINT_BYTES = 1 << 16


def read_share(paths: list[Path], column: str, extra: tuple[str, ...], what: str, setting: str, order: DocOrder,
               wanted: Sequence[int] = (), start: int = 0) -> Iterator[tuple[int, tuple[str, Any]]]:
    """(share position, (where, record)) of rank ``order.rank``'s records at the positions ``wanted`` (below
    ``start``), then at every position from ``start`` on, in order."""
    need = order.numbers(wanted, start)
    pos, number = next(need)
    first = 0  # the number (in the whole stream) of the chunk's first record
    for path in paths:
        for count, decode in record_chunks(path, column, extra, what, setting):
            end, rows = first + count, []
            while number < end:
                rows.append((pos, number - first))
                pos, number = next(need)
            if rows:
                for (p, _), item in zip(rows, decode([r for _, r in rows]), strict=True):
                    yield p, item
            first = end


def data_files(paths: list[Path]) -> list[Path]:
    """The files of ``paths`` (a directory: its parquet / Arrow files)."""
    from megaseq.data.columnar import columnar_files

    return [f for p in paths for f in (columnar_files(p) if is_columnar(p) and p.is_dir() else [p])]


def fingerprint(paths: list[Path]) -> str:
    """A short hash of the files' names, sizes and first and last ``FINGERPRINT_BYTES`` bytes."""
    h = hashlib.sha256()
    for f in data_files(paths):
        size = f.stat().st_size
        h.update(f"{f.name}\0{size}\0".encode())
        with open(f, "rb") as fh:
            h.update(fh.read(FINGERPRINT_BYTES))
            if size > FINGERPRINT_BYTES:
                fh.seek(max(FINGERPRINT_BYTES, size - FINGERPRINT_BYTES))
                h.update(fh.read())
    return h.hexdigest()[:16]
