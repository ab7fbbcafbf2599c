"""DeepSeek-V3.2 parity with transformers' ``DeepseekV32ForCausalLM`` (float64, CPU) and its export.

DeepSeek-V3's tiny config (``test_deepseek_v3_parity``) with every layer DeepSeek sparse attention: an
indexer of 16 heads x 10 (4 of them rotated) keeping 8 keys per query, over sequences longer than that. HF's
float32 casts are promoted to float64 outside its RMSNorm and rotary embedding (whose float32 megaseq keeps
literally), as megaseq computes the router, the indexer scores and the sparse softmax in
``promote_types(dtype, float32)``. With few indexer heads ReLU'd head scores of exactly zero make ties:
scored whole on the CPU, megaseq keeps the keys ``torch.topk`` keeps on transformers' row (2 heads below).
"""

from __future__ import annotations

import pytest
import torch

from family_parity import check_logits_and_grads, check_packed, check_round_trip, hf_promoted, make_pair
from megaseq.models.spec import from_hf_config

transformers = pytest.importorskip("transformers")
from test_deepseek_v3_parity import YARN  # noqa: E402
from transformers.models.deepseek_v32 import modeling_deepseek_v32  # noqa: E402

torch.set_num_threads(2)
VOCAB = 53
HF = hf_promoted(modeling_deepseek_v32, {"DeepseekV32RMSNorm", "DeepseekV32RotaryEmbedding"}, min_changes=5)


def hf_config(**kw) -> transformers.DeepseekV32Config:
    base = dict(vocab_size=VOCAB, hidden_size=36, intermediate_size=22, moe_intermediate_size=10, num_hidden_layers=4,
                num_attention_heads=3, num_key_value_heads=3, q_lora_rank=14, kv_lora_rank=12, qk_nope_head_dim=6,
                qk_rope_head_dim=4, v_head_dim=5, n_routed_experts=8, n_group=4, topk_group=2, num_experts_per_tok=3,
                n_shared_experts=1, routed_scaling_factor=1.7, first_k_dense_replace=2, rope_parameters=dict(YARN),
                max_position_embeddings=64, rms_norm_eps=1e-6, pad_token_id=0, index_topk=8, index_n_heads=16,
                index_head_dim=10, num_nextn_predict_layers=0)
    return transformers.DeepseekV32Config(**{**base, **kw})


def pair(seed: int, **kw):
    return make_pair(HF.DeepseekV32ForCausalLM, hf_config(**kw), seed)


def promoted_copy(model: torch.nn.Module) -> torch.nn.Module:
    """The reloaded HF model's weights in the promoted class (the reload is the real class)."""
    copy = HF.DeepseekV32ForCausalLM(model.config).to(torch.float64)
    copy.load_state_dict(model.state_dict())
    return copy


def test_spec_from_config() -> None:
    spec = from_hf_config(hf_config().to_dict())
    assert spec.family == "deepseek_v32" and spec.layer_types == ("dsa",) * 4 and spec.index_kpool == 1
    assert spec.indexer_types == ("full",) * 4 and spec.index_topk == 8


def test_logits_and_grads_match() -> None:
    hf, ours = pair(1)
    ids = torch.randint(1, VOCAB, (2, 37), generator=torch.Generator().manual_seed(2))
    err, worst = check_logits_and_grads(hf, ours, ids)
    print(f"\nDeepSeek-V3.2 parity: logits {err:.1e}, worst grad {worst:.1e}")
    assert all(p.grad is None for n, p in ours.named_parameters() if ".indexer." in n)  # frozen, as HF's no_grad


def test_packed_documents() -> None:
    hf, ours = pair(3)
    check_packed(hf, ours, [[11, 1, 17], [29]], VOCAB, seed=4)


def test_hf_round_trip(tmp_path) -> None:
    hf, _ = pair(7)
    ids = torch.randint(1, VOCAB, (1, 23), generator=torch.Generator().manual_seed(8))
    check_round_trip(hf, tmp_path, ids, "DeepseekV32ForCausalLM", prepare=promoted_copy)


def test_broken_block_fails() -> None:
    """The indexer's keys without their RoPE (GLM's NoPE indexer): the selection and so the logits differ."""
    hf, ours = pair(9)
    for layer in ours.layers:
        layer.self_attn.indexer.rope_dim = 0
    ids = torch.randint(1, VOCAB, (1, 31), generator=torch.Generator().manual_seed(10))
    with pytest.raises(AssertionError, match="logits differ"):
        check_logits_and_grads(hf, ours, ids)


@pytest.mark.parametrize("broken", [False, True])
def test_two_indexer_heads_break_ties_as_transformers(broken, monkeypatch) -> None:
    """2 indexer heads: about a quarter of the keys score exactly 0, so rows cut inside blocks of ties. The
    broken variant (ties to the lowest index) must change the logits."""
    from megaseq.ops.indexer import scoring as indexer_scoring

    if broken:
        monkeypatch.setattr(indexer_scoring, "topk_as_transformers",
                            lambda x, k, row_len, floor: indexer_scoring.topk_lowest_index_ties(x, k))
    hf, ours = pair(11, index_n_heads=2)
    ids = torch.randint(1, VOCAB, (2, 37), generator=torch.Generator().manual_seed(12))
    if broken:
        with pytest.raises(AssertionError, match="logits differ"):
            check_logits_and_grads(hf, ours, ids)
    else:
        err, worst = check_logits_and_grads(hf, ours, ids)
        print(f"\nDeepSeek-V3.2 with 2 indexer heads: logits {err:.1e}, worst grad {worst:.1e}")
