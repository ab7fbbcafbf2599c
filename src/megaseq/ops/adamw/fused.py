"""MasterAdamW's step in one Triton pass per parameter: clip, AdamW on the fp32 master, round into the weight.

Shapes: each parameter's local tensor, n elements, contiguous: the weight ``w`` (bf16, fp16 or fp32), its
gradient ``g`` (the backward's bf16, or MasterAdamW's fp32 sum), the fp32 master ``m`` and moments ``a``
(exp_avg) and ``s`` (exp_avg_sq).

torch's way (``memory.master_adam.MasterAdamW`` with ``kernel="torch"``, the reference) takes five passes over
memory: the gradient cast to an fp32 copy (6 bytes an element), the clip's multiply (8), the fused AdamW over
four fp32 tensors (28) and the master rounded into the weight (6): 48 bytes an element, 110 GB a step for
glm5-flash-1gpu's 2.3B parameters. This kernel reads the gradient in its own dtype, scales it by the clip
coefficient (a device scalar: no host sync), updates master and moments and writes the rounded weight: 28
bytes an element (a bf16 gradient and weight).

Arithmetic: torch's fused AdamW kernel's (``aten/src/ATen/native/cuda/fused_adam_utils.cuh``, ``ADAM_MODE::
ADAMW``), in its precisions: the hyperparameters are doubles, so the weight decay, both moment updates and the
denominator's ``+ eps`` are computed in fp64 and rounded to fp32; ``step_size = lr / bias_correction1`` and the
update ``step_size * exp_avg / denom`` in fp32 (IEEE division and square root: ``div_rn``, ``sqrt_rn``). The
bias corrections ``1 - beta ** step`` are fp64 from the step counters (torch's ``pow`` in double, then fp32),
made once per call for all tensors. torch's fused arithmetic has changed across releases (fma lerps, then fp32
hyperparameters) and nvcc may contract its products, so equality is not to the bit:
``tests/ops/adamw/test_triton_adamw.py`` holds the kernel to torch's AdamW within a few fp32 ulps, and
``tests/memory/test_master_adam.py`` to torch's fused kernel on the GPU within a bound derived there.
"""

from __future__ import annotations

import importlib.util

import torch

from megaseq.ops._triton_util import cdiv, interpreting, kernels

BLOCK = 4096  # elements per program
NUM_WARPS = 8


def available() -> bool:
    return importlib.util.find_spec("triton") is not None


def supports(w: torch.Tensor, g: torch.Tensor, master: torch.Tensor) -> str | None:
    """Why the kernel cannot step this parameter (None: it can)."""
    if not available():
        return "triton is not installed"
    if not (w.is_cuda or interpreting()):
        return f"device {w.device.type}"
    if master.dtype != torch.float32:
        return f"master dtype {master.dtype}"
    if w.dtype not in (torch.bfloat16, torch.float16, torch.float32) or g.dtype not in (
            torch.bfloat16, torch.float16, torch.float32):
        return f"weight {w.dtype} / gradient {g.dtype}"
    if not (w.is_contiguous() and g.is_contiguous() and master.is_contiguous()) or g.shape != w.shape:
        return "a non-contiguous weight, gradient or master"
    return None


def bias_corrections(steps: list[torch.Tensor], beta1: float, beta2: float) -> torch.Tensor:
    """``[P, 2]`` fp32: per step counter ``1 - beta1 ** step`` and ``sqrt(1 - beta2 ** step)``, computed in fp64
    as torch's fused AdamW does, then rounded (what its kernel receives)."""
    # the counters (0-d, or all [1]) stacked as they are: one reshape op each (~110 a parameter group) ran on the
    # host while the GPU waited for the update
    try:
        s = torch.stack(steps).reshape(-1).to(torch.float64)
    except RuntimeError:  # counters of mixed shapes
        s = torch.stack([t.reshape(()) for t in steps]).to(torch.float64)
    return torch.stack([1 - torch.pow(beta1, s), torch.sqrt(1 - torch.pow(beta2, s))], 1).to(torch.float32)


@torch.no_grad()
def master_adamw_(weights: list[torch.Tensor], grads: list[torch.Tensor], masters: list[torch.Tensor],
                  exp_avgs: list[torch.Tensor], exp_avg_sqs: list[torch.Tensor], steps: list[torch.Tensor],
                  coef: torch.Tensor | None, lr: float, beta1: float, beta2: float, eps: float,
                  weight_decay: float, finite: torch.Tensor | None = None) -> None:
    """One AdamW step of every parameter (each checked with ``supports``): ``steps`` (0-d fp32 counters on the
    weights' device) are incremented first, as torch's AdamW does; ``coef`` (0-d fp32, or None) scales the
    gradients (the clip). ``finite`` (0-d bool, or None): the step happens only where it is true, decided on
    the device (the counters add it, the kernel writes nothing where it is false), so the caller need not read
    the loss and gradient norm back before the update."""
    if not weights:
        return
    dev = weights[0].device
    if finite is None:
        torch._foreach_add_(steps, 1)
        ok = None
    else:
        ok = finite.to(device=dev, dtype=torch.int32).reshape(())
        # a list of the one flag, not the flag itself: torch's foreach add of a 0-d device tensor reads it back to
        # the host, a sync that would hold the update's launch until the backward has finished on the GPU
        add = ok.to(device=steps[0].device, dtype=steps[0].dtype)
        torch._foreach_add_(steps, [add] * len(steps))
    bc = bias_corrections(steps, beta1, beta2)
    hyper = torch.tensor([lr, beta1, beta2, eps, weight_decay], dtype=torch.float64).to(dev, non_blocking=True)
    coef_t = coef.to(device=dev, dtype=torch.float32) if coef is not None else bc  # any pointer when unused
    K = kernels("adamw.kernels")
    for i, (w, g, m, a, s) in enumerate(zip(weights, grads, masters, exp_avgs, exp_avg_sqs)):
        n = w.numel()
        if n:
            K.master_adamw_kernel[(cdiv(n, BLOCK),)](w, g, m, a, s, coef_t, bc, hyper, ok if ok is not None else bc, i,
                                                     n, HAS_COEF=coef is not None, HAS_OK=ok is not None,
                                                     BLOCK=BLOCK, num_warps=NUM_WARPS)
