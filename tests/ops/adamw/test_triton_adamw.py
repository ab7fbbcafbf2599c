"""MasterAdamW's one-pass Triton step (``ops/adamw/fused.py``) against torch's AdamW on an fp32 copy.

Without a GPU the kernel runs under Triton's interpreter (conftest.py), with fp16 and fp32 weights (the
interpreter's bf16 is broken); with a GPU the same tests run there and the ``gpu`` test compares bf16 weights
with torch's fused CUDA AdamW at a 10M-element parameter. The reference is ``torch.optim.adamw.adamw`` on the
fp32 master with the gradient cast to fp32 and scaled by the clip coefficient (MasterAdamW's torch way). Three
steps; master, both moments and the rounded weight are compared to 2e-6 of each tensor's largest value (a few
fp32 ulps: torch's single-tensor CPU AdamW orders its operations differently). A kernel without weight decay,
without the clip's scale or with the step counter off by one fails.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")  # on the CPU under the interpreter conftest.py selects

from torch.optim.adamw import adamw  # noqa: E402

from devices import BF16, DEV, F16, F32, GPU  # noqa: E402
from megaseq.memory.master_adam import MasterAdamW  # noqa: E402
from megaseq.ops.adamw import fused as triton_adamw  # noqa: E402

HYPER = dict(lr=3e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
RTOL = 2e-6  # of each tensor's largest value: a few fp32 ulps


def _state(shapes, wdtype, seed=0, device=DEV):
    gen = torch.Generator().manual_seed(seed)
    masters = [torch.randn(s, generator=gen).to(device) for s in shapes]
    weights = [m.to(wdtype) for m in masters]
    masters = [w.float() for w in weights]  # the master starts as the weight, exactly
    moments = [(torch.zeros_like(m), torch.zeros_like(m)) for m in masters]
    steps = [torch.zeros((), dtype=torch.float32, device=device) for _ in shapes]
    return weights, masters, moments, steps


def _grads(shapes, gdtype, step, device=DEV):
    gen = torch.Generator().manual_seed(100 + step)
    return [(torch.randn(s, generator=gen) * (step + 1)).to(device, gdtype) for s in shapes]


def _reference(weights, masters, moments, steps, grads, coef, **hyper):
    g32 = [g.float() * coef if coef is not None else g.float() for g in grads]
    fused = masters[0].is_cuda
    adamw(masters, g32, [a for a, _ in moments], [s for _, s in moments], [], steps, amsgrad=False,
          maximize=False, **hyper, **(dict(fused=True) if fused else dict(foreach=False)))
    for w, m in zip(weights, masters):
        w.copy_(m)


def _kernel(weights, masters, moments, steps, grads, coef, **hyper):
    triton_adamw.master_adamw_(weights, grads, masters, [a for a, _ in moments], [s for _, s in moments], steps,
                               coef, **hyper)


def _close(a_state, b_state) -> bool:
    """Master and moments within ``RTOL`` of each tensor's largest value (a moment summed from gradients of
    both signs can cancel to near 0, where a relative bound per element would measure the cancellation, not
    the kernel); the weights are each state's master rounded to nearest, exactly (a master a few ulps from the
    reference's may round to the next bf16 value, so the weights are not compared across)."""
    for state in (a_state, b_state):
        if not all(torch.equal(w, m.to(w.dtype)) for w, m in zip(state[0], state[1])):
            return False
    return all(float((x.float() - y.float()).abs().max()) <= RTOL * float(y.float().abs().max())
               for xs, ys in zip(a_state[1:], b_state[1:]) for x, y in zip(xs, ys))


def _report(a_state, b_state) -> str:
    return "; ".join(f"{name}{tuple(y.shape)} {float((x.float() - y.float()).abs().max() / y.float().abs().max()):.2e}"
                     for name, xs, ys in zip(("m", "a", "s"), a_state[1:], b_state[1:]) for x, y in zip(xs, ys))


