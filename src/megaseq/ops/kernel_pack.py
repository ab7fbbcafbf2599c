"""Compiled kernels shipped with the package: a recipe's Triton binaries, seeded into Triton's cache before the
precompile, so that a new machine with the same Triton build and GPU target loads its kernels instead of compiling them.

A **pack** (``<fingerprint>-<target>.tar.xz``, beside the recipe's kernel manifest in ``ops/tuned/kernels/``) holds
the files Triton's cache keeps for each of the manifest's kernels that a launch needs: the metadata (``.json``),
the binary (``.cubin``), the group file that names them, and the launchers and driver utilities Triton built with
the host compiler (``.so``; each named for the Python it was built against, so another Python never finds
them). The intermediate IR (``.ttir``, ``.ttgir``, ``.llir``, ``.ptx``, ``.source``) is left out, as Triton's
``TRITON_STORE_BINARY_ONLY`` leaves it out. Its first member, ``megaseq-kernel-pack.json``, names the Triton
version, GPU target and Python it was built for; a pack of another is not used (Triton's cache keys hash its own
compiled module, which is built for one Python: another Python's Triton never finds the pack's kernels).

``seed`` writes each file that the cache lacks under its cache key (Triton's own hash of the kernel's source,
options, Triton version, compiler and target: a kernel whose source changed since the pack was built has another
key, so its stale binary is never found), the group files pointed at this cache's paths, each file written to a
temporary name and renamed, so that processes seeding one cache at once never read half a file. What Triton then
finds it loads; what it does not, it compiles as without a pack.

``build`` writes a pack from a manifest: a fresh Triton cache in a subprocess, the manifest's kernels compiled and
loaded into it (``precompile.precompile``), then that cache packed (``write``).

Torch-free; Triton is imported only by ``build``'s subprocess and ``cache_dir``.
"""

from __future__ import annotations

import io
import json
import logging
import os
import re
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
from pathlib import Path
from typing import Any

from megaseq.files import write_atomic

logger = logging.getLogger(__name__)

FORMAT = 1
META = "megaseq-kernel-pack.json"
KEEP = (".json", ".cubin", ".hsaco", ".so")  # what a launch reads; the IR is left out
GROUP = "__grp__"
# a member is <cache key>/<file name>: one directory level, no path separators or dot-dot in either part
_MEMBER = re.compile(r"[A-Za-z0-9_-]+/[A-Za-z0-9_][A-Za-z0-9_.+-]*")


def pack_path(manifest: Path) -> Path:
    """The pack of the kernel manifest at ``manifest``, beside it: ``<fp>-cuda90.json`` -> ``<fp>-cuda90.tar.xz``."""
    return manifest.with_suffix(".tar.xz")


def cache_dir() -> Path:
    """Triton's cache directory as Triton reads it (``TRITON_CACHE_DIR``, else ``~/.triton/cache``)."""
    from triton import knobs

    return Path(knobs.cache.dir)


def _kept(path: Path) -> bool:
    name = path.name
    return (path.suffix in KEEP and not name.endswith(".autotune.json") and ".tmp." not in name
            and not name.startswith("."))


def write(cache: Path, path: Path, triton_version: str, target: str) -> dict[str, Any]:
    """Pack the launch files of every kernel in Triton cache directory ``cache`` into ``path`` (written to a
    temporary name, then renamed); the group files rewritten to name their files relative to their key. Returns the
    pack's metadata (version, target, files, bytes before compression)."""
    members: list[tuple[str, bytes]] = []
    groups: list[tuple[str, bytes]] = []
    for d in sorted(p for p in cache.iterdir() if p.is_dir()):
        for f in sorted(p for p in d.iterdir() if p.is_file() and _kept(p)):
            name = f"{d.name}/{f.name}"
            if not _MEMBER.fullmatch(name):
                continue
            if f.name.startswith(GROUP):
                child = json.loads(f.read_text()).get("child_paths") or {}
                rel = {c: Path(p).name for c, p in child.items() if _kept(Path(p)) and (d / Path(p).name).is_file()}
                groups.append((name, json.dumps({"child_paths": rel}).encode()))
            else:
                members.append((name, f.read_bytes()))
    meta = {"format": FORMAT, "triton": triton_version, "target": target,
            "python": sysconfig.get_config_var("EXT_SUFFIX"), "files": len(members) + len(groups),
            "bytes": sum(len(b) for _, b in members + groups)}
    packed = io.BytesIO()
    with tarfile.open(fileobj=packed, mode="w:xz") as tar:
        for name, data in [(META, json.dumps(meta).encode()), *members, *groups]:  # groups last: seed reads them after
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), 0o644
            tar.addfile(info, io.BytesIO(data))
    write_atomic(path, packed.getvalue())
    return meta


