"""Kernel manifests and a parallel precompile: the Triton kernels a run's first step compiles, compiled on several
threads before that step, while the model is built.

A first step on a new machine compiles every Triton kernel (megaseq's and fla's) one at a time on the calling
thread. A **manifest** lists the specialisations a run compiled, each ``{"kernel": "<module>.<qualname>", "spec":
<Triton's specialization data>}``, deduplicated by spec, in a JSON file ``{"format", "triton", "target",
"entries"}``; ``precompile`` compiles them all on a thread pool (``JITFunction.preload`` under Triton's
``AsyncCompileMode``) into the JIT's in-process kernel cache and Triton's disk cache, then builds each kernel's
launcher and loads its binary on the GPU (what a first launch does otherwise), so the step's launches with those
specialisations compile and build nothing.

- ``record()`` collects the entries of the compiles inside a ``with`` block from Triton's
  ``jit_post_compile_hook`` (the hook installed before it keeps being called, and is restored after).
- Manifests are named by ``fingerprint`` (what decides a run's kernel set, the sequence length excluded: every
  length of a recipe shares one manifest, the union of its lengths' entries) and the GPU target. Two are read:
  the one the package ships (``ops/tuned/kernels/``, written by ``megaseq tune --kernels-out``) and the user's
  (``<cache>/kernels/``, to which each run adds what its first step compiled that the manifest lacked).
  Entries recorded under another Triton version or target are not used (Triton's cache keys differ).
- ``Background`` runs ``precompile`` on a thread started before the model is built; ``join()`` before the first
  step. A stale entry (a kernel renamed, its source or signature changed) is skipped and counted, never raised.
- Before it compiles, a run seeds Triton's cache with the package's compiled kernels of its fingerprint and
  target where the package ships them (``ops.kernel_pack``): those load from Triton's cache instead of compiling.
- Under a tuned table (``ops.autotune``: the autotuners look their configs up instead of timing candidates), a run
  loads only the configs the table chose for each tuned kernel (``launched``); the manifest's other configs of
  those kernels, which only a tuning launches, are left to the autotuner of a length the table lacks (from the
  pack's files in Triton's cache where it was seeded).

Torch-free; Triton is imported when a manifest is read for the current machine or a kernel is compiled.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from importlib import import_module
from pathlib import Path
from typing import Any

from megaseq.files import write_atomic
from megaseq.ops import switches

logger = logging.getLogger(__name__)

FORMAT = 1
SHIPPED_DIR = Path(__file__).parent / "tuned" / "kernels"
MAX_WORKERS = 16  # compiles a process runs at once: each holds its own MLIR context and LLVM state

Entry = dict[str, str]  # {"kernel": "<module>.<qualname>", "spec": <specialization data, JSON>}


def fingerprint(parts: dict[str, Any]) -> str:
    """A short name for what decides a run's kernel set (``parts``: JSON-serialisable, e.g. the model spec, the
    compute dtype, ``model.kernels``, LoRA on or off): 16 hex digits of the sha256 of ``parts`` as sorted JSON."""
    text = json.dumps(parts, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def current_target() -> tuple[str, str]:
    """``(triton version, "<backend>:<arch>")`` of this process's GPU (e.g. ``("3.6.0", "cuda:90")``); needs the
    GPU driver."""
    import triton
    from triton.runtime import driver

    t = driver.active.get_current_target()
    return triton.__version__, f"{t.backend}:{t.arch}"


def manifest_name(fp: str, target: str) -> str:
    """The file name of fingerprint ``fp``'s manifest for ``target``: ``<fp>-cuda90.json``."""
    return f"{fp}-{target.replace(':', '')}.json"


def user_dir() -> Path:
    """The user's manifests: ``<cache>/kernels`` (``model.kernel_cache``, ``MEGASEQ_CACHE_DIR``)."""
    return switches.cache_root() / "kernels"


