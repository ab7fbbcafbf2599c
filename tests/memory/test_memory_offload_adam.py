"""OffloadStreamAdamW vs torch.optim.AdamW(foreach=False): weights, both moments, steps (float64, CPU)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from megaseq.memory.offload_adam import OffloadStreamAdamW, SequentialOffloadAdamW
from megaseq.plan.components import offload_adam_bytes

torch.set_num_threads(1)
TOL = {"rtol": 1e-12, "atol": 1e-14}
SHAPES = [(7, 5), (13,), (3, 4, 5), (1,), (31, 17), (2, 3), (11,)]


def _params(seed: int = 0) -> list[nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [nn.Parameter(torch.randn(s, generator=g, dtype=torch.float64)) for s in SHAPES]


def _groups(params, wd=0.1):
    # two groups, as the trainer makes them (no decay on norms/biases), with their own lr
    return [{"params": params[:4], "weight_decay": wd},
            {"params": params[4:], "weight_decay": 0.0, "lr": 3e-3}]


def _grads(step: int, skip_one: bool) -> list[torch.Tensor | None]:
    g = torch.Generator().manual_seed(100 + step)
    grads = [torch.randn(s, generator=g, dtype=torch.float64) * (1 + step) for s in SHAPES]
    if skip_one and step % 2 == 1:
        grads[2] = None  # no gradient this step: torch skips the parameter entirely
    return grads


def _schedule(opt):
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda k: min(1.0, (k + 1) / 3) * 0.9**k)


def _run(make_opt, steps: int = 5, clip: float | None = None, skip_one: bool = True):
    params = _params()
    opt = make_opt(_groups(params))
    sched = _schedule(opt)
    norms = []
    for k in range(steps):
        for p, g in zip(params, _grads(k, skip_one)):
            p.grad = None if g is None else g.clone()
        if clip is not None:
            if isinstance(opt, OffloadStreamAdamW):
                norms.append(opt.clip_grad_norm_(clip))
            else:
                norms.append(torch.nn.utils.clip_grad_norm_(params, clip, foreach=False))
        opt.step()
        opt.zero_grad()
        sched.step()
    return params, opt, norms


def _assert_matches(ref, got) -> None:
    (p_ref, o_ref, n_ref), (p_got, o_got, n_got) = ref, got
    for a, b in zip(p_got, p_ref):
        torch.testing.assert_close(a.detach(), b.detach(), **TOL)
    for a, b in zip(p_got, p_ref):
        s_got, s_ref = o_got.state[a], o_ref.state[b]
        assert float(s_got["step"]) == float(s_ref["step"])
        torch.testing.assert_close(s_got["exp_avg"], s_ref["exp_avg"], **TOL)
        torch.testing.assert_close(s_got["exp_avg_sq"], s_ref["exp_avg_sq"], **TOL)
        torch.testing.assert_close(s_got["master"], b.detach(), **TOL)
    for a, b in zip(n_got, n_ref):
        torch.testing.assert_close(a, b, **TOL)


def _torch_adamw(groups):
    return torch.optim.AdamW(groups, lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, foreach=False)


def _ours(bucket_params: int, **kw):
    return lambda groups: OffloadStreamAdamW(groups, lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1,
                                             bucket_params=bucket_params, **kw)


@pytest.mark.parametrize("bucket_params", [1, 20, 60, 10**6])
@pytest.mark.parametrize("clip", [None, 5.0])
def test_matches_torch_adamw(bucket_params, clip):
    """Bucket sizes: one parameter per bucket; several per bucket with the 527-element parameter larger
    than a bucket (it gets its own); one bucket per group. Clipping by global norm; an LR schedule."""
    ref = _run(_torch_adamw, clip=clip)
    got = _run(_ours(bucket_params), clip=clip)
    _assert_matches(ref, got)
    if clip is not None:  # the clip was active (the guard that this checks clipping at all)
        assert all(n > clip for n in got[2])


def test_buckets_hold_whole_parameters_and_never_mix_groups():
    opt = _ours(20)(_groups(_params()))
    sizes = [[p.numel() for p in b.params] for b in opt.buckets]
    assert sizes == [[35], [13], [60], [1], [527], [6, 11]]
    assert all(len({id(opt.param_groups[b.group])}) == 1 for b in opt.buckets)
    assert opt.staging_bytes == 0  # staging is made at the first step
    opt.step()  # no gradients: nothing to do, nothing allocated
    assert opt.staging_bytes == 0


def test_grads_in_backward_with_accumulation():
    """Hooks move each gradient to the host as backward produces it; a second micro-batch adds to it."""
    torch.manual_seed(0)
    ref_model = nn.Sequential(nn.Linear(13, 7), nn.Tanh(), nn.Linear(7, 5)).double()
    model = nn.Sequential(nn.Linear(13, 7), nn.Tanh(), nn.Linear(7, 5)).double()
    model.load_state_dict(ref_model.state_dict())
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, weight_decay=0.05, foreach=False)
    ours = OffloadStreamAdamW(model.parameters(), lr=1e-2, weight_decay=0.05, bucket_params=50,
                              grads_in_backward=True)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        batches = [torch.randn(9, 13, generator=g, dtype=torch.float64) for _ in range(2)]
        for m in (ref_model, model):
            for x in batches:
                m(x).square().mean().backward()
        assert all(p.grad is None for p in model.parameters())  # already on the host
        torch.nn.utils.clip_grad_norm_(ref_model.parameters(), 0.5, foreach=False)
        ours.clip_grad_norm_(0.5)
        ref.step()
        ours.step()
        ref.zero_grad()
        ours.zero_grad()
    for a, b in zip(model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(a.detach(), b.detach(), **TOL)


def test_state_dict_round_trip_resumes_exactly():
    straight = _run(_ours(20), steps=5)
    params = _params()
    opt = _ours(20)(_groups(params))
    sched = _schedule(opt)
    for k in range(3):
        for p, g in zip(params, _grads(k, True)):
            p.grad = None if g is None else g.clone()
        opt.step()
        opt.zero_grad()
        sched.step()
    saved = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in opt.state_dict().items()}
    saved_sched = sched.state_dict()
    # a fresh optimizer on fresh (wrong) weights: the master in the state restores them
    params2 = _params(seed=7)
    opt2 = _ours(20)(_groups(params2))
    sched2 = _schedule(opt2)  # the usual resume order: build both, then load both
    opt2.load_state_dict(saved)
    sched2.load_state_dict(saved_sched)
    for k in range(3, 5):
        for p, g in zip(params2, _grads(k, True)):
            p.grad = None if g is None else g.clone()
        opt2.step()
        opt2.zero_grad()
        sched2.step()
    _assert_matches((straight[0], straight[1], []), (params2, opt2, []))


def test_sequential_baseline_matches_in_fp32():
    params = [nn.Parameter(p.detach().float()) for p in _params()]
    ref_params = [nn.Parameter(p.detach().clone()) for p in params]
    seq = SequentialOffloadAdamW(params, lr=1e-2, weight_decay=0.1)
    ref = torch.optim.AdamW(ref_params, lr=1e-2, weight_decay=0.1, foreach=False)
    for k in range(3):
        for p, q, g in zip(params, ref_params, _grads(k, False)):
            p.grad, q.grad = g.float(), g.float()
        seq.step()
        ref.step()
    for a, b in zip(params, ref_params):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-6, atol=1e-7)


def test_memory_formula():
    params = _params()
    opt = _ours(60)(_groups(params))
    total = sum(p.numel() for p in params)
    f = offload_adam_bytes(total, 60, master_bytes=8)
    # host buffers are exact up to the 512-byte alignment of each bucket
    assert f["host"] <= opt.host_bytes <= f["host"] + 4 * 512 * len(opt.buckets)
    for p, g in zip(params, _grads(0, False)):
        p.grad = g
    opt.step()
    n_max = max(b.numel for b in opt.buckets)  # 527: a parameter larger than the bucket sets the slots
    assert opt.staging_bytes == 2 * 4 * n_max * 8
    assert offload_adam_bytes(3 * 10**9, 10**8)["host"] == 48 * 10**9


def test_rejects_bad_settings():
    with pytest.raises(ValueError, match="optimizer_bucket_params"):
        OffloadStreamAdamW(_params(), bucket_params=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("overlap", [True, False])
def test_gpu_streams_match_torch(overlap):
    def run(make):
        params = [nn.Parameter(p.detach().float().cuda()) for p in _params()]
        opt = make(params)
        for k in range(4):
            for p, g in zip(params, _grads(k, True)):
                p.grad = None if g is None else g.float().cuda()
            if isinstance(opt, OffloadStreamAdamW):
                opt.clip_grad_norm_(5.0)
            else:
                torch.nn.utils.clip_grad_norm_(params, 5.0)
            opt.step()
            opt.zero_grad()
        return [p.detach().cpu() for p in params]

    ref = run(lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1))
    got = run(lambda ps: OffloadStreamAdamW(ps, lr=1e-2, weight_decay=0.1, bucket_params=40, overlap=overlap))
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
