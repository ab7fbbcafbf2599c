"""The references of ops ``moe_permute``, ``moe_combine`` and ``grouped_mm``, and torch's grouped GEMM
(``grouped_mm``'s fast implementation ``torch_grouped_mm``).

``grouped_mm``: ``y_MO[rows of e] = x_MD[rows of e] @ w_EOD[e].T``, the rows sorted by expert."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def grouped_mm_reference(x_MD: torch.Tensor, w_EOD: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
    """One ``F.linear`` per expert over its contiguous block of rows (the HF eager order of ops)."""
    chunks = torch.split(x_MD, counts_E.tolist(), dim=0)
    return torch.cat([F.linear(xe, w_EOD[e]) for e, xe in enumerate(chunks)], dim=0)


def _mm_dtype(x_MD: torch.Tensor, w_EOD: torch.Tensor) -> torch.dtype:
    """The dtype the matmul runs in: bf16 autocast's (as ``F.linear`` would), else the inputs' common one."""
    if x_MD.device.type == "cuda" and torch.is_autocast_enabled("cuda"):
        return torch.get_autocast_dtype("cuda")
    return x_MD.dtype if x_MD.dtype == w_EOD.dtype else torch.promote_types(x_MD.dtype, w_EOD.dtype)


def _grouped_mm_supports(x_MD: torch.Tensor, w_EOD: torch.Tensor, counts_E: torch.Tensor) -> str | None:
    if not hasattr(F, "grouped_mm") and not hasattr(torch, "_grouped_mm"):
        return "torch has no grouped_mm"
    if x_MD.device.type != "cuda":
        return f"device {x_MD.device.type} (needs cuda)"
    if _mm_dtype(x_MD, w_EOD) != torch.bfloat16:
        return f"dtype {x_MD.dtype}/{w_EOD.dtype} without bf16 autocast (needs bfloat16)"
    if torch.cuda.get_device_capability(x_MD.device) < (9, 0):
        return "needs compute capability >= 9.0"
    if x_MD.shape[-1] % 8 or w_EOD.shape[1] % 8:
        return f"dims {x_MD.shape[-1]}, {w_EOD.shape[1]} not multiples of 8 (16-byte rows)"
    return None


def grouped_mm_fast(x_MD: torch.Tensor, w_EOD: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
    """cuBLAS/CUTLASS grouped GEMM (bf16, sm90+); no host sync: offsets stay on the device.

    Checked against the reference (values and gradients) by the GPU tests in tests/models/test_moe.py.
    """
    offs = torch.cumsum(counts_E, dim=0, dtype=torch.int32)
    gmm = getattr(F, "grouped_mm", None) or torch._grouped_mm
    dt = _mm_dtype(x_MD, w_EOD)  # under bf16 autocast cast as F.linear does (fp32 weights, bf16 matmul)
    x_MD, w_EOD = x_MD.to(dt), w_EOD.to(dt)
    # w_EOD.transpose(-2, -1) is the column-major [E, D, O] operand the kernel wants (out = x @ w.T)
    return gmm(x_MD, w_EOD.transpose(-2, -1), offs=offs)


def moe_permute_reference(x_NH: torch.Tensor, order_M: torch.Tensor, inverse_M: torch.Tensor, K: int,
                          dtype: torch.dtype) -> torch.Tensor:
    """``x_MH``: sorted row m is token ``order_M[m] // K``'s row. Here in x's dtype (``grouped_mm`` casts it to
    ``dtype``, the matmul's); a fast implementation may return it in ``dtype`` already (``ops.moe_glue.fused``).
    ``inverse_M`` (``inverse[order[m]] = m``) is for implementations whose backward needs it."""
    del inverse_M, dtype
    return x_NH[order_M // K]


def moe_combine_reference(y_MH: torch.Tensor, order_M: torch.Tensor, inverse_M: torch.Tensor,
                          weights_NK: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``out_NH``: the sorted rows ``y_MH`` back in token order (``inverse_M``), weighted and summed over K
    (``combine``); ``order_M`` is for implementations whose backward needs it."""
    del order_M
    return combine(y_MH[inverse_M], weights_NK, dtype)


def combine(y_MH: torch.Tensor, weights_NK: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``out_NH``: the routed rows' outputs in token-major order (row ``n * K + k``), weighted and summed
    over K. Weighted after down_proj and cast back, as HF does (weights may be float32 in a bf16 model);
    a sum over K instead of index_add_: deterministic on every device."""
    N, K = weights_NK.shape
    y_MH = (y_MH * weights_NK.reshape(-1, 1)).to(dtype)
    # CUDA autocast runs sum in float32: cast back, or a bf16 residual stream (a frozen bf16 base under
    # autocast) turns float32 at the first MoE layer and every later boundary doubles its bytes
    return y_MH.view(N, K, -1).sum(dim=1).to(dtype)
