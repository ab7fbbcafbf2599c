"""``megaseq tune RECIPE --seq-lens 8K,32K``: pre-tune the GPU kernels for the lengths a plan will use.

Runs the recipe's planned training step once at each length (as ``megaseq bench`` does: the planner's fixes,
the trainer's model and step, balanced routing for an MoE on random weights) with every autotuner timing its
whole space (``MEGASEQ_AUTOTUNE=full``, and the sparse MLA launcher's own tuning, ``MEGASEQ_MLA_AUTOTUNE=1``),
then writes what was tuned as a tuned table (``ops.autotune``): by default into this user's table, which
every later run on this GPU model reads before tuning; with ``--out src/megaseq/ops/tuned/<gpu>.json``, the
table the package ships for that GPU. A run then compiles one config per kernel and times nothing, at these
lengths and within ``autotune.NEAR_BUCKETS`` powers of two of them.

With ``--kernels-out DIR`` (``src/megaseq/ops/tuned/kernels`` to ship it) it also writes the recipe's kernel
manifest (``ops.precompile``): every Triton specialisation the steps compiled, less the configs an autotuner
timed and did not choose, added to ``DIR/<fingerprint>-<target>.json``; a later run of the recipe on that GPU
target compiles them on several threads before its first step. Beside it goes the manifest's kernel pack
(``ops.kernel_pack``, ``DIR/<fingerprint>-<target>.tar.xz``): the compiled kernels, which a run under the same
Triton version on that target loads instead of compiling.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from megaseq.config import Config, parse_size

logger = logging.getLogger(__name__)


def tune_lengths(cfg: Config, seq_lens: str | None) -> list[int]:
    """``--seq-lens`` as token counts (none given: the recipe's ``data.seq_len``)."""
    if not seq_lens:
        return [cfg.data.seq_len]
    lengths = [parse_size(s.strip(), "--seq-lens") for s in seq_lens.split(",") if s.strip()]
    if not lengths or min(lengths) < 1:
        raise ValueError(f"--seq-lens {seq_lens!r}: give one or more positive lengths like 8K,32K")
    return sorted(set(lengths))


def _check_out(out: str | None) -> Path | None:
    if out is None:
        return None
    path = Path(out)
    if path.suffix != ".json":
        raise ValueError(f"--out {out}: a tuned table is a .json file (e.g. src/megaseq/ops/tuned/nvidia-h200.json)")
    if path.is_dir():
        raise ValueError(f"--out {out} is a directory: give the .json file to write")
    return path


def _check_kernels_out(kernels_out: str | None) -> Path | None:
    if kernels_out is None:
        return None
    path = Path(kernels_out)
    if path.suffix == ".json" or path.is_file():
        raise ValueError(f"--kernels-out {kernels_out}: give the directory of the kernel manifests (e.g. "
                         "src/megaseq/ops/tuned/kernels); the file's name is the recipe's fingerprint")
    return path


def run_tune(cfg: Config, lengths: list[int], out: str | None = None, measure=None,
             kernels_out: str | None = None) -> dict[str, Any]:
    """Tune at each length and write the table (and with ``kernels_out`` the kernel manifest); returns what it
    did (rows, table path, entries, manifest path and its new kernels). ``measure`` (tests): the step to run,
    ``bench.measure.measure_megaseq``'s signature."""
    import dataclasses

    import torch

    from megaseq.bench.run import resolve_routing
    from megaseq.ops import autotune, precompile
    from megaseq.ops.triton_autotune import _tuners, forget_tunings

    path = _check_out(out)
    kernels_dir = _check_kernels_out(kernels_out)
    if not torch.cuda.is_available():
        raise ValueError("megaseq tune times the GPU kernels at the plan's shapes: it needs a CUDA GPU, and none "
                         "is visible here (run it on the GPU model the table is for)")
    if measure is None:
        from megaseq.bench.measure import measure_megaseq as measure
    if kernels_dir is not None:  # every kernel compiles in the step, where the manifest records it
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, precompile=False))
    if cfg.model.autotune not in (None, "full"):  # a recipe's model.autotune would win over the tuning's variable
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, autotune="full"))
    routing = resolve_routing(cfg, "auto", "random")
    device = torch.cuda.get_device_name()
    table = autotune.table(device)
    rows = []
    winners: dict[int, list[Any]] = {}
    recording = precompile.record() if kernels_dir is not None else contextlib.nullcontext([])
    with _tuning_environment(), recording as compiled:
        for i, L in enumerate(lengths):
            if i:  # Triton keys its tunings without the length: tune again for this length's bucket
                _add_winners(winners, precompile.autotune_winners(_tuners))
                forget_tunings()
            logger.info(f"megaseq tune: {L:,} tokens, every autotuned kernel over its whole space")
            rows.append(measure(cfg, L, 0, "random", routing))
    _add_winners(winners, precompile.autotune_winners(_tuners))
    manifest = write_kernels(cfg, kernels_dir, precompile.tuned_only(compiled, winners)) if kernels_dir else None
    if manifest is not None:
        from megaseq.ops import kernel_pack

        manifest_path = Path(manifest["path"])
        pack = kernel_pack.pack_path(manifest_path)
        logger.info(f"megaseq tune: compiling the manifest's {manifest['kernels']} kernels into {pack}")
        manifest["pack"] = kernel_pack.build(manifest_path, pack)
    path = path or table.user_path
    merged = autotune._read(path) if path.exists() else {}
    for kernel, entries in table.recorded.items():
        merged.setdefault(kernel, {}).update(entries)
    autotune.write_table(path, merged, device, autotune.cuda_arch(device))
    entries = sum(len(v) for v in table.recorded.values())
    return {"device": device, "lengths": lengths, "routing": routing, "table": str(path), "entries": entries,
            "manifest": manifest,
            "rows": [{k: r.get(k) for k in ("seq_len", "status", "step_s", "error")} for r in rows]}


@contextlib.contextmanager
def _tuning_environment() -> Iterator[None]:
    """Every autotuned kernel over its whole space (``MEGASEQ_AUTOTUNE=full``) and the sparse MLA launcher's own
    tuning (``MEGASEQ_MLA_AUTOTUNE=1``) inside the block; the variables as they were after it."""
    tuning = {"MEGASEQ_AUTOTUNE": "full", "MEGASEQ_MLA_AUTOTUNE": "1"}
    before = {k: os.environ.get(k) for k in tuning}
    os.environ.update(tuning)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _add_winners(into: dict[int, list[Any]], more: dict[int, list[Any]]) -> None:
    for k, v in more.items():
        into.setdefault(k, []).extend(v)


def write_kernels(cfg: Config, directory: Path, entries: list[dict[str, str]]) -> dict[str, Any]:
    """Add ``entries`` to the recipe's kernel manifest in ``directory``; its path, kernels and how many were new."""
    from megaseq.models.presets import resolve_spec
    from megaseq.ops import precompile
    from megaseq.train.build import kernel_fingerprint

    fp, describes = kernel_fingerprint(cfg, resolve_spec(cfg.model.name))
    version, target = precompile.current_target()
    path = directory / precompile.manifest_name(fp, target)
    added = precompile.add(path, entries, version, target, describes)
    return {"path": str(path), "kernels": len(precompile.read_manifest(path, version, target)), "added": added}
