"""A family's parallelize on the real GLM-5.3-Flash and Qwen3-MoE blocks: every scheme at once vs plain.

A 12-layer GLM model has DSA layers 3 (full indexer), 7 (shared: reuses layer 3's selection) and 11
(full), so during backward ``ctx.carry`` holds layer 11's selection when layer 7 is recomputed: the
recompute must see what layer 7 saw. Two documents per row, a top-k smaller than the pool count.
"""

from __future__ import annotations

import copy

import pytest
import torch

from megaseq.config import MemorySettings as MemoryPlan
from megaseq.memory.apply import loss_fn, make_optimizer
from megaseq.memory.kda_segments import segment_tokens_of
from megaseq.memory.offload_adam import OffloadStreamAdamW
from megaseq.models.build import build_model
from megaseq.models.glm5.spec import _glm5_pattern, glm5_flash_tiny
from megaseq.models.qwen3_moe.spec import qwen3_moe_tiny
from megaseq.models.registry import parallelize as apply_memory_plan
from megaseq.ops.rms_norm.reference import full_precision_norms
from megaseq.plan.activations import layer_input_bytes as boundary_bytes
from megaseq.plan.components import round_up

torch.set_num_threads(1)
S = 53


def _glm5_12() -> object:
    # DSA at 3, 4 (shared: reuses layer 3's selection), 7 and 11
    lt = list(_glm5_pattern(12))
    lt[4] = "dsa"
    indexer = ["shared" if i == 4 else "full" for i in range(12)]
    return glm5_flash_tiny().replace(num_layers=12, layer_types=tuple(lt), mlp_types=("dense",) + ("moe",) * 11,
                                     indexer_types=tuple(indexer), index_topk=32)


def _batch(vocab: int):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (2, S), generator=g)
    doc_ids = torch.tensor([[0] * 20 + [1] * (S - 20), [0] * S])
    labels = torch.cat([ids[:, 1:], torch.full((2, 1), -100)], dim=1)
    labels[0, 19] = -100  # no target across the document boundary
    return ids, doc_ids, labels


def _step(model, plan: MemoryPlan | None):
    ids, doc_ids, labels = _batch(model.spec.vocab_size)
    model.zero_grad(set_to_none=True)
    hidden = model(ids, doc_ids=doc_ids)
    fn = loss_fn(plan or MemoryPlan())
    loss = fn(hidden, model.lm_head.weight, labels)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    counts = {n: m.last_tokens_per_expert.clone() for n, m in model.named_modules()
              if hasattr(m, "last_tokens_per_expert")}
    return loss.detach(), grads, counts


TOL = {"rtol": 1e-10, "atol": 1e-12}


@pytest.mark.parametrize("make_spec", [_glm5_12, qwen3_moe_tiny], ids=["glm5", "qwen3_moe"])
def test_every_scheme_at_once_matches_plain(make_spec):
    spec = make_spec()
    plain = build_model(spec, dtype=torch.float64, seed=0)
    model = copy.deepcopy(plain)
    ref = _step(plain, None)
    hc = spec.hc_mult
    plan = MemoryPlan(chunked_loss=True, loss_chunk_tokens=13, tiled_mlp=True, mlp_tile_tokens=10,
                      indexer_query_chunk=7, recompute=True, checkpoint_offload=True,
                      offload_host_budget=5 * round_up(boundary_bytes(2 * S, spec.hidden_size, hc, 8)))
    done = apply_memory_plan(model, plan)
    got = _step(model, plan)
    assert done.checkpointed == spec.num_layers and len(done.tiled) == spec.num_layers
    assert done.offloader.num_offloaded == min(5, spec.num_layers)
    torch.testing.assert_close(got[0], ref[0], **TOL)
    assert got[1].keys() == ref[1].keys()
    for name in ref[1]:
        torch.testing.assert_close(got[1][name], ref[1][name], **TOL, msg=lambda m, n=name: f"{n}: {m}")
    for name in ref[2]:  # MoE load metrics: the forward's counts, not doubled by recompute
        assert torch.equal(got[2][name], ref[2][name]), name


