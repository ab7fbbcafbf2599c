"""flash-linear-attention's gated delta rule for op ``gdn`` (Qwen3-Next's gated DeltaNet).

Shapes: B batch (1 when ``cu_seqlens`` is given), S tokens, Hk / Hv key / value heads, Dk / Dv head dims.

``fla.ops.gated_delta_rule.chunk_gated_delta_rule`` with q, k l2-normalised in the kernel and the scale
``Dk^-0.5``, as the reference (``ops.gdn.reference.gdn_reference``, HF's ``torch_chunk_gated_delta_rule``).
Grouped value heads (Hv > Hk) are expanded first (``repeat_interleave``, as the reference does), so any fla
version that runs equal heads runs these. Memory O(S * H * D) where the reference's is O(S * 64 * D) per
head. fla is imported lazily; ``supports`` names why it cannot run (device, dtype, package) and the
dispatcher falls back to the reference. Not run in CI (no GPU): its check against the reference is the
GPU test in tests/ops/test_fast_ops.py.
"""

from __future__ import annotations

import torch

from megaseq.ops.kda.fla import _common_supports, _maybe_limit_autotune, _work_dtype

MAX_HEAD_DIM = 256


def gdn_fla_supports(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     cu_seqlens: torch.Tensor | None = None, initial_state: torch.Tensor | None = None,
                     return_state: bool = False) -> str | None:
    if q.shape != k.shape or g.shape != v.shape[:3] or beta.shape != v.shape[:3] or v.shape[2] % q.shape[2]:
        return f"shapes q {tuple(q.shape)}, v {tuple(v.shape)}, g {tuple(g.shape)}, beta {tuple(beta.shape)}"
    if max(q.shape[-1], v.shape[-1]) > MAX_HEAD_DIM:
        return f"head dims {q.shape[-1]}, {v.shape[-1]} > {MAX_HEAD_DIM}"
    return _common_supports(q, cu_seqlens) or (hopper_backward_refused() if q.is_cuda else None)


def hopper_backward_refused() -> str | None:
    """Why fla would refuse this machine's gated backward, else None: fla raises in the backward's
    ``chunk_bwd_dqkwg`` on a Hopper GPU with Triton 3.4-3.7.0 (wrong results there, fla issue #640) unless its
    TileLang backend can run (tilelang installed and an ``nvcc``). Declined before the forward, so a training
    step runs the reference in both passes instead of failing in the backward."""
    try:
        from fla.backends import TileLangBackend
        from fla.utils import IS_NVIDIA_HOPPER, TRITON_ABOVE_3_4_0, TRITON_ABOVE_3_7_1
    except ImportError:  # another fla: its own checks apply
        return None
    if not (IS_NVIDIA_HOPPER and TRITON_ABOVE_3_4_0 and not TRITON_ABOVE_3_7_1):
        return None
    if TileLangBackend.is_available() and TileLangBackend().is_enabled():
        return None
    import triton

    return (f"fla refuses the gated delta rule's backward on Hopper with Triton {triton.__version__} (fla #640): "
            "install Triton >= 3.7.1 or tilelang with an nvcc")


def gdn_fla(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
            cu_seqlens: torch.Tensor | None = None, initial_state: torch.Tensor | None = None,
            return_state: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule on fla's chunked kernel; the reference's arguments and result."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    _maybe_limit_autotune()
    dt = _work_dtype(q)
    rep = v.shape[2] // q.shape[2]
    qr, kr = (t.repeat_interleave(rep, dim=2) if rep > 1 else t for t in (q, k))
    h0 = None if initial_state is None else initial_state.float().contiguous()
    o, ht = chunk_gated_delta_rule(qr.to(dt), kr.to(dt), v.to(dt), g.float(), beta.to(dt), scale=q.shape[-1] ** -0.5,
                                   initial_state=h0, output_final_state=return_state, use_qk_l2norm_in_kernel=True,
                                   cu_seqlens=None if cu_seqlens is None else cu_seqlens.long())
    return (o.to(q.dtype), ht) if return_state else o.to(q.dtype)
