"""Autotuning that a new machine or a new length does not pay for again: length buckets, pruned spaces, a
persistent per-user cache and tuned configurations shipped in the package.

The first step on a machine compiles every Triton kernel (megaseq's and fla's) and times each autotuned
kernel over its whole config space: minutes, where a warm step takes seconds. Four things cut it:

- **Tuned tables.** A JSON per GPU model of the best launch config per kernel, per key (the kernel's own
  autotune key: head and feature dims, flags, dtype) and per **length bucket** (the token count rounded up
  to a power of two, ``seq_bucket``). The kernels read it before tuning (``TunedTable.lookup``): a key found
  there compiles one config and times nothing. Tables ship in the package (``ops/tuned/<gpu>.json``, written
  by ``megaseq tune`` on that GPU) and are kept per user (``<cache>/autotune/<gpu>.json``, every tuning this
  machine ran); the user's entries win. A GPU model without a shipped table of its own reads the shipped table
  of its architecture (``arch``, e.g. ``sm90``: an H200 reads the H100's): the same SMs, the same launch limits,
  and its configs the nearest to tuned there are; this GPU's own tunings replace them. A length without its
  own bucket takes the nearest bucket within ``NEAR_BUCKETS`` powers of two, so one tuning serves nearby
  lengths.
- **Pruned spaces** (``model.autotune``, ``MEGASEQ_AUTOTUNE``): ``pruned`` (the default) times at most
  ``PRUNED_CONFIGS`` configs of a space, the most conservative one and an even spread of the rest by cost, each on
  a shorter clock (``BENCH_MS``: Triton's warm-up and repetition time per config); ``full`` times them all on
  Triton's own clock (what ``megaseq tune`` uses); ``one`` runs the most conservative config untimed.
- **A persistent cache** (``use_persistent_cache``): ``TRITON_CACHE_DIR`` defaults to
  ``~/.cache/megaseq/triton`` (``model.kernel_cache`` or ``MEGASEQ_CACHE_DIR`` moves the root) and Triton's
  autotune results are kept there too (``TRITON_CACHE_AUTOTUNING``), unless the user set them.
- Triton's ``Autotuner`` reads the tables and the mode through ``ops.triton_autotune``; megaseq's own tuner
  (the sparse MLA launcher) calls ``TunedTable`` directly.

Torch-free and Triton-free: the tables, buckets and pruning are plain Python (tested on the CPU).
"""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path
from typing import Any

from megaseq.files import write_atomic
from megaseq.ops import switches

MODES = switches.AUTOTUNE_MODES
PRUNED_CONFIGS = 4
# milliseconds of warm-up and of timed repetitions per config (Triton's ``do_bench``), by mode; a mode not here
# keeps Triton's own (25 and 100). A first step on a new machine waits for every timing (about 125 ms a config
# on Triton's clock); the pruned spaces' few candidates are told apart on a quarter of that clock (a few
# hundred launches of an 8K kernel each).
BENCH_MS: dict[str, tuple[int, int]] = {"pruned": (5, 25)}
NEAR_BUCKETS = 2
FORMAT = 1
SHIPPED_DIR = Path(__file__).parent / "tuned"
logger = logging.getLogger(__name__)


def cache_root() -> Path:
    """megaseq's per-user cache: ``model.kernel_cache`` or ``MEGASEQ_CACHE_DIR``, else ``~/.cache/megaseq``
    (``ops.switches``)."""
    return switches.cache_root()


def use_persistent_cache() -> str:
    """Default ``TRITON_CACHE_DIR`` to ``<cache>/triton`` and keep Triton's autotune results there, unless the
    user set either; returns the Triton cache directory in use. Call before Triton compiles anything."""
    os.environ.setdefault("TRITON_CACHE_DIR", str(cache_root() / "triton"))
    os.environ.setdefault("TRITON_CACHE_AUTOTUNING", "1")
    return os.environ["TRITON_CACHE_DIR"]


def mode() -> str:
    """``model.autotune`` or ``MEGASEQ_AUTOTUNE`` (pruned, full or one; ``ops.switches.autotune_mode``)."""
    return switches.autotune_mode()


