"""bf16 weights with fp32 master state (``memory.master_adam.MasterAdamW``): a step equals torch's AdamW run on
an fp32 copy and cast to bf16, bit for bit on the CPU; so does each rank's shard under FSDP2 (2 gloo ranks,
glm5-flash-tiny in bf16, cut to its first 4 layers, every kind once: ``conftest.glm5_tiny4``; its router and KDA
decay kept fp32 and whole) and OffloadStreamAdamW's update of the same shards. Gradients of several backward
passes are summed in fp32, not in bf16."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed.tensor  # noqa: F401  (imported once here, not in each fork)

from conftest import glm5_tiny4
from megaseq.memory.master_adam import MasterAdamW, clip_grad_norm_
from megaseq.memory.offload_adam import OffloadStreamAdamW
from megaseq.parallel.launch import spawn_local

BF16 = torch.bfloat16
HYPER = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8)
SHAPES = [(7, 5), (13,), (3, 4, 5), (31, 17)]


def _params(seed: int = 0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(BF16)) for s in SHAPES]


def _grads(step: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return [(torch.randn(s, generator=g) * 1e-3 * (1 + step)).to(BF16) for s in SHAPES]


def _fp32_reference(params, grads_per_step, lrs, decay: float = 0.1, fused: bool = False,
                    clip: float | None = None) -> list[torch.Tensor]:
    """torch.optim.AdamW on fp32 copies (the master), each step's bf16 gradient cast to fp32 (and clipped by
    torch's ``clip_grad_norm_`` to ``clip``); the bf16 weights are the master cast after each step."""
    masters = [torch.nn.Parameter(p.detach().float().clone()) for p in params]
    kind = dict(fused=True) if fused else dict(foreach=False)
    opt = torch.optim.AdamW([{"params": masters[:2], "weight_decay": decay},
                             {"params": masters[2:], "weight_decay": 0.0}], **HYPER, **kind)
    for grads, lr in zip(grads_per_step, lrs):
        for group in opt.param_groups:
            group["lr"] = lr
        for m, g in zip(masters, grads):
            m.grad = g.float()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(masters, clip, foreach=False)
        opt.step()
    return masters


@pytest.mark.parametrize("fused", [False, True], ids=["foreach", "fused"])
@pytest.mark.parametrize("clip", [None, 0.01], ids=["unclipped", "clipped"])
def test_a_step_equals_the_fp32_master_update_cast_bitwise(fused, clip):
    """Against torch's AdamW of the same kind (``fused``: torch's fused kernel, what a GPU run uses; foreach
    False: the per-tensor loop); ``clip`` 0.01 clips every step (the gradients' norms are 0.06-0.2)."""
    params = _params()
    opt = MasterAdamW([{"params": params[:2], "weight_decay": 0.1}, {"params": params[2:], "weight_decay": 0.0}],
                      **HYPER, foreach=False, fused=fused)
    steps, lrs = [_grads(0), _grads(1), _grads(2)], [3e-3, 2e-3, 1e-3]
    for grads, lr in zip(steps, lrs):
        for group in opt.param_groups:
            group["lr"] = lr
        for p, g in zip(params, grads):
            p.grad = g.clone()
        if clip is not None:
            assert opt.clip_grad_norm_(clip) > clip
        opt.step()
        opt.zero_grad()
    masters = _fp32_reference(_params(), steps, lrs, fused=fused, clip=clip)
    for p, m in zip(params, masters):
        assert p.dtype == BF16
        assert torch.equal(opt.state[p]["master"], m.detach())  # the fp32 master, bit for bit
        assert torch.equal(p.detach(), m.detach().to(BF16))  # the weights: the master rounded to bf16
    # the update is smaller than bf16's resolution for most weights: without a master they would not move
    assert any(not torch.equal(m.detach().to(BF16), p0) for m, p0 in zip(masters, _params()))


