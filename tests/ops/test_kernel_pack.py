"""``ops.kernel_pack``: a Triton cache's launch files packed (the IR left out, the group files made relative) and
seeded into another cache (group files pointed at its paths, what it has kept, unsafe members and packs of
another Triton version or target refused), the precompile seeding before it compiles, and with real Triton a
seeded kernel found in the new cache instead of compiled, while a verbatim copy of the pack is not."""

from __future__ import annotations

import io
import json
import logging
import os
import subprocess
import sys
import sysconfig
import tarfile
from pathlib import Path

import pytest

from megaseq.ops import kernel_pack, precompile, switches

LAUNCHER = "__triton_launcher.cpython-312-x86_64-linux-gnu.so"


def fake_cache(root: Path) -> Path:
    """A Triton cache as Triton writes it: a kernel (metadata, binary, IR, a group file naming them by absolute
    path), a launcher, an autotune result and a half-written temporary file."""
    k = root / "KEYA"
    k.mkdir(parents=True)
    files = {"add.json": '{"name": "add"}', "add.cubin": "BINARY", "add.ptx": "PTX", "add.ttir": "TTIR"}
    for name, text in files.items():
        (k / name).write_text(text)
    (k / "__grp__add.json").write_text(json.dumps({"child_paths": {n: str(k / n) for n in files}}))
    (k / "add.json.tmp.pid_1_x").write_text("half")
    launcher = root / "KEYB"
    launcher.mkdir()
    (launcher / LAUNCHER).write_bytes(b"ELF")
    tuned = root / "KEYC"
    tuned.mkdir()
    (tuned / "add.autotune.json").write_text("{}")
    return root


def members(path: Path) -> list[str]:
    with tarfile.open(path, "r:xz") as tar:
        return tar.getnames()


def group_paths(cache: Path, key: str, name: str) -> dict[str, str]:
    """What Triton's ``FileCacheManager.get_group`` returns: the group's files that exist."""
    child = json.loads((cache / key / f"__grp__{name}").read_text())["child_paths"]
    return {c: p for c, p in child.items() if os.path.exists(p)}


def test_write_keeps_the_launch_files_and_seed_points_the_groups_at_the_new_cache(tmp_path):
    src = fake_cache(tmp_path / "built")
    pack = tmp_path / "ship" / "fp-cuda90.tar.xz"
    meta = kernel_pack.write(src, pack, "3.6.0", "cuda:90")
    assert (meta["format"], meta["triton"], meta["target"], meta["files"]) == (1, "3.6.0", "cuda:90", 4)
    assert members(pack) == [kernel_pack.META, "KEYA/add.cubin", "KEYA/add.json", f"KEYB/{LAUNCHER}",
                             "KEYA/__grp__add.json"]  # metadata first, group files last, no IR or temporaries
    dst = tmp_path / "user" / "triton"
    assert kernel_pack.seed(pack, dst, "3.6.0", "cuda:90") == 4
    assert sorted(p.name for p in (dst / "KEYA").iterdir()) == ["__grp__add.json", "add.cubin", "add.json"]
    assert group_paths(dst, "KEYA", "add.json") == {"add.json": str(dst / "KEYA" / "add.json"),
                                                    "add.cubin": str(dst / "KEYA" / "add.cubin")}
    assert (dst / "KEYA" / "add.cubin").read_text() == "BINARY" and (dst / "KEYB" / LAUNCHER).read_bytes() == b"ELF"
    assert kernel_pack.seed(pack, dst, "3.6.0", "cuda:90") == 0  # all there: nothing written twice


def test_seed_keeps_what_the_cache_has(tmp_path):
    pack = tmp_path / "p.tar.xz"
    kernel_pack.write(fake_cache(tmp_path / "built"), pack, "3.6.0", "cuda:90")
    dst = tmp_path / "dst"
    (dst / "KEYA").mkdir(parents=True)
    (dst / "KEYA" / "add.cubin").write_text("MINE")
    assert kernel_pack.seed(pack, dst, "3.6.0", "cuda:90") == 3
    assert (dst / "KEYA" / "add.cubin").read_text() == "MINE"


