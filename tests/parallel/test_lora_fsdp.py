"""LoRA (and ``train.trainable``) under FSDP2 (``parallel.fsdp``) over gloo processes, float64: qwen3-moe-tiny
with adapters on the attention and the routed experts and the post-attention norms trained. Two clipped AdamW
steps through the trainer's ``train_step`` equal the one-process steps on the whole batch: the loss, every
adapter and trained gradient, every parameter after the second step (1e-10). The frozen base is sharded
(DTensors) with no gradient and no optimizer state; what trains is whole on every rank. Meshes: dp (2 ranks),
dp x cp fully sharded (2), HSDP dp 2 x cp 2 and dp_cp over 4 ranks with tiling, recompute and the chunked
loss; glm5-flash-tiny (KDA, DSA with the merged kv_b_proj adapter, mHC) with sequence segments (slow).

Through ``megaseq train`` (2 ranks, FSDP over dp): the one-process run's losses, PEFT adapter, merged HF export
and checkpoint contents; its checkpoint resumes on the same curve; from ``model.init_from`` the adapters drawn
after the meta build are the one-process ones. The planner's FSDP terms with a frozen base (what each unit
gathers, parameter / gradient / AdamW bytes) equal what each rank holds.

Broken variants that must fail: the adapters' gradients not all-reduced (``reduce_gradients`` skipped); the
planner's terms without the frozen base (everything sharded, gathered in fp32); (by hand) the adapters not
drawn after the meta build: the run diverges.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed.tensor  # noqa: F401  assert_close imports it lazily: once here, not in each fork
from test_fsdp_train_step import _cfg, run_steps

from conftest import run_as_of_step, torch_threads
from lora_helpers import randomize_adapters, settings
from lora_parallel_checks import (
    assert_exports_match,
    assert_steps_match,
    lora_run_overrides,
    run_losses,
    safetensors_in,
    train_rank,
)
from megaseq.config import MemorySettings
from megaseq.models.build import build_model
from megaseq.models.common.lora import is_adapter
from megaseq.models.presets import get_preset
from megaseq.models.registry import parallelize
from megaseq.parallel.env import DistributedEnv, ParallelEnv
from megaseq.parallel.fsdp import is_sharded
from megaseq.parallel.launch import spawn_local

PRESET = "qwen3-moe-tiny"
TARGETS = {"qwen3-moe-tiny": "attention,experts", "glm5-flash-tiny": "q_proj,v_proj,o_proj,kv_b_proj,experts"}
TRAIN = "*.post_attention_layernorm.weight"
MEMORY = {"plain": MemorySettings(),
          "schemes": MemorySettings(tiled_mlp=True, mlp_tile_tokens=7, recompute=True, chunked_loss=True,
                                    loss_chunk_tokens=5),
          "segments": MemorySettings(model_segment_tokens=12, chunked_loss=True, loss_chunk_tokens=5)}


def _model(env=None, preset: str = PRESET, memory: str = "plain"):
    model = build_model(get_preset(preset), dtype=torch.float64, seed=0)
    applied = parallelize(model, MEMORY[memory], env, settings(targets=TARGETS[preset], trainable=TRAIN))
    randomize_adapters(model)  # B is zero at initialisation: the test would be trivial
    return model, applied


def reference(preset: str = PRESET):
    model, _ = _model(preset=preset)
    return run_steps(model, ParallelEnv(), MemorySettings(), _cfg())


@pytest.fixture(scope="module")
def ref():
    with torch_threads(1):
        yield reference()


def _rank(rank: int, dp: int, cp: int, fsdp: str, broken: str, ref, preset: str = PRESET,
          memory: str = "plain") -> None:
    cfg = _cfg(dp, cp, fsdp)
    env = DistributedEnv(cfg, spec=get_preset(preset))
    model, applied = _model(env, preset, memory)
    sharded = applied.sharded
    assert sharded is not None and len(sharded.blocks) == 1 + len(model.layers)  # + the embedding
    params = dict(model.named_parameters())
    trains = {n for n, p in params.items() if p.requires_grad}
    assert trains and all(is_adapter(n) or n.endswith("post_attention_layernorm.weight") for n in trains)
    assert not any(is_sharded(params[n]) for n in trains)  # what trains is whole on every rank
    assert all(is_sharded(p) for n, p in params.items() if n not in trains)  # the frozen base is sharded
    if broken == "unreduced":
        env.reduce_gradients = lambda model: None
    assert_steps_match(model, env, MEMORY[memory], cfg, ref, trains)
    env.shutdown()


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("dp, cp, fsdp, memory", [
    (2, 1, "dp", "plain"),  # 2 ranks
    (1, 2, "dp_cp", "plain"),  # 2 ranks, fully sharded over the cp pair
    (2, 2, "dp", "plain"),  # 4 ranks: HSDP (sharded over dp, replicated over cp)
    (2, 2, "dp_cp", "schemes"),  # 4 ranks, fully sharded, tiled MLP + recompute + chunked loss
])
def test_lora_fsdp_steps_match_one_process(dp, cp, fsdp, memory, ref):
    spawn_local(_rank, dp * cp, args=(dp, cp, fsdp, "", ref, PRESET, memory))


@pytest.mark.slow  # ~20 s on a 2-core machine
def test_glm5_lora_fsdp_with_sequence_segments_matches_one_process():
    """The other family (KDA + DSA/MLA with the merged kv_b_proj adapter + mHC + MoE) with sequence segments,
    FSDP over dp x cp."""
    with torch_threads(1):
        ref = reference("glm5-flash-tiny")
    spawn_local(_rank, 2, args=(1, 2, "dp_cp", "", ref, "glm5-flash-tiny", "segments"))


def test_adapter_gradients_not_reduced_fail(ref):
    with pytest.raises(Exception, match=r"step 0 grad .*(lora|layernorm)"):
        spawn_local(_rank, 2, args=(2, 1, "dp", "unreduced", ref))


# ---- through the trainer: checkpoints, resume, the PEFT adapter and the merged export ----------------------
def test_fsdp_lora_run_checkpoints_exports_and_resumes_as_one_process(tmp_path) -> None:
    """A 2-rank FSDP LoRA run (``megaseq train``) has the one-process run's losses, writes checkpoints of what
    trains only (every rank its part, the base's fingerprint the one process's), exports the same PEFT adapter
    and merged HF checkpoint, and its step-2 checkpoint resumes on 2 FSDP ranks on the same loss curve."""

    import numpy as np
    from torch.distributed.checkpoint import FileSystemReader

    from megaseq.train import checkpoint as ckpt

    rng = np.random.default_rng(4)
    (tmp_path / "g.fa").write_text(">rec\n" + "".join(rng.choice(list("ACGT"), 4000)) + "\n")
    train_rank(0, lora_run_overrides(tmp_path, "one", 1, 2))  # the same 2 sequences per step
    spawn_local(train_rank, 2, args=(lora_run_overrides(tmp_path, "two", 2, 1, "dp"),))
    one, two = tmp_path / "one", tmp_path / "two"
    np.testing.assert_allclose(run_losses(two), run_losses(one), rtol=1e-10, atol=0)
    assert_exports_match(two, one)
    step2 = two / ckpt.CKPT_DIR / "step_000002"
    meta, meta_one = ckpt.read_meta(step2), ckpt.read_meta(one / ckpt.CKPT_DIR / "step_000002")
    assert meta["trainable_only"] and meta["trainable"] == meta_one["trainable"]
    np.testing.assert_allclose(meta["base_fingerprint"], meta_one["base_fingerprint"], rtol=1e-12)
    keys = {k for k in FileSystemReader(str(step2)).read_metadata().state_dict_metadata if k.startswith("model.")}
    assert keys and all(".lora_" in k or k.endswith("norm.weight") for k in keys), sorted(keys)[:5]
    run = run_as_of_step(two, tmp_path / "resumed", 2, drop=())  # the step-2 checkpoint resumed on 2 FSDP ranks
    resume = lora_run_overrides(tmp_path, "resumed", 2, 1, "dp", **{"train.resume": True})
    spawn_local(train_rank, 2, args=(resume,))
    np.testing.assert_allclose(run_losses(run), run_losses(two), rtol=1e-10, atol=0)
    # from an HF checkpoint (the merged export): under FSDP the model is built on the meta device and the
    # adapters' factors are drawn once it is materialised, the values one process draws (A matters from step 2)
    init = {"model.init_from": str(one / "hf"), "train.steps": 2, "train.save_every": 0, "lora.export_merged": False}
    train_rank(0, lora_run_overrides(tmp_path, "init_one", 1, 2, **init))
    spawn_local(train_rank, 2, args=(lora_run_overrides(tmp_path, "init_two", 2, 1, "dp", **init),))
    np.testing.assert_allclose(run_losses(tmp_path / "init_two"), run_losses(tmp_path / "init_one"), rtol=1e-10,
                               atol=0)
    want, got = safetensors_in(tmp_path / "init_one" / "adapter"), safetensors_in(tmp_path / "init_two" / "adapter")
    for k, t in want.items():
        torch.testing.assert_close(got[k], t, rtol=1e-10, atol=1e-13, msg=lambda m, k=k: f"init_from {k}: {m}")


# ---- the planner's state terms against what each rank holds -----------------------------------------------
PLAN_TARGETS = {"glm5-flash-tiny": "q_proj,v_proj,o_proj,kv_b_proj,experts,shared_experts.up_proj",
                "qwen3-moe-tiny": "q_proj,v_proj,experts"}


def _planner_rank(rank: int, name: str, broken: bool) -> None:
    """A bf16-stored frozen base (the GPU's storage; fp32 adapters) sharded over dp 2: per layer the elements
    FSDP gathers, the embedding's and the root's, this rank's parameter bytes, the gradient and AdamW bytes
    (what trains is whole) equal the planner's ``plan.components`` / ``plan.phases`` terms."""
    from megaseq.plan import components as C
    from megaseq.plan.params import trained_counts
    from megaseq.plan.phases import fsdp_per_layer

    spec = get_preset(name)
    env = DistributedEnv(_cfg(2, 1, "dp"), spec=spec)
    adapters = settings(targets=PLAN_TARGETS[name], rank=4, trainable="*norm.weight", frozen_dtype="bf16")
    model = build_model(spec, dtype=torch.float32, seed=0)
    parallelize(model, MemorySettings(), env, adapters)
    counts, mesh, prec = C.count_params(spec), C.Mesh(dp=2, fsdp="dp"), C.precision_for("bf16")
    counts.trained = trained_counts(spec, adapters)
    if broken:  # the planner's FSDP terms without the frozen base's (everything sharded, gathered in fp32)
        counts.trained = None
    run = type("R", (), {"counts": counts, "mesh": mesh, "prec": prec, "spec": spec})()
    layers, embed, head = fsdp_per_layer(run)

    def gathered(params) -> int:
        return sum(p.numel() for p in params if is_sharded(p))

    for i, layer in enumerate(model.layers):
        assert gathered(layer.parameters()) == layers[i] == C.gathered_params(counts, i, mesh, prec), i
        assert all(p.dtype == torch.bfloat16 for p in layer.parameters() if is_sharded(p)), i
    assert gathered(model.embed_tokens.parameters()) == embed
    assert gathered(p for n, p in model.named_parameters() if not n.startswith(("layers.", "embed_tokens."))) == head
    local = sum(_local_bytes(p) for p in model.parameters())
    assert abs(local / C.param_bytes(counts, mesh, prec) - 1) < 0.05, (local, C.param_bytes(counts, mesh, prec))
    trains = [p for p in model.parameters() if p.requires_grad]
    assert not any(is_sharded(p) for p in trains)
    opt = torch.optim.AdamW(trains, foreach=False)
    for p in trains:
        p.grad = torch.zeros_like(p)
    opt.step()
    state = sum(_local_bytes(t) for st in opt.state.values() for k, t in st.items() if k != "step")
    assert state == C.optimizer_gpu_bytes(counts, mesh, prec, False, 1)
    assert sum(_local_bytes(p.grad) for p in trains) == counts.trainable * prec.grad
    env.shutdown()


def _local_bytes(t: torch.Tensor) -> int:
    t = t.to_local() if hasattr(t, "to_local") else t
    return t.numel() * t.element_size()


@pytest.mark.parametrize("name", sorted(PLAN_TARGETS))
def test_planner_state_terms_are_what_each_rank_holds(name: str) -> None:
    spawn_local(_planner_rank, 2, args=(name, False))


def test_planner_without_the_frozen_base_terms_fails() -> None:
    with pytest.raises(Exception, match="AssertionError"):
        spawn_local(_planner_rank, 2, args=("qwen3-moe-tiny", True))