def read_manifest(path: Path, triton_version: str, target: str) -> list[Entry]:
    """The entries of the manifest at ``path``; none where it is missing, and none (said in one log line) where
    it is unreadable or was recorded under another Triton version or target."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return []
    except (OSError, ValueError) as e:
        logger.info(f"kernel manifest {path}: unreadable ({e}); not used")
        return []
    if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("entries"), list):
        logger.info(f"kernel manifest {path}: not a megaseq kernel manifest of format {FORMAT}; not used")
        return []
    if (data.get("triton"), data.get("target")) != (triton_version, target):
        logger.info(f"kernel manifest {path}: recorded under Triton {data.get('triton')} for {data.get('target')}, "
                    f"this is Triton {triton_version} on {target}; not used")
        return []
    return [e for e in data["entries"] if isinstance(e, dict) and isinstance(e.get("kernel"), str)
            and isinstance(e.get("spec"), str)]


def merge(*lists: Iterable[Entry]) -> list[Entry]:
    """The entries of ``lists`` in order, each spec once."""
    seen: set[str] = set()
    out = []
    for entries in lists:
        for e in entries:
            if e["spec"] not in seen:
                seen.add(e["spec"])
                out.append({"kernel": e["kernel"], "spec": e["spec"]})
    return out


def write_manifest(path: Path, entries: Iterable[Entry], triton_version: str, target: str,
                   describes: dict[str, Any] | None = None) -> None:
    """Write a manifest atomically (``files.write_atomic``), its entries sorted by kernel; ``describes``: what the
    fingerprint stands for, for whoever reads the file."""
    body: dict[str, Any] = {"format": FORMAT, "triton": triton_version, "target": target}
    if describes:
        body["describes"] = describes
    body["entries"] = sorted(merge(entries), key=lambda e: (e["kernel"], e["spec"]))
    write_atomic(path, json.dumps(body, indent=1) + "\n")


def load(fp: str, triton_version: str, target: str, shipped: Path | None = None,
         user: Path | None = None) -> list[Entry]:
    """The union of the shipped and the user's manifest of ``fp`` for this Triton version and target."""
    name = manifest_name(fp, target)
    return merge(read_manifest((shipped or SHIPPED_DIR) / name, triton_version, target),
                 read_manifest((user or user_dir()) / name, triton_version, target))


def add(path: Path, entries: Iterable[Entry], triton_version: str, target: str,
        describes: dict[str, Any] | None = None) -> int:
    """Add ``entries`` to the manifest at ``path`` (read back and merged, so other processes' entries stay; a
    manifest of another Triton version or target is replaced); returns how many were new. A directory that
    cannot be written is said in one log line: the run goes on."""
    have = read_manifest(path, triton_version, target)
    merged = merge(have, entries)
    if len(merged) == len(have):
        return 0
    try:
        write_manifest(path, merged, triton_version, target, describes)
    except OSError as e:
        logger.info(f"kernel manifest {path}: not written ({e})")
        return 0
    return len(merged) - len(have)


def hook_kernel_name(fn: Any) -> str | None:
    """``<module>.<qualname>`` of a JIT hook's ``fn`` (``JitFunctionInfo``: Triton passes the module's name, its
    annotation says a module, and the function's qualname); None where either is missing."""
    module, name = getattr(fn, "module", None), getattr(fn, "name", None)
    module = getattr(module, "__name__", module)
    return f"{module}.{name}" if isinstance(module, str) and isinstance(name, str) else None


def _kernel_name(fn: Any) -> str | None:
    """``hook_kernel_name``, or None where the kernel is not importable by name (a function defined inside
    another, or in ``__main__``)."""
    name = hook_kernel_name(fn)
    if name is None or "<locals>" in name or name.startswith("__main__."):
        return None
    return name


@contextmanager
def record() -> Iterator[list[Entry]]:
    """The entries of the Triton compiles inside the block, each spec once (a list filled as they happen); the
    ``jit_post_compile_hook`` installed before keeps being called and is restored after. Without Triton it
    records nothing."""
    entries: list[Entry] = []
    try:
        from triton import knobs
    except ImportError:
        yield entries
        return
    seen: set[str] = set()
    lock = threading.Lock()

    def post(**kw: Any) -> None:
        name = _kernel_name(kw.get("fn"))
        spec = (kw.get("compile") or {}).get("specialization_data")
        if name is not None and isinstance(spec, str):
            with lock:
                if spec not in seen:
                    seen.add(spec)
                    entries.append({"kernel": name, "spec": spec})

    with _chained(knobs.runtime, "jit_post_compile_hook", post):
        yield entries


