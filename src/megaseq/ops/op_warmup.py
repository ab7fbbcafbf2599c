"""Op manifests and their replay: torch's one-time CUDA costs of a run's first step, paid while the precompile
finishes.

A process's first call of each torch CUDA op at a shape costs far more than later ones: cuBLAS chooses and loads
a kernel per GEMM shape, and CUDA loads each elementwise or reduction kernel's module on its first launch. A
step of a few hundred milliseconds spends as much again on these the first time (glm5-flash-1gpu at 8K on an
H100: about 0.7 s of host time, `benchmarks/results/speed/first_step/README.md`), while the run's first step
waits seconds for the precompile (``ops.precompile``) anyway.

An **op manifest** lists the distinct aten ops a run's first step called on the GPU: each op's overload and its
arguments, a tensor as its shape, strides, offset and dtype (never its values), in order of first call.
``replay`` calls each one once on zero-filled tensors of those layouts, on the run's device, while the
precompile's threads finish; the step's own first calls then find cuBLAS's choices made and the modules loaded.

- ``recording()`` collects the ops of the block (the first step) through a ``TorchDispatchMode``, which the
  autograd engine carries into the backward pass. Views, factories, host syncs and ops of other namespaces
  (megaseq's and fla's Triton kernels are not aten ops) are not recorded; neither is an op of more than
  ``MAX_TENSORS`` tensors (the optimizer's foreach calls over every parameter).
- Manifests are named by the run's kernel fingerprint, its sequence length and batch (``name``). Two are read:
  the one the package ships (``ops/tuned/ops/``) and the user's (``<cache>/ops/``), which a run without either
  writes after its first step (at most ``RECORD_MAX_LEN`` tokens). A manifest recorded under another torch
  version or GPU is not used (the kernels torch chooses differ).
- ``replay`` stops where the precompile is done (the warm-up only fills the wait), skips an op whose tensors
  would take more than ``MAX_REPLAY_BYTES`` at once, restores the device's random-number state after (a resumed
  run draws what it would have drawn), and counts the ops that raise: an op that refuses zero-filled arguments
  only misses its warm-up. Integer tensors are zeros, so every index is in range.

``MEGASEQ_WARM_OPS=0`` turns the replay and the recording off (``ops.switches.warm_ops``).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megaseq.files import write_atomic
from megaseq.ops import switches

logger = logging.getLogger(__name__)

FORMAT = 1
SHIPPED_DIR = Path(__file__).parent / "tuned" / "ops"
MAX_TENSORS = 16  # an op over more tensors (a foreach over the parameters) is not recorded
MAX_REPLAY_BYTES = 1 << 30  # an op whose tensors need more at once is not replayed
# no kernel of their own, a host sync, or values that zero-filled arguments would make invalid
NOT_RECORDED = frozenset({
    "empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided", "_local_scalar_dense", "item",
    "_assert_async", "_assert_scalar", "_functional_assert_async", "multinomial", "set_", "resize_",
    "record_stream", "lift_fresh", "_has_compatible_shallow_copy_type", "is_same_size", "is_nonzero",
    "_pin_memory", "pin_memory", "is_pinned", "repeat_interleave", "segment_reduce", "_unsafe_view",
})
# a first step longer than this is not recorded: its first calls are a small part of it, and a dispatch mode's
# host time on each of its many segments' ops would not be
RECORD_MAX_LEN = 131072

Entry = list[Any]  # [op name "aten.mm.default", args, kwargs], each tensor as {"T": [shape, stride, offset, dtype]}


class Unrecorded(Exception):
    """An argument the manifest cannot describe: the op is not recorded."""


def _describe(x: Any, device: torch.device, count: list[int]) -> Any:
    """``x`` as JSON: a tensor on ``device`` (or a CPU scalar) as its layout, a dtype, device or memory format by
    name; anything else that is not a plain value raises ``Unrecorded``."""
    if isinstance(x, torch.Tensor):
        if x.layout != torch.strided or x.is_nested or x.is_quantized:
            raise Unrecorded
        if x.device != device and not (x.device.type == "cpu" and x.dim() == 0):
            raise Unrecorded
        count[0] += 1
        return {"T": [list(x.shape), list(x.stride()), x.storage_offset(), str(x.dtype).removeprefix("torch."),
                      x.device.type == "cpu"]}
    if isinstance(x, (list, tuple)):
        return [_describe(v, device, count) for v in x]
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    if isinstance(x, torch.dtype):
        return {"dtype": str(x).removeprefix("torch.")}
    if isinstance(x, torch.device):
        return {"device": x.type}
    if isinstance(x, torch.memory_format):
        return {"memory_format": str(x).removeprefix("torch.")}
    if isinstance(x, torch.layout):
        return {"layout": str(x).removeprefix("torch.")}
    raise Unrecorded


def _span(shape: list[int], stride: list[int], offset: int) -> int:
    """Elements of storage a tensor of this layout reaches (0 for an empty one)."""
    return offset + 1 + sum((n - 1) * s for n, s in zip(shape, stride, strict=True)) if all(shape) else 0


def _build(x: Any, device: torch.device) -> Any:
    """The value ``_describe`` wrote, a tensor as zeros of its layout on ``device`` (a CPU scalar on the CPU)."""
    if isinstance(x, list):
        return [_build(v, device) for v in x]
    if not isinstance(x, dict):
        return x
    if "T" in x:
        shape, stride, offset, dtype, on_cpu = x["T"]
        t = torch.zeros(max(_span(shape, stride, offset), 1), dtype=getattr(torch, dtype),
                        device="cpu" if on_cpu else device)
        return t.as_strided(shape, stride, offset)
    if "dtype" in x:
        return getattr(torch, x["dtype"])
    if "device" in x:
        return device if x["device"] != "cpu" else torch.device("cpu")
    if "memory_format" in x:
        return getattr(torch, x["memory_format"])
    if "layout" in x:
        return getattr(torch, x["layout"])
    return x


def _bytes(x: Any) -> int:
    if isinstance(x, list):
        return sum(_bytes(v) for v in x)
    if isinstance(x, dict) and "T" in x:
        shape, stride, offset, dtype, _ = x["T"]
        return _span(shape, stride, offset) * getattr(torch, dtype).itemsize
    return 0


def _device(device: torch.device) -> torch.device:
    """``device`` with its index (a tensor's device always has one)."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _op(name: str) -> Any:
    """The ``OpOverload`` of ``aten.<op>.<overload>``."""
    ns, op, overload = name.split(".")
    return getattr(getattr(getattr(torch.ops, ns), op), overload)


class Recorder(TorchDispatchMode):
    """The distinct aten ops called on ``device`` inside the mode, in order of first call (``entries``)."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = _device(device)
        self.seen: set[str] = set()
        self.entries: list[Entry] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self._note(func, args, kwargs)
        return out

    def _note(self, func: Any, args: tuple, kwargs: dict) -> None:
        if func.namespace != "aten" or func.is_view or func._opname in NOT_RECORDED:
            return
        count = [0]
        try:
            entry = [f"aten.{func._opname}.{func._overloadname}", _describe(list(args), self.device, count),
                     {k: _describe(v, self.device, count) for k, v in kwargs.items()}]
        except Unrecorded:
            return
        if not count[0] or count[0] > MAX_TENSORS:
            return
        key = json.dumps(entry)
        if key not in self.seen:
            self.seen.add(key)
            self.entries.append(entry)


@dataclass
class Replayed:
    """What ``replay`` did: ops called, skipped (over ``MAX_REPLAY_BYTES``), failed (raised), left (not reached
    when its ``until`` said stop), and seconds."""

    ops: int = 0
    skipped: int = 0
    failed: int = 0
    left: int = 0
    seconds: float = 0.0


def _rng_state(device: torch.device) -> Any:
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()


def _set_rng_state(device: torch.device, state: Any) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


def replay(entries: list[Entry], device: torch.device, max_bytes: int = MAX_REPLAY_BYTES,
           until: Callable[[], bool] | None = None) -> Replayed:
    """Call each entry's op once on zero-filled tensors of its layouts on ``device`` (no autograd), in order, until
    ``until()`` is true (checked before each op; the rest are counted as left), then wait for the device; the
    random-number state of ``device`` (and the CPU's) as before."""
    out = Replayed()
    t0 = time.perf_counter()
    device = _device(device)
    states = (_rng_state(device), torch.get_rng_state())
    try:
        with torch.no_grad():
            for i, (name, args, kwargs) in enumerate(entries):
                if until is not None and until():
                    out.left = len(entries) - i
                    break
                if _bytes([args, list(kwargs.values())]) > max_bytes:
                    out.skipped += 1
                    continue
                try:
                    _op(name)(*_build(args, device), **{k: _build(v, device) for k, v in kwargs.items()})
                    out.ops += 1
                except Exception as e:  # noqa: BLE001  an op that refuses zeros only misses its warm-up
                    out.failed += 1
                    logger.debug(f"op warm-up: {name}: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    finally:
        _set_rng_state(device, states[0])
        torch.set_rng_state(states[1])
    out.seconds = time.perf_counter() - t0
    return out


# ---- manifests --------------------------------------------------------------------------------------------------
def target(device: torch.device) -> dict[str, str]:
    """What decides the kernels torch chooses for an op: its version and the device's name."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return {"torch": torch.__version__, "device": name}


def name(fp: str, seq_len: int, batch: int) -> str:
    """The file name of a run's op manifest: its kernel fingerprint ``fp``, sequence length and batch."""
    return f"{fp}-{seq_len}x{batch}.json"


def user_dir() -> Path:
    """The user's op manifests: ``<cache>/ops`` (``model.kernel_cache``, ``MEGASEQ_CACHE_DIR``)."""
    return switches.cache_root() / "ops"


def read(path: Path, want: dict[str, str]) -> list[Entry] | None:
    """The entries of the op manifest at ``path``; None where it is missing, unreadable or recorded for another
    ``target`` (said in one log line)."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        logger.info(f"op manifest {path}: unreadable ({e}); not used")
        return None
    if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("entries"), list):
        logger.info(f"op manifest {path}: not a megaseq op manifest of format {FORMAT}; not used")
        return None
    if data.get("target") != want:
        logger.info(f"op manifest {path}: recorded for {data.get('target')}, this is {want}; not used")
        return None
    return [e for e in data["entries"] if isinstance(e, list) and len(e) == 3 and isinstance(e[0], str)]


def write(path: Path, entries: list[Entry], want: dict[str, str]) -> None:
    write_atomic(path, json.dumps({"format": FORMAT, "target": want, "entries": entries}))


class RunWarmup:
    """A run's op warm-up: ``replay`` of its manifest (the package's, else the user's) before the first step, and
    that step run inside ``recording`` where neither manifest exists, which writes the user's."""

    def __init__(self, fp: str, seq_len: int, batch: int, device: torch.device,
                 shipped: Path | None = None, user: Path | None = None) -> None:
        self.device = device
        self.want = target(device)
        file = name(fp, seq_len, batch)
        self.user_path = (user or user_dir()) / file
        self.entries = read((shipped or SHIPPED_DIR) / file, self.want)
        if self.entries is None:
            self.entries = read(self.user_path, self.want)
        self.record = seq_len <= RECORD_MAX_LEN
        self.result: Replayed | None = None
        self.recorded = 0

    def replay(self, log: Any = logger.info, until: Callable[[], bool] | None = None) -> Replayed | None:
        """The manifest's ops replayed until ``until()`` (``replay``; None: no manifest)."""
        if not self.entries:
            return None
        self.result = replay(self.entries, self.device, until=until)
        r = self.result
        log(f"op warm-up: {r.ops} of {len(self.entries)} ops called once in {r.seconds:.2f} s"
            + (f", {r.skipped} over {MAX_REPLAY_BYTES >> 30} GiB skipped" if r.skipped else "")
            + (f", {r.failed} refused zero-filled arguments" if r.failed else "")
            + (f", {r.left} left to the first step (the precompile was done)" if r.left else ""))
        return r

    @contextmanager
    def recording(self) -> Iterator[None]:
        """Without a manifest, record the block's ops (the first step) into the user's, up to ``RECORD_MAX_LEN``
        tokens; else nothing."""
        if self.entries is not None or not self.record:
            yield
            return
        rec = Recorder(self.device)
        with rec:
            yield
        try:
            write(self.user_path, rec.entries, self.want)
            self.recorded = len(rec.entries)
        except OSError as e:
            logger.info(f"op manifest {self.user_path}: not written ({e})")

    def summary(self) -> dict[str, Any]:
        """The replay's counts (``Replayed``) and the ops recorded into the user's manifest."""
        done = asdict(self.result) if self.result is not None else {}
        return {**done, "entries": len(self.entries or []), "recorded": self.recorded}
