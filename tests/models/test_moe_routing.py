"""Balanced routing for speed benchmarks (``models.common.routing``): every expert gets N * K / E rows at the
published expert counts, the router still computes the weights and receives their gradient, megaseq's balanced
MoE equals transformers' MoE with the same balanced ids (loss and every gradient, float64, CPU), and natural
routing is untouched."""

from __future__ import annotations

import pytest
import torch

from megaseq.models.common import routing
from megaseq.models.common.moe import MoE, set_routing
from megaseq.models.common.routing import balance_hf_experts, balanced_experts
from megaseq.models.spec import ModelSpec
from megaseq.train.metrics import moe_load

pytest.importorskip("transformers")
from test_moe import (  # noqa: E402
    _check_parity,
    _glm_spec,
    _hf_glm_moe,
    _hf_qwen_moe,
    _qwen_spec,
    gpu_moe_matches_float64,
)

torch.set_num_threads(2)


def _published(E: int, K: int, router: str) -> ModelSpec:
    """A one-layer MoE with a published model's expert count and top-k (small hidden sizes)."""
    kw = dict(family="qwen3_moe", vocab_size=16, hidden_size=16, num_layers=1, layer_types=("attention",),
              mlp_types=("moe",), num_experts=E, num_experts_per_tok=K, moe_intermediate_size=8, router=router,
              norm_topk_prob=True)
    if router == "sigmoid_bias":
        kw.update(family="glm5_next", n_group=1, topk_group=1, routed_scaling_factor=2.5)
    return ModelSpec(**kw)


@pytest.mark.parametrize("E,K,router", [(128, 8, "softmax"), (32, 8, "sigmoid_bias"), (64, 8, "sigmoid_bias")])
def test_balanced_spreads_evenly_at_published_counts(E: int, K: int, router: str) -> None:
    """Qwen3-30B-A3B (128 experts, top-8), glm5-flash-1gpu (32, top-8), GLM-5.3-Flash (64, top-8)."""
    moe = MoE(_published(E, K, router)).double()
    x = torch.randn(2, 256, 16, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    moe(x)
    assert moe_load(moe)[""] > 1.1, "the router's own choice is uneven"
    set_routing(moe, "balanced")
    moe(x)
    counts = moe.last_tokens_per_expert
    assert counts.sum() == 512 * K and (counts == 512 * K // E).all()
    assert moe_load(moe)[""] == pytest.approx(1.0, abs=1e-12)
    ids_NK = balanced_experts(512, K, E, torch.device("cpu"))
    assert all(len(set(row)) == K for row in ids_NK.tolist()), "a token's K experts must be distinct"


def test_balanced_uneven_total_is_within_one_row() -> None:
    counts = torch.bincount(balanced_experts(37, 8, 128, torch.device("cpu")).reshape(-1), minlength=128)
    assert counts.max() - counts.min() <= 1 and counts.sum() == 37 * 8


def _balanced_parity(spec: ModelSpec, hf: torch.nn.Module, seed: int) -> None:
    """megaseq's balanced MoE against transformers' MoE with ``balance_hf_experts``: output, the input's and
    every parameter's gradient (the router's included), float64."""

    def balance(ours: MoE, hf_: torch.nn.Module) -> None:
        assert set_routing(ours, "balanced") == 1 and balance_hf_experts(hf_) == 1

    ours = _check_parity(spec, hf, seed, prepare=balance)
    assert ours.gate.weight.grad.abs().max() > 0, "the router's gradient must flow under balanced routing"


@pytest.mark.parametrize("router", ["softmax", "sigmoid_bias"])
def test_balanced_matches_transformers_with_balanced_ids(router: str) -> None:
    spec = _qwen_spec() if router == "softmax" else _glm_spec(n_group=4, topk_group=2)
    hf = _hf_qwen_moe(spec) if router == "softmax" else _hf_glm_moe(spec)
    _balanced_parity(spec, hf, seed=11)


def test_broken_balanced_variants_fail(monkeypatch) -> None:
    """Each check fails on a broken variant: router weights cut off from the graph (no router gradient), and
    ids that differ from the peer's."""
    spec = _qwen_spec()
    original = routing.balanced_experts

    def shifted(N: int, K: int, E: int, device: torch.device) -> torch.Tensor:
        return (original(N, K, E, device) + 1) % E

    import megaseq.models.common.moe as moe_mod

    monkeypatch.setattr(moe_mod, "balanced_experts", shifted)
    with pytest.raises(AssertionError):
        _balanced_parity(spec, _hf_qwen_moe(spec), seed=11)
    monkeypatch.undo()
    real_route = moe_mod.TopKRouter.route

    def detached(self, x_NH, probs=False):
        w, e, p = real_route(self, x_NH, probs)
        return w.detach(), e, p

    monkeypatch.setattr(moe_mod.TopKRouter, "route", detached)
    with pytest.raises(AssertionError):
        _balanced_parity(spec, _hf_qwen_moe(spec), seed=11)


def test_natural_routing_unchanged_after_switching_back() -> None:
    spec = _qwen_spec()
    gen = torch.Generator().manual_seed(4)
    a, b = MoE(spec).double(), MoE(spec).double()
    b.load_state_dict(a.state_dict())
    x = torch.randn(4, 9, spec.hidden_size, generator=gen, dtype=torch.float64)
    set_routing(b, "balanced")
    assert not torch.equal(a(x), b(x))
    set_routing(b, "natural")
    assert torch.equal(a(x), b(x)) and torch.equal(a.last_tokens_per_expert, b.last_tokens_per_expert)


def test_bad_routing_names_the_setting() -> None:
    with pytest.raises(ValueError, match="--routing must be one of natural, balanced"):
        set_routing(MoE(_qwen_spec()), "even")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_balanced_grouped_mm_on_gpu_matches_float64() -> None:
    """Balanced routing at Qwen3-30B-A3B's expert count (128, top-8) through the bf16 grouped GEMMs, against the
    float64 loop reference on the CPU with the same balanced ids: outputs and every gradient.

    The routing weights are the router's top-k values in order, and slot j's weight goes to the slot's balanced
    expert, so the router's gradient follows which experts (and in which order) the router ranks first. Among
    128 nearly equal random logits, bf16 rounding reorders that top 8 for many tokens; the tokens are those
    whose bf16 top-8 on the GPU equals the float64 one, so the comparison measures the kernels, not the ties."""

    spec = _published(128, 8, "softmax")
    ref = MoE(spec).double()
    fast = MoE(spec, layer="gpu.balanced").cuda()
    fast.load_state_dict(ref.state_dict())
    fast.experts.bfloat16()
    for m in (ref, fast):
        set_routing(m, "balanced")
    pool = torch.randn(16384, 16, generator=torch.Generator().manual_seed(0)).bfloat16().double()
    with torch.no_grad():
        same = (fast.gate._softmax(pool.cuda().bfloat16())[1].cpu() == ref.gate._softmax(pool)[1]).all(dim=1)
    assert int(same.sum()) >= 2048, int(same.sum())
    x = pool[same][:2048].view(2, 1024, 16)
    gpu_moe_matches_float64(fast, ref, x, "gpu.balanced")
    assert (fast.last_tokens_per_expert == 2048 * 8 // 128).all()
