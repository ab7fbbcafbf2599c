"""Memory formulas of megaseq.plan.components against hand-computed values on small odd shapes, and
against the formulas the memory modules state for themselves."""

from __future__ import annotations

import pytest

from megaseq.models.presets import get_preset
from megaseq.models.spec import ModelSpec
from megaseq.plan import components as C
from megaseq.plan.mesh import GIB, Mesh, Precision

AUTOCAST = Precision()  # fp32 params + bf16 autocast: param 4, grad 4, moments 8, compute 2, stream 4
FP32 = C.precision_for("fp32")
BF16_WEIGHTS = Precision(param=2, grad=2, moments=8, compute=2, stream=2, f32=4, autocast=False, master=4)


def small_spec(**kw) -> ModelSpec:
    """H=8, 3 streams, KDA 2 heads x 3, MLA 2 heads (nope 3, v 5), 4 experts top-2 (I=6), vocab 100."""
    base = dict(
        family="glm5_next", vocab_size=100, hidden_size=8, num_layers=4,
        layer_types=("kda", "kda", "kda", "dsa"), mlp_types=("dense", "moe", "moe", "moe"),
        intermediate_size=12, swiglu_limit=10.0, num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=6, num_shared_experts=1, num_attention_heads=2,
        num_key_value_heads=2, q_lora_rank=6, kv_lora_rank=4, qk_nope_head_dim=3, qk_rope_head_dim=0,
        v_head_dim=5, index_topk=8, index_n_heads=2, index_head_dim=4, index_kpool=4,
        indexer_types=("full",) * 4, linear_num_heads=2, linear_head_dim=3, linear_conv_kernel=4, hc_mult=3,
        hc_sinkhorn_iters=2,
    )
    base.update(kw)
    return ModelSpec(**base)


def test_precision_modes():
    assert C.precision_for("bf16") == AUTOCAST  # fp32 weights + bf16 autocast
    # model.weights bf16: bf16 weights and gradients, the optimizer's fp32 master (4 B) + moments (8 B)
    assert C.precision_for("bf16", "bf16") == BF16_WEIGHTS
    assert C.precision_for("fp64").compute == 8
    with pytest.raises(ValueError, match="model.dtype"):
        C.precision_for("fp8")
    with pytest.raises(ValueError, match="model.weights"):
        C.precision_for("bf16", "fp8")


def test_mesh_sizes_and_errors():
    m = Mesh(dp=3, cp=4, ep=2, gpus_per_host=8)
    assert (m.world, m.gpus_on_host, m.hosts, m.shard) == (24, 8, 3, 1)
    assert Mesh(dp=2, fsdp=True).shard == 2  # True: over the whole world (dp_cp)
    assert (Mesh(dp=2, cp=4, fsdp="dp").shard, Mesh(dp=2, cp=4, fsdp="dp_cp").shard) == (2, 8)
    assert not Mesh(dp=1, cp=1, fsdp="dp_cp").sharded and Mesh(dp=2, fsdp="dp").sharded
    with pytest.raises(ValueError, match="parallel.fsdp"):
        Mesh(fsdp="zero3")
    assert Mesh(cp=2, gpus_per_host=8).gpus_on_host == 2
    with pytest.raises(ValueError, match="cp"):
        Mesh(cp=0)
    with pytest.raises(ValueError, match="mla_mode"):
        Mesh(mla_mode="ring")


def test_boundary_linear_inputs_norm():
    spec = small_spec()
    # 10 tokens x 3 streams x 8 hidden x 4 bytes (fp32 stream under autocast)
    assert C.boundary_bytes(spec, 10, AUTOCAST) == 10 * 3 * 8 * 4 == 960
    # autocast: each of 6 linears saves its own bf16 cast of a 8-wide fp32 input: 6 * 2 * 8
    assert C.linear_inputs(8, 6, 4, AUTOCAST) == 96
    # a bf16 input is shared by the linears (no cast): 2 * 8 once
    assert C.linear_inputs(8, 6, 2, AUTOCAST) == 16
    assert C.linear_inputs(8, 6, 4, FP32) == 32
    # RMSNorm: fp32 input (4) + normalised value in the input dtype (2) per element; output promotes to fp32
    assert C.norm_saved(5, 2, AUTOCAST) == ((4 + 2) * 5, 4)
    assert C.norm_saved(5, 4, FP32) == (40, 4)


