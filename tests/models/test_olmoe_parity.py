"""OLMoE parity with transformers' ``OlmoeForCausalLM`` (float64, CPU), its export and its aux loss.

A tiny odd-sized config: 3 layers, 5 heads of 6 (q/k RMSNorm over all 30 channels, as OLMoE's), 7 experts
top-3 without renormalisation, ``clip_qkv`` set low enough to clamp. HF's routers run with their float32
softmax promoted to float64 (``test_moe.promote_hf_routers_``), as megaseq's compute in
``promote_types(dtype, float32)``.
"""

from __future__ import annotations

import pytest
import torch

from family_parity import check_logits_and_grads, check_packed, check_round_trip, make_pair
from megaseq.models.spec import from_hf_config

transformers = pytest.importorskip("transformers")
from test_balance import check_aux_loss  # noqa: E402
from test_moe import promote_hf_routers_  # noqa: E402
from transformers.models.olmoe import modeling_olmoe  # noqa: E402

torch.set_num_threads(2)
VOCAB = 41


def hf_config(**kw) -> transformers.OlmoeConfig:
    base = dict(vocab_size=VOCAB, hidden_size=30, intermediate_size=13, num_hidden_layers=3, num_attention_heads=5,
                num_key_value_heads=5, num_experts=7, num_experts_per_tok=3, norm_topk_prob=False, clip_qkv=2.5,
                rope_parameters={"rope_type": "default", "rope_theta": 500.0}, pad_token_id=0, rms_norm_eps=1e-5,
                router_aux_loss_coef=0.2, max_position_embeddings=128)
    return transformers.OlmoeConfig(**{**base, **kw})


def pair(seed: int, **kw):
    hf, ours = make_pair(transformers.OlmoeForCausalLM, hf_config(**kw), seed)
    return promote_hf_routers_(hf), ours


def test_spec_from_config() -> None:
    spec = from_hf_config(hf_config().to_dict())
    assert spec.family == "olmoe" and spec.qk_norm_scope == "all" and spec.clip_qkv == 2.5
    assert spec.moe_intermediate_size == 13 and spec.mlp_types == ("moe",) * 3 and spec.router_aux_loss_coef == 0.2


@pytest.mark.parametrize("norm_topk_prob", [False, True])
def test_logits_and_grads_match(norm_topk_prob: bool) -> None:
    hf, ours = pair(1, norm_topk_prob=norm_topk_prob)
    ids = torch.randint(1, VOCAB, (2, 71), generator=torch.Generator().manual_seed(2))
    err, worst = check_logits_and_grads(hf, ours, ids)
    print(f"\nOLMoE parity: logits {err:.1e}, worst grad {worst:.1e}")


def test_packed_documents() -> None:
    hf, ours = pair(3)
    check_packed(hf, ours, [[9, 1, 23], [33]], VOCAB, seed=4)


def test_aux_loss_matches(monkeypatch: pytest.MonkeyPatch) -> None:
    hf, ours = pair(5)
    ids = torch.randint(1, VOCAB, (2, 19), generator=torch.Generator().manual_seed(6))
    check_aux_loss(hf, ours, ids, modeling_olmoe, monkeypatch)


def test_hf_round_trip(tmp_path) -> None:
    hf, _ = pair(7)
    ids = torch.randint(1, VOCAB, (1, 17), generator=torch.Generator().manual_seed(8))
    check_round_trip(hf, tmp_path, ids, "OlmoeForCausalLM", prepare=promote_hf_routers_)


def test_broken_block_fails() -> None:
    """The q/k norms per head instead of over all heads (Qwen3's layout): the parity check must fail."""
    hf, ours = pair(9)
    for layer in ours.layers:
        layer.self_attn.per_head_norm = True
        layer.self_attn.q_norm.weight.data = layer.self_attn.q_norm.weight.data[:6].clone()
        layer.self_attn.k_norm.weight.data = layer.self_attn.k_norm.weight.data[:6].clone()
    ids = torch.randint(1, VOCAB, (1, 13), generator=torch.Generator().manual_seed(10))
    with pytest.raises(AssertionError, match="logits differ"):
        check_logits_and_grads(hf, ours, ids)


@pytest.mark.parametrize("field, value, match", [
    ("hidden_act", "gelu", "hidden_act"), ("attention_dropout", 0.1, "attention_dropout"),
    ("rope_parameters", {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}, "rope_type 'dynamic'"),
    ("head_dim", 9, "head_dim"),
])
def test_refuses_what_it_does_not_implement(field, value, match) -> None:
    d = hf_config().to_dict()
    d[field] = value
    with pytest.raises(ValueError, match=match):
        from_hf_config(d)