@contextmanager
def _chained(owner: Any, slot: str, fn: Callable[..., None]) -> Iterator[None]:
    """Triton's hook ``owner.slot`` set, for the block, to call ``fn`` and then the hook installed before (whose
    answer it returns); that hook restored after."""
    before = getattr(owner, slot)

    def hook(**kw: Any) -> Any:
        fn(**kw)
        return before(**kw) if before is not None else None

    setattr(owner, slot, hook)
    try:
        yield
    finally:
        setattr(owner, slot, before)


def resolve(kernel: str) -> Any:
    """The ``JITFunction`` named ``<module>.<qualname>``: the longest importable module prefix, then the
    qualname's attributes, Triton's ``Autotuner`` and ``Heuristics`` unwrapped (``.fn``). ValueError where
    there is none."""
    from triton.runtime.jit import JITFunction

    parts = kernel.split(".")
    for i in range(len(parts) - 1, 0, -1):
        try:
            obj = import_module(".".join(parts[:i]))
        except ImportError:
            continue
        try:
            for attr in parts[i:]:
                obj = getattr(obj, attr)
        except AttributeError:
            continue
        fn = _unwrap(obj)
        if isinstance(fn, JITFunction):
            return fn
        break
    raise ValueError(f"{kernel}: no Triton kernel of that name")


def _unwrap(obj: Any) -> Any:
    """``obj`` or the kernel it wraps (Triton's ``Autotuner`` and ``Heuristics``: ``.fn``, nested): the first that
    holds per-device kernel caches (a ``JITFunction``), or None."""
    for _ in range(8):  # Autotuner(Heuristics(JITFunction)) and the like
        if obj is None or hasattr(obj, "device_caches"):
            return obj
        obj = getattr(obj, "fn", None)
    return None


@dataclass
class Result:
    """What ``precompile`` did: kernels compiled (or loaded from Triton's disk cache), entries skipped (a kernel
    that no longer resolves or compiles), the wall seconds and the threads."""

    compiled: int = 0
    skipped: int = 0
    seconds: float = 0.0
    workers: int = 0
    cached: int = 0  # already in this process's kernel cache (an earlier run in the process compiled them)
    loaded: int = 0  # of those compiled, launchers built and binaries loaded on the GPU
    from_disk: int = 0  # of those compiled, found in Triton's disk cache (a kernel pack or an earlier run)
    seeded: int = 0  # files the package's kernel pack wrote into Triton's cache (``ops.kernel_pack.seed``)
    untimed: int = 0  # entries left out: other configs of the kernels the tuned table chose for (``launched``)

    def summary(self) -> dict[str, Any]:
        return {**asdict(self), "seconds": round(self.seconds, 3)}

    def line(self) -> str:
        cached = f", {self.cached} compiled already" if self.cached else ""
        disk = f", {self.from_disk} from Triton's cache" if self.from_disk else ""
        seeded = f", {self.seeded} files from the package's kernel pack" if self.seeded else ""
        untimed = f", {self.untimed} configs the tuned table does not choose left out" if self.untimed else ""
        return (f"precompiled {self.compiled} kernels ({self.skipped} skipped{cached}{disk}{seeded}{untimed}; "
                f"{self.loaded} loaded) in {self.seconds:.1f} s on {self.workers} threads")


