"""The plan counts the fast set's working sets where a run uses it (``plan.planner.planned_fast_ops``): the
Triton norm and SwiGLU keep less, the Triton indexer selection scores ``[c, P]`` not ``[c, I, P]``, Liger's
loss holds one chunk of logits beside its two gradients. Each stays an upper bound of what the H200 measured
with the fast set (the committed bench JSON), and tighter than the base kernels' plan."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megaseq.models.glm5.spec import glm5_flash_1gpu
from megaseq.ops import kernels
from megaseq.plan import components as C
from megaseq.plan import layers
from megaseq.plan.fixes import indexer_chunk_cap
from megaseq.plan.given import peak_for, run_for
from megaseq.plan.planner import PLANNED_FAST_OPS, planned_fast_ops

GIB = 2**30
RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "speed" / "runs"
# the measured runs: the fast set before the Triton hc_mix (R12: fp32 weights; R13: bf16 weights; R14: the plan that
# counts the fast set) and with it (R15, the default calibration)
R12, R13 = "2026-12-02_fast-kernels", "2026-12-02_bf16-weights"
R14, R15 = "2026-12-02_fast-plan", "2026-12-02_hc-mix-triton"


def test_which_ops_are_planned_fast(monkeypatch):
    assert planned_fast_ops("fast", "bf16") == PLANNED_FAST_OPS  # `megaseq plan`: a GPU run as configured
    assert planned_fast_ops("base", "bf16") == frozenset()
    assert planned_fast_ops("fast", "fp32") == frozenset()  # the fast set runs in bf16 only
    assert planned_fast_ops("fast", "bf16", "cpu") == frozenset()  # the CPU runs the references
    monkeypatch.setattr(kernels, "fast_ops_installed", lambda: frozenset({"rms_norm", "swiglu", "indexer_topk"}))
    assert planned_fast_ops("fast", "bf16", "cuda") == {"rms_norm", "swiglu", "indexer_topk"}  # no Liger here
    assert PLANNED_FAST_OPS <= set(kernels.FAST_GPU) and set(kernels.FAST_PACKAGES) == PLANNED_FAST_OPS


def test_fast_formulas():
    spec = glm5_flash_1gpu()
    prec = C.precision_for("bf16", "fp32")
    # the fused SwiGLU keeps gate and up (views) and the product: 3 units of c * I, the torch one 6 with the clamp
    assert layers.swiglu_saved_ci(spec, fast=True) == 3 and layers.swiglu_saved_ci(spec) == 6
    # the Triton norm keeps its input and an fp32 rstd per row; the torch one the fp32 input and the normalised value
    assert C.norm_saved(2048, 4, prec, fast=True) == (4 * 2048 + 4, 4)
    assert C.norm_saved(2048, 4, prec) == (8 * 2048, 4)
    # Liger at 32K tokens, H 2048, V 154,880, bf16: both gradients, one 4096-row chunk of logits, the fp32 loss,
    # the weight gradient's fp32 cast
    N, H, V = 32768, 2048, 154880
    assert C.liger_loss_bytes(N, H, V, 2) == N * H * 2 + V * H * 2 + 4096 * V * 2 + 4 * N + V * H * 4
    assert C.liger_loss_bytes(N, H, V, 2) < C.vocab_loss_bytes(N, H, V, 8192, 2)["chunked"]
    assert C.loss_bytes(spec, N, 2, True, 8192, fast=True) == C.liger_loss_bytes(N, H, V, 2)
    # the Triton hc_mix keeps the streams themselves and its fp32 u [M] and r per token: under autocast (fp32
    # streams) not the reference's bf16 normalised input, with bf16 weights (bf16 streams) not its fp32 copy and
    # fp32 normalised input; the Triton merge keeps the residual itself, not autocast's bf16 cast of it
    N, Hs = spec.hc_mult, spec.hidden_size
    M = (2 + N) * N
    bf16w = C.precision_for("bf16", "bf16")
    assert C.hc_saved(spec, prec) - C.hc_saved(spec, prec, fast=True) == 2 * N * Hs - 4 * (M + 1)
    assert C.hc_saved(spec, bf16w) - C.hc_saved(spec, bf16w, fast=True) == 8 * N * Hs - 4 * (M + 1)
    # the closed-form torch op (the calibration of the R12-R14 runs): the streams and their copy in the GEMM's dtype
    # (bf16 under autocast: the reference's bytes; an fp32 copy of bf16 streams: half the reference's)
    old = C.Calibration(hc_mix_torch=True)
    assert C.hc_saved(spec, prec, old, fast=True) == C.hc_saved(spec, prec)
    assert C.hc_saved(spec, bf16w) - C.hc_saved(spec, bf16w, old, fast=True) == 4 * N * Hs
    assert C.merge_saved(spec, 2, prec) - C.merge_saved(spec, 2, prec, fast=True) == 2 * N * Hs
    # the fused sparse MLA keeps o_lat [Q, Hh, R] beside absorbed's latent copy and log-sum-exp
    args = (spec, N, 1, N, 2, prec, C.Mesh(), "gather_kv", True)
    fused, absorbed = (sum(layers.dsa_saved(*args, impl=i).values()) for i in ("triton", "absorbed"))
    assert fused - absorbed == N * spec.num_attention_heads * (spec.kv_lora_rank + spec.qk_rope_head_dim) * 2
    # the indexer's scoring chunk: [c, P] fp32 and candidates, not the reference's [c, I, P]
    fast, base = (layers.indexer_scoring(spec, 1024, 1 << 18, fast=f) for f in (True, False))
    assert fast * 8 < base


# the runs R12-R14 ran the closed-form torch hc_mix (its input's copy kept), not the Triton one, and
# KDA's gated norm in torch, not fla's
BEFORE_TRITON_HC_MIX = C.Calibration(hc_mix_torch=True)


# the runs R12-R15 ran KDA's forget gate in torch (fla's fused gate joined the fast set after them)
BEFORE_FLA_GATE = PLANNED_FAST_OPS - {"kda_gate"}


def _fast(n: int, memory: dict, weights: str = "fp32", calibration: C.Calibration = C.CAL):
    return peak_for(glm5_flash_1gpu(), n, memory, weights=weights, fast_ops=BEFORE_FLA_GATE, calibration=calibration)


@pytest.mark.parametrize("where,n,memory,weights", [
    (R12 + "/bench_1gpu_fast_32k_nosegments.json", 32768, {"chunked_loss": True, "indexer_query_chunk": 4096},
     "fp32"),
    (R12 + "/bench_1gpu.json", 8192, {}, "fp32"),
    (R12 + "/bench_1gpu.json", 32768,
     {"chunked_loss": True, "indexer_query_chunk": 4096, "kda_segment_tokens": 16384}, "fp32"),
    (R13 + "/bench_1gpu_256k_plan.json", 1 << 18,
     {"tiled_mlp": True, "mlp_tile_tokens": 16384, "indexer_query_chunk": 16384, "kda_segment_tokens": 65536}, "bf16"),
    (R13 + "/bench_1gpu_1m.json", 1 << 20, {"indexer_query_chunk": 128, "model_segment_tokens": 8192}, "bf16"),
    (R13 + "/bench_1gpu_bf16w.json", 8192, {}, "bf16"),
    (R13 + "/bench_1gpu_bf16w.json", 32768,
     {"chunked_loss": True, "indexer_query_chunk": 4096, "kda_segment_tokens": 16384}, "bf16"),
    # R14: the plans that count the fast set, as the recipe runs them
    (R14 + "/bench_1gpu_plan2.json", 32768, {"indexer_query_chunk": 32768, "kda_segment_tokens": 0}, "bf16"),
    (R14 + "/bench_1gpu_plan2.json", 1 << 18, {"indexer_query_chunk": 16384, "model_segment_tokens": 32768},
     "bf16"),
    (R14 + "/bench_1gpu_1m_plan.json", 1 << 20, {"indexer_query_chunk": 4096, "model_segment_tokens": 16384},
     "bf16"),
    # R15: the Triton hc_mix and fla's gated norm (the default calibration)
    (R15 + "/bench_1gpu_issue.json", 8192, {"indexer_query_chunk": 8192}, "bf16"),
    (R15 + "/bench_1gpu_issue.json", 32768, {"indexer_query_chunk": 32768}, "bf16"),
    (R15 + "/bench_1gpu_1m.json", 1 << 20, {"indexer_query_chunk": 4096, "model_segment_tokens": 32768}, "bf16"),
], ids=["32k-no-kda-segments", "8k", "32k-kda-segments", "256k-bf16-weights", "1m-bf16-weights", "8k-bf16-weights",
        "32k-kda-segments-bf16-weights", "32k-plan", "256k-plan", "1m-plan", "8k-s15", "32k-s15", "1m-s15"])
def test_the_fast_plan_bounds_what_the_h200_measured(where, n, memory, weights):
    """glm5-flash-1gpu with the fast set, for each H200 run in RESULTS (R12 to R15, each with the calibration
    of the code it ran): the plan of the measured settings is at or above the measured peak, by at most 12%,
    and below the base kernels' plan (which does not count the fused sparse MLA's ``o_lat``)."""
    data = json.loads((RESULTS / where).read_text())
    rows = [dict(r, meta_weights=data["meta"].get("weights", "fp32")) for r in data["rows"]
            if r["seq_len"] == n and r["status"] == "ok" and r.get("system", "megaseq") == "megaseq"]
    measured = rows[0]["measured_gpu_gib"]
    assert {k: rows[0]["memory_plan"][k] for k in memory} == memory and rows[0]["meta_weights"] == weights
    cal = C.CAL if where.startswith(R15) else BEFORE_TRITON_HC_MIX
    planned = _fast(n, memory, weights, cal).peak_tensors / GIB
    base = peak_for(glm5_flash_1gpu(), n, memory, weights=weights).peak_tensors / GIB
    assert measured <= planned <= 1.12 * measured, (planned, measured)
    assert planned < base


def test_at_256k_the_plan_picks_the_faster_measured_setting():
    """glm5-flash-1gpu at 256K: the plan picks tiled MLP + KDA segments, the faster of the measured settings
    (R13's bench_1gpu_256k_plan.json against the 32K sequence segments of R14's bench_1gpu_plan2.json); they
    fit because the fused sparse MLA's backward does not hold the head-major q beside its kernel."""
    from megaseq.plan.planner import plan

    p = plan(glm5_flash_1gpu(), 1 << 18, weights="bf16", fast_ops=PLANNED_FAST_OPS)
    assert p.fits and {f[0] for f in p.fixes} == {"indexer_query_chunk", "tiled_mlp", "kda_segments"}, p.fixes