def test_reapplying_replaces_the_plan():
    model = build_model(qwen3_moe_tiny(), dtype=torch.float64, seed=0)
    apply_memory_plan(model, MemoryPlan(tiled_mlp=True, mlp_tile_tokens=4, recompute=True))
    apply_memory_plan(model, MemoryPlan(tiled_mlp=True, mlp_tile_tokens=9, recompute=True))
    assert model.layers[0].mlp.forward.tile_tokens == 9
    assert model.layers[0].forward.inner.__func__ is type(model.layers[0]).forward  # not stacked
    apply_memory_plan(model, MemoryPlan())
    assert "forward" not in model.layers[0].__dict__ and "forward" not in model.layers[0].mlp.__dict__
    keys = set(build_model(qwen3_moe_tiny(), dtype=torch.float64, seed=0).state_dict())
    assert set(model.state_dict()) == keys


def test_plan_validation_and_from_dict():
    with pytest.raises(ValueError, match="memory.recompute"):
        MemoryPlan(checkpoint_offload=True).check_combination()  # (run as given: checked when applied)
    with pytest.raises(ValueError, match="memory.mlp_tile_tokens"):
        MemoryPlan(mlp_tile_tokens=0)
    plan = MemoryPlan.from_dict({"tiled_mlp": True, "mlp_tile_tokens": 512})
    assert plan.tiled_mlp and plan.mlp_tile_tokens == 512
    with pytest.raises(ValueError, match="gpu_budget"):  # an unknown key is refused, never dropped
        MemoryPlan.from_dict({"tiled_mlp": True, "gpu_budget": "auto"})
    with pytest.raises(ValueError, match="layers"):
        apply_memory_plan(torch.nn.Linear(2, 2), plan)


def test_make_optimizer_follows_the_plan():
    params = [torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))]
    hp = (1e-3, (0.9, 0.95), 1e-8, 0.1)
    assert isinstance(make_optimizer(params, MemoryPlan(optimizer_offload=True), *hp), OffloadStreamAdamW)
    assert type(make_optimizer(params, MemoryPlan(), *hp)) is torch.optim.AdamW


@full_precision_norms()
def test_every_scheme_with_kda_segments_matches_plain():
    """``kda_segment_tokens`` on top of every other scheme (one document per row: the segmented KDA
    rejects document boundaries), 12-layer GLM-5, float64.

    With the norms in float64 (``full_precision_norms``): segments move the KDA's chunk boundaries, which
    reorders its sums by ~1e-17, and HF's float32 RMSNorm statistics can turn that into one float32 ulp
    (in this environment: layer 6's router input 2**-27 off, embed_tokens' gradient 7.3e-9, with the loss
    equal). In float64 throughout the step is exact to 1e-12 here, as it must be."""
    spec = _glm5_12()
    plain = build_model(spec, dtype=torch.float64, seed=0)
    model = copy.deepcopy(plain)
    ids, _, labels = _batch(spec.vocab_size)

    def step(m, plan):
        m.zero_grad(set_to_none=True)
        loss = loss_fn(plan)(m(ids), m.lm_head.weight, labels)
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}

    ref = step(plain, MemoryPlan())
    plan = MemoryPlan(chunked_loss=True, loss_chunk_tokens=13, tiled_mlp=True, mlp_tile_tokens=10,
                      indexer_query_chunk=7, recompute=True, kda_segment_tokens=11)
    done = apply_memory_plan(model, plan)
    got = step(model, plan)
    assert done.kda_segmented == 11
    assert all(segment_tokens_of(layer.self_attn) == 11 for layer in model.layers if layer.layer_type == "kda")
    torch.testing.assert_close(got[0], ref[0], **TOL)
    for name in ref[1]:
        torch.testing.assert_close(got[1][name], ref[1][name], **TOL, msg=lambda m, n=name: f"{n}: {m}")
    apply_memory_plan(model, MemoryPlan())
    assert all(segment_tokens_of(layer.self_attn) is None for layer in model.layers)
    with pytest.raises(ValueError, match="memory.kda_segment_tokens"):
        MemoryPlan(kda_segment_tokens=-1)