def test_several_backward_passes_are_summed_in_fp32():
    params = _params()
    opt = MasterAdamW(params, **HYPER, weight_decay=0.0, foreach=False, accumulate=True)
    parts = [_grads(0), _grads(1), _grads(2)]
    for grads in parts:  # three backward passes of one step, each leaving a bf16 gradient
        loss = sum((p.float() * g.float()).sum() for p, g in zip(params, grads))
        loss.backward()
        assert all(p.grad is None for p in params)  # folded into the fp32 sum as they arrive
    summed = [sum(part[i].float() for part in parts) for i in range(len(SHAPES))]
    for p, s in zip(params, summed):
        assert torch.equal(opt.acc[p], s)
    in_bf16 = [sum(part[i] for part in parts) for i in range(len(SHAPES))]
    assert any(not torch.equal(s, b.float()) for s, b in zip(summed, in_bf16))  # bf16 sums would differ
    opt.step()
    masters = _fp32_reference(_params(), [summed], [HYPER["lr"]], decay=0.0)
    for p, m in zip(params, masters):
        assert torch.equal(p.detach(), m.detach().to(BF16))


@pytest.mark.parametrize("accumulate", [True, False], ids=["accumulate", "broken-bf16-sums"])
def test_offloaded_optimizer_sums_kept_gradients_in_fp32(accumulate):
    """OffloadStreamAdamW under sequence segments (gradients kept on the device until the step): three backward
    passes' bf16 gradients are summed in fp32 as they arrive, the update is the fp32 master update of that sum,
    bit for bit; without ``accumulate`` (the bf16 ``.grad`` sums, the broken variant) it is not."""
    params = _params()
    opt = OffloadStreamAdamW(params, **HYPER, weight_decay=0.0, overlap=False, accumulate=accumulate)
    parts = [_grads(0), _grads(1), _grads(2)]
    for grads in parts:
        loss = sum((p.float() * g.float()).sum() for p, g in zip(params, grads))
        loss.backward()
    summed = [sum(part[i].float() for part in parts) for i in range(len(SHAPES))]
    opt.step()
    masters = _fp32_reference(_params(), [summed], [HYPER["lr"]], decay=0.0)
    same = all(torch.equal(opt.state[p]["master"], m.detach()) for p, m in zip(params, masters))
    assert same == accumulate
    if accumulate:
        assert opt.acc == {} and all(p.grad is None for p in params)


def test_clip_equals_torchs_on_the_fp32_gradients():
    grads = [(g.float() * 100).to(BF16) for g in _grads(3)]  # norm about 10: clipped to 1
    params = _params()
    opt = MasterAdamW(params, **HYPER, foreach=False)
    for p, g in zip(params, grads):
        p.grad = g.clone()
    copies = [torch.nn.Parameter(torch.zeros(s)) for s in SHAPES]
    for c, g in zip(copies, grads):
        c.grad = g.float()
    want = torch.nn.utils.clip_grad_norm_(copies, 1.0, foreach=False)
    assert want > 1
    torch.testing.assert_close(opt.clip_grad_norm_(1.0), want, rtol=1e-6, atol=0)
    whole = [torch.nn.Parameter(torch.zeros(s)) for s in SHAPES]
    for w, g in zip(whole, grads):
        w.grad = g.float()
    torch.testing.assert_close(clip_grad_norm_(whole, 1.0), want, rtol=1e-6, atol=0)
    for w, c in zip(whole, copies):
        torch.testing.assert_close(w.grad, c.grad, rtol=1e-6, atol=0)


# ---- FSDP2 shards of a bf16 model, 2 ranks -----------------------------------------------------------
def test_reduce_dtype_is_the_setting_or_the_weights_when_wider():
    from megaseq.parallel.fsdp import reduce_dtype

    assert reduce_dtype(BF16, "fp32") == torch.float32 and reduce_dtype(BF16, "bf16") == BF16
    assert reduce_dtype(torch.float64, "fp32") == torch.float64  # the float64 tests reduce exactly


