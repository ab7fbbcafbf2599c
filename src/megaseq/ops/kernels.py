"""The kernels a run is planned to use, per op: what ``model.strict_kernels`` holds a run to.

On a CUDA GPU in bf16 the memory plan assumes these implementations (the planner's working sets are
theirs: fla's KDA and conv, the absorbed sparse MLA, SDPA, grouped GEMMs); elsewhere the references run
and nothing is planned. With ``strict_kernels`` a layer that falls back from its planned kernel is an
error naming the layer and the reason (``dispatch.KernelFallbackError``): the reference system's silent
dense-attention fallback becomes a message.
"""

from __future__ import annotations

import importlib.util

GPU_BF16 = {
    "kda": "fla_chunk",
    "gdn": "fla_chunk",
    "causal_conv": "fla",
    "grouped_mm": "torch_grouped_mm",
    "sparse_attention": "absorbed",
    "attention": "sdpa",
}


# ``model.kernels fast`` (the default on a GPU): the Triton, fla and Liger kernels, each checked against its
# reference on the GPU (tests/test_triton_*.py, tests/test_hc_mix.py, tests/test_liger_loss.py) and measured in full
# steps (benchmarks/results/speed/glm5-flash-1gpu/: glm5-flash-1gpu 2.47x and 3.96x the transformers reference's
# tokens/s at 8K and 32K); the memory plan counts the
# fast working sets of the ops in FAST_PACKAGES (plan.planner.PLANNED_FAST_OPS) and the base kernels' for the rest
# (for these, an upper bound): 54.8 and 127.0 GiB planned at 8K and 32K (no KDA segments) for 53.0 and 119.4
# measured, where the base kernels' plan said 71.9 and 151.6 (docs/planner.md, "The fast kernels")
FAST_GPU = {
    "sparse_attention": "triton",
    "indexer_topk": "triton",
    "hc_mix": "triton",
    "gated_rms_norm": "fla",
    "kda_gate": "fla",
    "hc_weights": "triton",
    "hc_collapse": "triton",
    "hc_merge": "triton",
    "swiglu": "triton",
    "rms_norm": "triton",
    "moe_permute": "triton",
    "moe_combine": "triton",
    "linear_cross_entropy": "liger",
    "chunked_linear_cross_entropy": "liger",
}
# where a fast kernel declines (a dtype, a shape), the next one it tries before the reference
FAST_FALLBACKS = {"hc_mix": ("torch_fused",)}
KERNEL_SETS = ("fast", "base")


def planned_kernels(device_type: str, model_dtype: str) -> dict[str, str]:
    """op -> the implementation a run on ``device_type`` with ``model.dtype`` is planned to use."""
    return dict(GPU_BF16) if device_type == "cuda" and model_dtype == "bf16" else {}


def preferred_kernels(device_type: str, kernels: str) -> dict[str, list[str]]:
    """op -> the implementations ``model.kernels`` puts first (the fast set only on a GPU)."""
    if kernels not in KERNEL_SETS:
        raise ValueError(f"model.kernels must be one of {', '.join(KERNEL_SETS)}, got {kernels!r}")
    if kernels == "fast" and device_type == "cuda":
        return {op: [name, *FAST_FALLBACKS.get(op, ())] for op, name in FAST_GPU.items()}
    return {}


# the packages each fast kernel the memory plan counts needs (the others fall back and are planned as base)
FAST_PACKAGES = {"rms_norm": ("triton",), "swiglu": ("triton",), "indexer_topk": ("triton",),
                 "sparse_attention": ("triton",), "hc_merge": ("triton",), "hc_mix": ("triton",),
                 "gated_rms_norm": ("triton", "fla"),
                 "linear_cross_entropy": ("triton", "liger_kernel")}


def fast_ops_installed() -> frozenset[str]:
    """The ops of ``FAST_PACKAGES`` whose packages are importable here."""
    have = {m: importlib.util.find_spec(m) is not None for ms in FAST_PACKAGES.values() for m in ms}
    return frozenset(op for op, ms in FAST_PACKAGES.items() if all(have[m] for m in ms))


def cold_start_note(device_type: str) -> str | None:
    """What a run says before its first step on a GPU, where that step compiles and autotunes the Triton
    kernels (fla's and megaseq's) for minutes on a machine without a Triton cache (467 s for glm5-flash-1gpu
    at 1M on a fresh H200, the 2026-12-02 run); None elsewhere, where there is nothing to compile."""
    if device_type != "cuda":
        return None
    import os

    cache = os.environ.get("TRITON_CACHE_DIR", "~/.triton/cache")
    return (f"step 1 compiles and autotunes the GPU kernels: minutes without a Triton cache ({cache}; kept for "
            "the next run)")
