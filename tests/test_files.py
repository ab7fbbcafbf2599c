"""megaseq.files.write_atomic: the whole file or the old one, never half; no temporary left; unique temporaries."""

from __future__ import annotations

import os
import stat
import threading
from pathlib import Path

import pytest

from megaseq import files
from megaseq.files import write_atomic


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def _temporaries(d: Path) -> list[Path]:
    return [p for p in d.iterdir() if files.TMP_INFIX in p.name]


def test_text_and_bytes_land_whole(tmp_path):
    text = "ACGT é ü 漢\n" * 10_000
    out = write_atomic(tmp_path / "a" / "b" / "t.txt", text)  # parents created
    assert out == tmp_path / "a" / "b" / "t.txt" and isinstance(out, Path)
    assert out.read_bytes() == text.encode("utf-8")
    blob = bytes(range(256)) * 4096
    assert write_atomic(str(tmp_path / "b.bin"), blob).read_bytes() == blob  # a str path too
    write_atomic(out, "short")
    assert out.read_text() == "short"  # replaced, not appended or overlaid
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b.bin"]
    assert not _temporaries(out.parent)


@pytest.mark.parametrize("umask", [0o022, 0o027, 0o077])
def test_mode_is_what_open_gives_unless_given(umask, tmp_path):
    previous = os.umask(umask)
    try:
        new = write_atomic(tmp_path / "new", "x")
        (tmp_path / "plain").write_text("x")
        given = write_atomic(tmp_path / "given", "x", mode=0o640)
    finally:
        os.umask(previous)
    assert _mode(new) == _mode(tmp_path / "plain") == 0o666 & ~umask
    assert _mode(given) == 0o640


def test_a_reader_during_the_write_sees_the_old_file(tmp_path, monkeypatch):
    path = write_atomic(tmp_path / "m.json", "old")
    seen = []
    real = os.fsync

    def reader(fd):
        seen.append((path.read_text(), [p.read_text() for p in _temporaries(tmp_path)]))
        return real(fd)

    monkeypatch.setattr(files.os, "fsync", reader)
    write_atomic(path, "new")
    assert seen == [("old", ["new"])]  # the new bytes sit in the one temporary, the destination is still old
    assert path.read_text() == "new"


@pytest.mark.parametrize("where", ["fsync", "replace"])
@pytest.mark.parametrize("error", [OSError("disk full"), KeyboardInterrupt()])
def test_a_failed_write_leaves_the_old_file_and_no_temporary(where, error, tmp_path, monkeypatch):
    path = write_atomic(tmp_path / "m.json", "old")

    def fail(*a, **k):
        raise error

    monkeypatch.setattr(files.os, where, fail)
    with pytest.raises(type(error)):
        write_atomic(path, "new")
    monkeypatch.undo()
    assert path.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["m.json"]


def test_a_failed_first_write_leaves_nothing(tmp_path, monkeypatch):
    def fail(*a, **k):
        raise OSError("read-only")

    monkeypatch.setattr(files.os, "replace", fail)
    with pytest.raises(OSError, match="read-only"):
        write_atomic(tmp_path / "m.json", "new")
    assert list(tmp_path.iterdir()) == []


def test_each_write_takes_its_own_temporary(tmp_path, monkeypatch):
    moved = []
    real = os.replace

    def record(src, dst):
        moved.append((Path(src), Path(dst)))
        return real(src, dst)

    monkeypatch.setattr(files.os, "replace", record)
    path = tmp_path / "t.json"
    write_atomic(path, "1")
    write_atomic(path, "2")
    (a, da), (b, db) = moved
    assert da == db == path and a != b
    assert a.parent == b.parent == tmp_path
    assert a.name.startswith(".t.json.tmp-") and b.name.startswith(".t.json.tmp-")


def test_a_temporary_held_by_another_writer_is_never_reused(tmp_path, monkeypatch):
    names = iter(["aaaaaaaaaaaa", "aaaaaaaaaaaa", "bbbbbbbbbbbb"])
    monkeypatch.setattr(files.secrets, "token_hex", lambda n: next(names))
    theirs = tmp_path / ".t.json.tmp-aaaaaaaaaaaa"
    theirs.write_text("another writer's half file")
    write_atomic(tmp_path / "t.json", "mine")
    assert (tmp_path / "t.json").read_text() == "mine"
    assert theirs.read_text() == "another writer's half file"  # not opened, not truncated, not moved


def test_concurrent_writers_of_one_name(tmp_path):
    path = tmp_path / "t.bin"
    bodies = [bytes([i]) * 200_000 for i in range(8)]
    errors = []

    def writer(body):
        try:
            for _ in range(5):
                write_atomic(path, body)
                assert path.read_bytes() in bodies  # whole, one writer's
        except BaseException as e:  # reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=writer, args=(b,)) for b in bodies]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert path.read_bytes() in bodies
    assert [p.name for p in tmp_path.iterdir()] == ["t.bin"]
