"""Qwen3-Next parity with transformers' ``Qwen3NextForCausalLM`` (float64, CPU) and its export and aux loss.

A tiny odd-sized config: 6 layers (gated DeltaNet x4 with 2 key heads of 6 serving 4 value heads of 5, a
4-tap conv, over 70 tokens: past the 64-token chunk; gated attention x2 with GQA 4/2 heads of 8, 2 dims of
each rotated), one dense layer (``mlp_only_layers``) and MoE layers of 7 experts top-3 with a gated shared
expert. HF's float32 casts are promoted to float64 outside its eager attention and its rotary embedding
(whose float32 megaseq keeps literally), as megaseq computes the gate, the recurrence, the gated and the
zero-centered norms and the router in ``promote_types(dtype, float32)``.
"""

from __future__ import annotations

import pytest
import torch

from family_parity import (
    check_logits_and_grads,
    check_packed,
    check_round_trip,
    hf_promoted,
    make_pair,
)
from megaseq.models.spec import from_hf_config

transformers = pytest.importorskip("transformers")
from test_balance import check_aux_loss  # noqa: E402
from transformers.models.qwen3_next import modeling_qwen3_next  # noqa: E402

torch.set_num_threads(2)
VOCAB = 53
HF = hf_promoted(modeling_qwen3_next, {"eager_attention_forward", "Qwen3NextRotaryEmbedding"}, min_changes=5)
LAYERS = ["linear_attention", "linear_attention", "full_attention", "linear_attention", "full_attention",
          "linear_attention"]


def hf_config(**kw) -> transformers.Qwen3NextConfig:
    base = dict(vocab_size=VOCAB, hidden_size=36, intermediate_size=22, moe_intermediate_size=10,
                shared_expert_intermediate_size=14, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
                head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=6,
                linear_value_head_dim=5, linear_conv_kernel_dim=4, num_experts=7, num_experts_per_tok=3,
                mlp_only_layers=[1], layer_types=LAYERS, rms_norm_eps=1e-6, router_aux_loss_coef=0.3,
                rope_parameters={"rope_type": "default", "rope_theta": 1000.0, "partial_rotary_factor": 0.25},
                max_position_embeddings=256, pad_token_id=0)
    return transformers.Qwen3NextConfig(**{**base, **kw})


def randomize(model: torch.nn.Module, seed: int) -> None:
    """family_parity.randomize_ with HF's zero-centered norms near 0 (their weight is w - 1)."""
    from family_parity import randomize_

    randomize_(model, seed)
    gen = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        for m in model.modules():
            if type(m).__name__ == "Qwen3NextRMSNorm":
                m.weight.copy_(0.2 * torch.randn(m.weight.shape, generator=gen, dtype=torch.float64))
            if type(m).__name__ == "Qwen3NextGatedDeltaNet":
                m.A_log.copy_(torch.empty(m.A_log.shape, dtype=torch.float64).uniform_(-2, 1, generator=gen))
                m.dt_bias.copy_(torch.randn(m.dt_bias.shape, generator=gen, dtype=torch.float64))


def pair(seed: int, **kw):
    return make_pair(HF.Qwen3NextForCausalLM, hf_config(**kw), seed, randomize=randomize)


def promoted_copy(model: torch.nn.Module) -> torch.nn.Module:
    copy = HF.Qwen3NextForCausalLM(model.config).to(torch.float64)
    copy.load_state_dict(model.state_dict())
    return copy


def test_spec_from_config() -> None:
    spec = from_hf_config(hf_config().to_dict())
    assert spec.layer_types == ("gdn", "gdn", "attention", "gdn", "attention", "gdn")
    assert spec.mlp_types[1] == "dense" and spec.partial_rotary_factor == 0.25 and spec.linear_num_value_heads == 4


def test_logits_and_grads_match() -> None:
    hf, ours = pair(1)
    ids = torch.randint(1, VOCAB, (2, 70), generator=torch.Generator().manual_seed(2))
    err, worst = check_logits_and_grads(hf, ours, ids)
    print(f"\nQwen3-Next parity: logits {err:.1e}, worst grad {worst:.1e}")


def test_packed_documents() -> None:
    hf, ours = pair(3)
    check_packed(hf, ours, [[29, 1, 13], [43]], VOCAB, seed=4)


def test_aux_loss_matches(monkeypatch: pytest.MonkeyPatch) -> None:
    hf, ours = pair(5)
    ids = torch.randint(1, VOCAB, (2, 19), generator=torch.Generator().manual_seed(6))
    check_aux_loss(hf, ours, ids, HF, monkeypatch)


def test_hf_round_trip(tmp_path) -> None:
    hf, _ = pair(7)
    ids = torch.randint(1, VOCAB, (1, 21), generator=torch.Generator().manual_seed(8))
    check_round_trip(hf, tmp_path, ids, "Qwen3NextForCausalLM", prepare=promoted_copy)


def test_broken_block_fails() -> None:
    """Each gated DeltaNet head decaying at another head's rate (A_log reversed): the parity check must fail."""
    hf, ours = pair(9)
    for layer in ours.layers:
        if layer.layer_type == "gdn":
            layer.linear_attn.A_log.data = layer.linear_attn.A_log.data.flip(0)  # each head gets another's decay
    ids = torch.randint(1, VOCAB, (1, 13), generator=torch.Generator().manual_seed(10))
    with pytest.raises(AssertionError, match="logits differ"):
        check_logits_and_grads(hf, ours, ids)