def seq_bucket(n: int) -> int:
    """The power of two at or above ``n`` (at least 1): lengths 4097..8192 share bucket 8192."""
    return 1 << max(0, (int(n) - 1).bit_length())


def device_slug(name: str) -> str:
    """A file name for a GPU model: ``NVIDIA H200`` -> ``nvidia-h200``."""
    return "-".join(name.lower().replace("_", " ").split())


def entry_key(fields: dict[str, Any], length: int | None) -> str:
    """The table's key of one tuning: the kernel's key fields in order, then the length bucket."""
    key = ",".join(f"{k}={v}" for k, v in fields.items())
    return key if length is None else f"{key}|len={seq_bucket(length)}"


def _split(key: str) -> tuple[str, int | None]:
    base, _, length = key.partition("|len=")
    return base, int(length) if length else None


def covers(entries: dict[str, Any], length: int | None) -> bool:
    """Whether a kernel's table ``entries`` (key -> config) answer a lookup at ``length`` without tuning, as far
    as the length decides it: a key without a length, or one whose bucket is within ``NEAR_BUCKETS`` of it.
    ``length`` None: yes."""
    if length is None:
        return True
    want = math.log2(seq_bucket(length))
    return any(b is None or abs(math.log2(b) - want) <= NEAR_BUCKETS for b in (_split(k)[1] for k in entries))


def config_cost(config: Any) -> tuple:
    """How conservative a Triton config is (smaller first): stages, the product of its block sizes, distance of
    its warps from 4."""
    blocks = 1
    for v in config.kwargs.values():
        blocks *= v if isinstance(v, int) else 1
    return (config.num_stages or 0, blocks, abs((config.num_warps or 4) - 4))


def prune(configs: list, how: str | None = None) -> list:
    """The configs to time under ``how`` (default ``mode()``): all, the most conservative one, or at most
    ``PRUNED_CONFIGS``: the most conservative and an even spread of the rest by ``config_cost``."""
    how = how or mode()
    if how == "full" or len(configs) <= 1:
        return list(configs)
    ranked = sorted(configs, key=config_cost)
    if how == "one":
        return ranked[:1]
    if len(ranked) <= PRUNED_CONFIGS:
        return ranked
    step = (len(ranked) - 1) / (PRUNED_CONFIGS - 1)
    return [ranked[round(i * step)] for i in range(PRUNED_CONFIGS)]


def _load(path: Path) -> dict[str, Any]:
    """A tuned table's whole body (``format``, ``device``, ``arch`` where written, ``kernels``); ``{}``: no file."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: not a megaseq tuned table ({e}); delete it (it is a cache) or fix it") from e
    if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("kernels"), dict):
        raise ValueError(f"{path}: not a megaseq tuned table of format {FORMAT}; delete it (it is a cache)")
    return data


def _read(path: Path) -> dict[str, dict[str, Any]]:
    return _load(path).get("kernels", {})


def _arch(path: Path) -> str | None:
    """A shipped table's ``arch`` (None: none written, or not a readable table)."""
    try:
        return _load(path).get("arch")
    except ValueError:
        return None


def write_table(path: Path, kernels: dict[str, dict[str, Any]], device: str, arch: str | None = None) -> None:
    """Write a tuned table atomically (``files.write_atomic``); ``arch`` (``sm90``) lets other GPU models of that
    architecture read a shipped one."""
    ordered = {k: dict(sorted(v.items())) for k, v in sorted(kernels.items())}
    body = {"format": FORMAT, "device": device, **({"arch": arch} if arch else {}), "kernels": ordered}
    write_atomic(path, json.dumps(body, indent=1) + "\n")


def shipped_table(device: str, arch: str | None, shipped_dir: Path | None = None) -> Path | None:
    """The shipped table ``device`` reads: its own, else (``arch`` given) the first by name of its architecture's;
    None: neither."""
    shipped_dir = shipped_dir or SHIPPED_DIR
    own = shipped_dir / f"{device_slug(device)}.json"
    if own.exists() or not arch:
        return own if own.exists() else None
    same = [p for p in sorted(shipped_dir.glob("*.json")) if _arch(p) == arch]
    return same[0] if same else None


