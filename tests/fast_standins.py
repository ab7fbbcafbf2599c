"""Stand-ins for the fast Triton norm and SwiGLU kernels on the CPU, for measuring a step's memory as the GPU runs
it: the ops' wrappers (``ops/rms_norm/fused.py``, ``ops/swiglu/fused.py``) run unchanged, so their outputs and
saved tensors are the GPU's; only the kernels' work is done in torch, a few rows at a time (transient temporaries
of a few rows, as a kernel's registers), writing into the wrappers' outputs. Not a check of the kernels' values
(their own tests do that): of what their callers allocate."""

from __future__ import annotations

import torch
import torch.nn.functional as F

ROWS = 256  # rows of one stand-in block


class _Launch:
    """``kernel[grid](*args)`` as Triton launches it; the grid is ignored."""

    def __init__(self, fn) -> None:
        self.fn = fn

    def __getitem__(self, grid):
        return self.fn


@torch.no_grad()
def _rms_fwd(x, w, y, rstd, R, eps, **_):
    wf = w.float()
    for a in range(0, R, ROWS):
        xs = x[a:a + ROWS].float()
        rs = torch.rsqrt(xs.pow(2).mean(-1) + eps)
        y[a:a + ROWS] = (xs * rs[:, None] * wf).to(y.dtype)
        rstd[a:a + ROWS] = rs


@torch.no_grad()
def _rms_bwd(x, w, g, rstd, gx, part, R, **_):
    wf = w.float()
    for a in range(0, R, ROWS):
        xh = x[a:a + ROWS].float() * rstd[a:a + ROWS, None]
        gw = g[a:a + ROWS].float() * wf
        gx[a:a + ROWS] = (rstd[a:a + ROWS, None] * (gw - xh * (gw * xh).mean(-1, keepdim=True))).to(gx.dtype)
        part[0] += (g[a:a + ROWS].float() * xh).sum(0)


@torch.no_grad()
def _swiglu_fwd(g, u, out, g_stride, u_stride, R, I, lim, **_):
    for a in range(0, R, ROWS):
        out[a:a + ROWS] = (F.silu(g[a:a + ROWS].float()) * u[a:a + ROWS].float()).to(out.dtype)


@torch.no_grad()
def _swiglu_bwd(g, u, g_out, gg, gu, g_stride, u_stride, R, I, lim, **_):
    for a in range(0, R, ROWS):
        gf, uf, of = g[a:a + ROWS].float(), u[a:a + ROWS].float(), g_out[a:a + ROWS].float()
        s = torch.sigmoid(gf)
        gu[a:a + ROWS] = (of * gf * s).to(gu.dtype)
        gg[a:a + ROWS] = (of * uf * s * (1 + gf * (1 - s))).to(gg.dtype)


class _RMSKernels:
    rms_norm_fwd_kernel = _Launch(_rms_fwd)
    rms_norm_bwd_kernel = _Launch(_rms_bwd)


class _SwiGLUKernels:
    swiglu_fwd_kernel = _Launch(_swiglu_fwd)
    swiglu_bwd_kernel = _Launch(_swiglu_bwd)


STOOD_IN = frozenset({"rms_norm", "swiglu"})  # the fast ops whose kernels this module stands in for


def install(monkeypatch) -> None:
    """The ``triton`` implementations of ``rms_norm`` and ``swiglu`` runnable on the CPU, with these stand-ins."""
    import megaseq.ops.rms_norm.fused as rms
    import megaseq.ops.swiglu.fused as swiglu

    for mod, kernels in ((rms, _RMSKernels), (swiglu, _SwiGLUKernels)):
        monkeypatch.setattr(mod, "triton_supports", lambda *tensors: None)
        monkeypatch.setattr(mod, "kernels", lambda name, k=kernels: k)