def test_the_fast_indexer_scores_longer_chunks():
    """At 256K the reference's [c, I, P] bound allows 512 queries a chunk (such short chunks leave a step's GPU
    idle for about half its time: R13's profile_1gpu_256k_fast.txt); the Triton selection's 16K."""
    spec = glm5_flash_1gpu()
    base = indexer_chunk_cap(run_for(spec, 1 << 18, {}))
    fast = indexer_chunk_cap(run_for(spec, 1 << 18, {}, fast_ops=PLANNED_FAST_OPS))
    assert (base, fast) == (512, 16384)
    assert layers.indexer_scoring(spec, fast, 1 << 18, fast=True) <= 2 * GIB


def test_the_report_names_the_planned_fast_kernels():
    from megaseq.plan import format_plan
    from megaseq.plan.planner import plan

    fast = plan(glm5_flash_1gpu(), 8192, fast_ops=PLANNED_FAST_OPS)
    assert fast.mesh["fast_kernels"] == sorted(PLANNED_FAST_OPS)
    assert ("fast kernels planned: gated_rms_norm, hc_merge, hc_mix, hc_weights, indexer_kl, indexer_target, "
            "indexer_topk, kda_gate, linear_cross_entropy, rms_norm, sparse_attention, swiglu") in \
        " ".join(format_plan(fast).split())  # the table may wrap the header
    assert "fast kernels planned" not in format_plan(plan(glm5_flash_1gpu(), 8192))


