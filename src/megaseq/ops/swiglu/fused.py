"""Op ``swiglu``: GLM's clamped SwiGLU ``silu(gate.clamp(max=limit)) * up.clamp(-limit, limit)``, fused.

Shapes: ``gate`` and ``up`` any ``[..., I]`` (the same shape and dtype; rows may be strided, as the two
halves of the routed experts' ``gu_M2I.chunk(2, -1)`` are); R = the leading dims flattened.

Used by the dense MLP and every routed expert (``blocks/mlp.py: swiglu``): at 32K tokens x top-8 the
torch expression is five elementwise passes over ``[262144, 1024]`` forward (two clamps, silu, mul, and
silu's output kept for backward) and as many backward, saving four ``[R, I]`` tensors. The fused
forward reads gate and up once and writes the output; it saves gate and up only (views of their
producer, no copy), and the backward recomputes the clamps and the silu.

Contract (both implementations): ``swiglu(gate, up, limit: float | None) -> [..., I]`` in the input dtype,
no clamp when ``limit`` is None, gradients as torch's autograd gives them (zero where a clamp was active,
passed at the bound itself). The Triton kernels round as torch does on bf16/fp16 (see the kernels'
docstring), so they agree with the reference to the last bit but where the exp rounds differently.

Timings: ``benchmarks/kernels/glue_gpu.py`` (``benchmarks/results/kernels/h200_ops.md``).
"""

from __future__ import annotations

import torch

from megaseq.ops._triton_util import cdiv, kernels, triton_supports

KERNELS = "swiglu.kernels"
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


# the reference, ``torch``, is ``ops.swiglu.reference.swiglu`` (rows: ``ops.table``)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``[..., I] -> [R, I]`` with unit column stride: a view where one exists (strided rows kept)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _limit_in(limit: float | None, dtype: torch.dtype) -> float:
    """The clamp bound as torch compares it: the limit rounded to the tensor's dtype (10.0 is exact)."""
    return 0.0 if limit is None else float(torch.tensor(float(limit), dtype=dtype))


def _grid(R: int, I: int):
    return lambda meta: (cdiv(R, meta["BR"]), cdiv(I, meta["BC"]))


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up, limit):
        K = kernels(KERNELS)
        g_RI, u_RI = _rows(gate), _rows(up)
        R, I = g_RI.shape
        out = torch.empty(R, I, device=gate.device, dtype=gate.dtype)
        lim = _limit_in(limit, gate.dtype)
        if R * I > 0:
            K.swiglu_fwd_kernel[_grid(R, I)](g_RI, u_RI, out, g_RI.stride(0), u_RI.stride(0), R, I, lim,
                                             HAS_LIMIT=limit is not None)
        ctx.save_for_backward(g_RI, u_RI)
        ctx.args = (lim, limit is not None, gate.shape)
        return out.view(gate.shape)

    @staticmethod
    def backward(ctx, g_out):
        K = kernels(KERNELS)
        g_RI, u_RI = ctx.saved_tensors
        lim, has_limit, shape = ctx.args
        R, I = g_RI.shape
        gg = torch.empty(R, I, device=g_RI.device, dtype=g_RI.dtype)
        gu = torch.empty_like(gg)
        if R * I > 0:
            K.swiglu_bwd_kernel[_grid(R, I)](g_RI, u_RI, g_out.reshape(R, I).contiguous(), gg, gu,
                                             g_RI.stride(0), u_RI.stride(0), R, I, lim, HAS_LIMIT=has_limit)
        return gg.view(shape), gu.view(shape), None


def swiglu_triton_supports(gate: torch.Tensor, up: torch.Tensor, limit: float | None) -> str | None:
    if gate.shape != up.shape or gate.dim() == 0:
        return f"shapes gate {tuple(gate.shape)} vs up {tuple(up.shape)}"
    if gate.dtype != up.dtype or gate.dtype not in DTYPES:
        return f"dtypes {gate.dtype}/{up.dtype} (one of {', '.join(map(str, DTYPES))}; float64 runs the reference)"
    if limit is not None and not limit > 0:
        return f"limit {limit} (the kernel clamps into [-limit, limit], limit > 0)"
    return triton_supports(gate, up)


def swiglu_triton(gate: torch.Tensor, up: torch.Tensor, limit: float | None) -> torch.Tensor:
    """Same contract as ``swiglu_reference``."""
    return _SwiGLU.apply(gate, up, None if limit is None else float(limit))
