"""flash-linear-attention (fla-core) Triton kernels for ops ``kda`` and ``causal_conv``.

Shapes: B batch (1 when ``cu_seqlens`` is given: documents flattened into one row), S tokens,
H heads, D head dim, C conv channels, K conv kernel size.

``kda``: ``fla.ops.kda.chunk_kda`` with the decay pre-computed (``g`` in log space, the block's forget
gate) and q, k l2-normalised in the kernel (eps 1e-6 inside the sqrt, as the reference). Its memory is
O(S * H * D) (chunk states ``[S / 64, H, D, D]``), where the pure-torch reference's is
O(S * chunk * D) per head: the reference cannot run at 1M tokens, this can.
``causal_conv``: ``fla.modules.causal_conv1d.causal_conv1d`` (Triton backend), depthwise causal conv +
SiLU restarting at every segment of ``cu_seqlens``; no fp32 copy of the input (the reference casts the
input to the conv weight's dtype first: 4 bytes x C x S, 24 GiB at 1M tokens for C = 6144).

fla is imported lazily inside the calls and the ``supports`` checks, so megaseq imports without it; each
check returns the reason the kernel cannot run (device, dtype, shape, package) and the dispatcher falls
back to the reference. Inputs are cast to one working dtype (autocast's when it is on, else q's);
``g`` goes in as float32.
"""

from __future__ import annotations

import importlib.util

import torch

from megaseq.ops import switches

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MAX_HEAD_DIM = 256  # chunk_kda's limit on the key head dim


def fla_available() -> str | None:
    """None when fla-core (and Triton) can be imported, else why not."""
    if importlib.util.find_spec("fla") is None:
        return "fla-core is not installed (pip install fla-core)"
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed"
    return None


_AUTOTUNE_LIMITED = False


def limit_autotune() -> None:
    """One config per Triton autotuner of fla's kernels: the fewest stages, the smallest blocks, 4 warps.

    fla tunes each kernel over dozens of configs on its first call (minutes on a fresh machine). With
    ``MEGASEQ_FLA_AUTOTUNE=one`` the first fla call applies this instead: every kernel compiles once and
    runs a conservative config, so timings are a lower bound on what full tuning gives.
    """
    global _AUTOTUNE_LIMITED
    if _AUTOTUNE_LIMITED:
        return
    from triton.runtime.autotuner import Autotuner

    from megaseq.ops.triton_autotune import kernel_name

    run = Autotuner.run

    def cost(c) -> tuple:
        blocks = 1
        for v in c.kwargs.values():
            blocks *= v if isinstance(v, int) else 1
        return (c.num_stages or 0, blocks, abs((c.num_warps or 4) - 4))

    def run_one(self, *args, **kwargs):
        if len(self.configs) > 1 and kernel_name(self).startswith("fla."):  # megaseq's kernels: ops.autotune
            self.configs = [min(self.configs, key=cost)]
        return run(self, *args, **kwargs)

    Autotuner.run = run_one
    _AUTOTUNE_LIMITED = True


def _maybe_limit_autotune() -> None:
    """fla's autotuners read megaseq's tuned tables and tune a pruned space otherwise (``ops.autotune``,
    ``MEGASEQ_AUTOTUNE``); their results are cached on disk with the compiled kernels (Triton's
    ``TRITON_CACHE_AUTOTUNING``, in ``TRITON_CACHE_DIR``, by default ``~/.cache/megaseq/triton``) and in the
    user's tuned table. ``MEGASEQ_FLA_AUTOTUNE=one``: one conservative config per kernel, untimed."""
    from megaseq.ops.triton_autotune import install

    install()  # the persistent cache, the tuned tables and the pruned spaces (ops.autotune)
    if switches.fla_one_config():
        limit_autotune()


def _work_dtype(x: torch.Tensor) -> torch.dtype:
    if x.device.type == "cuda" and torch.is_autocast_enabled("cuda"):
        return torch.get_autocast_dtype("cuda")
    return x.dtype


def _common_supports(x: torch.Tensor, cu_seqlens: torch.Tensor | None) -> str | None:
    if x.device.type != "cuda":
        return f"device {x.device.type} (fla's Triton kernels need cuda)"
    if _work_dtype(x) not in DTYPES:
        return f"dtype {_work_dtype(x)} (fla runs bf16/fp16/fp32)"
    if cu_seqlens is not None and x.shape[0] != 1:
        return "cu_seqlens needs the batch flattened to one row"
    return fla_available()


# ---- kda ----------------------------------------------------------------------------------------------
def kda_fla_supports(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     cu_seqlens: torch.Tensor | None = None, chunk_size: int = 64,
                     initial_state: torch.Tensor | None = None, return_state: bool = False) -> str | None:
    if q.shape != k.shape or g.shape != k.shape or beta.shape != q.shape[:3] or v.shape[:3] != q.shape[:3]:
        return f"shapes q {tuple(q.shape)}, v {tuple(v.shape)}, g {tuple(g.shape)}, beta {tuple(beta.shape)}"
    if initial_state is not None:
        n = q.shape[0] if cu_seqlens is None else cu_seqlens.numel() - 1
        if initial_state.shape != (n, q.shape[2], k.shape[-1], v.shape[-1]):
            return f"initial_state {tuple(initial_state.shape)}, expected [{n}, H, Dk, Dv]"
    if q.shape[-1] > MAX_HEAD_DIM:
        return f"head dim {q.shape[-1]} > {MAX_HEAD_DIM}"
    if q.device.type == "cuda" and _work_dtype(q) == torch.float32:
        # fla 0.6.0 on an H200: "out of resource: shared memory, Required: 245760, Hardware limit: 232448"
        return "float32 (fla 0.6.0's chunk_kda asks more shared memory than an H200 has; bf16 autocast runs it)"
    return _common_supports(q, cu_seqlens)


