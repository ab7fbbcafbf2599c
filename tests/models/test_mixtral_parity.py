"""Mixtral parity with transformers' ``MixtralForCausalLM`` (float64, CPU), its export and its aux loss.

A tiny odd-sized config: 3 layers, GQA 6/2 heads of 10 (head_dim apart from hidden / heads), 5 experts
top-2. HF's routers run with their float32 softmax promoted to float64 (``test_moe.promote_hf_routers_``).
The round trip reads what ``save_pretrained`` writes (``block_sparse_moe.experts.J.w1/w2/w3``).
"""

from __future__ import annotations

import json

import pytest
import torch

from family_parity import check_logits_and_grads, check_packed, check_round_trip, make_pair
from megaseq.models.spec import from_hf_config

transformers = pytest.importorskip("transformers")
from test_balance import check_aux_loss  # noqa: E402
from test_moe import promote_hf_routers_  # noqa: E402
from transformers.models.mixtral import modeling_mixtral  # noqa: E402

torch.set_num_threads(2)
VOCAB = 43


def hf_config(**kw) -> transformers.MixtralConfig:
    base = dict(vocab_size=VOCAB, hidden_size=26, intermediate_size=14, num_hidden_layers=3, num_attention_heads=6,
                num_key_value_heads=2, head_dim=10, num_local_experts=5, num_experts_per_tok=2,
                rope_parameters={"rope_type": "default", "rope_theta": 1e6}, rms_norm_eps=1e-5,
                router_aux_loss_coef=0.3, max_position_embeddings=256, sliding_window=None)
    return transformers.MixtralConfig(**{**base, **kw})


def pair(seed: int, **kw):
    hf, ours = make_pair(transformers.MixtralForCausalLM, hf_config(**kw), seed)
    return promote_hf_routers_(hf), ours


def test_spec_from_config() -> None:
    spec = from_hf_config(hf_config().to_dict())
    assert spec.family == "mixtral" and spec.router_weights_fp32 and spec.norm_topk_prob
    assert spec.moe_intermediate_size == 14 and spec.head_dim == 10 and spec.router_aux_loss_coef == 0.3


def test_logits_and_grads_match() -> None:
    hf, ours = pair(1)
    ids = torch.randint(0, VOCAB, (2, 67), generator=torch.Generator().manual_seed(2))
    err, worst = check_logits_and_grads(hf, ours, ids)
    print(f"\nMixtral parity: logits {err:.1e}, worst grad {worst:.1e}")


def test_packed_documents() -> None:
    hf, ours = pair(3)
    check_packed(hf, ours, [[4, 1, 30], [35]], VOCAB, seed=4)


def test_aux_loss_matches(monkeypatch: pytest.MonkeyPatch) -> None:
    hf, ours = pair(5)
    ids = torch.randint(0, VOCAB, (2, 21), generator=torch.Generator().manual_seed(6))
    check_aux_loss(hf, ours, ids, modeling_mixtral, monkeypatch)


def test_hf_round_trip(tmp_path) -> None:
    hf, _ = pair(7)
    ids = torch.randint(0, VOCAB, (1, 15), generator=torch.Generator().manual_seed(8))
    out = check_round_trip(hf, tmp_path, ids, "MixtralForCausalLM", prepare=promote_hf_routers_)
    keys = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert "model.layers.2.block_sparse_moe.experts.4.w3.weight" in keys  # the on-disk layout HF reads


def test_broken_block_fails() -> None:
    """The experts' gate and up halves swapped (w1 read as w3): the parity check must fail."""
    hf, ours = pair(9)
    with torch.no_grad():
        for layer in ours.layers:
            gu = layer.mlp.experts.gate_up_proj
            gu.copy_(torch.cat(gu.chunk(2, dim=1)[::-1], dim=1))
    ids = torch.randint(0, VOCAB, (1, 11), generator=torch.Generator().manual_seed(10))
    with pytest.raises(AssertionError, match="logits differ"):
        check_logits_and_grads(hf, ours, ids)


@pytest.mark.parametrize("field, value, match", [
    ("sliding_window", 4096, "sliding_window"), ("router_jitter_noise", 0.1, "router_jitter_noise"),
    ("hidden_act", "gelu", "hidden_act"),
])
def test_refuses_what_it_does_not_implement(field, value, match) -> None:
    d = hf_config().to_dict()
    d[field] = value
    with pytest.raises(ValueError, match=match):
        from_hf_config(d)
