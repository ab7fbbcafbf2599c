"""Named architectures. A recipe says ``model.name: glm5-flash-tiny`` or a path to a HF checkpoint.

- ``glm5-flash``        the full GLM-5.3-Flash text model (45 layers, hidden 4096), for planning.
- ``glm5-flash-1gpu``   the largest-context workhorse for one H200 host: the same layer pattern at
                        hidden 2048, 8 layers (6 KDA + 2 DSA), 32 experts top-8, full vocabulary, 4 streams.
- ``glm5-flash-slice``  the full model's real layer shapes with 4 layers (3 KDA + 1 DSA), so per-layer
                        throughput can be set beside the full model's.
- ``glm5-flash-tiny``   a CPU-sized model of the same layer pattern (the embedded default, DNA vocab).
- ``qwen3-moe-tiny``    a CPU-sized Qwen3-MoE (softmax attention + GQA + RoPE + softmax router).
"""

from __future__ import annotations

import difflib

from megaseq.models.spec import ModelSpec

DNA_VOCAB_SIZE = 16  # A C G T N + specials, padded to 16 (see megaseq.data.tokenizer)


def _glm5_pattern(n: int) -> tuple[str, ...]:
    return tuple("dsa" if i % 4 == 3 else "kda" for i in range(n))


def _glm5_indexer(layer_types: tuple[str, ...]) -> tuple[str, ...]:
    """Every DSA layer runs its own indexer. (A 'shared' layer must directly follow a 'full' DSA layer,
    as in transformers; with DSA every 4th layer no layer can share.)"""
    return ("full",) * len(layer_types)


def glm5_flash() -> ModelSpec:
    n = 45
    lt = _glm5_pattern(n)
    return ModelSpec(
        family="glm5_next", vocab_size=154880, hidden_size=4096, num_layers=n, layer_types=lt,
        mlp_types=("dense",) * 3 + ("moe",) * (n - 3), rms_norm_eps=1e-5, pad_token_id=154820,
        intermediate_size=12288, swiglu_limit=10.0, num_experts=288, num_experts_per_tok=8,
        moe_intermediate_size=2048, num_shared_experts=1, router="sigmoid_bias", routed_scaling_factor=2.5,
        num_attention_heads=64, num_key_value_heads=64, q_lora_rank=1536, kv_lora_rank=512,
        qk_nope_head_dim=256, qk_rope_head_dim=0, v_head_dim=256, index_topk=2048, index_n_heads=32,
        index_head_dim=128, index_kpool=16, indexer_types=_glm5_indexer(lt),
        linear_num_heads=64, linear_head_dim=128, linear_conv_kernel=4, linear_lower_bound=-5.0,
        hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6,
    )


def glm5_flash_1gpu() -> ModelSpec:
    n = 8
    lt = _glm5_pattern(n)
    return glm5_flash().replace(
        hidden_size=2048, num_layers=n, layer_types=lt, mlp_types=("dense",) + ("moe",) * (n - 1),
        intermediate_size=6144, num_experts=32, moe_intermediate_size=1024,
        num_attention_heads=16, num_key_value_heads=16, linear_num_heads=16,
        indexer_types=_glm5_indexer(lt),
    )


def glm5_flash_slice() -> ModelSpec:
    n = 4
    lt = _glm5_pattern(n)
    return glm5_flash().replace(
        num_layers=n, layer_types=lt, mlp_types=("moe",) * n, num_experts=32,
        indexer_types=_glm5_indexer(lt),
    )


def glm5_flash_tiny() -> ModelSpec:
    n = 8
    lt = _glm5_pattern(n)
    return ModelSpec(
        family="glm5_next", vocab_size=DNA_VOCAB_SIZE, hidden_size=64, num_layers=n, layer_types=lt,
        mlp_types=("dense",) + ("moe",) * (n - 1), rms_norm_eps=1e-5, pad_token_id=0,
        intermediate_size=128, swiglu_limit=10.0, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=32, num_shared_experts=1, router="sigmoid_bias", routed_scaling_factor=2.5,
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=32,
        qk_nope_head_dim=16, qk_rope_head_dim=0, v_head_dim=16, index_topk=256, index_n_heads=16,
        index_head_dim=16, index_kpool=16, indexer_types=_glm5_indexer(lt),
        linear_num_heads=4, linear_head_dim=16, linear_conv_kernel=4, linear_lower_bound=-5.0,
        hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6,
    )


def qwen3_moe_tiny() -> ModelSpec:
    n = 4
    return ModelSpec(
        family="qwen3_moe", vocab_size=DNA_VOCAB_SIZE, hidden_size=64, num_layers=n,
        layer_types=("attention",) * n, mlp_types=("moe",) * n, rms_norm_eps=1e-6, pad_token_id=0,
        intermediate_size=128, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        router="softmax", norm_topk_prob=True, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        rope_theta=10000.0, qk_norm=True,
    )


PRESETS = {
    "glm5-flash": glm5_flash,
    "glm5-flash-1gpu": glm5_flash_1gpu,
    "glm5-flash-slice": glm5_flash_slice,
    "glm5-flash-tiny": glm5_flash_tiny,
    "qwen3-moe-tiny": qwen3_moe_tiny,
}


def get_preset(name: str) -> ModelSpec:
    try:
        return PRESETS[name]()
    except KeyError:
        close = difflib.get_close_matches(name, PRESETS, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ValueError(
            f"unknown model preset {name!r}.{hint} Presets: {', '.join(PRESETS)}; "
            "or give a path to a Hugging Face checkpoint directory or config.json"
        ) from None


def resolve_spec(name_or_path: str) -> ModelSpec:
    """A preset name, or a HF checkpoint directory / config.json path."""
    from pathlib import Path

    from megaseq.models.spec import from_hf_config

    if name_or_path in PRESETS:
        return get_preset(name_or_path)
    p = Path(name_or_path)
    if p.exists():
        return from_hf_config(p)
    return get_preset(name_or_path)  # raises with the list of presets
