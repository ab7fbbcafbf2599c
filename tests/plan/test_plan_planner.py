"""The planner's choices: no fix where none is needed, the cheapest fixes as the length grows, each one
needed, refusal naming the binding component, mesh validation, forced settings, torch-free planning."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from test_plan_components import small_spec

from megaseq.config import MemoryConfig, build_config
from megaseq.models.presets import get_preset
from megaseq.plan import GB, GIB, Mesh, plan, plan_from_config
from megaseq.plan.fixes import INDEXER_SCORING_MAX
from megaseq.plan.given import peak_for
from megaseq.plan.planner import LADDER, MEMORY_KEYS, Budgets, Plan

SPEC_1GPU = get_preset("glm5-flash-1gpu")
K = 1024


def _fits(spec, seq_len, memory, mesh=None, budgets=None):
    budgets = budgets or Budgets()
    ev = peak_for(spec, seq_len, memory, mesh)
    return ev.peak_gpu <= budgets.gpu_bytes and ev.peak_host <= budgets.host(mesh or Mesh())


def _without(memory: dict, fix: str, n: int) -> dict:
    m = dict(memory)
    if fix == "indexer_query_chunk":
        m[fix] = n
    elif fix == "kda_segments":
        m["kda_segment_tokens"] = 0
    elif fix == "model_segments":
        m["model_segment_tokens"] = 0
    else:
        m[fix] = False
    if fix == "recompute":
        m["checkpoint_offload"] = False
    return m


@pytest.fixture(scope="module")
def ladder() -> dict[int, Plan]:
    return {k: plan(SPEC_1GPU, k * K) for k in (8, 16, 20, 32, 48, 96, 128, 160, 192, 224, 256, 384, 1024)}


def test_no_fixes_when_none_needed(ladder):
    p = ladder[8]  # 8K tokens on one H200: nothing to fix
    assert p.fits and p.fixes == []
    assert not any(p.memory[k] for k in ("chunked_loss", "tiled_mlp", "recompute", "checkpoint_offload",
                                         "optimizer_offload"))
    assert p.memory["indexer_query_chunk"] == 8 * K  # all queries in one block


def test_fixes_grow_with_length_in_ladder_order(ladder):
    first_seen: dict[str, int] = {}
    for k, p in sorted(ladder.items()):
        assert p.fits, (k, p.advice)
        names = [f[0] for f in p.fixes]
        assert names == sorted(names, key=LADDER.index)  # listed cheapest-first, in ladder order
        for name in names:
            first_seen.setdefault(name, k)
    costly = {f: k for f, k in first_seen.items() if f != "indexer_query_chunk"}
    assert min(costly, key=costly.get) == "chunked_loss"  # the cheapest fix with a cost comes first
    # per-layer fixes first; sequence segments (one forward more, like recompute, and a per-segment cost)
    # once those no longer fit, and they carry the run to 1M on one H200 alone
    assert first_seen["recompute"] < first_seen["model_segments"]
    # (stream_base streams a frozen base: LoRA and train.trainable only, never this full fine-tuning)
    assert set(first_seen) == set(LADDER) - {"checkpoint_offload", "optimizer_offload", "stream_base"}
    for k in (224, 256, 384):
        assert [f[0] for f in ladder[k].fixes] == ["indexer_query_chunk", "model_segments"], k
    # at 1M the chunked loss makes room for segments of 16K, whose fewer joins cost less than its chunks
    assert [f[0] for f in ladder[1024].fixes] == ["chunked_loss", "indexer_query_chunk", "model_segments"]
    assert ladder[1024].memory["model_segment_tokens"] == 16 * K
    # with context parallelism a segment is split over the cp ranks: segments serve there too
    cp2 = plan(SPEC_1GPU, 512 * K, Mesh(cp=2, gpus_per_host=2))
    assert cp2.fits and "model_segments" in [f[0] for f in cp2.fixes]
    assert cp2.memory["model_segment_tokens"] % 2 == 0
    # SCO where sequence segments cost more (softmax attention's K/V with their fp32 gradients outgrow the
    # boundaries SCO offloads); the optimizer offload on a smaller GPU
    wide = get_preset("qwen3-moe-tiny").replace(hidden_size=2048, num_layers=24, layer_types=("attention",) * 24,
                                                mlp_types=("moe",) * 24)
    qwen = plan(wide, 256 * K, budgets=Budgets(gpu_bytes=40 * GIB))
    assert qwen.fits and "checkpoint_offload" in [f[0] for f in qwen.fixes], qwen.fixes
    assert "model_segments" not in [f[0] for f in qwen.fixes]
    small = plan(SPEC_1GPU, 256 * K, budgets=Budgets(gpu_bytes=50 * GIB))
    assert small.fits and "optimizer_offload" in [f[0] for f in small.fixes]


def test_every_chosen_fix_is_needed(ladder):
    """Dropping any enabled fix (SCO with recompute) makes the plan no longer fit; the free indexer
    chunking is on exactly when all queries at once would score more than INDEXER_SCORING_MAX."""
    from megaseq.plan.layers import indexer_scoring_bytes

    for k, p in ladder.items():
        n = k * K
        for name, _, _ in p.fixes:
            if name != "indexer_query_chunk":
                assert not _fits(SPEC_1GPU, n, _without(p.memory, name, n)), (k, name)
        whole = indexer_scoring_bytes(n, n // 16, 32, 128)  # 16-token pools, 32 heads, 2048 / 16 selected
        chunked = "indexer_query_chunk" in [f[0] for f in p.fixes]
        unchunked_fits = _fits(SPEC_1GPU, n, dict(p.memory, indexer_query_chunk=n))
        assert chunked == (whole > INDEXER_SCORING_MAX or not unchunked_fits)
        assert indexer_scoring_bytes(p.memory["indexer_query_chunk"], n // 16, 32, 128) <= INDEXER_SCORING_MAX
        assert _fits(SPEC_1GPU, n, p.memory)


def test_refusal_names_binding_component_and_ways_to_fit():
    p = plan(SPEC_1GPU, 8 << 20)  # 8M tokens: even sequence segments' caches outgrow one H200
    assert not p.fits and p.headroom < 0
    assert p.binding and p.binding in p.advice
    assert "longest length that fits" in p.advice
    longest = int(p.advice.split("longest length that fits this mesh is ")[1].split(" ")[0])
    assert 1 << 20 < longest < 8 << 20 and plan(SPEC_1GPU, longest).fits
    per_layer = plan(SPEC_1GPU, 1 << 20, memory_cfg=MemoryConfig(auto=False, recompute=True, chunked_loss=True,
                                                                tiled_mlp=True, checkpoint_offload=True))
    assert not per_layer.fits and "--parallel.cp" in per_layer.advice  # cp is advised where it would help
    full = plan(get_preset("glm5-flash"), 1 << 20)  # 313B parameters on one GPU: the state alone is too big
    assert not full.fits and full.binding in full.advice
    assert "FSDP" in full.advice and "no length fits" in full.advice


def test_full_model_on_64_gpus_plans_without_torch():
    code = (
        "import sys\n"
        "from megaseq.models.presets import get_preset\n"
        "from megaseq.plan import Mesh, format_plan, plan\n"
        "from megaseq.plan.planner import Budgets\n"
        "spec = get_preset('glm5-flash')\n"
        "mesh = Mesh(cp=64, gpus_per_host=8, fsdp=True)\n"
        "sharded = plan(spec, 1 << 20, mesh, Budgets(host_bytes=2 * 10**12))\n"
        "replicated = plan(spec, 1 << 20, Mesh(cp=64, gpus_per_host=8))\n"
        "text = format_plan(sharded)\n"
        "assert 'torch' not in sys.modules, 'the planner imported torch'\n"
        "print(sharded.fits, replicated.fits, replicated.binding, sharded.mesh['mla_mode'])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    sharded_fits, replicated_fits, binding, mode = out.stdout.split()
    # replicated, 313B parameters in bf16 alone exceed a GPU: the state must bind
    assert replicated_fits == "False" and binding in ("parameters", "gradients")
    assert mode in ("gather_kv", "ulysses")


def test_mesh_validation_errors():
    with pytest.raises(ValueError, match=r"seq_len = 4096 is not divisible by parallel.cp = 3"):
        plan(SPEC_1GPU, 4096, Mesh(cp=3))
    with pytest.raises(ValueError, match=r"KDA layers: linear_num_heads = 16 .* parallel.cp = 32"):
        plan(SPEC_1GPU, 32 * K, Mesh(cp=32))
    spec = small_spec(linear_num_heads=4, num_attention_heads=2)
    with pytest.raises(ValueError, match=r"DSA layers .*num_attention_heads = 2.*gather_kv"):
        plan(spec, 1024, Mesh(cp=4, mla_mode="ulysses"))
    assert plan(spec, 1024, Mesh(cp=4, mla_mode="gather_kv")).mesh["mla_mode"] == "gather_kv"
    with pytest.raises(ValueError, match=r"attention layers: num_attention_heads = 4"):
        plan(get_preset("qwen3-moe-tiny"), 1024, Mesh(cp=8))
    with pytest.raises(ValueError, match="parallel.ep"):
        plan(spec, 1024, Mesh(ep=3))


def test_user_forced_settings_are_respected():
    cfg = MemoryConfig(auto=False, chunked_loss=True, loss_chunk_tokens="4K", recompute=True,
                       indexer_query_chunk="512")
    p = plan(SPEC_1GPU, 64 * K, memory_cfg=cfg)
    assert p.memory["chunked_loss"] and p.memory["loss_chunk_tokens"] == 4096 and p.memory["recompute"]
    assert not p.memory["tiled_mlp"] and p.memory["indexer_query_chunk"] == 512
    assert [f[0] for f in p.fixes] == ["chunked_loss", "indexer_query_chunk", "recompute"]
    bare = plan(SPEC_1GPU, 128 * K, memory_cfg=MemoryConfig(auto=False))
    # the config's default indexer chunk (1K) applies as given; nothing else is switched on
    assert not bare.fits and "does not fit" in bare.advice
    assert [f[0] for f in bare.fixes] == ["indexer_query_chunk"]


def test_memory_dict_is_a_memory_plan():
    p = plan(SPEC_1GPU, 512 * K, Mesh(cp=2, gpus_per_host=2))
    assert tuple(p.memory) == MEMORY_KEYS
    assert p.memory["model_segment_tokens"] > 0
    try:
        from megaseq.memory.apply import MemoryPlan
    except ImportError:
        pytest.skip("megaseq.memory.apply not present")
    MemoryPlan(**p.memory)


def test_peak_model_responds_to_each_fix():
    n = 64 * K
    base = peak_for(SPEC_1GPU, n, {})
    chunked = peak_for(SPEC_1GPU, n, {"chunked_loss": True, "loss_chunk_tokens": 1024})
    assert chunked.phases["loss"] < base.phases["loss"]
    rec = peak_for(SPEC_1GPU, n, {"recompute": True})
    assert rec.phases["forward"] < base.phases["forward"] and "checkpoint boundaries" in rec.breakdown
    sco_memory = {"recompute": True, "checkpoint_offload": True, "offload_host_budget": 40 * GB}
    sco = peak_for(SPEC_1GPU, n, sco_memory)
    assert sco.breakdown.get("checkpoint boundaries", 0) < rec.breakdown["checkpoint boundaries"]
    assert sco.host_per_gpu["SCO pinned boundaries"] > 0 and sco.peak_host > rec.peak_host
    opt = peak_for(SPEC_1GPU, n, {"optimizer_offload": True})
    assert opt.phases["optimizer step"] < base.phases["optimizer step"]
    assert opt.host_per_gpu["optimizer state (OffloadStreamAdamW)"] > 0


def test_smaller_budgets_need_more_fixes():
    roomy = plan(SPEC_1GPU, 32 * K)
    tight = plan(SPEC_1GPU, 32 * K, budgets=Budgets(gpu_bytes=80 * GIB))
    assert sum(f[1] for f in tight.fixes) > sum(f[1] for f in roomy.fixes)
    assert tight.peak_gpu <= 80 * GIB


def test_plan_round_trips_through_json():
    p = plan(SPEC_1GPU, 1 << 20)
    again = Plan.from_dict(json.loads(json.dumps(p.to_dict())))
    assert again == p


def test_plan_from_config():
    cfg = build_config({"model": {"name": "glm5-flash-1gpu"}, "data": {"seq_len": "32K"}})
    p = plan_from_config(cfg, world_size=1)
    assert p.fits and p.seq_len == 32 * K and tuple(p.memory) == MEMORY_KEYS
    small = plan_from_config(cfg, world_size=1, gpu_bytes=60 * GIB)
    assert small.gpu_budget == 60 * GIB and small.peak_gpu <= 60 * GIB
    cp = build_config({"model": {"name": "glm5-flash-1gpu"}, "data": {"seq_len": "256K"},
                       "parallel": {"cp": 4, "dp": -1}})
    p4 = plan_from_config(cp, world_size=8, host_bytes=512 * GB)
    assert p4.mesh["dp"] == 2 and p4.mesh["cp"] == 4 and "dsa" in p4.comm
    with pytest.raises(ValueError, match="not a multiple of parallel.cp"):
        plan_from_config(cp, world_size=6)


def test_context_parallel_comm_mode_is_reported():
    p = plan(SPEC_1GPU, 256 * K, Mesh(cp=4, gpus_per_host=4))
    dsa = p.comm["dsa"]
    assert p.mesh["mla_mode"] in ("gather_kv", "ulysses") and {"gather_kv", "ulysses"} <= set(dsa)
    assert p.comm["kda"]["mode"] == "ulysses"


def test_kept_selections_only_when_asked_and_with_room():
    """``memory.segment_keep_selection`` (a speed-up, unmeasured on a GPU): off by default; asked for, the
    planner keeps the forward's DSA selections where the plan then has 5% of the GPU to spare, and counts
    them (int32, topk + kpool - 1 slots per token and full-indexer DSA layer)."""
    from megaseq.plan.sparse_attention import dsa_selection_bytes

    roomy = Budgets(gpu_bytes=220 * GIB)  # where the segments' growth leaves the selections room
    default = plan(SPEC_1GPU, 1 << 20, budgets=roomy)
    assert not default.memory["segment_keep_selection"]
    asked = plan(SPEC_1GPU, 1 << 20, memory_cfg=MemoryConfig(segment_keep_selection=True), budgets=roomy)
    assert asked.memory["segment_keep_selection"] and asked.peak_gpu <= 0.95 * roomy.gpu_bytes
    kept = dict((c[0], c[1]) for c in asked.components)["segment DSA selections (kept)"]
    assert kept == 2 * dsa_selection_bytes(SPEC_1GPU, 1 << 20) == 2 * 4 * (1 << 20) * (2048 + 15)
    tight = plan(SPEC_1GPU, 512 * K, memory_cfg=MemoryConfig(segment_keep_selection=True))
    assert tight.fits and not tight.memory["segment_keep_selection"]  # no 5% to spare there


def test_unknown_layer_kind_is_refused_by_name(monkeypatch):
    """A layer kind the planner has no terms for: one message naming the kind, not an IndexError."""
    spec = get_preset("qwen3-next-tiny")
    monkeypatch.setattr(spec, "layer_types", ("ssm",) + spec.layer_types[1:])  # past ModelSpec's own check
    with pytest.raises(ValueError, match="no terms for layer kind 'ssm'"):
        plan(spec, 2048)


@pytest.mark.parametrize("preset", ["olmoe-tiny", "mixtral-tiny", "glm4-moe-tiny", "deepseek-v32-tiny",
                                    "deepseek-v3-tiny",
                                    "kimi-linear-tiny", "qwen3-next-tiny"])
def test_new_families_plan(preset):
    cfg = build_config(None, [f"model.name={preset}", "data.kind=random", "data.seq_len=2K"])
    assert plan_from_config(cfg, world_size=1).fits
