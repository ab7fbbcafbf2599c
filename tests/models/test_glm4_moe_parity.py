"""GLM-4.5 parity with transformers' ``Glm4MoeForCausalLM`` (float64, CPU), its export and its balancing.

A tiny odd-sized config: 4 layers (2 dense, 2 MoE), GQA 6/2 heads of 10 with 6 dims rotated
(``partial_rotary_factor`` 0.6), q/k/v biases, per-head q/k norms, 8 experts in 4 groups (top-2 groups,
top-3 experts), a shared expert, ``routed_scaling_factor`` 1.7. HF's routers run with their float32
casts promoted to float64 (``test_moe.promote_hf_routers_``).
"""

from __future__ import annotations

import warnings

import pytest
import torch

from family_parity import check_logits_and_grads, check_packed, check_round_trip, make_pair
from megaseq.models.spec import from_hf_config

transformers = pytest.importorskip("transformers")
from test_moe import promote_hf_routers_  # noqa: E402

torch.set_num_threads(2)
VOCAB = 47


def hf_config(**kw) -> transformers.Glm4MoeConfig:
    base = dict(vocab_size=VOCAB, hidden_size=34, intermediate_size=22, moe_intermediate_size=12,
                num_hidden_layers=4, num_attention_heads=6, num_key_value_heads=2, head_dim=10,
                n_routed_experts=8, num_experts_per_tok=3, n_shared_experts=1, n_group=4, topk_group=2,
                first_k_dense_replace=2, routed_scaling_factor=1.7, use_qk_norm=True, attention_bias=True,
                rope_parameters={"rope_type": "default", "rope_theta": 5000.0, "partial_rotary_factor": 0.6},
                rms_norm_eps=1e-5, max_position_embeddings=256, pad_token_id=0, num_nextn_predict_layers=0)
    return transformers.Glm4MoeConfig(**{**base, **kw})


def pair(seed: int, **kw):
    hf, ours = make_pair(transformers.Glm4MoeForCausalLM, hf_config(**kw), seed)
    return promote_hf_routers_(hf), ours


def test_spec_from_config() -> None:
    spec = from_hf_config(hf_config().to_dict())
    assert spec.family == "glm4_moe" and spec.partial_rotary_factor == 0.6 and spec.mlp_types == ("dense",) * 2 + (
        "moe",) * 2
    assert spec.attention_bias and not spec.o_proj_bias and spec.router == "sigmoid_bias" and spec.n_group == 4


def test_mtp_layer_is_noted_and_skipped() -> None:
    with pytest.warns(UserWarning, match="multi-token-prediction layer .* not modelled"):
        from_hf_config(hf_config(num_nextn_predict_layers=1).to_dict())


@pytest.mark.parametrize("qk_norm", [True, False])
def test_logits_and_grads_match(qk_norm: bool) -> None:
    hf, ours = pair(1, use_qk_norm=qk_norm)
    ids = torch.randint(1, VOCAB, (2, 69), generator=torch.Generator().manual_seed(2))
    err, worst = check_logits_and_grads(hf, ours, ids)
    print(f"\nGLM-4.5 parity: logits {err:.1e}, worst grad {worst:.1e}")


def test_packed_documents() -> None:
    hf, ours = pair(3)
    check_packed(hf, ours, [[13, 1, 20], [34]], VOCAB, seed=4)


def test_hf_round_trip(tmp_path) -> None:
    hf, _ = pair(7)
    ids = torch.randint(1, VOCAB, (1, 19), generator=torch.Generator().manual_seed(8))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        check_round_trip(hf, tmp_path, ids, "Glm4MoeForCausalLM", prepare=promote_hf_routers_)


def test_broken_block_fails() -> None:
    """Rotating whole heads instead of 60% of each (the partial rotary dropped): the parity check must fail."""
    hf, ours = pair(9)
    for layer in ours.layers:
        layer.self_attn.rotary_dim = layer.self_attn.head_dim
    ids = torch.randint(1, VOCAB, (1, 13), generator=torch.Generator().manual_seed(10))
    with pytest.raises(AssertionError, match="logits differ"):
        check_logits_and_grads(hf, ours, ids)


def test_refuses_what_it_does_not_implement() -> None:
    d = hf_config().to_dict()
    d["rope_parameters"] = {"rope_type": "longrope", "rope_theta": 1e4}
    with pytest.raises(ValueError, match="rope_type 'longrope'"):
        from_hf_config(d)
