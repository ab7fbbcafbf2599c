"""The kernels a run is planned to use, per op: what ``model.strict_kernels`` holds a run to.

On a CUDA GPU in bf16 the memory plan assumes these implementations (the planner's working sets are
theirs: fla's KDA and conv, the absorbed sparse MLA, SDPA, grouped GEMMs); elsewhere the references run
and nothing is planned. With ``strict_kernels`` a layer that falls back from its planned kernel is an
error naming the layer and the reason (``dispatch.KernelFallbackError``): the reference system's silent
dense-attention fallback becomes a message.
"""

from __future__ import annotations

GPU_BF16 = {
    "kda": "fla_chunk",
    "causal_conv": "fla",
    "grouped_mm": "torch_grouped_mm",
    "sparse_attention": "absorbed",
    "attention": "sdpa",
}


def planned_kernels(device_type: str, model_dtype: str) -> dict[str, str]:
    """op -> the implementation a run on ``device_type`` with ``model.dtype`` is planned to use."""
    return dict(GPU_BF16) if device_type == "cuda" and model_dtype == "bf16" else {}