def _bf16_rank(rank: int, which: str, out: str) -> None:
    from megaseq.config import MemorySettings, build_config
    from megaseq.models.build import build_model
    from megaseq.models.registry import parallelize
    from megaseq.parallel.env import DistributedEnv
    from megaseq.parallel.mesh import complete_batch

    torch.set_num_threads(1)
    cfg = build_config(overrides={"parallel.dp": 2, "parallel.fsdp": "dp", "parallel.backend": "gloo",
                                  "data.seq_len": 16, "train.device": "cpu"})
    env = DistributedEnv(cfg, spec=glm5_tiny4())
    model = build_model(glm5_tiny4(), dtype=BF16, seed=0)
    start = {n: p.detach().float().clone() for n, p in model.named_parameters()}
    applied = parallelize(model, MemorySettings(), env)
    assert any(p.dtype == torch.float32 for p in applied.sharded.replicated)  # the router: fp32, whole
    for unit in applied.sharded.units:  # gradients reduce-scattered in fp32 (parallel.reduce_dtype)
        assert unit._get_fsdp_state()._mp_policy.reduce_dtype == torch.float32
    trainable = [p for p in model.parameters() if p.requires_grad]
    if which == "master":
        opt = MasterAdamW(trainable, **HYPER, weight_decay=0.1, foreach=False)
    else:
        opt = OffloadStreamAdamW(trainable, **HYPER, weight_decay=0.1, overlap=False)
    g = torch.Generator().manual_seed(rank)
    batch = complete_batch({"input_ids": torch.randint(1, 16, (1, 16), generator=g)})
    hidden = model(batch["input_ids"])
    loss = torch.nn.functional.cross_entropy((hidden @ model.lm_head.weight.t()).float().flatten(0, 1),
                                             batch["labels"].flatten())
    loss.backward()
    env.reduce_gradients(model)  # the whole (fp32) parameters; FSDP reduce-scattered the shards
    names = {p: n for n, p in model.named_parameters()}
    grads = {names[p]: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
             for p in trainable if p.grad is not None}
    if which == "master":
        _check_planner_state(model, applied, opt)
    opt.step()
    ref = {}
    for n, gr in grads.items():  # AdamW on an fp32 copy of the whole tensor, cast: elementwise, so a shard
        m = torch.nn.Parameter(start[n].clone())  # of it is the update of the shard
        m.grad = gr.float()
        torch.optim.AdamW([m], **HYPER, weight_decay=0.1, foreach=False).step()
        ref[n] = m.detach()
    for n, p in model.named_parameters():
        if n not in ref:
            continue
        full = p.detach().full_tensor() if hasattr(p, "full_tensor") else p.detach()
        assert full.dtype == start_dtype(n, model), n
        assert torch.equal(full, ref[n].to(full.dtype)), f"{n}: the shard's update is not the fp32 update cast"
    from megaseq.train import checkpoint as ckpt

    ckpt.save_checkpoint(Path(out), 1, model, opt, None, {"spec": model.spec.to_dict()})  # every rank: its shards
    if rank == 0:
        torch.save(ref, Path(out) / "ref.pt")
    env.shutdown()


def _check_planner_state(model, applied, opt) -> None:
    """The planner's state formulas (plan.components) against what this rank holds: the fp32 parameters FSDP
    keeps whole, what each layer gathers, the local weights and MasterAdamW's fp32 master and moments."""
    from megaseq.plan import components as C

    counts, mesh = C.count_params(model.spec), C.Mesh(dp=2, fsdp="dp")
    prec = C.precision_for("bf16", "bf16")
    assert sum(p.numel() for p in applied.sharded.replicated) == counts.kept
    for i, layer in enumerate(model.layers):
        gathered = sum(p.numel() for p in layer.parameters() if hasattr(p, "to_local"))
        assert gathered == C.gathered_params(counts, i, mesh, prec), i
    local = sum(_local_bytes(p) for p in model.parameters())
    state = sum(_local_bytes(t) for st in opt.state.values() for k, t in st.items() if k != "step")
    for held, planned in ((local, C.param_bytes(counts, mesh, prec)),
                          (state, C.optimizer_gpu_bytes(counts, mesh, prec, False, 1))):
        assert abs(held / planned - 1) < 0.05, (held, planned)  # uneven dim-0 shards of a tiny model


def _local_bytes(t: torch.Tensor) -> int:
    t = t.to_local() if hasattr(t, "to_local") else t
    return t.numel() * t.element_size()


def start_dtype(name: str, model) -> torch.dtype:
    from megaseq.models.build import fp32_param_suffixes

    return torch.float32 if name.endswith(fp32_param_suffixes(model.spec.family)) else BF16