def test_a_pack_seeded_whole_is_not_read_again_until_it_changes(tmp_path, monkeypatch):
    pack = tmp_path / "p.tar.xz"
    kernel_pack.write(fake_cache(tmp_path / "built"), pack, "3.6.0", "cuda:90")
    dst = tmp_path / "dst"
    assert kernel_pack.seed(pack, dst, "3.6.0", "cuda:90") == 4
    assert (dst / "megaseq-packs" / "p.tar.xz.json").is_file()
    real = tarfile.open
    opened = []
    monkeypatch.setattr(kernel_pack.tarfile, "open", lambda *a, **k: opened.append(a) or real(*a, **k))
    (dst / "KEYA" / "add.cubin").unlink()
    assert kernel_pack.seed(pack, dst, "3.6.0", "cuda:90") == 0 and opened == []  # the stamp: not read
    kernel_pack.write(fake_cache(tmp_path / "built2"), pack, "3.6.0", "cuda:90")  # a new build of the pack
    os.utime(pack, ns=(1, 1))
    opened.clear()
    assert kernel_pack.seed(pack, dst, "3.6.0", "cuda:90") == 1 and len(opened) == 1
    assert (dst / "KEYA" / "add.cubin").read_text() == "BINARY"


def test_a_pack_read_in_part_leaves_no_stamp(tmp_path, monkeypatch):
    pack = tmp_path / "p.tar.xz"
    kernel_pack.write(fake_cache(tmp_path / "built"), pack, "3.6.0", "cuda:90")
    real = kernel_pack.write_atomic

    def full_disk(dest, data, **kw):
        if dest.name.endswith(".cubin"):
            raise OSError(28, "No space left on device")
        return real(dest, data, **kw)

    monkeypatch.setattr(kernel_pack, "write_atomic", full_disk)
    dst = tmp_path / "dst"
    kernel_pack.seed(pack, dst, "3.6.0", "cuda:90")
    assert not (dst / "megaseq-packs").exists()
    monkeypatch.setattr(kernel_pack, "write_atomic", real)
    assert kernel_pack.seed(pack, dst, "3.6.0", "cuda:90") == 4  # read again: the rest written


def test_a_group_whose_metadata_is_missing_is_not_written(tmp_path):
    """Triton finds a whole kernel or none: a group file is written only where its metadata file is present."""
    src = fake_cache(tmp_path / "built")
    (src / "KEYA" / "add.json").unlink()
    pack = tmp_path / "p.tar.xz"
    kernel_pack.write(src, pack, "3.6.0", "cuda:90")
    dst = tmp_path / "dst"
    kernel_pack.seed(pack, dst, "3.6.0", "cuda:90")
    assert not (dst / "KEYA" / "__grp__add.json").exists() and (dst / "KEYA" / "add.cubin").exists()


def test_packs_of_another_version_or_target_unreadable_or_missing_seed_nothing(tmp_path, caplog):
    pack = tmp_path / "p.tar.xz"
    kernel_pack.write(fake_cache(tmp_path / "built"), pack, "3.6.0", "cuda:90")
    dst = tmp_path / "dst"
    with caplog.at_level(logging.INFO, logger="megaseq.ops.kernel_pack"):
        assert kernel_pack.seed(pack, dst, "3.5.1", "cuda:90") == 0
        assert kernel_pack.seed(pack, dst, "3.6.0", "cuda:100") == 0
        assert kernel_pack.seed(tmp_path / "none.tar.xz", dst, "3.6.0", "cuda:90") == 0
        (tmp_path / "junk.tar.xz").write_bytes(b"not a tar")
        assert kernel_pack.seed(tmp_path / "junk.tar.xz", dst, "3.6.0", "cuda:90") == 0
    assert not dst.exists()
    said = caplog.text
    assert "built under Triton 3.6.0 for cuda:90, this is Triton 3.5.1 on cuda:90; not used" in said
    assert "this is Triton 3.6.0 on cuda:100; not used" in said and "junk.tar.xz: unreadable" in said


def test_a_pack_built_under_another_python_seeds_nothing(tmp_path, monkeypatch, caplog):
    """Triton's cache keys hash its compiled module, one build per Python: another Python's pack is not used."""
    pack = tmp_path / "p.tar.xz"
    monkeypatch.setattr(kernel_pack.sysconfig, "get_config_var", lambda name: ".cpython-399-x86_64-linux-gnu.so")
    kernel_pack.write(fake_cache(tmp_path / "built"), pack, "3.6.0", "cuda:90")
    monkeypatch.undo()
    with caplog.at_level(logging.INFO, logger="megaseq.ops.kernel_pack"):
        assert kernel_pack.seed(pack, tmp_path / "dst", "3.6.0", "cuda:90") == 0
    assert "built under Python .cpython-399-x86_64-linux-gnu.so, this is" in caplog.text
    assert not (tmp_path / "dst").exists()