def default_workers(processes: int = 1) -> int:
    """The CPUs this process may use, shared by ``processes`` on the machine, at most ``MAX_WORKERS``."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    return max(1, min(MAX_WORKERS, cpus // max(1, processes)))


def localize(spec: str) -> str:
    """``spec`` for this machine: Triton records the options a kernel compiled with, among them the absolute path of
    its libdevice (``extern_libs``), which is another machine's in a shipped manifest. An extern library whose path
    does not exist here is dropped, so that Triton fills in its own libdevice (its cache key hashes the file's
    content, not its path: the same Triton finds the same kernel); a spec without one is returned as it is."""
    try:
        data = json.loads(spec)
        libs = data["options"]["extern_libs"]
    except (ValueError, KeyError, TypeError):
        return spec
    if not isinstance(libs, list):
        return spec
    kept = [lib for lib in libs if not (isinstance(lib, list) and len(lib) == 2 and isinstance(lib[1], str)
                                        and not os.path.exists(lib[1]))]
    if len(kept) == len(libs):
        return spec
    if kept:
        data["options"]["extern_libs"] = kept
    else:
        del data["options"]["extern_libs"]
    return json.dumps(data)


def _in_kernel_cache(fn: Any, spec: str, device: int | None) -> bool:
    """Whether ``fn`` (a ``JITFunction``) holds ``spec``'s kernel for ``device`` (None: the current one)."""
    caches = getattr(fn, "device_caches", None)
    if not isinstance(caches, dict) or not caches:
        return False
    if device is None:
        from triton.runtime import driver

        device = driver.active.get_current_device()
    if device not in caches:
        return False
    try:
        return json.loads(spec).get("key") in caches[device][0]
    except (ValueError, AttributeError, TypeError):
        return False


class Stopped(Exception):
    """A queued compile or load of a cancelled precompile (``Background.cancel``)."""


class _Pool(ThreadPoolExecutor):
    """The precompile's threads: once ``stop`` is set, a queued call raises ``Stopped`` instead of running. So a
    cancel leaves every future finished, which ``AsyncCompileMode`` waits on (a future cancelled in an executor's
    queue is never reported done to ``as_completed``)."""

    def __init__(self, workers: int) -> None:
        super().__init__(workers, thread_name_prefix="megaseq-precompile")
        self.stop = threading.Event()

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
        def guarded() -> Any:
            if self.stop.is_set():
                raise Stopped("precompile cancelled")
            return fn(*args, **kwargs)

        return super().submit(guarded)


def _loaded(future: Any) -> int:
    try:
        return future.result()
    except Stopped:
        return 0


def _load(kernel: Any, device: int | None) -> int:
    """1 when ``kernel`` (a ``CompiledKernel``) now has its launcher and its binary loaded on ``device`` (None: the
    thread's current one), else 0: a kernel over the GPU's limits raises at its launch, as without this."""
    init = getattr(kernel, "_init_handles", None)
    if init is None:
        return 0
    try:
        if device is not None:
            from triton.runtime import driver

            driver.active.set_current_device(device)
        init()
        return 1
    except Exception as err:  # noqa: BLE001  the launch says it again, where it would have said it
        logger.debug(f"precompile: loading {getattr(kernel, 'name', kernel)}: {type(err).__name__}: {err}")
        return 0


@contextmanager
def _count_disk_hits() -> Iterator[list[int]]:
    """A one-element list counting the compiles inside the block that Triton found in its disk cache (its
    compilation listener, ``cache_hit``); the listener installed before keeps being called and is restored after."""
    hits = [0]
    try:
        from triton import knobs
    except ImportError:
        yield hits
        return
    comp = getattr(knobs, "compilation", None)
    if comp is None or not hasattr(comp, "listener"):
        yield hits
        return
    lock = threading.Lock()

    def listener(**kw: Any) -> None:
        if kw.get("cache_hit"):
            with lock:
                hits[0] += 1

    with _chained(comp, "listener", listener):
        yield hits


