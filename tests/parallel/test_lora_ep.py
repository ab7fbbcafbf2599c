"""LoRA (and ``train.trainable``) under expert parallelism (``parallel.ep`` > 1), with and without FSDP, over
gloo processes, float64: qwen3-moe-tiny with adapters on the attention and the routed experts and the
post-attention norms trained. The experts' factors are split over the ep ranks with their experts (DTensors
``Shard(0)`` over the ep axis, summed over the ranks holding the same experts after the backward); LLEP in
chunks of 8 tokens sends spilled experts' weights *and factors* to their helper and the factors' gradients
back. Two clipped AdamW steps through the trainer's ``train_step`` equal the one-process steps on the whole
batch: the loss, every trained gradient (the frozen base has none) and every parameter after the second step.
Meshes: ep 2 (2 ranks), ep 2 x dp 2 with the frozen base FSDP-sharded over the 4 ranks; a frozen base with
adapters on the attention only (no expert adapters) on ep 2. Through ``megaseq train`` on ep 2: the
one-process run's losses and PEFT adapter (the expert factors gathered), and the merged HF export.

Broken variants that must fail: the spilled experts' factor gradients kept by the helper (not sent back to the
native rank), and the expert factors' gradients not summed over the dp ranks holding the same experts.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed.tensor  # noqa: F401  assert_close imports it lazily: once here, not in each fork
from test_ep_fsdp import _cfg, max_rel_err
from test_fsdp_train_step import STEPS, run_steps
from test_lora_fsdp import TRAIN

from conftest import torch_threads
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
TARGETS = {"experts": "attention,experts", "attention": "attention"}


def _model(env, targets: str):
    model = build_model(get_preset(PRESET), dtype=torch.float64, seed=0)
    applied = parallelize(model, MemorySettings(), env, settings(targets=TARGETS[targets], trainable=TRAIN))
    with torch.no_grad():  # random factors (B is zero at initialisation: the test would be trivial), drawn whole
        whole = build_model(get_preset(PRESET), dtype=torch.float64, seed=0)
        parallelize(whole, MemorySettings(), None, settings(targets=TARGETS[targets], trainable=TRAIN))
        randomize_adapters(whole)
        drawn = dict(whole.named_parameters())
        from megaseq.models.common.lora import copy_whole

        for n, p in model.named_parameters():
            if is_adapter(n):
                copy_whole(p, drawn[n])
    return model, applied


def reference(targets: str):
    with torch_threads(1):
        model, _ = _model(None, targets)
        return run_steps(model, ParallelEnv(), MemorySettings(), _cfg())


def _break(env, broken: str) -> None:
    if broken == "lost_factor_grads":  # the helper keeps the spilled experts' factor gradients
        from megaseq.parallel.expert import EPDispatch

        EPDispatch.return_weight_grads = lambda self, route, g_foreign, *g_held: None
    elif broken == "unreduced_experts":  # the factors' gradients not summed over the dp ranks holding them
        env.expert_params.clear()


def _rank(rank: int, dp: int, ep: int, fsdp: str, targets: str, ref, broken: str = "") -> None:
    cfg = _cfg(dp, ep, 1, fsdp)
    env = DistributedEnv(cfg, spec=get_preset(PRESET))
    model, applied = _model(env, targets)
    params = dict(model.named_parameters())
    trains = {n for n, p in params.items() if p.requires_grad}
    factors = {n for n in trains if ".experts.lora_" in n}
    assert bool(factors) == (targets == "experts")
    assert all(p.to_local().shape[0] * ep == p.shape[0] for n, p in params.items() if n in factors)
    assert not any(is_sharded(params[n]) for n in trains - factors)  # the other trained tensors are whole
    if fsdp != "off":
        assert applied.sharded is not None
        assert all(is_sharded(p) for n, p in params.items() if n not in trains)  # the frozen base is sharded
    _break(env, broken)
    _, grads, final = assert_steps_match(model, env, MemorySettings(), cfg, ref, trains)
    moved = sum(m.mlp.expert_dispatch.last.get("foreign_experts", 0) for m in model.layers)
    if rank == 0:
        _, ref_grads, ref_params = ref
        print(f"\nLoRA ({targets}) ep {ep} dp {dp} fsdp {fsdp}: spilled experts on rank 0 at the last layer call "
              f"{moved}; max rel err step-0 grads {max_rel_err(grads[0], ref_grads[0]):.1e}, parameters after step "
              f"{STEPS} {max_rel_err(final, ref_params):.1e}")
    env.shutdown()


@pytest.fixture(scope="module")
def ref():
    return reference("experts")


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("dp, fsdp", [(1, "off"), (2, "dp")])
def test_lora_on_experts_under_ep_matches_one_process(dp, fsdp, ref):
    spawn_local(_rank, dp * 2, args=(dp, 2, fsdp, "experts", ref))


def test_frozen_base_under_ep_without_expert_adapters_matches_one_process():
    spawn_local(_rank, 2, args=(1, 2, "off", "attention", reference("attention")))


def test_spilled_factor_gradients_kept_by_the_helper_fail(ref):
    """(The base is frozen: what the helper sends back is the factors' gradients only.)"""
    with pytest.raises(Exception, match=r"step \d grad .*experts\.lora_"):
        spawn_local(_rank, 2, args=(1, 2, "off", "experts", ref, "lost_factor_grads"))


def test_expert_factor_gradients_not_reduced_over_their_replicas_fail(ref):
    with pytest.raises(Exception, match=r"step 0 grad .*experts\.lora_"):
        spawn_local(_rank, 4, args=(2, 2, "dp", "experts", ref, "unreduced_experts"))


# ---- through the trainer: the PEFT adapter (expert factors gathered), the merged export, resume -------------
def test_lora_ep_run_exports_and_resumes_as_one_process(tmp_path) -> None:
    """``megaseq train`` with LoRA on the attention and the experts on ep 2 (LLEP moving weights and factors):
    the one-process run's losses, the same PEFT adapter (every expert's factors, gathered from both ranks) and
    merged HF export; its step-2 checkpoint (what trains only: the expert factors as ep shards) resumes on ep 2
    on the same loss curve."""
    import numpy as np

    from conftest import run_as_of_step
    from megaseq.parallel.launch import spawn_local as spawn

    rng = np.random.default_rng(4)
    (tmp_path / "g.fa").write_text(">rec\n" + "".join(rng.choice(list("ACGT"), 4000)) + "\n")
    ep = {"parallel.ep": 2, "parallel.dp": 1, "parallel.ep_chunk_tokens": 8, "parallel.ep_max_chunks": 4,
          "parallel.llep_min_tokens": 2}
    train_rank(0, lora_run_overrides(tmp_path, "one", 1, 2))
    spawn(train_rank, 2, args=(lora_run_overrides(tmp_path, "ep", 1, 1, **ep),))
    one, two = tmp_path / "one", tmp_path / "ep"
    np.testing.assert_allclose(run_losses(two), run_losses(one), rtol=1e-10, atol=0)
    assert_exports_match(two, one)
    assert any(".experts." in k for k in safetensors_in(two / "adapter"))
    run = run_as_of_step(two, tmp_path / "resumed", 2, drop=("hf", "adapter"))
    resume = lora_run_overrides(tmp_path, "resumed", 1, 1, **ep, **{"train.resume": True})
    spawn(train_rank, 2, args=(resume,))
    np.testing.assert_allclose(run_losses(run), run_losses(two), rtol=1e-10, atol=0)