@pytest.mark.parametrize("which", ["master", "offload"])
def test_fsdp_shards_of_bf16_weights_step_as_the_fp32_master_cast(which, tmp_path):
    """On 2 ranks each shard's step is the fp32 update cast; their sharded checkpoint (DCP: weights, fp32
    masters, moments as DTensors) then loads in one process (resharded) with those masters bit for bit."""
    from megaseq.models.build import build_model
    from megaseq.train import checkpoint as ckpt

    spawn_local(_bf16_rank, 2, args=(which, str(tmp_path)))
    model = build_model(glm5_tiny4(), dtype=BF16, seed=1)  # other weights: all overwritten
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = (MasterAdamW(trainable, **HYPER, weight_decay=0.1, foreach=False) if which == "master"
           else OffloadStreamAdamW(trainable, **HYPER, weight_decay=0.1, overlap=False))
    ckpt.load_checkpoint(tmp_path / ckpt.CKPT_DIR / "step_000001", model, opt, None)
    ref = torch.load(tmp_path / "ref.pt")
    names = {p: n for n, p in model.named_parameters()}
    for p in trainable:
        n = names[p]
        if n in ref:
            assert torch.equal(opt.state[p]["master"].reshape(ref[n].shape), ref[n]), n
            assert torch.equal(p.detach(), ref[n].to(p.dtype)), n


# ---- the trainer with bf16 weights (one process) -------------------------------------------------------
def test_trainer_with_bf16_weights_resumes_exactly(tmp_path):
    import json

    import numpy as np

    from megaseq.config import build_config
    from megaseq.train.trainer import run_training

    rng = np.random.default_rng(2)
    (tmp_path / "g.fa").write_text(">r\n" + "".join(rng.choice(list("ACGT"), 3000)) + "\n")

    def cfg(run: str, steps: int, **train):
        return build_config(overrides={
            "model.dtype": "bf16", "model.weights": "bf16", "data.train": [str(tmp_path / "g.fa")],
            "data.seq_len": 64, "data.heldout_tail": 0, "train.steps": steps, "train.run_dir": str(tmp_path / run),
            "train.eval_after": False, "train.export_hf": False, "train.device": "cpu", "optim.lr": 1e-2,
            "optim.warmup_steps": 5, "log.progress": False, "log.tensorboard": False, **train})

    full = run_training(cfg("full", 6))
    run_training(cfg("part", 3))
    resumed = run_training(cfg("part", 6, **{"train.resume": True}))
    assert full.losses[-1] < full.losses[0]
    np.testing.assert_array_equal(resumed.losses, full.losses[3:])  # bf16 weights + fp32 master: exact resume
    logged = [json.loads(line)["loss"] for line in (tmp_path / "part" / "metrics.jsonl").read_text().splitlines()]
    np.testing.assert_array_equal(logged, full.losses)
    import torch.distributed.checkpoint as dcp

    saved = dcp.FileSystemReader(str(full.last_checkpoint)).read_metadata().state_dict_metadata
    dtypes = {k: v.properties.dtype for k, v in saved.items() if hasattr(v, "properties")}
    assert dtypes["model.layers.0.self_attn.q_proj.weight"] == BF16  # the weights the GPU holds
    assert dtypes["optim.state.layers.0.self_attn.q_proj.weight.master"] == torch.float32  # the master
    assert dtypes["model.layers.1.mlp.gate.weight"] == torch.float32  # the router stays fp32


