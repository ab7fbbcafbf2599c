"""Qwen3-MoE parity with transformers: hidden states, logits and every gradient, float64 on the CPU.

A tiny config with odd sizes: 3 layers (one dense via mlp_only_layers), GQA 6/2 heads, head_dim 10 not
equal to hidden/heads, 7 experts top-3. HF runs its eager attention and eager experts, and its router's
float32 softmax promoted to float64 (``promote_hf_routers_``), as megaseq's router computes in
``promote_types(dtype, float32)``; tests/models/test_moe.py checks the unmodified router in float32 and bf16.
"""

from __future__ import annotations

import pytest
import torch

from megaseq.models.common.context import SeqContext
from megaseq.models.qwen3_moe.model import Qwen3MoeModel
from megaseq.models.spec import from_hf_config
from megaseq.ops import dispatch

transformers = pytest.importorskip("transformers")
from test_moe import promote_hf_routers_  # noqa: E402

torch.set_num_threads(2)
RTOL = 1e-10


def hf_config(norm_topk_prob: bool = True, **kw) -> transformers.Qwen3MoeConfig:
    base = dict(vocab_size=53, hidden_size=36, intermediate_size=22, moe_intermediate_size=14,
                num_hidden_layers=3, num_attention_heads=6, num_key_value_heads=2, head_dim=10,
                num_experts=7, num_experts_per_tok=3, mlp_only_layers=[1], norm_topk_prob=norm_topk_prob,
                rope_parameters={"rope_type": "default", "rope_theta": 1000.0}, pad_token_id=0,
                rms_norm_eps=1e-6, tie_word_embeddings=False)
    cfg = transformers.Qwen3MoeConfig(**{**base, **kw})
    cfg._attn_implementation = "eager"
    cfg._experts_implementation = "eager"
    return cfg


def make_pair(cfg: transformers.Qwen3MoeConfig, seed: int) -> tuple[torch.nn.Module, Qwen3MoeModel]:
    """A randomized HF model (routers promoted to float64) and a megaseq model with the same weights."""
    torch.manual_seed(seed)
    hf = promote_hf_routers_(transformers.Qwen3MoeForCausalLM(cfg).to(torch.float64).eval())
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float64)
            p.copy_(1.0 + 0.2 * noise if name.endswith("norm.weight") else 0.25 * noise)
    ours = Qwen3MoeModel(from_hf_config(cfg.to_dict())).to(torch.float64).eval()
    state = {k.removeprefix("model."): v for k, v in hf.state_dict().items()}
    ours.load_state_dict(state, strict=True)
    return hf, ours


def assert_close(name: str, got: torch.Tensor, want: torch.Tensor, rtol: float = RTOL) -> None:
    err = (got - want).abs().max().item()
    scale = want.abs().max().item()
    assert err <= rtol * max(scale, 1e-300), f"{name}: max abs err {err:.3e}, scale {scale:.3e}"


def test_spec_from_hf_config() -> None:
    spec = from_hf_config(hf_config().to_dict())
    assert spec.num_experts == 7 and spec.head_dim == 10 and spec.rope_theta == 1000.0
    assert spec.mlp_types == ("moe", "dense", "moe") and spec.num_key_value_heads == 2


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_logits_and_grads_match_hf(norm_topk_prob: bool) -> None:
    hf, ours = make_pair(hf_config(norm_topk_prob), seed=11)
    gen = torch.Generator().manual_seed(12)
    ids = torch.randint(0, 53, (2, 19), generator=gen)
    ids[0, 4] = 0  # a padding token: its embedding row gets no gradient in either model
    out = hf(input_ids=ids, output_hidden_states=True)
    hidden = ours(ids)
    assert_close("hidden", hidden, out.hidden_states[-1])
    logits = ours.logits(hidden)
    assert_close("logits", logits, out.logits)
    # per-layer boundaries too (HF's hidden_states[i] is the input of layer i)
    h = ours.embed(ids)
    for i, layer in enumerate(ours.layers):
        assert_close(f"layer {i} input", h, out.hidden_states[i])
        h = layer(h, SeqContext())

    g = torch.randn(logits.shape, generator=gen, dtype=torch.float64)
    (out.logits * g).sum().backward()
    (logits * g).sum().backward()
    ours_params = dict(ours.named_parameters())
    for name, p in hf.named_parameters():
        mine = ours_params[name.removeprefix("model.")]
        assert p.grad is not None and mine.grad is not None, name
        assert_close(f"grad {name}", mine.grad, p.grad)