def seed(path: Path, cache: Path, triton_version: str, target: str) -> int:
    """Write each file of the pack at ``path`` that Triton cache directory ``cache`` lacks; returns how many: none
    where there is no pack, and none (said in one log line) where it is unreadable or of another Triton version or
    target. A group file is written last, naming this cache's paths of its files that are present, and only where
    its metadata is: Triton then finds a whole kernel or none. A pack seeded whole leaves a stamp in the cache
    (``megaseq-packs/<pack name>.json``: its size and modification time), and the same pack is not read again
    there; a kernel deleted from the cache since compiles as without a pack."""
    stamp = _stamp(path, cache)
    if stamp is not None and stamp[0].is_file() and stamp[0].read_text() == stamp[1]:
        return 0
    try:
        tar = tarfile.open(path, "r:xz")
    except FileNotFoundError:
        return 0
    except (OSError, tarfile.TarError) as e:
        logger.info(f"kernel pack {path}: unreadable ({e}); not used")
        return 0
    written = 0
    try:
        with tar:
            first = tar.next()
            meta = json.loads(tar.extractfile(first).read()) if first is not None and first.name == META else None
            if not isinstance(meta, dict) or meta.get("format") != FORMAT:
                logger.info(f"kernel pack {path}: not a megaseq kernel pack of format {FORMAT}; not used")
                return 0
            if (meta.get("triton"), meta.get("target")) != (triton_version, target):
                logger.info(f"kernel pack {path}: built under Triton {meta.get('triton')} for {meta.get('target')}, "
                            f"this is Triton {triton_version} on {target}; not used")
                return 0
            here = sysconfig.get_config_var("EXT_SUFFIX")
            if meta.get("python") != here:  # Triton's cache keys hash its compiled module, one build per Python
                logger.info(f"kernel pack {path}: built under Python {meta.get('python')}, this is {here}; not used")
                return 0
            groups = []
            for m in tar:
                if not m.isfile() or not _MEMBER.fullmatch(m.name):
                    logger.debug(f"kernel pack {path}: member {m.name!r} skipped")
                    continue
                key, name = m.name.split("/")
                dest = cache / key / name
                if name.startswith(GROUP):
                    groups.append((dest, tar.extractfile(m).read()))
                elif not dest.exists():
                    write_atomic(dest, tar.extractfile(m).read(), durable=False)
                    written += 1
            for dest, data in groups:
                if dest.exists():
                    continue
                child = json.loads(data).get("child_paths") or {}
                paths = {c: str(dest.parent / rel) for c, rel in child.items()
                         if isinstance(rel, str) and "/" not in rel and (dest.parent / rel).is_file()}
                if any(c.endswith(".json") for c in paths):
                    write_atomic(dest, json.dumps({"child_paths": paths}).encode(), durable=False)
                    written += 1
    except (OSError, ValueError, tarfile.TarError) as e:
        logger.info(f"kernel pack {path}: stopped reading ({e}); {written} files seeded")
        return written
    if stamp is not None:
        try:
            write_atomic(stamp[0], stamp[1], durable=False)
        except OSError as e:
            logger.debug(f"kernel pack {path}: no stamp ({e})")
    return written


def _stamp(path: Path, cache: Path) -> tuple[Path, str] | None:
    """Where the stamp of pack ``path`` seeded whole into ``cache`` lives, and its content (the pack's size and
    modification time: another build of the pack differs); None where the pack is missing."""
    try:
        st = path.stat()
    except OSError:
        return None
    return cache / "megaseq-packs" / f"{path.name}.json", json.dumps({"size": st.st_size, "mtime_ns": st.st_mtime_ns})


def seed_cache(path: Path, triton_version: str, target: str) -> int:
    """``seed`` into Triton's cache directory (``cache_dir``)."""
    return seed(path, cache_dir(), triton_version, target)


def build(manifest: Path, out: Path, workers: int | None = None, timeout: float = 1800,
          env: dict[str, str] | None = None) -> dict[str, Any]:
    """Write the pack of ``manifest`` (a kernel manifest of this machine's Triton and target) to ``out``: its
    kernels compiled and loaded into a fresh Triton cache by a subprocess (environment ``env``, default this
    process's), then packed. Returns the pack's metadata with the precompile's result
    (``precompile.Result.summary``). Needs the GPU the manifest is for."""
    with tempfile.TemporaryDirectory(prefix="megaseq-pack-") as tmp:
        env = {**(os.environ if env is None else env), "TRITON_CACHE_DIR": tmp}
        answer = Path(tmp) / "megaseq-pack-result.json"
        cmd = [sys.executable, "-m", "megaseq.ops.kernel_pack", str(manifest), str(out), str(answer),
               str(workers or 0)]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        if done.returncode != 0 or not answer.is_file():
            raise RuntimeError(f"kernel pack of {manifest}: the subprocess failed:\n{done.stderr[-4000:]}")
        return json.loads(answer.read_text())


def _main(argv: list[str]) -> None:
    """``python -m megaseq.ops.kernel_pack MANIFEST OUT ANSWER WORKERS``, run by ``build`` with
    ``TRITON_CACHE_DIR`` a fresh directory: compile and load the manifest's kernels there (``WORKERS`` threads, 0:
    the default), pack it into ``OUT``, write the pack's metadata and the precompile's result to ``ANSWER``."""
    from megaseq.ops import precompile

    manifest, out, answer = Path(argv[0]), Path(argv[1]), Path(argv[2])
    version, target = precompile.current_target()
    entries = precompile.read_manifest(manifest, version, target)
    if not entries:
        raise SystemExit(f"{manifest}: no kernels for Triton {version} on {target}")
    result = precompile.precompile(entries, int(argv[3]) or None)
    meta = write(cache_dir(), out, version, target)
    answer.write_text(json.dumps({**meta, "path": str(out), "precompile": result.summary()}))


if __name__ == "__main__":
    _main(sys.argv[1:])