class TunedTable:
    """The tuned configs of one GPU model: the shipped table under the user's, and what this process tuned.

    A config is stored as ``{"kwargs": {...}, "num_warps": w, "num_stages": s, "tuned": how}``, ``how`` the
    space it won in (``full`` or ``pruned``). Entries of another GPU model's table (``shipped_table``: same
    ``arch``, none of this model's own) read ``"<how> on <device>"``, so any tuning on this GPU replaces them;
    ``borrowed_from`` names that device."""

    def __init__(self, device: str, shipped: Path | None = None, user: Path | None = None,
                 arch: str | None = None) -> None:
        slug = device_slug(device)
        self.device = device
        self.user_path = user or cache_root() / "autotune" / f"{slug}.json"
        self.shipped_path = shipped or shipped_table(device, arch) or SHIPPED_DIR / f"{slug}.json"
        shipped_body = _load(self.shipped_path)
        theirs = shipped_body.get("device")
        self.borrowed_from = theirs if theirs and device_slug(theirs) != slug else None
        shipped_kernels = shipped_body.get("kernels", {})
        if self.borrowed_from:
            shipped_kernels = {k: {key: {**cfg, "tuned": f"{cfg.get('tuned')} on {theirs}"}
                                   for key, cfg in entries.items()} for k, entries in shipped_kernels.items()}
        self.kernels: dict[str, dict[str, Any]] = {}
        for tables in (shipped_kernels, _read(self.user_path)):  # the user's entries override the shipped ones...
            for kernel, entries in tables.items():
                mine = self.kernels.setdefault(kernel, {})
                for key, cfg in entries.items():  # ...except a pruned search over a full one
                    if not (cfg.get("tuned") == "pruned" and mine.get(key, {}).get("tuned") == "full"):
                        mine[key] = cfg
        self.recorded: dict[str, dict[str, Any]] = {}

    def lookup(self, kernel: str, fields: dict[str, Any], length: int | None = None) -> dict[str, Any] | None:
        """The config for this key: its length bucket, else the nearest within ``NEAR_BUCKETS``; None: untuned."""
        entries = self.kernels.get(kernel, {})
        exact = entries.get(entry_key(fields, length))
        if exact is not None or length is None:
            return exact
        base, want = entry_key(fields, None), math.log2(seq_bucket(length))
        near = [(abs(math.log2(b) - want), b, cfg) for k, cfg in entries.items()
                for kb, b in [_split(k)] if kb == base and b is not None]
        near = [n for n in near if n[0] <= NEAR_BUCKETS]
        return min(near, key=lambda n: (n[0], -n[1]))[2] if near else None

    def record(self, kernel: str, fields: dict[str, Any], length: int | None, config: dict[str, Any],
               persist: bool = True) -> None:
        """Keep a tuning in this process and, with ``persist``, in the user's table (read back, merged, rewritten:
        other processes' entries survive)."""
        key = entry_key(fields, length)
        self.kernels.setdefault(kernel, {})[key] = config
        self.recorded.setdefault(kernel, {})[key] = config
        if persist:
            on_disk = _read(self.user_path)
            on_disk.setdefault(kernel, {})[key] = config
            try:
                write_table(self.user_path, on_disk, self.device)
            except OSError:  # a read-only home: the tuning still serves this process
                pass


_tables: dict[str, TunedTable] = {}


def cuda_arch(device: str) -> str | None:
    """``sm<major><minor>`` of the visible CUDA device named ``device`` (None: none is)."""
    import torch

    if not torch.cuda.is_available():
        return None
    for i in range(torch.cuda.device_count()):
        if torch.cuda.get_device_name(i) == device:
            major, minor = torch.cuda.get_device_capability(i)
            return f"sm{major}{minor}"
    return None


def table(device: str | None = None) -> TunedTable:
    """This process's table for ``device`` (default: the current CUDA device's name)."""
    if device is None:
        import torch

        device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    if device not in _tables:
        arch = cuda_arch(device) if device != "cpu" else None
        t = _tables[device] = TunedTable(device, arch=arch)
        if t.borrowed_from:
            logger.info(f"tuned launch configs: none ship for the {device}; reading the {t.borrowed_from}'s "
                        f"({t.shipped_path.name}, the same architecture, {arch}) until this GPU tunes its own")
    return _tables[device]
