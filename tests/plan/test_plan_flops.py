"""Model FLOPs, MFU and context-parallel communication volume, by hand on small shapes."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_plan_components import small_spec

from megaseq.models.presets import get_preset
from megaseq.models.spec import from_hf_config
from megaseq.plan import flops as F
from megaseq.plan.mesh import Mesh


def test_causal_keys():
    assert F.causal_keys(5, 3) == 1 + 2 + 3 + 3 + 3
    assert F.causal_keys(4, 10) == 1 + 2 + 3 + 4
    assert F.causal_keys(10, 9.5) == pytest.approx(9.5 * 10.5 / 2 + 0.5 * 9.5)


def test_mlp_and_kda_flops_by_hand():
    spec = small_spec()  # H 8, I 12 dense; MoE E 4, K 2, I 6, 1 shared; KDA 2 heads x 3
    assert F.mlp_flops(spec, 10, "dense") == 6 * 10 * 8 * 12
    # router 2 S H E + (K + shared) SwiGLU experts 6 S H I
    assert F.mlp_flops(spec, 10, "moe") == 2 * 10 * 8 * 4 + 6 * 10 * 8 * 6 * 3
    proj = 2 * 10 * (3 * 8 * 6 + 8 * 3 + 3 * 6 + 8 * 2 + 8 * 3 + 3 * 6 + 6 * 8)
    conv = 2 * 10 * 18 * 4
    # per token and head (chunk 64, d 3): Aqk + Akk + w + u 4 x 2*32*3, Aqk v 2*32*3, states 3 x 2*9
    chunk = 2 * 2 * 32 * 3 * 2 + 2 * 32 * 3 + 3 * 2 * 9
    assert F.kda_flops(spec, 10) == proj + conv + 10 * 2 * chunk


def test_dsa_flops_by_hand():
    spec = small_spec()  # MLA 2 heads, q_lora 6, kv_lora 4, qk 3, v 5; indexer 2 x 4, topk 8, kpool 4
    mixer, indexer = F.dsa_flops(spec, 10, full_indexer=True)
    proj = 2 * 10 * (8 * 6 + 6 * 2 * 3 + 8 * 4 + 4 * 2 * 8 + 2 * 5 * 8)
    keys = F.causal_keys(10, 8 + 1.5)  # topk + the average incomplete-pool tail (kpool - 1) / 2
    assert mixer == pytest.approx(proj + 2 * 2 * (3 + 5) * keys)
    idx_proj = 2 * 10 * (6 * 2 * 4 + 8 * 4 + 8 * 2 + 4 * 8) + 2 * 10 * 4 * 4
    pools = F.causal_keys(10, 10) / 4
    assert indexer == pytest.approx(idx_proj + 2 * pools * 2 * 4 + 2 * pools * 2)
    assert F.dsa_flops(spec, 10, full_indexer=False)[1] == 0.0  # a shared layer reuses the selection


def test_step_flops_counts_training_as_three_forwards():
    spec = small_spec()
    st = F.step_flops(spec, 10)
    parts = [F.layer_flops(spec, 10, i) for i in range(spec.num_layers)]
    assert st.layers == pytest.approx(3 * sum(p.mixer + p.hc for p in parts))
    assert st.mlp == pytest.approx(3 * sum(p.mlp for p in parts))
    assert st.indexer == pytest.approx(sum(p.indexer for p in parts))  # no grad: forward only
    assert st.loss == 3 * 2 * 10 * 8 * 100
    assert st.per_token == pytest.approx(st.total / 10)


def test_a_frozen_base_skips_a_third_of_the_weights_matmuls_not_the_attention_cores():
    """``StepFlops.frozen_share`` (LoRA's step time): the weight gradients are a third of every weight's matmuls;
    the attention cores (here DSA's over its selected keys and KDA's chunks) and the no-grad indexer keep theirs.
    Kimi-Linear-48B-A3B at 8K is mostly weights (near a third skipped), at 1M mostly attention (near none)."""
    spec = small_spec()
    st = F.step_flops(spec, 10)
    parts = [F.layer_flops(spec, 10, i) for i in range(spec.num_layers)]
    cores = sum(F.mixer_core_flops(spec, 10, i) for i in range(spec.num_layers))
    assert all(0 < p.core < p.mixer for p in parts)
    keys = F.causal_keys(10, 8 + 1.5)
    assert F.mixer_core_flops(spec, 10, spec.layer_types.index("dsa")) == pytest.approx(2 * 2 * (3 + 5) * keys)
    assert st.cores == pytest.approx(3 * cores)
    assert st.frozen_share * st.total == pytest.approx((st.total - st.indexer - 3 * cores) / 3)
    kimi = from_hf_config(str(Path(__file__).parents[2] / "recipes/kimi-linear-48b-a3b-instruct/config.json"))
    short, long = F.step_flops(kimi, 8192).frozen_share, F.step_flops(kimi, 1 << 20).frozen_share
    assert 0.25 < short < 1 / 3 and long < 0.05


def test_active_flops_of_full_model_near_six_per_active_param():
    spec = get_preset("glm5-flash")
    from megaseq.plan.components import count_params

    active = count_params(spec).active(spec) - spec.vocab_size * spec.hidden_size  # the embedding is a lookup
    per_token = F.step_flops(spec, 4096).per_token
    assert 6 * active < per_token < 6.6 * active  # 6 FLOPs per active parameter + short-context attention


def test_mfu():
    assert F.mfu(1000, 1e12, 2, peak=1e15) == 0.5


def test_comm_volume_by_hand():
    spec = small_spec()
    v = F.comm_volume(spec, 16, Mesh(cp=4))
    n, a2a = 4, 3 / 4
    # KDA: q, k, v bf16 (3 * 6 * 2), g fp32 (6 * 4), beta (2 * 2) in, o (6 * 2) out; backward the same
    assert v["kda"]["ulysses"] == pytest.approx(2 * n * a2a * (36 + 24 + 4 + 12))
    # MLA Ulysses: q, k (2 * 3) and v, o (2 * 5) bf16 per head, forward and backward
    assert v["dsa"]["ulysses"] == pytest.approx(2 * n * a2a * 2 * (2 * 2 * 3 + 2 * 2 * 5))
    # gather-KV: 3 other ranks' latents (fp32, forward + backward) and indexer keys + gates (fp32, forward)
    assert v["dsa"]["gather_kv"] == n * 3 * (2 * 4 * 4 + 2 * 4 * 4)
    assert v["dsa"]["mode"] == "ulysses" and v["dsa"]["per_step"] == v["dsa"]["ulysses"] * 1


def test_glm5_gather_kv_moves_less_than_ulysses():
    v = F.comm_volume(get_preset("glm5-flash"), 1 << 20, Mesh(cp=8))["dsa"]
    assert v["mode"] == "gather_kv" and v["gather_kv"] < v["ulysses"]