def precompile(entries: list[Entry], workers: int | None = None, device: int | None = None,
               resolver: Callable[[str], Any] | None = None, executor: ThreadPoolExecutor | None = None) -> Result:
    """Compile each entry's specialisation (``resolver(kernel).preload(spec)``) on ``workers`` threads (default
    ``default_workers()``) under Triton's ``AsyncCompileMode``, on CUDA device ``device`` (None: the current
    one); returns when all are in the JIT's kernel caches, their launchers built and binaries loaded (``_load``).
    An entry that does not resolve or compile is skipped and counted. ``resolver`` (tests): a kernel name to an
    object with ``preload`` (default ``resolve``). ``executor``: the pool to run on (``_Pool``; its owner shuts it down
    and may stop it: what it stops is skipped), else one of ``workers`` threads made and shut down here."""
    t0 = time.perf_counter()
    resolver = resolver or resolve
    workers = workers or default_workers()
    result = Result(workers=workers)
    if not entries:
        return result
    from triton import AsyncCompileMode
    if device is not None:
        from triton.runtime import driver

        driver.active.set_current_device(device)  # the kernel caches are per device: the run's
    futures = []
    try:
        owned = executor is None
        with _Pool(workers) if owned else contextlib.nullcontext(executor) as pool, _count_disk_hits() as hits:
            with AsyncCompileMode(pool, ignore_errors=True):  # finalising a failed compile does not raise
                for e in entries:
                    try:
                        fn = resolver(e["kernel"])
                        if _in_kernel_cache(fn, e["spec"], device):
                            result.cached += 1
                            continue
                        futures.append(fn.preload(localize(e["spec"])))
                    except Exception as err:  # noqa: BLE001  a stale entry: counted, never raised
                        logger.debug(f"precompile: {e['kernel']}: {type(err).__name__}: {err}")
                        result.skipped += 1
            # what a kernel's first launch does otherwise, one kernel at a time on the step's thread: build its
            # launcher (a C module the host compiler builds, kept in Triton's cache) and load its binary on the GPU
            kernels = [k for f in futures if f is not None and (k := getattr(f, "kernel", None)) is not None]
            result.loaded = sum(_loaded(f) for f in [pool.submit(_load, k, device) for k in kernels])
            result.from_disk = hits[0]
    except Exception as err:  # noqa: BLE001  a hook raising as the compiles are finalised: what finished counts
        logger.info(f"precompile: {type(err).__name__}: {err}")
    for f in futures:  # a FutureKernel: ``kernel`` set once finalised; a compile that raised leaves it None
        if f is not None and getattr(f, "kernel", f) is not None:
            result.compiled += 1
        else:
            result.skipped += 1
    result.seconds = time.perf_counter() - t0
    return result


class Background:
    """``precompile`` on a thread of its own, started at once: it overlaps whatever the caller does next (building
    the model, loading weights, planning), which must launch no Triton kernel until ``join``; the thread only
    compiles, into the JIT's kernel caches and Triton's disk cache."""

    def __init__(self, entries: list[Entry], workers: int | None = None, device: int | None = None,
                 resolver: Callable[[str], Any] | None = None, prepare: Callable[[], int] | None = None) -> None:
        """``prepare``: run first on the thread (the kernel pack's ``seed``), its count kept as ``Result.seeded``."""
        self.entries = entries
        self.result: Result | None = None
        self.error: BaseException | None = None
        n = workers or default_workers()
        self.pool = _Pool(n)

        def run() -> None:
            try:
                seeded = 0
                try:
                    seeded = prepare() if prepare is not None else 0
                except Exception as e:  # noqa: BLE001  a pack that cannot be seeded: its kernels compile instead
                    logger.info(f"precompile: seeding Triton's cache failed ({type(e).__name__}: {e})")
                self.result = precompile(entries, n, device, resolver, self.pool)
                self.result.seeded = seeded
            except BaseException as e:  # noqa: BLE001  said at join: the run goes on and compiles as it launches
                self.error = e
            finally:
                self.pool.shutdown(wait=False)

        self._thread = threading.Thread(target=run, name="megaseq-precompile", daemon=True)
        self._thread.start()

    def cancel(self) -> None:
        """Drop the compiles and loads not started yet (a run that fails before its first step exits without
        waiting for them; those running finish). Nothing after a ``join``."""
        self.pool.stop.set()

    def done(self) -> bool:
        """Whether the compiles have ended (nothing left to wait for)."""
        return not self._thread.is_alive()

    def join(self) -> Result:
        """Wait for the compiles; the result (an error in the thread: said in one log line, nothing counted)."""
        self._thread.join()
        if self.error is not None:
            logger.info(f"precompile failed ({type(self.error).__name__}: {self.error}); the first step compiles "
                        "its kernels as it launches them")
            return Result(skipped=len(self.entries))
        assert self.result is not None
        return self.result