def kda_fla(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
            cu_seqlens: torch.Tensor | None = None, chunk_size: int = 64, initial_state: torch.Tensor | None = None,
            return_state: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """KDA over ``[B, S, H, D]`` (``g [B, S, H, Dk]`` log decay, ``beta [B, S, H]``) -> ``[B, S, H, Dv]``.

    Same contract as ``kda_reference``: the state starts at ``initial_state [N, H, Dk, Dv]`` (None: zero)
    per row or per ``cu_seqlens`` segment, scale ``Dk ** -0.5``; with ``return_state`` returns
    ``(out, final_state [N, H, Dk, Dv] float32)``. fla backprops through both states (``initial_state``
    goes in as float32). ``chunk_size`` is the reference's knob; fla uses its own (64), which changes
    nothing but the order of sums.
    """
    from fla.ops.kda import chunk_kda

    _maybe_limit_autotune()
    del chunk_size
    dt = _work_dtype(q)
    h0 = None if initial_state is None else initial_state.float().contiguous()
    o, ht = chunk_kda(q.to(dt), k.to(dt), v.to(dt), g.float(), beta.to(dt), scale=q.shape[-1] ** -0.5,
                      initial_state=h0, output_final_state=return_state, use_qk_l2norm_in_kernel=True,
                      cu_seqlens=None if cu_seqlens is None else cu_seqlens.long())
    return (o.to(q.dtype), ht) if return_state else o.to(q.dtype)


# ---- kda_gate -----------------------------------------------------------------------------------------
def kda_gate_fla_supports(f_BSHD: torch.Tensor, A_log_H: torch.Tensor, dt_bias_C: torch.Tensor,
                          lower_bound: float | None) -> str | None:
    if f_BSHD.dim() < 2:
        return f"f {tuple(f_BSHD.shape)} (expected [..., Hh, D])"
    Hh, D = f_BSHD.shape[-2:]
    if A_log_H.numel() != Hh or dt_bias_C.numel() != Hh * D:
        return f"A_log {tuple(A_log_H.shape)}, dt_bias {tuple(dt_bias_C.shape)} for f {tuple(f_BSHD.shape)}"
    for t in (f_BSHD, A_log_H, dt_bias_C):
        if t.dtype not in DTYPES:
            return f"dtype {t.dtype} (fla's gate computes in float32; float64 runs the reference)"
        if t.device.type != "cuda":
            return f"device {t.device.type} (fla's Triton kernels need cuda)"
    return fla_available()


def kda_gate_fla(f_BSHD: torch.Tensor, A_log_H: torch.Tensor, dt_bias_C: torch.Tensor,
                 lower_bound: float | None) -> torch.Tensor:
    """Same contract as ``ops/kda/reference.py: kda_gate_reference`` (float32 out): fla's ``fused_kda_gate``, the
    bias, ``exp(A_log)``, the sigmoid (or softplus) and the bound in one pass each way (fla's KimiDeltaAttention's
    own gate), where the reference runs five float32 elementwise passes forward and as many back, and sums the
    bias's and A_log's gradients per 32-token block on the fly. ``f``'s gradient comes back in its dtype."""
    from fla.ops.kda.gate import fused_kda_gate

    _maybe_limit_autotune()
    with torch.autocast(f_BSHD.device.type, enabled=False):
        return fused_kda_gate(f_BSHD, A_log_H, dt_bias_C, lower_bound=lower_bound, output_dtype=torch.float32)


# ---- causal_conv --------------------------------------------------------------------------------------
def conv_fla_supports(x_BSC: torch.Tensor, weight_CK: torch.Tensor, activation: str | None = "silu",
                      cu_seqlens: torch.Tensor | None = None) -> str | None:
    if activation not in ("silu", None):
        return f"activation {activation!r}"
    if x_BSC.dim() != 3 or weight_CK.shape[0] != x_BSC.shape[-1]:
        return f"x {tuple(x_BSC.shape)} vs weight {tuple(weight_CK.shape)}"
    return _common_supports(x_BSC, cu_seqlens)


def conv_fla(x_BSC: torch.Tensor, weight_CK: torch.Tensor, activation: str | None = "silu",
             cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
    """Depthwise causal conv (+ SiLU) ``[B, S, C] -> [B, S, C]`` in x's dtype, as the reference."""
    from fla.modules.causal_conv1d import causal_conv1d

    _maybe_limit_autotune()
    dt = _work_dtype(x_BSC)
    y, _ = causal_conv1d(x_BSC.to(dt), weight_CK, activation=activation, backend="triton",
                         cu_seqlens=None if cu_seqlens is None else cu_seqlens.long())
    return y.to(x_BSC.dtype)