def _flat(weights, masters, moments):
    return [weights, masters, [a for a, _ in moments], [s for _, s in moments]]


def _run(step_fn, shapes, wdtype, gdtype, coef, steps_n=3, **hyper):
    weights, masters, moments, steps = _state(shapes, wdtype)
    for k in range(steps_n):
        step_fn(weights, masters, moments, steps, _grads(shapes, gdtype, k), coef, **hyper)
    return _flat(weights, masters, moments), steps


WDTYPES = [F16, F32] if DEV == "cpu" else [BF16, F16, F32]
SHAPES = [(5000,), (3, 7), (4096,), (1,)]  # a partial second block, a tiny one, one exact block, one element


@pytest.mark.parametrize("wdtype", WDTYPES)
@pytest.mark.parametrize("clip", [None, 0.37])
def test_kernel_matches_torch_adamw(wdtype, clip):
    coef = None if clip is None else torch.tensor(clip, device=DEV)
    ref, ref_steps = _run(_reference, SHAPES, wdtype, wdtype, coef, **HYPER)
    got, got_steps = _run(_kernel, SHAPES, wdtype, wdtype, coef, **HYPER)
    assert all(float(s) == 3 for s in got_steps) and all(float(s) == 3 for s in ref_steps)
    assert _close(got, ref), _report(got, ref)
    if wdtype != F32:  # an fp32 gradient (MasterAdamW's sum over several backward passes) for a low-precision weight
        got32, _ = _run(_kernel, SHAPES, wdtype, F32, coef, **HYPER)
        ref32, _ = _run(_reference, SHAPES, wdtype, F32, coef, **HYPER)
        assert _close(got32, ref32)


def test_broken_variants_fail():
    coef = torch.tensor(0.37, device=DEV)
    ref, _ = _run(_reference, SHAPES, F32, F32, coef, **HYPER)
    assert not _close(_run(_kernel, SHAPES, F32, F32, coef, **{**HYPER, "weight_decay": 0.0})[0], ref)
    assert not _close(_run(_kernel, SHAPES, F32, F32, None, **HYPER)[0], ref)  # the clip's scale ignored

    def off_by_one(weights, masters, moments, steps, grads, coef, **hyper):
        _kernel(weights, masters, moments, [s + 1 for s in steps], grads, coef, **hyper)
        torch._foreach_add_(steps, 1)

    assert not _close(_run(off_by_one, SHAPES, F32, F32, coef, **HYPER)[0], ref)


def test_master_adamw_with_the_kernel_steps_as_torch_does():
    """MasterAdamW(kernel="triton") against MasterAdamW(kernel="torch") over three clipped steps of two groups:
    the weights' lone gradients are read as they are (not folded into fp32 copies)."""
    def build(kernel):
        gen = torch.Generator().manual_seed(7)
        w1 = torch.nn.Parameter((torch.randn(300, 17, generator=gen)).to(DEV, WDTYPES[0]))
        w2 = torch.nn.Parameter(torch.randn(9, generator=gen).to(DEV))  # fp32, as a bf16 model's router
        opt = MasterAdamW([{"params": [w1], "weight_decay": 0.1}, {"params": [w2], "weight_decay": 0.0}], lr=1e-2,
                          betas=(0.9, 0.95), kernel=kernel, fused=DEV == "cuda", foreach=False)
        return (w1, w2), opt

    results = []
    for kernel in ("torch", "triton"):
        params, opt = build(kernel)
        for k in range(3):
            gen = torch.Generator().manual_seed(50 + k)
            for p in params:
                p.grad = torch.randn(p.shape, generator=gen).to(DEV, p.dtype) * 10
            if kernel == "triton":
                assert opt._grad(params[0]) is params[0].grad  # no fp32 copy
            norm = opt.clip_grad_norm_(1.0)
            assert float(norm) > 1.0  # the clip scales
            opt.step()
            opt.zero_grad()
        results.append([[p.detach() for p in params], [opt.state[p]["master"] for p in params],
                        [opt.state[p]["exp_avg"] for p in params]])
    assert _close(results[1], results[0])
    with pytest.raises(ValueError, match="kernel must be torch or triton"):
        MasterAdamW([torch.nn.Parameter(torch.zeros(2))], kernel="cuda")


