"""DeepSeek-V3 parity with transformers' ``DeepseekV3ForCausalLM`` (float64, CPU) and its export.

A tiny odd-sized config: 4 layers (2 dense, 2 MoE), 3 heads, MLA with q LoRA 14, latent 12, 6 NoPE + 4 RoPE
dims, values of 5, YaRN (factor 4, ``mscale_all_dim`` 0.7: the softmax scale moves too) over a sequence
longer than its original window, interleaved RoPE pairs; 8 experts in 4 groups (top-2 groups, top-3),
a shared expert. Variants: no q LoRA (``q_proj``), half-split RoPE. HF's routers run with their float32
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
VOCAB = 53
YARN = {"rope_type": "yarn", "rope_theta": 100.0, "factor": 4.0, "original_max_position_embeddings": 16,
        "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.7}


def hf_config(**kw) -> transformers.DeepseekV3Config:
    base = dict(vocab_size=VOCAB, hidden_size=36, intermediate_size=22, moe_intermediate_size=10, num_hidden_layers=4,
                num_attention_heads=3, num_key_value_heads=3, q_lora_rank=14, kv_lora_rank=12, qk_nope_head_dim=6,
                qk_rope_head_dim=4, v_head_dim=5, n_routed_experts=8, n_group=4, topk_group=2, num_experts_per_tok=3,
                n_shared_experts=1, routed_scaling_factor=1.7, first_k_dense_replace=2, rope_parameters=dict(YARN),
                max_position_embeddings=64, rms_norm_eps=1e-6, pad_token_id=0, rope_interleave=True,
                num_nextn_predict_layers=0)
    return transformers.DeepseekV3Config(**{**base, **kw})


def pair(seed: int, **kw):
    hf, ours = make_pair(transformers.DeepseekV3ForCausalLM, hf_config(**kw), seed)
    return promote_hf_routers_(hf), ours


def test_spec_from_config() -> None:
    spec = from_hf_config(hf_config().to_dict())
    assert spec.family == "deepseek_v3" and spec.layer_types == ("mla",) * 4 and spec.rope_interleave
    assert spec.rope_scaling["rope_type"] == "yarn" and spec.mlp_types == ("dense", "dense", "moe", "moe")


@pytest.mark.parametrize("kw", [{}, {"q_lora_rank": None, "rope_interleave": False},
                                {"rope_parameters": {"rope_type": "default", "rope_theta": 1000.0}}])
def test_logits_and_grads_match(kw) -> None:
    hf, ours = pair(1, **kw)
    ids = torch.randint(1, VOCAB, (2, 71), generator=torch.Generator().manual_seed(2))  # 71 > 16 * 4
    err, worst = check_logits_and_grads(hf, ours, ids)
    print(f"\nDeepSeek-V3 parity {kw}: logits {err:.1e}, worst grad {worst:.1e}")


def test_packed_documents() -> None:
    hf, ours = pair(3)
    check_packed(hf, ours, [[17, 1, 19], [37]], VOCAB, seed=4)


def test_hf_round_trip(tmp_path) -> None:
    hf, _ = pair(7)
    ids = torch.randint(1, VOCAB, (1, 19), generator=torch.Generator().manual_seed(8))
    check_round_trip(hf, tmp_path, ids, "DeepseekV3ForCausalLM", prepare=promote_hf_routers_)


def test_broken_block_fails() -> None:
    """Half-split RoPE where DeepSeek interleaves its pairs: the parity check must fail."""
    hf, ours = pair(9)
    for layer in ours.layers:
        layer.self_attn.interleave = False
    ids = torch.randint(1, VOCAB, (1, 13), generator=torch.Generator().manual_seed(10))
    with pytest.raises(AssertionError, match="logits differ"):
        check_logits_and_grads(hf, ours, ids)


def test_mtp_noted_and_fp8_refused(tmp_path) -> None:
    from safetensors.torch import save_file

    from megaseq.models.hf_io import load_hf_checkpoint

    with pytest.warns(UserWarning, match="multi-token-prediction module .* not modelled"):
        spec = from_hf_config(hf_config(num_nextn_predict_layers=1).to_dict())
    (tmp_path / "config.json").write_text(hf_config().to_json_string())
    save_file({"model.layers.0.self_attn.q_a_proj.weight": torch.zeros(14, 36),
               "model.layers.0.self_attn.q_a_proj.weight_scale_inv": torch.ones(1, 1)}, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="FP8 block-quantized checkpoint.*dequantize"):
        load_hf_checkpoint(tmp_path, spec=spec)


@pytest.mark.parametrize("field, value, match", [
    ("topk_method", "greedy", "topk_method"), ("scoring_func", "softmax", "scoring_func"),
    ("num_key_value_heads", 1, "num_key_value_heads"), ("moe_layer_freq", 2, "moe_layer_freq"),
])
def test_refuses_what_it_does_not_implement(field, value, match) -> None:
    d = hf_config().to_dict()
    d[field] = value
    with pytest.raises(ValueError, match=match), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from_hf_config(d)