def test_localize_drops_another_machines_libdevice_path(tmp_path):
    """A shipped manifest's specs name the libdevice of the machine that recorded them; ``localize`` drops a path
    that does not exist here (Triton then fills in its own, whose content its cache key hashes), keeps one that
    does, and leaves a spec without extern libraries as it is."""
    here = tmp_path / "libdevice.10.bc"
    here.write_bytes(b"bc")
    spec = {"name": "k", "options": {"num_warps": 4, "extern_libs": [
        ["libdevice", "/opt/elsewhere/site-packages/triton/backends/nvidia/lib/libdevice.10.bc"]]}, "key": "x"}
    got = json.loads(precompile.localize(json.dumps(spec)))
    assert got["options"] == {"num_warps": 4} and got["key"] == "x"
    spec["options"]["extern_libs"].append(["mine", str(here)])
    assert json.loads(precompile.localize(json.dumps(spec)))["options"]["extern_libs"] == [["mine", str(here)]]
    plain = json.dumps({"name": "k", "options": {"num_warps": 4}})
    assert precompile.localize(plain) is plain and precompile.localize("not json") == "not json"


def test_unsafe_members_are_skipped(tmp_path):
    """A member outside ``<key>/<file>`` (a parent reference, an absolute path, a deeper path, a link) is never
    written."""
    pack = tmp_path / "evil.tar.xz"
    with tarfile.open(pack, "w:xz") as tar:
        meta = {"format": 1, "triton": "3.6.0", "target": "cuda:90", "python": sysconfig.get_config_var("EXT_SUFFIX")}
        for name, data in [(kernel_pack.META, json.dumps(meta)),
                           ("../escape.so", "x"), ("/abs/x.so", "x"), ("K/deeper/x.so", "x"), ("K/..", "x"),
                           ("K/ok.so", "ok")]:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data.encode()))
        link = tarfile.TarInfo("K/link.so")
        link.type, link.linkname = tarfile.SYMTYPE, "/etc/passwd"
        tar.addfile(link)
    dst = tmp_path / "cache" / "triton"
    assert kernel_pack.seed(pack, dst, "3.6.0", "cuda:90") == 1
    assert [str(p.relative_to(tmp_path)) for p in sorted(tmp_path.rglob("*")) if p.is_file()] == [
        "cache/triton/K/ok.so", "cache/triton/megaseq-packs/evil.tar.xz.json", "evil.tar.xz"]


def test_the_precompile_seeds_the_shipped_pack_before_it_compiles_unless_told_to_compile(monkeypatch, tmp_path):
    """``RunPrecompile``: the shipped pack of its fingerprint and target seeded into Triton's cache on the
    precompile's thread before the compiles (``Result.seeded``); with ``MEGASEQ_PRECOMPILE=compile`` not."""
    monkeypatch.setattr(precompile, "current_target", lambda: ("3.6.0", "cuda:90"))
    monkeypatch.setattr("megaseq.ops.triton_autotune.install", lambda: None)
    monkeypatch.setenv("MEGASEQ_CACHE_DIR", str(tmp_path / "megaseq"))
    shipped = tmp_path / "ship"
    kernel_pack.write(fake_cache(tmp_path / "built"), kernel_pack.pack_path(shipped / "fp-cuda90.json"), "3.6.0",
                      "cuda:90")
    cache = tmp_path / "triton"
    monkeypatch.setattr(kernel_pack, "cache_dir", lambda: cache)
    order = []
    monkeypatch.setattr(precompile, "precompile", lambda entries, *a, **k: order.append(
        sorted(p.name for p in cache.rglob("*"))) or precompile.Result())
    monkeypatch.setenv("MEGASEQ_PRECOMPILE", "compile")
    assert switches.precompile() and not switches.kernel_pack()
    pre = precompile.RunPrecompile("fp", None, shipped=shipped, user=tmp_path / "user")
    assert pre.join(lambda line: None).seeded == 0 and order == [[]]
    monkeypatch.delenv("MEGASEQ_PRECOMPILE")
    pre = precompile.RunPrecompile("fp", None, shipped=shipped, user=tmp_path / "user")
    result = pre.join(lambda line: None)
    assert result.seeded == 4 and "__grp__add.json" in order[1]  # seeded before the compiles started
    assert pre.summary()["seeded"] == 4
    assert "4 files from the package's kernel pack" in result.line()


# ---- with real Triton ---------------------------------------------------------------------------------------
COMPILE = """
import json, sys, torch
from megaseq.ops import precompile
import precompile_kernels as mod
mod.use_stand_in_driver()
if sys.argv[1] == "record":
    with precompile.record() as entries:
        for c in (3, 4):
            mod.add_constant.warmup(torch.float32, 1000, C=c, BLOCK=256, grid=(4,))
    print(json.dumps(entries))
else:
    r = precompile.precompile(json.loads(sys.argv[2]), workers=2, device=0)
    print(json.dumps([r.compiled, r.from_disk]))
"""