def enabled(device_type: str) -> bool:
    """Whether a run on ``device_type`` precompiles: on a CUDA GPU with Triton installed, unless
    ``model.precompile`` or ``MEGASEQ_PRECOMPILE`` turns it off (``ops.switches.precompile``)."""
    if device_type != "cuda" or not switches.precompile():
        return False
    import importlib.util

    return importlib.util.find_spec("triton") is not None


class RunPrecompile:
    """A run's precompile: the shipped and the user's manifest of fingerprint ``fp`` compiled in the background
    from construction (``Background``), ``join`` before the first step, and that step run inside ``recording``,
    which adds what it compiled that the manifests lacked to the user's manifest. ``device``: the run's CUDA
    device index (the kernel caches are per device). Construct it on the main thread (it reads the GPU's target
    and installs megaseq's autotuner patch before the thread imports any kernel module)."""

    def __init__(self, fp: str, device: int | None, describes: dict[str, Any] | None = None,
                 workers: int | None = None, shipped: Path | None = None, user: Path | None = None,
                 tuned: dict[str, dict[str, Any]] | None = None, length: int | None = None,
                 warmup: Any = None) -> None:
        """``tuned``: the tuned table the autotuners will read (``TunedTable.kernels``), whose chosen configs are
        the only ones of its kernels loaded where it covers the run's sequence ``length`` (``launched``); None
        loads every entry. ``warmup``: the run's op warm-up (``ops.op_warmup.RunWarmup``): replayed on the
        calling thread at ``join`` while the compiles run (no longer), and recording the first step beside them."""
        from megaseq.ops.triton_autotune import install

        install()  # the persistent Triton cache and the autotuner patch, once, before any compile
        self.version, self.target = current_target()
        name = manifest_name(fp, self.target)
        self.user_path = (user or user_dir()) / name
        self.describes = describes
        self.entries = load(fp, self.version, self.target, shipped, user)
        prepare = None
        if switches.kernel_pack():  # the package's compiled kernels into Triton's cache, on the precompile's thread
            from megaseq.ops import kernel_pack

            pack = kernel_pack.pack_path((shipped or SHIPPED_DIR) / name)
            prepare = functools.partial(kernel_pack.seed_cache, pack, self.version, self.target)
        loading, self.untimed = launched(self.entries, tuned, length) if tuned else (self.entries, [])
        self.background = Background(loading, workers, device, prepare=prepare)
        self.result: Result | None = None
        self.warmup = warmup
        self.wait_s = 0.0
        self.added = 0

    def cancel(self) -> None:
        """``Background.cancel``: for a run that ends before its first step."""
        self.background.cancel()

    def join(self, log: Callable[[str], None] = logger.info) -> Result:
        """Replay the op warm-up while the compiles run, then wait for them (the seconds of both: ``wait_s``) and
        log the precompile's line; the result."""
        t0 = time.perf_counter()
        if self.warmup is not None:
            try:
                self.warmup.replay(log, self.background.done)  # only while the compiles run
            except Exception as e:  # noqa: BLE001  a warm-up that fails costs the step its first calls, no more
                log(f"op warm-up failed ({type(e).__name__}: {e}); the first step makes its own first calls")
        self.result = self.background.join()
        self.result.untimed = len(self.untimed)
        self.wait_s = time.perf_counter() - t0
        log(self.result.line())
        return self.result

    @contextmanager
    def recording(self) -> Iterator[list[Entry]]:
        """Record the compiles of the block (the first step) and add the new ones to the user's manifest (and
        its ops, where the op warm-up has no manifest)."""
        ops = self.warmup.recording() if self.warmup is not None else contextlib.nullcontext()
        with record() as entries, ops:
            yield entries
        known = {e["spec"] for e in self.entries}
        self.added = add(self.user_path, [e for e in entries if e["spec"] not in known], self.version, self.target,
                         self.describes)
        if self.added:
            logger.info(f"kernel manifest {self.user_path}: {self.added} kernels added (the next run precompiles them)")

    def summary(self) -> dict[str, Any]:
        """The result (``Result.summary``) with the manifests' entries, the seconds the first step waited for it
        (``wait_s``) and the kernels that step added to the user's manifest."""
        done = self.result.summary() if self.result is not None else {}
        warm = {"op_warmup": self.warmup.summary()} if self.warmup is not None else {}
        return {**done, "entries": len(self.entries), "wait_s": round(self.wait_s, 3), "added": self.added, **warm}


