"""Kimi-Linear parity with transformers' ``KimiLinearForCausalLM`` (float64, CPU) and its export.

A tiny odd-sized config: 6 layers (KDA x4, NoPE MLA x2; 2 dense MLPs then 4 MoE), 3 KDA heads of 6 with a
4-tap conv over 70 tokens (past HF's 64-token KDA chunk and megaseq's 16), 3 MLA heads with a 12-wide latent
and 4 unrotated rope dims, 8 experts in 4 groups (top-2 groups, top-3) and a shared expert. HF's float32
casts are promoted to float64 outside its RMSNorm and its eager attention (whose float32 megaseq keeps
literally), as megaseq computes the KDA recurrence, the gated norm and the router in
``promote_types(dtype, float32)``.
"""

from __future__ import annotations

import pytest
import torch

from family_parity import check_logits_and_grads, check_packed, check_round_trip, hf_promoted, make_pair
from megaseq.models.spec import from_hf_config

transformers = pytest.importorskip("transformers")
from transformers.models.kimi_linear import modeling_kimi_linear  # noqa: E402

torch.set_num_threads(2)
VOCAB = 53
HF = hf_promoted(modeling_kimi_linear, {"KimiLinearRMSNorm", "eager_attention_forward"}, min_changes=5)
LAYERS = ["linear_attention", "linear_attention", "full_attention", "linear_attention", "full_attention",
          "linear_attention"]


def hf_config(**kw) -> transformers.KimiLinearConfig:
    base = dict(vocab_size=VOCAB, hidden_size=36, intermediate_size=22, moe_intermediate_size=10, num_hidden_layers=6,
                num_attention_heads=3, num_key_value_heads=3, kv_lora_rank=12, q_lora_rank=None, qk_nope_head_dim=6,
                qk_rope_head_dim=4, v_head_dim=5, num_experts=8, n_group=4, topk_group=2, num_experts_per_tok=3,
                n_shared_experts=1, routed_scaling_factor=1.7, layer_types=LAYERS,
                mlp_layer_types=["dense", "dense"] + ["sparse"] * 4, linear_num_heads=3, linear_head_dim=6,
                linear_conv_kernel_dim=4, rms_norm_eps=1e-5, pad_token_id=0)
    return transformers.KimiLinearConfig(**{**base, **kw})


def pair(seed: int, **kw):
    return make_pair(HF.KimiLinearForCausalLM, hf_config(**kw), seed)


def promoted_copy(model: torch.nn.Module) -> torch.nn.Module:
    copy = HF.KimiLinearForCausalLM(model.config).to(torch.float64)
    copy.load_state_dict(model.state_dict())
    return copy


def test_spec_from_config() -> None:
    spec = from_hf_config(hf_config().to_dict())
    assert spec.layer_types == ("kda", "kda", "mla", "kda", "mla", "kda") and not spec.mla_rotate
    assert spec.n_group == 4 and spec.num_experts_per_tok == 3 and spec.linear_lower_bound is None


@pytest.mark.parametrize("kw", [{}, {"q_lora_rank": 14}])
def test_logits_and_grads_match(kw) -> None:
    hf, ours = pair(1, **kw)
    ids = torch.randint(1, VOCAB, (2, 70), generator=torch.Generator().manual_seed(2))
    err, worst = check_logits_and_grads(hf, ours, ids)
    print(f"\nKimi-Linear parity {kw}: logits {err:.1e}, worst grad {worst:.1e}")


def test_packed_documents() -> None:
    hf, ours = pair(3)
    check_packed(hf, ours, [[23, 1, 17], [41]], VOCAB, seed=4)


def test_hf_round_trip(tmp_path) -> None:
    hf, _ = pair(7)
    ids = torch.randint(1, VOCAB, (1, 21), generator=torch.Generator().manual_seed(8))
    check_round_trip(hf, tmp_path, ids, "KimiLinearForCausalLM", prepare=promoted_copy)


def test_broken_block_fails() -> None:
    """GLM-5's safe gate (a lower bound on the KDA decay) where Kimi has none: the parity check must fail."""
    hf, ours = pair(9)
    for layer in ours.layers:
        if layer.layer_type == "kda":
            layer.self_attn.forget_gate.lower_bound = -5.0
    ids = torch.randint(1, VOCAB, (1, 13), generator=torch.Generator().manual_seed(10))
    with pytest.raises(AssertionError, match="logits differ"):
        check_logits_and_grads(hf, ours, ids)


def test_refuses_a_rotating_mla() -> None:
    d = hf_config().to_dict()
    d["mla_use_nope"] = False
    with pytest.raises(ValueError, match="mla_use_nope"):
        from_hf_config(d)


def test_tie_word_embeddings_true_is_untied_as_in_transformers(tmp_path) -> None:
    """transformers never ties KimiLinearForCausalLM (its ``_tied_weights_keys`` is empty): a config saying
    ``tie_word_embeddings: true`` runs distinct ``embed_tokens`` and ``lm_head``, both loaded, and the export
    keeps the flag. Tying them instead is the broken variant (``test_hf_fields``)."""
    hf, ours = pair(11, tie_word_embeddings=True)
    assert hf.lm_head.weight.data_ptr() != hf.model.embed_tokens.weight.data_ptr()
    assert not ours.spec.tie_word_embeddings
    ids = torch.randint(1, VOCAB, (2, 37), generator=torch.Generator().manual_seed(12))
    check_logits_and_grads(hf, ours, ids)
    out = check_round_trip(hf, tmp_path, ids[:1], "KimiLinearForCausalLM", prepare=promoted_copy)
    assert from_hf_config(out).hf_extra["tie_word_embeddings"] is True