# glm5-flash-1gpu with the whole fast set (fla's forget gate among it), the recipe's bf16 weights, one H200
LATEST = [("speed/glm5-flash-1gpu/2026-12-04_8k-32k-baseline.json", 8192),
          ("speed/glm5-flash-1gpu/2026-12-04_8k-32k-baseline.json", 32768),
          ("speed/glm5-flash-1gpu/2026-12-04_1m.json", 1 << 20)]


@pytest.mark.parametrize("where,n", LATEST, ids=["8k", "32k", "1m"])
def test_the_plan_is_within_5_percent_of_the_h200(where, n):
    """The plan of each measured setting (the plan's own: none at 8K and 32K, sequence segments at 1M) is at or above
    the peak the H200 measured, by at most 5%."""
    data = json.loads((RESULTS.parents[1] / where).read_text())
    row = next(r for r in data["rows"] if r["seq_len"] == n and r.get("system") == "megaseq" and r["status"] == "ok")
    assert data["meta"]["weights"] == "bf16"
    planned = peak_for(glm5_flash_1gpu(), n, row["memory_plan"], weights="bf16",
                       fast_ops=PLANNED_FAST_OPS).peak_tensors / 2**30
    measured = row["measured_gpu_gib"]
    assert measured <= planned <= 1.05 * measured, (planned, measured)
