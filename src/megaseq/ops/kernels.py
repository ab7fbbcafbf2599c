"""The kernels a run is planned to use, per op: what ``model.strict_kernels`` holds a run to.

On a CUDA GPU in bf16 the memory plan assumes these implementations (the planner's working sets are
theirs: fla's KDA and conv, the absorbed sparse MLA, SDPA, grouped GEMMs); elsewhere the references run
and nothing is planned. With ``strict_kernels`` a layer that falls back from its planned kernel is an
error naming the layer and the reason (``dispatch.KernelFallbackError``): the reference system's silent
dense-attention fallback becomes a message.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

from megaseq.ops import switches
from megaseq.ops.table import OPS, fast_impl


@dataclass(frozen=True)
class Fast:
    """One op's fast kernel under ``model.kernels fast`` on a GPU (a view of its ``ops.table`` row)."""

    impl: str  # the implementation put first
    packages: tuple[str, ...] = ()  # what it needs where the memory plan counts its working set; else empty
    fallbacks: tuple[str, ...] = ()  # where it declines (a dtype, a shape), the next tried before the reference


# The fast set (``ops.table``: Triton kernels and fla's, Liger's), each checked against its reference on the GPU
# (tests/ops/<op>/). The memory plan counts the working sets of those with ``packages`` (where they are
# installed) and the base kernels' for the rest (for these an upper bound); docs/planner.md, "The fast
# kernels", and benchmarks/results/h200 hold the measurements.
GPU_BF16: dict[str, str] = {op.name: op.gpu_bf16 for op in OPS if op.gpu_bf16}
FAST: dict[str, Fast] = {
    op.name: Fast(op.fast, fast_impl(op).packages if op.plan_counts_fast else (), op.fast_fallbacks)
    for op in OPS if op.fast
}
# views of FAST: op -> implementation; op -> its fallbacks; op -> the packages of the planned ones
FAST_GPU = {op: f.impl for op, f in FAST.items()}
FAST_FALLBACKS = {op: f.fallbacks for op, f in FAST.items() if f.fallbacks}
FAST_PACKAGES = {op: f.packages for op, f in FAST.items() if f.packages}
PLANNED_FAST_OPS = frozenset(FAST_PACKAGES)  # the fast ops whose working sets the plan models
KERNEL_SETS = ("fast", "base")


def fast_set_on(kernels: str, device_type: str | None) -> bool:
    """The one reading of ``model.kernels``: whether the fast set runs on ``device_type`` (None: a GPU run
    planned from elsewhere, as ``megaseq plan`` does)."""
    if kernels not in KERNEL_SETS:
        raise ValueError(f"model.kernels must be one of {', '.join(KERNEL_SETS)}, got {kernels!r}")
    return kernels == "fast" and device_type in (None, "cuda")


def planned_kernels(device_type: str, model_dtype: str) -> dict[str, str]:
    """op -> the implementation a run on ``device_type`` with ``model.dtype`` is planned to use."""
    return dict(GPU_BF16) if device_type == "cuda" and model_dtype == "bf16" else {}


def preferred_kernels(device_type: str, kernels: str) -> dict[str, list[str]]:
    """op -> the implementations ``model.kernels`` puts first (the fast set only on a GPU)."""
    if fast_set_on(kernels, device_type) and device_type == "cuda":
        off = switches.fast_off()
        return {op: [f.impl, *f.fallbacks] for op, f in FAST.items() if op not in off}
    return {}


def planned_fast_ops(kernels: str, model_dtype: str, device_type: str | None = None) -> frozenset[str]:
    """The ops whose fast kernels a GPU run of ``model.kernels`` / ``model.dtype`` uses and the plan counts
    (``plan.run.Run.fast_ops``; the fast set in bf16 on CUDA). ``device_type`` (a run planning where it
    starts): none off CUDA, and on CUDA only those whose packages are installed (``fast_ops_installed``); the
    others run their references, whose working sets the plan then counts. None: every one the config names
    (``megaseq plan`` of a GPU run)."""
    if model_dtype != "bf16" or not fast_set_on(kernels, device_type):
        return frozenset()
    return PLANNED_FAST_OPS & fast_ops_installed() if device_type == "cuda" else PLANNED_FAST_OPS


def fast_ops_installed() -> frozenset[str]:
    """The ops of ``FAST_PACKAGES`` whose packages are importable here."""
    have = {m: importlib.util.find_spec(m) is not None for ms in FAST_PACKAGES.values() for m in ms}
    return frozenset(op for op, ms in FAST_PACKAGES.items() if all(have[m] for m in ms))


def cold_start_note(device_type: str) -> str | None:
    """What a run says before its first step on a GPU, where that step compiles and autotunes the Triton
    kernels (fla's and megaseq's) for minutes on a machine without a Triton cache (``benchmarks/results/kernels/
    h200_ops.md``); None elsewhere, where there is nothing to compile."""
    if device_type != "cuda":
        return None
    import os

    from megaseq.ops.autotune import cache_root

    cache = os.environ.get("TRITON_CACHE_DIR") or str(cache_root() / "triton")
    return (f"step 1 compiles and autotunes the GPU kernels: minutes without a Triton cache ({cache}; kept for "
            "the next run)")
