"""Expert parallelism with FSDP2 (``parallel.ep`` > 1 with ``parallel.fsdp``) over gloo processes, float64: the
routed experts are split over the ep ranks (DTensors ``Shard(0)`` over the ep axis, each slice whole on the
dp x cp ranks holding it, its gradient summed over them after the backward), every other parameter
FSDP-sharded over all dp x ep (x cp) ranks. Two clipped AdamW steps through the trainer's ``train_step`` equal
the one-process steps on the whole batch: the loss, every gradient (gathered from its shards) and every
parameter after the second step. LLEP in chunks of 8 tokens, so expert weights and their gradients travel
between the ep ranks. Meshes: ep 2 x dp 2 (FSDP over 4 ranks), ep 2 x dp 4 (8 ranks), ep 2 x dp 2 x cp 2 fully
sharded (8 ranks); qwen3-moe-tiny and deepseek-v3-tiny (MLA, a shared expert, dense first layer).

Broken variants that must fail: the experts' gradients summed over the ep group (other experts' slices)
instead of the ranks holding the same experts; the clipping norm counting each expert slice once per rank
holding it (summed over the replicated dp axis too).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed.tensor  # noqa: F401  assert_close imports it lazily: once here, not in each fork
from test_fsdp_train_step import LATER_TOL, STEPS, TOL, run_steps

from conftest import torch_threads
from megaseq.config import MemorySettings, build_config
from megaseq.models.build import build_model
from megaseq.models.presets import get_preset
from megaseq.models.registry import parallelize
from megaseq.parallel.env import DistributedEnv, ParallelEnv
from megaseq.parallel.fsdp import is_sharded
from megaseq.parallel.launch import spawn_local

S = 32
LLEP = {"parallel.ep_chunk_tokens": 8, "parallel.ep_max_chunks": 4, "parallel.llep_min_tokens": 2}


def _cfg(dp: int = 1, ep: int = 1, cp: int = 1, fsdp: str = "off"):
    over = {"parallel.dp": dp, "parallel.ep": ep, "parallel.cp": cp, "parallel.backend": "gloo",
            "parallel.fsdp": fsdp, "parallel.loss_parallel": "ring_dtp", "data.seq_len": S, "train.device": "cpu",
            "optim.grad_clip": 0.5, **(LLEP if ep > 1 else {})}
    return build_config(overrides=over)


def reference(preset: str):
    with torch_threads(1):
        model = build_model(get_preset(preset), dtype=torch.float64, seed=0)
        return run_steps(model, ParallelEnv(), MemorySettings(), _cfg())


def _break(env: DistributedEnv, broken: str) -> None:
    if broken == "wrong_group":  # the experts' gradients summed with the other ep ranks' (other experts)
        env.mesh.expert_group = env.mesh.ep_group
    elif broken == "norm_twice":  # each expert slice's squares summed over every rank holding it too
        import megaseq.memory.master_adam as master_adam

        master_adam._shard_groups = lambda t: [t.device_mesh.get_group(d) for d in range(t.device_mesh.ndim)
                                               if t.device_mesh.size(d) > 1]


def _rank(rank: int, dp: int, ep: int, cp: int, fsdp: str, preset: str, ref, broken: str = "") -> None:
    cfg = _cfg(dp, ep, cp, fsdp)
    env = DistributedEnv(cfg, spec=get_preset(preset))
    model = build_model(get_preset(preset), dtype=torch.float64, seed=0)
    applied = parallelize(model, MemorySettings(), env)
    assert applied.sharded is not None and len(applied.sharded.blocks) == 1 + len(model.layers)
    experts = {n for n, p in model.named_parameters() if ".experts." in n and "shared" not in n}
    assert experts and all(env.mesh.device_mesh == p.device_mesh and p.to_local().shape[0] * ep == p.shape[0]
                           for n, p in model.named_parameters() if n in experts)  # split over ep, not FSDP
    assert all(is_sharded(p) and p.device_mesh.size() == dp * ep * (cp if fsdp == "dp_cp" else 1)
               for n, p in model.named_parameters() if n not in experts)
    _break(env, broken)
    losses, grads, params = run_steps(model, env, MemorySettings(), cfg)
    ref_losses, ref_grads, ref_params = ref
    for k in range(STEPS):
        assert abs(losses[k] - ref_losses[k]) < 1e-12 * abs(ref_losses[k]), (k, losses[k], ref_losses[k])
        assert grads[k].keys() == ref_grads[k].keys()
        for n, g in grads[k].items():
            torch.testing.assert_close(g, ref_grads[k][n], **(LATER_TOL if k else TOL),
                                       msg=lambda m, n=n, k=k: f"step {k} grad {n}: {m}")
    for n, p in params.items():
        torch.testing.assert_close(p, ref_params[n], **LATER_TOL, msg=lambda m, n=n: f"{n}: {m}")
    if rank == 0:  # the figures (pytest -s shows them)
        print(f"\n{preset} ep {ep} dp {dp} cp {cp} fsdp {fsdp}: max rel err step-0 grads "
              f"{max_rel_err(grads[0], ref_grads[0]):.1e}, parameters after step {STEPS} "
              f"{max_rel_err(params, ref_params):.1e}")
    env.shutdown()


def max_rel_err(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    """The largest ``|got - want| / max|want|`` over the tensors (each relative to its own scale)."""
    return max(float((got[n] - w).abs().max() / w.abs().max().clamp_min(1e-300)) for n, w in want.items())


@pytest.fixture(scope="module")
def qwen_ref():
    return reference("qwen3-moe-tiny")


pytestmark = pytest.mark.usefixtures("one_thread")


def test_ep2_fsdp2_matches_one_process(qwen_ref):
    spawn_local(_rank, 4, args=(2, 2, 1, "dp", "qwen3-moe-tiny", qwen_ref))


def test_deepseek_v3_ep2_fsdp2_matches_one_process():
    spawn_local(_rank, 4, args=(2, 2, 1, "dp", "deepseek-v3-tiny", reference("deepseek-v3-tiny")))


@pytest.mark.slow  # 8 gloo ranks (`make test-all`); ep2 x dp2 and ep2 x dp2 x cp2 run in `make test`
def test_ep2_fsdp4_matches_one_process(qwen_ref):
    spawn_local(_rank, 8, args=(4, 2, 1, "dp", "qwen3-moe-tiny", qwen_ref))


def test_ep2_fsdp_over_dp_and_cp_matches_one_process(qwen_ref):
    spawn_local(_rank, 8, args=(2, 2, 2, "dp_cp", "qwen3-moe-tiny", qwen_ref))


def test_expert_gradients_reduced_over_the_ep_group_fail(qwen_ref):
    with pytest.raises(Exception, match=r"step 0 grad .*experts\.(gate_up|down)_proj"):
        spawn_local(_rank, 4, args=(2, 2, 1, "dp", "qwen3-moe-tiny", qwen_ref, "wrong_group"))


def test_clipping_norm_counting_each_expert_slice_per_replica_fails(qwen_ref):
    """Step 0's gradients are right (recorded before the clip); the clipped update is not: step 1's loss differs."""
    with pytest.raises(Exception, match=r"AssertionError: \(1, "):
        spawn_local(_rank, 4, args=(2, 2, 1, "dp", "qwen3-moe-tiny", qwen_ref, "norm_twice"))


# ---- through the trainer: the DCP checkpoint, resume and the HF export ----------------------------------------
def test_trainer_run_checkpoints_resumes_and_exports_as_one_process(tmp_path):
    """``megaseq train`` on ep 2 x dp 2 with FSDP: the one-process run's losses and gradient norms (two clipped
    steps), every parameter of both checkpoints (the experts gathered from their ep shards, the rest from
    FSDP's), each expert slice stored once; the step-1 checkpoint resumed on the same mesh continues the run,
    and the HF export equals the one-process export."""
    from test_ep_train import (
        _assert_same,
        _fasta,
        _one_process,
        _overrides,
        _records,
        _train_rank,
        _weights,
        assert_every_expert_saved_once,
    )

    from conftest import run_as_of_step
    from megaseq.train import checkpoint as ckpt

    _fasta(tmp_path / "g.fa")
    extra = {"parallel.dp": 2, "parallel.fsdp": "dp", "train.export_hf": True}
    spawn_local(_train_rank, 4, args=(_overrides(tmp_path, "epf", 2, 1, **extra),))
    _one_process(_overrides(tmp_path, "one", 1, 4, **{"train.export_hf": True}))
    got, want = _records(tmp_path / "epf"), _records(tmp_path / "one")
    assert len(got) == len(want) == STEPS
    for g, w in zip(got, want):
        assert w["grad_norm"] > 0.1  # clipped at 0.05
        assert abs(g["loss"] - w["loss"]) <= 1e-10 * abs(w["loss"]), (g["loss"], w["loss"])
        assert abs(g["grad_norm"] - w["grad_norm"]) <= 1e-10 * w["grad_norm"], (g["grad_norm"], w["grad_norm"])
    for step in (1, 2):
        d = f"{ckpt.CKPT_DIR}/step_{step:06d}"
        _assert_same(_weights(tmp_path / "epf" / d), _weights(tmp_path / "one" / d))
    assert_every_expert_saved_once(tmp_path / "epf" / ckpt.CKPT_DIR / "step_000001")
    run = run_as_of_step(tmp_path / "epf", tmp_path / "resumed", 1)
    spawn_local(_train_rank, 4, args=(_overrides(tmp_path, "resumed", 2, 1, **extra, **{"train.resume": True}),))
    assert [r["loss"] for r in _records(run)] == pytest.approx([r["loss"] for r in got], rel=1e-10, abs=0)
    _assert_same(_weights(run), _weights(tmp_path / "epf"))
    from safetensors.torch import load_file

    def tensors(d):
        return {k: v for f in sorted(d.glob("*.safetensors")) for k, v in load_file(f).items()}

    _assert_same(tensors(tmp_path / "epf" / "hf"), tensors(tmp_path / "one" / "hf"))


# ---- the planner's terms against what each rank holds ----------------------------------------------------------
def _planner_rank(rank: int, preset: str, lora: bool, broken: bool) -> None:
    """ep 2 x dp 2 with FSDP (fp64 here, the planner's fp64 precision): per layer the elements FSDP gathers (the
    experts are not among them), this rank's parameter bytes, its routed-expert parameters (whole: ``E / ep``
    experts), its gradient and AdamW bytes after a step equal the planner's ``plan.components`` terms. With a
    frozen base (LoRA on the attention and the experts) the same for what trains (whole) and the frozen shards."""
    from lora_helpers import settings
    from megaseq.plan import components as C
    from megaseq.plan.params import trained_counts

    spec = get_preset(preset)
    env = DistributedEnv(_cfg(2, 2, 1, "dp"), spec=spec)
    adapters = settings(targets="q_proj,v_proj,experts", rank=4, trainable="*norm.weight") if lora else None
    model = build_model(spec, dtype=torch.float64, seed=0)
    parallelize(model, MemorySettings(), env, adapters)
    mesh, prec = C.Mesh(dp=2, ep=2, fsdp="dp"), C.precision_for("fp64")
    counts = C.count_params(spec)
    counts.trained = trained_counts(spec, adapters)
    counts = C.gpu_counts(counts, mesh)
    if broken:  # the experts counted as FSDP-sharded with the rest (the planner's picture before ep x FSDP)
        C.expert_params = lambda *a, **k: 0
    for i, layer in enumerate(model.layers):
        gathered = sum(p.numel() for p in layer.parameters() if is_sharded(p) and p.device_mesh.ndim == 1)
        assert gathered == C.gathered_params(counts, i, mesh, prec), i
    local = sum(_local_numel(p) for p in model.parameters()) * 8
    assert abs(local / C.param_bytes(counts, mesh, prec) - 1) < 0.01, (local, C.param_bytes(counts, mesh, prec))
    experts = [p for n, p in model.named_parameters() if ".experts." in n and "shared" not in n]
    assert sum(p.to_local().numel() for p in experts) == C.expert_params(counts, mesh)
    trains = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trains, foreach=False)
    for p in trains:
        p.grad = torch.zeros_like(p)
    opt.step()
    state = sum(_local_numel(t) * 8 for st in opt.state.values() for k, t in st.items() if k != "step")
    want = C.optimizer_gpu_bytes(counts, mesh, prec, False, 1)
    assert abs(state / want - 1) < 0.01, (state, want)
    env.shutdown()


def _local_numel(t: torch.Tensor) -> int:
    return (t.to_local() if hasattr(t, "to_local") else t).numel()


@pytest.mark.parametrize("lora", [False, True])
def test_planner_terms_are_what_each_rank_holds(lora):
    spawn_local(_planner_rank, 4, args=("qwen3-moe-tiny", lora, False))


def test_planner_with_the_experts_sharded_by_fsdp_fails():
    with pytest.raises(Exception, match=r"AssertionError: \(\d+, \d+\)"):  # the parameter bytes differ
        spawn_local(_planner_rank, 4, args=("qwen3-moe-tiny", False, True))