def _spec_config(spec: str, arg_names: list[str] | None = None) -> tuple[dict[str, Any], Any, Any]:
    """(constexpr arguments by name, num_warps, num_stages) of a specialization data string; ``arg_names`` default to
    the spec's own signature's."""
    d = json.loads(spec)
    if arg_names is None:
        arg_names = list(d.get("signature", {}))
    consts = {}
    for path, value in zip(d.get("constant_keys", []), d.get("constant_vals", [])):
        if len(path) == 1 and isinstance(path[0], int) and path[0] < len(arg_names):
            consts[arg_names[path[0]]] = value["constexpr"] if isinstance(value, dict) and "constexpr" in value \
                else value
    options = d.get("options", {})
    return consts, options.get("num_warps"), options.get("num_stages")


def launched(entries: list[Entry], tuned: dict[str, dict[str, Any]], length: int | None = None,
             ) -> tuple[list[Entry], list[Entry]]:
    """``entries`` split into those a step launches under the tuned table ``tuned`` (kernel name -> key -> config
    ``{"kwargs", "num_warps", "num_stages", ...}``, as ``ops.autotune.TunedTable.kernels`` holds it) and the rest:
    an entry of a kernel the table has configs for, matching none of them (its constexprs, warps and stages), is a
    config only an autotuner's timing launches. ``length``: the run's sequence length; a kernel whose table keys
    are all of lengths the lookup does not reach from it (``ops.autotune.covers``) will be tuned, and keeps every
    entry. Every other entry is launched. The argument names come from the entry's own signature, so nothing is
    imported."""
    from megaseq.ops.autotune import covers

    keep, rest = [], []
    for e in entries:
        configs = tuned.get(e["kernel"])
        if not configs or not covers(configs, length):
            keep.append(e)
            continue
        try:
            consts, warps, stages = _spec_config(e["spec"])
        except (ValueError, TypeError, AttributeError):  # not a spec this reads: loaded, as before
            keep.append(e)
            continue
        chosen = any(isinstance(c, dict) and all(consts.get(k) == v for k, v in c.get("kwargs", {}).items())
                     and warps == c.get("num_warps") and stages == c.get("num_stages") for c in configs.values())
        (keep if chosen else rest).append(e)
    return keep, rest


def tuned_only(entries: list[Entry], winners: dict[int, list[Any]], resolver: Callable[[str], Any] = resolve,
               ) -> list[Entry]:
    """``entries`` without the configs an autotuner timed and did not choose: ``winners`` maps ``id()`` of an
    autotuned ``JITFunction`` to the configs its ``Autotuner`` chose (``Config``: ``kwargs``, ``num_warps``,
    ``num_stages``); an entry of such a kernel stays when it matches one of them, any other entry stays."""
    out = []
    for e in entries:
        try:
            fn = resolver(e["kernel"])
        except Exception:  # noqa: BLE001  kept: precompile skips what does not resolve
            out.append(e)
            continue
        chosen = winners.get(id(fn))
        if chosen is None:
            out.append(e)
            continue
        consts, warps, stages = _spec_config(e["spec"], list(getattr(fn, "arg_names", [])))
        if any(all(consts.get(k) == v for k, v in c.kwargs.items()) and warps == c.num_warps
               and stages == c.num_stages for c in chosen):
            out.append(e)
    return out


def autotune_winners(tuners: Iterable[Any]) -> dict[int, list[Any]]:
    """``id()`` of each autotuner's ``JITFunction`` (its ``.fn`` chain unwrapped) to the configs it chose for
    its keys so far (``Autotuner.cache``)."""
    out: dict[int, list[Any]] = {}
    for tuner in tuners:
        fn = _unwrap(tuner.fn)
        if fn is not None:
            out.setdefault(id(fn), []).extend(getattr(tuner, "cache", {}).values())
    return out