def _verbatim(pack: Path, cache: Path, *args) -> int:
    """A broken seed: every member written as packed, the group files unchanged."""
    with tarfile.open(pack, "r:xz") as tar:
        for m in tar.getmembers()[1:]:
            dest = cache / m.name
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_bytes(tar.extractfile(m).read())
    return 1


@pytest.mark.parametrize("seed", [kernel_pack.seed, _verbatim], ids=["seed", "broken-verbatim"])
def test_a_seeded_kernel_is_found_in_the_new_cache_instead_of_compiled(tmp_path, seed):
    """Real Triton under a stand-in sm_90 driver (no GPU), each step a process of its own: two specialisations
    compiled into one cache, packed, the cache deleted (the machine that built the pack is not the user's),
    the pack seeded into a new cache; there the precompile finds both in Triton's cache and compiles none. A
    seed that copies the pack verbatim leaves group files naming the deleted cache: Triton compiles both again."""
    pytest.importorskip("triton")

    here = Path(__file__).resolve().parent
    base = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    base["PYTHONPATH"] = os.pathsep.join([str(here.parents[1] / "src"), str(here)])

    def run(cache: Path, *args: str) -> object:
        out = subprocess.run([sys.executable, "-c", COMPILE, *args], env={**base, "TRITON_CACHE_DIR": str(cache)},
                             capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-3000:]
        return json.loads(out.stdout.strip().splitlines()[-1])

    import shutil

    import triton

    built = tmp_path / "built"
    entries = run(built, "record")
    assert len(entries) == 2
    pack = tmp_path / "p.tar.xz"
    meta = kernel_pack.write(built, pack, triton.__version__, "cuda:90")
    assert meta["files"] >= 6  # per kernel its metadata, binary and group
    shutil.rmtree(built)
    fresh = tmp_path / "fresh"
    assert seed(pack, fresh, triton.__version__, "cuda:90") > 0
    compiled, from_disk = run(fresh, "load", json.dumps(entries))
    if seed is _verbatim:
        assert (compiled, from_disk) == (2, 0)
    else:
        assert (compiled, from_disk) == (2, 2)


