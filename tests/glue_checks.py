"""What the CPU/GPU tests of the fused glue kernels (mHC weights, collapse, merge, SwiGLU, RMSNorm) share: the
tolerances and the comparison of outputs and gradients against the torch references.

Tolerances are relative to the largest reference value. fp32: the kernels sum in another order than torch
(and the exp and rsqrt round differently); the Sinkhorn's 39 divisions are contractive and end within
~3e-7 of the reference, tested at 2e-5. fp16/bf16: outputs round like the reference (often bit for bit);
gradients accumulate in fp32 where autograd rounds each product, a few half ulps apart.
"""

from __future__ import annotations

import torch

from devices import BF16, DEV, F16, F32
from numerics import assert_close

# (output, gradients) relative tolerance per input dtype
TOL = {F32: (2e-5, 2e-5), F16: (2e-3, 4e-3), BF16: (1.6e-2, 3e-2)}


def assert_supported(why: str | None) -> None:
    """The kernel's ``supports`` accepts the arguments; on the CPU only the device stops the dispatcher."""
    assert why is None if DEV == "cuda" else why.startswith("device cpu"), why


def grads(out, inputs, seed: int = 7):
    """Gradients of ``sum(out * w)`` for fixed random ``w`` per output (a tuple of outputs or one)."""
    outs = out if isinstance(out, tuple) else (out,)
    gen = torch.Generator(device=outs[0].device).manual_seed(seed)
    loss = sum((o.float() * torch.randn(o.shape, generator=gen, device=o.device)).sum() for o in outs)
    return torch.autograd.grad(loss, inputs)


def compare(name, fast, ref, inputs, dtype):
    out_tol, grad_tol = TOL[dtype]
    fo, ro = fast(*inputs), ref(*inputs)
    fo, ro = (fo if isinstance(fo, tuple) else (fo,)), (ro if isinstance(ro, tuple) else (ro,))
    for i, (a, b) in enumerate(zip(fo, ro)):
        assert a.dtype == b.dtype, f"{name} output {i}: dtype {a.dtype} vs {b.dtype}"
        assert_close(f"{name} output {i}", a, b, out_tol)
    diff = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
    for i, (a, b) in enumerate(zip(grads(fo, diff), grads(ro, diff))):
        assert_close(f"{name} grad {i}", a, b, grad_tol)