def test_hc_and_merge():
    spec = small_spec()
    N, H = 3, 8
    # autocast, fp32 stream: no flat copy; fn's bf16 cast 2*N*H = 48; small fp32 terms:
    # Sinkhorn (2*2-1) divisions x (N*N + N) = 3 * 12 = 36, + 3*N*N + 4*N = 27 + 12 = 39 -> 75 floats = 300 B
    assert C.hc_saved(spec, AUTOCAST) == 2 * N * H + 4 * 75 == 348
    # bf16 model: flat fp32 copy 4*N*H = 96, fp32 normalised input 96, + 300
    assert C.hc_saved(spec, BF16_WEIGHTS) == 96 + 96 + 300
    # merge: y (2 B x H) + bf16 cast of the residual 2*N*H + post 4*N + comb 2*N*N = 16 + 48 + 12 + 18
    assert C.merge_saved(spec, 2, AUTOCAST) == 94
    assert C.merge_saved(spec, 4, FP32) == 32 + 0 + 12 + 4 * 9


def test_param_counts_small_spec_by_hand():
    spec = small_spec()
    H, D, Dk = 8, 6, 3
    kda = 3 * H * D + 3 * D * 4 + H * Dk + Dk * D + D + 2 + H * 2 + H * Dk + Dk * D + Dk + D * H
    assert C.kda_params(spec) == kda == 144 + 72 + 24 + 18 + 6 + 2 + 16 + 24 + 18 + 3 + 48
    # MLA: q_a 8*6 + norm 6 + q_b 6*2*3; kv_a 8*4 + norm 4 + kv_b 4*2*(3+5); o 2*5*8
    assert C.mla_params(spec) == 48 + 6 + 36 + 32 + 4 + 64 + 80
    # indexer: wq_b 6*2*4, wk 8*4, k_norm 2*4, weights 8*2, ape 4*4, gate 4*8
    assert C.indexer_params(spec) == 48 + 32 + 8 + 16 + 16 + 32
    assert C.mlp_params(spec, "dense") == (3 * 8 * 12, 0)
    assert C.mlp_params(spec, "moe") == (4 * 8 + 3 * 8 * 6, 3 * 4 * 8 * 6)
    counts = C.count_params(spec)
    hc = 2 * ((2 + 3) * 3 * 3 * 8 + (2 + 3) * 3 + 3)  # two hyper-connections: fn, base, scale
    assert counts.layers[0] == (hc + 16 + kda + 288, 0, 0)
    assert counts.layers[3][2] == C.indexer_params(spec)  # no gradient: the indexer runs under no_grad
    assert counts.trainable == counts.total - C.indexer_params(spec) * 1


@pytest.mark.parametrize("name", ["glm5-flash-tiny", "qwen3-moe-tiny"])
def test_param_counts_match_built_model(name):
    torch = pytest.importorskip("torch")
    from megaseq.models.build import build_model

    spec = get_preset(name)
    model = build_model(spec, dtype=torch.float32, seed=0)
    assert C.count_params(spec).total == sum(p.numel() for p in model.parameters())


def test_full_model_size_matches_brief():
    spec = get_preset("glm5-flash")
    counts = C.count_params(spec)
    assert abs(counts.total / 320e9 - 1) < 0.05  # GLM-5.3-Flash: about 320B parameters
    assert abs(counts.active(spec) / 18e9 - 1) < 0.05  # and 18B active


def test_state_bytes():
    spec = small_spec()
    counts = C.count_params(spec)
    P, T = counts.total, counts.trainable
    assert C.param_bytes(counts, Mesh(), AUTOCAST) == 4 * P
    assert C.param_bytes(counts, Mesh(dp=4, fsdp=True), AUTOCAST) == 4 * P // 4
    assert C.optimizer_gpu_bytes(counts, Mesh(), AUTOCAST, False, 100) == 8 * T
    # OffloadStreamAdamW: two staging slots of one bucket (master, m, v, grad) + a temporary, fp32
    assert C.optimizer_gpu_bytes(counts, Mesh(), AUTOCAST, True, 100) == (2 * 4 + 1) * 100 * 4
    assert C.optimizer_host_bytes(counts, Mesh(), True) == 16 * T
    assert C.weight_copy_bytes(1000, AUTOCAST, Mesh()) == 2000
    assert C.weight_copy_bytes(1000, AUTOCAST, Mesh(dp=2, fsdp=True)) == 2000  # FSDP gathers fp32: still cast
    assert C.weight_copy_bytes(1000, FP32, Mesh()) == C.weight_copy_bytes(1000, BF16_WEIGHTS, Mesh()) == 0
    # bf16 weights: 2 B weights; the fp32-kept ones (router, KDA conv/decay, mHC base/scale) 4 B and whole
    K = counts.kept
    assert 0 < K < P
    assert C.param_bytes(counts, Mesh(dp=4, fsdp=True), BF16_WEIGHTS) == 2 * (P - K) // 4 + 4 * K
    assert C.optimizer_gpu_bytes(counts, Mesh(dp=4, fsdp=True), BF16_WEIGHTS, False, 1) == 12 * (T - K) // 4 + 12 * K
    assert C.grad_bytes(1000, Mesh(dp=4, fsdp=True), BF16_WEIGHTS, 0) == 2 * 1000 // 4
    assert C.grad_bytes(1000, Mesh(dp=4, fsdp=True), BF16_WEIGHTS, 0, accumulate=True) == 4 * 1000 // 4  # fp32 sum
    # FSDP: the running and the prefetched block, and the root's head, in the weights' dtype; in backward also
    # the block's unsharded gradient, the fp32 reduce-scatter input and output, and the head's gradient
    m2 = Mesh(dp=2, fsdp="dp")
    assert C.fsdp_buffers(100, 60, 30, m2, BF16_WEIGHTS, 4, False) == (100 + 60 + 30) * 2
    assert C.fsdp_buffers(100, 60, 30, m2, BF16_WEIGHTS, 4, True) == (100 + 60 + 30) * 2 + 100 * 6 + 200 + 30 * 2
    assert C.fsdp_buffers(100, 60, 30, Mesh(dp=2), BF16_WEIGHTS, 4, True) == 0