LAUNCH = """
import json, sys, torch
from megaseq.bench.compiles import compile_record
from megaseq.ops import precompile
import precompile_kernels as mod
r = precompile.precompile(json.loads(sys.argv[1]), workers=2, device=0)
x = torch.zeros(1000, device="cuda")
with compile_record() as rec:
    mod.add_constant[(4,)](x, 1000, C=int(sys.argv[2]), BLOCK=256)
    torch.cuda.synchronize()
print(json.dumps([r.compiled, r.from_disk, r.loaded, rec.summary()["count"], float(x[0]), float(x[999])]))
"""


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs CUDA")
def test_a_pack_built_on_the_gpu_loads_its_kernels_in_a_new_cache(tmp_path):
    """``build`` on the GPU: a manifest's kernel compiled and loaded into a fresh cache by a subprocess and packed
    (its binary and its launcher); seeded into another new cache, a new process's precompile finds it in Triton's
    cache, builds nothing, and its launch computes the right values. Without the seed (or with the broken verbatim
    copy) ``from_disk`` is 0 and the test fails."""
    import random

    import torch
    import triton

    from megaseq.ops.precompile import current_target

    mod = pytest.importorskip("precompile_kernels")
    c = random.randint(1, 10**6)  # a constant no earlier run specialised on
    x = torch.zeros(1000, device="cuda")
    with precompile.record() as entries:
        mod.add_constant[(4,)](x, 1000, C=c, BLOCK=256)
    version, target = current_target()
    manifest = tmp_path / precompile.manifest_name("fp", target)
    precompile.write_manifest(manifest, entries, version, target)
    here = Path(__file__).resolve().parent
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(here.parents[1] / "src"), str(here), env.get("PYTHONPATH", "")])
    meta = kernel_pack.build(manifest, tmp_path / "p.tar.xz", workers=2, timeout=300, env=env)
    assert meta["precompile"]["compiled"] == 1 and meta["precompile"]["loaded"] == 1
    assert any(n.endswith(".so") for n in members(tmp_path / "p.tar.xz"))  # the launcher travels too
    fresh = tmp_path / "fresh"
    assert kernel_pack.seed(tmp_path / "p.tar.xz", fresh, triton.__version__, target) >= 4
    out = subprocess.run([sys.executable, "-c", LAUNCH, json.dumps(entries), str(c)],
                         env={**env, "TRITON_CACHE_DIR": str(fresh)}, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    compiled, from_disk, loaded, step_compiles, first, last = json.loads(out.stdout.strip().splitlines()[-1])
    assert (compiled, from_disk, loaded, step_compiles) == (1, 1, 1, 0) and first == last == c


def test_the_build_subprocess_packs_what_it_compiled_into_its_fresh_cache(monkeypatch, tmp_path):
    """``build``'s subprocess (``_main``): the manifest read for this Triton and target, its entries precompiled,
    the fresh cache packed, the pack's metadata and the precompile's result written for ``build`` to read; a
    manifest with nothing for this Triton refused by name."""
    monkeypatch.setattr(precompile, "current_target", lambda: ("3.6.0", "cuda:90"))
    cache = fake_cache(tmp_path / "fresh")
    monkeypatch.setattr(kernel_pack, "cache_dir", lambda: cache)
    compiled = []
    monkeypatch.setattr(precompile, "precompile", lambda entries, workers: compiled.append((entries, workers))
                        or precompile.Result(compiled=len(entries), workers=16))
    manifest = tmp_path / "fp-cuda90.json"
    entry = {"kernel": "m.k", "spec": "s"}
    precompile.write_manifest(manifest, [entry], "3.6.0", "cuda:90")
    out, answer = tmp_path / "fp-cuda90.tar.xz", tmp_path / "answer.json"
    kernel_pack._main([str(manifest), str(out), str(answer), "0"])
    got = json.loads(answer.read_text())
    assert compiled == [([entry], None)] and got["files"] == 4 and got["path"] == str(out)
    assert got["precompile"]["compiled"] == 1 and members(out)[0] == kernel_pack.META
    precompile.write_manifest(manifest, [entry], "3.5.0", "cuda:90")
    with pytest.raises(SystemExit, match="fp-cuda90.json: no kernels for Triton 3.6.0 on cuda:90"):
        kernel_pack._main([str(manifest), str(out), str(answer), "2"])


FRESH = """
import json, sys
from pathlib import Path
import triton
from megaseq.ops import kernel_pack, precompile
import precompile_kernels
precompile_kernels.use_stand_in_driver()
manifest, pack, cache = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
kernel_pack.seed(pack, cache, triton.__version__, "cuda:90")
entries = [e for e in precompile.read_manifest(manifest, triton.__version__, "cuda:90")
           if e["kernel"].startswith("megaseq.")]
missed = []
with precompile._count_disk_hits() as hits:
    for e in entries:
        before = hits[0]
        precompile.precompile([e], workers=1, device=0)
        if hits[0] == before:
            missed.append(e["kernel"])
print(json.dumps({"entries": len(entries), "missed": missed}))
"""


@pytest.mark.triton  # collected by `make test-gpu` too: the GPU machine has the packs' Triton build
@pytest.mark.parametrize("manifest", sorted(p.name for p in precompile.SHIPPED_DIR.glob("*-cuda90.json")))
def test_the_shipped_packs_hold_megaseqs_kernels_as_they_are_now(tmp_path, manifest):
    """Each shipped manifest's megaseq kernels, precompiled from its pack seeded into an empty cache (real Triton
    under a stand-in sm_90 driver, in a process of its own), are all found in the cache: a kernel edited since the
    pack was built has another cache key, compiles, and is named here (rebuild with `bash
    benchmarks/speed/speed_gpu.sh pack`). Runs where the Triton build matches the pack's (its version and Python:
    the GPU machine's); skipped elsewhere."""
    triton = pytest.importorskip("triton")
    pack = kernel_pack.pack_path(precompile.SHIPPED_DIR / manifest)
    with tarfile.open(pack, "r:xz") as tar:
        meta = json.loads(tar.extractfile(tar.next()).read())
    if (meta["triton"], meta["python"]) != (triton.__version__, sysconfig.get_config_var("EXT_SUFFIX")):
        pytest.skip(f"the pack is of Triton {meta['triton']} under {meta['python']}")
    here = Path(__file__).resolve().parent
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(here.parents[1] / "src"), str(here), env.get("PYTHONPATH", "")])
    out = subprocess.run([sys.executable, "-c", FRESH, str(precompile.SHIPPED_DIR / manifest), str(pack),
                          str(tmp_path / "cache")], env={**env, "TRITON_CACHE_DIR": str(tmp_path / "cache")},
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["entries"] > 0 and got["missed"] == [], got
