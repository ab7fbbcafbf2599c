"""Op ``hc_weights``: the mHC pre/post/comb weights of one hyper-connection, fused into one Triton kernel.

Shapes: B batch, S tokens, N = hc_mult streams, M = 2N + N*N columns of ``mix`` (pre N, post N, comb N*N),
T = B * S tokens flattened.

``HyperConnection.forward`` (``models/blocks/mhc.py``) maps ``mix_BSM`` (the output of its ``fn`` linear,
which stays a torch GEMM) through sigmoid gates, a row softmax and ``2 * iters - 1`` Sinkhorn
normalisations. In torch that is about 10 + 4 * iters small kernels forward and twice that backward, each
saving a ``[B, S, N, N]`` tensor: at 32K tokens, launch-bound milliseconds per call, twice per layer. Here
the forward is one kernel (a token tile per program, every matrix in registers, fp32) and the backward one
kernel that recomputes the iterations from the saved ``mix`` (nothing else is saved) and backpropagates
through them; ``grad base`` and ``grad scale`` are per-program partial sums, added by torch (deterministic,
no atomics).

Contract (both implementations): ``hc_weights(mix_BSM, base_M, scale_3, N, iters, hc_eps) ->
(pre_BSN, post_BSN, comb_BSNN)`` in the compute dtype ``promote_types(mix.dtype, float32)``, differentiable
in ``mix``, ``base`` and ``scale``. The Triton kernel computes in float32, so it declines float64 (the
reference keeps a float64 model exact).

Precision: the kernel agrees with the reference to float32 rounding (sums in another order); the Sinkhorn
iterations are contractive, so the relative error stays ~1e-6 after 39 divisions (tests: 2e-5).

Timings: ``benchmarks/kernels/glue_gpu.py`` (``benchmarks/results/kernels/h200_ops.md``).
"""

from __future__ import annotations

import torch

from megaseq.ops._triton_util import cdiv, kernels, next_pow2, triton_supports
from megaseq.ops.amp import compute_dtype

MAX_STREAMS = 8  # [BT, 8, 8] matrices still fit the registers of a token tile
# (tokens per program, warps): the forward holds ~3 matrices per token, the backward ~6
FWD_CONFIG = (128, 4)
BWD_CONFIG = (64, 4)
SEGMENT_PAIRS = 4  # Sinkhorn (row, col) pairs per recompute segment of the backward


# the reference, ``torch``, is ``ops.mhc.reference.hc_weights_reference`` (rows: ``ops.table``)


# ---- Triton -------------------------------------------------------------------------------------------
class _HcWeights(torch.autograd.Function):
    @staticmethod
    def forward(ctx, mix_BSM, base_M, scale_3, N: int, iters: int, hc_eps: float):
        K = kernels("mhc.weights_kernels")
        M = mix_BSM.shape[-1]
        lead = mix_BSM.shape[:-1]
        mix_TM = mix_BSM.reshape(-1, M).contiguous()
        base_M, scale_3 = base_M.contiguous(), scale_3.contiguous()
        T = mix_TM.shape[0]
        kw = {"device": mix_TM.device, "dtype": torch.float32}
        pre_TN, post_TN, comb_TNN = torch.empty(T, N, **kw), torch.empty(T, N, **kw), torch.empty(T, N, N, **kw)
        BT, warps = FWD_CONFIG
        if T > 0:
            K.hc_weights_fwd_kernel[(cdiv(T, BT),)](
                mix_TM, base_M, scale_3, pre_TN, post_TN, comb_TNN, T, M, hc_eps, ITERS=iters,
                N=N, NP=next_pow2(N), BT=BT, num_warps=warps)
        ctx.save_for_backward(mix_TM, base_M, scale_3)
        ctx.args = (N, iters, hc_eps, tuple(mix_BSM.shape))
        return pre_TN.view(*lead, N), post_TN.view(*lead, N), comb_TNN.view(*lead, N, N)

    @staticmethod
    def backward(ctx, g_pre, g_post, g_comb):
        K = kernels("mhc.weights_kernels")
        mix_TM, base_M, scale_3 = ctx.saved_tensors
        N, iters, hc_eps, shape = ctx.args
        T, M = mix_TM.shape
        BT, warps = BWD_CONFIG
        grid = cdiv(T, BT)
        g_mix = torch.empty_like(mix_TM)
        part = torch.zeros(max(grid, 1), M + 3, device=mix_TM.device, dtype=torch.float32)
        flat = [None if g is None else g.reshape(T, -1).contiguous() for g in (g_pre, g_post, g_comb)]
        if T > 0:
            K.hc_weights_bwd_kernel[(grid,)](
                mix_TM, base_M, scale_3, *(mix_TM if g is None else g for g in flat), g_mix, part,
                T, M, hc_eps, ITERS=iters, N=N, NP=next_pow2(N), BT=BT, SEG=SEGMENT_PAIRS,
                HAS_GPRE=flat[0] is not None, HAS_GPOST=flat[1] is not None, HAS_GCOMB=flat[2] is not None,
                num_warps=warps)
        total = part.sum(0)
        g_base = total[:M].to(base_M.dtype) if ctx.needs_input_grad[1] else None
        g_scale = total[M:].to(scale_3.dtype) if ctx.needs_input_grad[2] else None
        return g_mix.view(shape), g_base, g_scale, None, None, None


def hc_weights_triton_supports(mix_BSM: torch.Tensor, base_M: torch.Tensor, scale_3: torch.Tensor, N: int,
                               iters: int, hc_eps: float) -> str | None:
    if compute_dtype(mix_BSM.dtype) != torch.float32:
        return f"dtype {mix_BSM.dtype} (the kernel computes in float32; the reference keeps float64 exact)"
    if not 1 <= N <= MAX_STREAMS:
        return f"N = {N} streams (the kernel holds [tokens, N, N] in registers: 1..{MAX_STREAMS})"
    M = 2 * N + N * N
    if mix_BSM.shape[-1] != M or base_M.shape != (M,) or scale_3.shape != (3,):
        return f"shapes mix {tuple(mix_BSM.shape)}, base {tuple(base_M.shape)}, scale {tuple(scale_3.shape)}"
    if iters < 1:
        return f"iters = {iters} (needs >= 1)"
    return triton_supports(mix_BSM, base_M, scale_3)


def hc_weights_triton(mix_BSM: torch.Tensor, base_M: torch.Tensor, scale_3: torch.Tensor, N: int, iters: int,
                      hc_eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Same contract as ``hc_weights_reference``; outputs float32."""
    return _HcWeights.apply(mix_BSM, base_M, scale_3, int(N), int(iters), float(hc_eps))