def test_packed_documents_match_each_document_alone() -> None:
    """Packed rows with doc_ids give each document's own HF result (positions restart, no leak)."""
    hf, ours = make_pair(hf_config(), seed=21)
    gen = torch.Generator().manual_seed(22)
    lengths = [[5, 1, 11], [17]]  # a 1-token document and a row with a single document
    S = 17
    ids = torch.randint(1, 53, (2, S), generator=gen)
    doc_ids = torch.tensor([[d for d, n in enumerate(row) for _ in range(n)] for row in lengths])
    hidden = ours(ids, doc_ids=doc_ids)
    logits = ours.logits(hidden)
    g = torch.randn(logits.shape, generator=gen, dtype=torch.float64)
    (logits * g).sum().backward()
    for b, row in enumerate(lengths):
        start = 0
        for n in row:
            ref = hf(input_ids=ids[b:b + 1, start:start + n])
            assert_close(f"row {b} doc at {start}", logits[b:b + 1, start:start + n], ref.logits)
            (ref.logits * g[b:b + 1, start:start + n]).sum().backward()  # HF grads accumulate over docs
            start += n
    ours_params = dict(ours.named_parameters())
    for name, p in hf.named_parameters():
        assert_close(f"grad {name}", ours_params[name.removeprefix("model.")].grad, p.grad)


def test_dispatch_records_reference_kernels() -> None:
    _, ours = make_pair(hf_config(), seed=31)
    dispatch.reset_records()
    ours(torch.randint(0, 53, (1, 6)))
    table = {(layer, r.op): r.impl for layer, r in dispatch.records()}
    assert table[("layers.0.self_attn", "attention")] == "torch_reference"
    assert table[("layers.2.mlp", "grouped_mm")] == "torch_loop"
    assert ("layers.1.mlp", "grouped_mm") not in table  # layer 1 is dense
    assert ours.layers[0].mlp.last_tokens_per_expert.sum() == 6 * 3


def test_tied_embeddings_share_the_weight() -> None:
    cfg = hf_config(tie_word_embeddings=True)
    hf, ours = make_pair(cfg, seed=41)
    assert ours.lm_head.weight is ours.embed_tokens.weight
    ids = torch.randint(0, 53, (1, 9), generator=torch.Generator().manual_seed(42))
    assert_close("tied logits", ours.logits(ours(ids)), hf(input_ids=ids).logits)


YARN = {"rope_type": "yarn", "rope_theta": 1000.0, "factor": 4.0, "original_max_position_embeddings": 16}


@pytest.mark.parametrize("rope", [YARN, {**YARN, "attention_factor": 1.3, "beta_fast": 16, "beta_slow": 2},
                                  {"rope_type": "linear", "rope_theta": 1000.0, "factor": 2.0}])
def test_scaled_rope_matches_hf(rope) -> None:
    """Qwen3's YaRN (as its model cards add it past 32K) and linear RoPE over 71 tokens, past the original
    16-token window: logits and every gradient."""
    hf, ours = make_pair(hf_config(rope_parameters=dict(rope), max_position_embeddings=64), seed=51)
    assert ours.spec.rope_scaling["rope_type"] == rope["rope_type"]
    ids = torch.randint(0, 53, (1, 71), generator=torch.Generator().manual_seed(52))
    out = hf(input_ids=ids)
    logits = ours.logits(ours(ids))
    assert_close("logits", logits, out.logits)
    g = torch.randn(logits.shape, generator=torch.Generator().manual_seed(53), dtype=torch.float64)
    (out.logits * g).sum().backward()
    (logits * g).sum().backward()
    mine = dict(ours.named_parameters())
    for name, p in hf.named_parameters():
        assert_close(f"grad {name}", mine[name.removeprefix("model.")].grad, p.grad)
    # broken: the default RoPE where the config says YaRN
    for layer in ours.layers:
        layer.self_attn.rope_scaling = {}
    with pytest.raises(AssertionError, match="logits"):
        assert_close("logits", ours.logits(ours(ids)), out.logits)


def test_refuses_unimplemented_rope() -> None:
    with pytest.raises(ValueError, match="rope_type 'dynamic' is not supported"):
        from_hf_config(hf_config(rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}).to_dict())
    with pytest.raises(ValueError, match=r"rope_parameters \['low_freq_factor'\] are not implemented"):
        from_hf_config({**hf_config().to_dict(), "rope_parameters": {**YARN, "low_freq_factor": 1.0}})
