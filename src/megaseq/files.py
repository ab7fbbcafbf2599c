"""Atomic file writes: readers see the old file or the new one, never half of either.

``write_atomic`` writes to a temporary file beside the destination (``.NAME.tmp-<random>``, created exclusively,
so concurrent writers of one name never share a temporary), flushes it, fsyncs it unless told the file need not
be durable, then ``os.replace``s it onto the destination. A failure at any point removes the temporary and
leaves the destination as it was.

The lowest layer of the package: imports nothing from megaseq.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

TMP_INFIX = ".tmp-"  # a temporary of NAME is ``.NAME.tmp-<random>``; ``.NAME.tmp-*`` finds what a killed write left


def temporary_name(path: Path) -> Path:
    """A fresh temporary name for ``path``, in its directory: ``.NAME.tmp-<12 hex digits>``."""
    return path.with_name(f".{path.name}{TMP_INFIX}{secrets.token_hex(6)}")


def _create(path: Path) -> tuple[int, Path]:
    """Create and open a new temporary file for ``path`` (``O_EXCL``: never one another writer holds). Its mode is
    what ``open`` gives a new file under the process's umask."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0) | getattr(os, "O_CLOEXEC", 0)
    for _ in range(100):
        tmp = temporary_name(path)
        try:
            return os.open(tmp, flags, 0o666), tmp
        except FileExistsError:
            continue
    raise FileExistsError(f"no free temporary name for {path}")


def write_atomic(path: str | os.PathLike[str], data: bytes | str, *, mode: int | None = None,
                 durable: bool = True) -> Path:
    """Write ``data`` (``str``: encoded as UTF-8) to ``path`` atomically; returns ``path`` as a ``Path``.

    The parent directory is created. ``mode``: the file's permission bits; None gives what ``open`` gives a new
    file under the umask. ``durable``: the data reaches the disk (fsync) before the rename; a cache that can be
    rebuilt (Triton's, seeded file by file) leaves it off, as Triton's own cache writes do. Raises what the write
    raises (``OSError`` for a full disk or a read-only directory), the destination then untouched."""
    path = Path(path)
    raw = data.encode("utf-8") if isinstance(data, str) else bytes(data)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = _create(path)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(raw)
            fh.flush()
            if mode is not None:
                os.fchmod(fh.fileno(), mode)
            if durable:
                os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path