def test_loss_bytes_by_hand():
    """(The runtime's copy of this formula is gone: tests/plan/test_plan_formulas.py measures the one left.)"""
    spec = small_spec(vocab_size=97)
    # by hand, fp32: plain 12 B per logit; chunked: per-token lse + loss (2 * 4) and the input gradient
    # (8 * 4), the weight gradient 97 * 8 * 4, one strip 64 * 97 * 8 + the fp32 grad_hidden block 64 * 8 * 4
    assert C.loss_bytes(spec, 10, 4, False, 0) == 10 * 97 * 12
    assert C.loss_bytes(spec, 10, 4, True, 64) == 10 * (8 + 32) + 97 * 32 + 10 * 97 * 8 + 10 * 32


def test_allocator_reserve():
    assert C.allocator_reserve(100 * GIB) == 2 * GIB + 5 * GIB


def test_sequence_segment_terms_by_hand():
    """Sequence segments (``memory.model_segment_tokens``): the per-layer terms see one segment's tokens
    and the DSA keys of the whole sequence; the caches are over the whole sequence; gradients are held."""
    from dataclasses import replace

    from megaseq.plan.choice import base_settings
    from megaseq.plan.phases import evaluate
    from megaseq.plan.run import Run
    from megaseq.plan.segments import segment_store_bytes

    spec = small_spec()  # 3 KDA (2 heads x 3, conv 4, H 8) + 1 DSA (kv_lora 4, indexer dim 4)
    S, T = 1000, 256
    base = dict(base_settings(None, S).to_dict(), indexer_query_chunk=64)
    run = Run(spec=spec, seq_len=S, batch=1, mesh=Mesh(), model_dtype="bf16", memory=dict(base, model_segment_tokens=T),
              counts=C.count_params(spec))
    assert (run.segment, run.n, run.n_seq) == (256, 256, 1000)
    store = segment_store_bytes(run)
    # DSA: latent bf16 (4 * 2) + indexer keys and gates fp32 (2 * 4 * 4) per token, one layer
    assert store["segment caches (DSA latents, indexer keys)"] == 1000 * (4 * 2 + 2 * 4 * 4)
    # the latent's fp32 gradient accumulator, and one more [s, R] during that layer's backward
    assert store["segment latent gradients (fp32)"] == 2 * 1000 * 4 * 4
    # KDA: per layer and segment (4 of them) the fp32 state 2 x 3 x 3 and 3 halo rows of the projected q, k, v
    # (3 x 2 heads x 3 = 18 wide) in bf16
    assert store["segment KDA states"] == 3 * 4 * (2 * 3 * 3 * 4 + 3 * 18 * 2)
    ev = evaluate(run)
    assert store["segment DSA selections (kept)"] == 0  # not asked for
    for k, v in store.items():
        assert ev.breakdown.get(k, 0) == v
    kept = segment_store_bytes(replace(run, memory=run.memory.replace(segment_keep_selection=True)))
    assert kept["segment DSA selections (kept)"] == 1000 * 4 * (8 + 4 - 1)  # one full DSA layer, W = 11
    plain = evaluate(Run(spec=spec, seq_len=T, batch=1, mesh=Mesh(), model_dtype="bf16", memory=base,
                         counts=C.count_params(spec)))
    # the segment's forward holds the gradients of the later segments (as gradient accumulation would)
    assert ev.phases["forward"] > plain.phases["forward"]
    # a segment as long as the sequence is no segmentation
    assert Run(spec=spec, seq_len=S, batch=1, mesh=Mesh(), model_dtype="bf16",
               memory=dict(base, model_segment_tokens=S), counts=C.count_params(spec)).segment == 0