@pytest.mark.gpu
@GPU
def test_gpu_bf16_matches_torch_fused_adamw():
    shapes = [(10_000_003,), (2048, 1024)]
    coef = torch.tensor(0.6, device="cuda")
    ref, _ = _run(_reference, shapes, BF16, BF16, coef, **HYPER)
    got, _ = _run(_kernel, shapes, BF16, BF16, coef, **HYPER)
    assert _close(got, ref), _report(got, ref)
    # the rounded weights: the same bf16 values but where the masters straddle a rounding boundary
    assert all((a != b).float().mean() < 1e-3 for a, b in zip(got[0], ref[0]))


@pytest.mark.parametrize("kernel", ["triton", "torch"])
def test_step_guarded_on_the_device_writes_nothing_when_not_finite(kernel):
    """``MasterAdamW.step(finite=...)``: false leaves weights, masters, moments and step counters as they were
    (the Triton kernel masks its stores; torch's way reads the flag back); true steps as ``step()`` does."""
    def build():
        gen = torch.Generator().manual_seed(3)
        ps = [torch.nn.Parameter(torch.randn(s, generator=gen).to(DEV, WDTYPES[0])) for s in SHAPES]
        return ps, MasterAdamW(ps, lr=1e-2, betas=(0.9, 0.95), kernel=kernel, fused=DEV == "cuda", foreach=False)

    def grads(ps, k):
        gen = torch.Generator().manual_seed(60 + k)
        for p in ps:
            p.grad = torch.randn(p.shape, generator=gen).to(DEV, p.dtype) * 10

    def snapshot(ps, opt):
        return [t.detach().clone() for p in ps for t in (p, *(opt.state[p][n] for n in
                                                               ("master", "exp_avg", "exp_avg_sq", "step")))]

    (a, opt_a), (b, opt_b) = build(), build()
    for ps, opt in ((a, opt_a), (b, opt_b)):  # a first step, so that the moments are not zero
        grads(ps, 0)
        opt.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
    before = snapshot(a, opt_a)
    grads(a, 1)
    opt_a.clip_grad_norm_(1.0)
    opt_a.step(finite=torch.tensor(False, device=DEV))
    opt_a.zero_grad()
    assert all(torch.equal(x, y) for x, y in zip(snapshot(a, opt_a), before))
    for ps, opt, finite in ((a, opt_a, torch.tensor(True, device=DEV)), (b, opt_b, None)):
        grads(ps, 1)
        opt.clip_grad_norm_(1.0)
        opt.step(finite=finite)
        opt.zero_grad()
    assert all(torch.equal(x, y) for x, y in zip(snapshot(a, opt_a), snapshot(b, opt_b)))
    assert float(opt_a.state[a[0]]["step"]) == 2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_guarded_step_makes_no_host_sync():
    """The clip and the update guarded on the device (``train.step``'s one-process path) launch without reading
    anything back: a sync there holds the update's launch until the backward has finished on the GPU (torch's
    foreach add of a 0-d device tensor makes one)."""
    ps = [torch.nn.Parameter(torch.randn(s, device="cuda").to(torch.bfloat16)) for s in SHAPES]
    opt = MasterAdamW(ps, lr=1e-2, betas=(0.9, 0.95), kernel="triton", fused=True)
    for step in range(2):  # the second step's launches, compiled and warm (the first may compile and tune)
        for p in ps:
            p.grad = torch.randn_like(p)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error" if step else "default")
        try:
            norm = opt.clip_grad_norm_(1.0)
            opt.step(finite=torch.isfinite(norm))
        finally:
            torch.cuda.set_sync_debug_mode("default")
        opt.zero_grad()
    assert float(opt.state[ps[0]]["step"]) == 2