# The Triton update against torch's fused AdamW: torch's fused arithmetic has changed across releases (fp64
# hyperparameters and plain lerps; then fma lerps; then fp32 hyperparameters and bias corrections from fp32 powf),
# and nvcc may contract ``p - lr * wd * p`` into an fma, so the Triton kernel is held to a bound, not to bits. Per
# step the two may round differently in: the decay product (1 ulp of p), each moment (1 ulp), the bias
# corrections (powf: 2 ulps), step size and denominator (1 ulp each), the subtraction (1/2 ulp of p). A moment's
# difference carries to later steps scaled by beta < 1, so over 3 steps the master differs by at most
# 3 * (1.5 ulp(p) + 6 ulp(update)) with |update| < lr * 3 << |p|: below 5 ulps of the tensor's largest entry
# (6e-7), and the moments by at most 3 ulps of theirs. 2e-6 of each tensor's largest value (16 fp32 ulps) is the
# bound, as in tests/ops/adamw/test_triton_adamw.py; dropping the weight decay (3e-4 of |p|) or the clip's scale
# breaks it.
TRITON_RTOL = 2e-6


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("kernel", ["torch", "triton"])
def test_fused_step_on_the_gpu_equals_torchs_fused_adamw_on_fp32_copies(kernel, monkeypatch):
    """What ``make_optimizer`` builds for bf16 weights on CUDA (fused, step counters on the GPU): three clipped
    steps against torch's fused AdamW on fp32 copies clipped by the same coefficient, cast. The torch way
    (``MEGASEQ_ADAMW=torch``) runs torch's fused kernel on the masters: bit for bit. The Triton way (the
    default) is within ``TRITON_RTOL`` (see above) and its weights are its own master rounded, exactly."""
    from megaseq.config import MemorySettings
    from megaseq.memory.apply import make_optimizer

    monkeypatch.setenv("MEGASEQ_ADAMW", kernel)
    params = [torch.nn.Parameter(p.detach().cuda()) for p in _params()]
    opt = make_optimizer(params, MemorySettings(), HYPER["lr"], HYPER["betas"], HYPER["eps"], 0.1)
    assert isinstance(opt, MasterAdamW) and opt.fused and opt.state[params[0]]["step"].is_cuda
    assert opt.kernel == kernel
    masters = [torch.nn.Parameter(p.detach().float().clone()) for p in params]
    ref = torch.optim.AdamW(masters, **HYPER, weight_decay=0.1, fused=True)
    for k in range(3):
        for p, m, g in zip(params, masters, _grads(k)):
            p.grad, m.grad = g.cuda(), g.float().cuda()
        assert opt.clip_grad_norm_(0.01) > 0.01  # the norm is torch's to rounding (the CPU test above)
        torch._foreach_mul_([m.grad for m in masters], opt.clip_coef)
        opt.step()
        ref.step()
        opt.zero_grad()
    for p, m in zip(params, masters):
        ours, theirs = opt.state[p], ref.state[m]
        if kernel == "torch":
            assert torch.equal(ours["master"], m.detach())
            assert torch.equal(p.detach(), m.detach().to(BF16))
            continue
        assert torch.equal(p.detach(), ours["master"].to(BF16))
        for a, b in ((ours["master"], m.detach()), (ours["exp_avg"], theirs["exp_avg"]),
                     (ours["exp_avg_sq"], theirs["exp_avg_sq"])):
            err = float((a - b).abs().max())
            assert err <= TRITON_RTOL * float(b.abs().max()), (tuple(b.shape), err, float(b.abs().max()))


@pytest.mark.parametrize("kind", ["master-accumulate", "offload-in-backward", "offload-accumulate"])
@pytest.mark.parametrize("broken", [False, True], ids=["weak-hooks", "broken-strong-hooks"])
def test_an_optimizer_with_gradient_hooks_is_freed_with_its_last_reference(kind, broken, monkeypatch):
    """The optimizers' gradient hooks hold them weakly: a parameter's hooks are out of the collector's sight, so a
    hook holding its optimizer kept it, its state and the parameters alive for the whole process (a
    ``megaseq bench`` row's fp32 masters and moments, 25 GiB at 1M, were still allocated when the next row
    started). With the hooks holding them strongly (the broken variant) the optimizer survives ``gc.collect``."""
    import gc
    import weakref

    from megaseq.memory import master_adam, offload_adam

    if broken:
        monkeypatch.setattr(master_adam, "weak_hook", lambda method: method)
        monkeypatch.setattr(offload_adam, "weak_hook", lambda method: method)
    params = _params()
    if kind == "master-accumulate":
        opt = MasterAdamW(params, **HYPER, foreach=False, accumulate=True)
    else:
        opt = OffloadStreamAdamW(params, **HYPER, overlap=False, grads_in_backward=kind == "offload-in-backward",
                                 accumulate=kind == "offload-accumulate")
    assert opt.hooks
    sum((p.float() * g.float()).sum() for p, g in zip(params, _grads(0))).backward()  # the hooks run
    assert all(p.grad is None for p in params)
    ref = weakref.ref(opt)
    del opt
    gc.collect()
    assert (ref() is not None) == broken
    sum((p.float() * g.float()).sum() for p, g in zip(params, _grads(1))).backward()  # a gone optimizer: no-op
    assert all(p.grad is not None for p in params) != broken
