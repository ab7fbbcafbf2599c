"""A tiled MLP's cost at the tile it grows to, and the choice made on it.

Each tile of each tiled layer has a fixed cost (``fixes.TILE_FIXED_S``) that its own GPU work hides only when the
tile is long enough; on an H100, Qwen3-30B-A3B LoRA at 32K under MoE tiles of 2048 tokens took 2.5x the step of
tiles of 16,384 (benchmarks/results/speed/qwen3-30b-a3b-lora/2026-12-06_32k_h100.md). ``choice.choose`` costs
each fitting set at its grown chunk sizes and returns the cheapest, which these tests check against every
candidate set costed the same way.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from megaseq.config import load_config
from megaseq.plan import choice
from megaseq.plan.fixes import FIXES, LAST_RESORT, TILE_CHUNKS, TILE_FIXED_S, CostTerms, tile_excess_seconds
from megaseq.plan.mesh import GIB
from megaseq.plan.phases import evaluate
from megaseq.plan.planner import plan_from_config

ROOT = Path(__file__).resolve().parents[2]
H100_BYTES = 85_520_809_984  # torch.cuda.get_device_properties(...).total_memory of an H100 80GB HBM3


def _qwen_lora(n: int):
    return load_config(str(ROOT / "recipes/qwen3-30b-a3b-lora.yaml"),
                       [f"data.seq_len={n}", f"model.name={ROOT / 'recipes/qwen3-30b-a3b/config.json'}"])


def _planned(monkeypatch, n: int, gpu_bytes: int, make_plan=None) -> dict:
    """What ``choose`` saw and returned when the planner planned Qwen3-30B-A3B LoRA at ``n`` tokens (or ran
    ``make_plan()``)."""
    import megaseq.plan.planner as planner

    seen: dict = {}
    real = choice.choose

    def spy(run, budgets, memory_cfg):
        seen.update(run=run, budgets=budgets, memory_cfg=memory_cfg)
        seen["chosen"] = real(run, budgets, memory_cfg)
        return seen["chosen"]

    monkeypatch.setattr(planner, "choose", spy)
    seen["plan"] = (make_plan or (lambda: plan_from_config(_qwen_lora(n), world_size=1, gpu_bytes=gpu_bytes)))()
    monkeypatch.setattr(planner, "choose", real)
    return seen


def test_tile_excess_is_the_fixed_cost_a_tile_does_not_hide(monkeypatch):
    """The written-out formula: in every layer, each tile's fixed cost less the tile's share of the layer's MLP
    seconds, where that share is shorter."""
    seen = _planned(monkeypatch, 32 * 1024, H100_BYTES)
    run = seen["run"]
    t = CostTerms.of(run)
    layers = run.spec.num_layers
    mlp_layer_s = t.step_s * t.sf.mlp / t.sf.total / layers
    for tile in (1024, 2048, 4096, 16384, 32768):
        r = replace(run, memory=run.memory.replace(tiled_mlp=True, mlp_tile_tokens=tile))
        tiles = -(-32768 // min(tile, 32768))
        want = layers * tiles * max(0.0, TILE_FIXED_S - mlp_layer_s / tiles)
        assert tile_excess_seconds(r, t) == pytest.approx(want, rel=1e-12)
    small = replace(run, memory=run.memory.replace(tiled_mlp=True, mlp_tile_tokens=2048))
    large = replace(run, memory=run.memory.replace(tiled_mlp=True, mlp_tile_tokens=16384))
    # 16 tiles of 2048 tokens cost seconds a step; one tile's GPU work at 16K hides most of its fixed cost
    assert tile_excess_seconds(small, t) > 5.0 > 1.0 > tile_excess_seconds(large, t)
    assert FIXES["tiled_mlp"].cost(small, t) > FIXES["tiled_mlp"].cost(large, t) > t.sf.mlp / 3 / t.sf.total


def test_qwen_lora_on_an_80gb_gpu_gets_large_tiles():
    """At 32K on an H100 the plan without tiles does not fit; the cheapest set that does tiles the MoE, at
    16,384 tokens a tile rather than the 2048 the first fitting set grows to."""
    p = plan_from_config(_qwen_lora(32 * 1024), world_size=1, gpu_bytes=H100_BYTES)
    assert p.fits and p.memory["tiled_mlp"]
    assert p.memory["mlp_tile_tokens"] == TILE_CHUNKS[1]
    costs = dict((f, c) for f, c, _ in p.fixes)
    assert costs["tiled_mlp"] < 0.15  # the recompute of the MoE forward and little more


@pytest.mark.parametrize("n,gpu_gib", [(32 * 1024, 79.65), (64 * 1024, 79.65), (128 * 1024, 139.8)])
def test_choose_returns_the_cheapest_grown_set(monkeypatch, n, gpu_gib):
    """Against every candidate set grown and costed: the choice is the cheapest (sets without a last-resort fix
    first), so stopping the search at the first set whose least cost exceeds the best loses nothing."""
    seen = _planned(monkeypatch, n, int(gpu_gib * GIB))
    run = replace(seen["run"], memory=seen["run"].memory.replace(model_segment_tokens=0))
    budgets, memory_cfg = seen["budgets"], seen["memory_cfg"]
    base = choice.base_settings(memory_cfg, run.n).replace(indexer_query_chunk=choice.indexer_chunk_cap(run))
    terms = CostTerms.of(run)
    least = choice.least_costs(run, terms)
    host_room = budgets.host(run.mesh) // run.mesh.gpus_on_host - run.cal.process_host_bytes
    grown = {}
    for fixes in choice._candidates(run, least):  # every set, as ``choose`` would run it were it the only one
        m = choice.fitting_settings(run, base, fixes, budgets, host_room)
        if m is not None:
            m = choice._grow(run, m, budgets)
            grown[fixes] = (choice.grown_cost(run, fixes, m, least, terms), m)
    assert grown, "some set fits"
    plain = {f: c for f, c in grown.items() if not any(x in LAST_RESORT for x in f)}
    pool = plain or grown
    best = min(c for c, _ in pool.values())
    m, fixes, fits = seen["chosen"]
    assert fits
    chosen = tuple(f for f in fixes if f != "indexer_query_chunk")
    assert chosen in pool and pool[chosen][0] == pytest.approx(best, abs=1e-6)
    assert m.mlp_tile_tokens == pool[chosen][1].mlp_tile_tokens


def test_the_first_fitting_set_is_not_the_choice_here(monkeypatch):
    """The broken variant: a search that returns its first fitting set (grown) picks tiles of 2048 tokens at 32K
    on an H100, which costs more than the choice by the tiles' fixed cost."""
    cfg = _qwen_lora(32 * 1024)
    import megaseq.plan.planner as planner

    def first_fit(run, budgets, memory_cfg):
        run = replace(run, memory=run.memory.replace(model_segment_tokens=0))
        base = choice.base_settings(memory_cfg, run.n).replace(indexer_query_chunk=choice.indexer_chunk_cap(run))
        costs = choice.fix_costs(run)
        host_room = budgets.host(run.mesh) // run.mesh.gpus_on_host - run.cal.process_host_bytes
        for fixes in choice._candidates(run, costs):
            m = choice.with_fixes(base, fixes, run, host_room)
            if choice._fits(evaluate(replace(run, memory=m)), budgets, run.mesh):
                return choice._grow(run, m, budgets), fixes, True
        raise AssertionError("nothing fits")

    good = plan_from_config(cfg, world_size=1, gpu_bytes=H100_BYTES)
    monkeypatch.setattr(planner, "choose", first_fit)
    broken = plan_from_config(cfg, world_size=1, gpu_bytes=H100_BYTES)
    assert broken.memory["mlp_tile_tokens"] < good.memory["mlp_tile_tokens"]
    cost_good, cost_broken = (sum(c for _, c, _ in p.fixes) for p in (good, broken))
    assert cost_broken > cost_good + 0.5  # the tiles' fixed cost: more than half a step


def test_the_tiles_replay_is_free_beside_recompute_where_only_the_mlp_is_tiled(monkeypatch):
    """A family that tiles only its MLP/MoE (a pre-norm layer) skips the tiles in its layer rerun, so beside
    recompute the tiles' replay adds no forward; GLM-5's layers tile every token-separable part, whose rerun
    runs the tiles, so there it still costs a third of the MLPs' share (tests/memory/test_tiling_rerun.py
    checks the runtime side)."""
    from megaseq.models.presets import get_preset
    from megaseq.plan.fixes import tile_rerun_share

    seen = _planned(monkeypatch, 32 * 1024, H100_BYTES)
    qwen = seen["run"]
    t = CostTerms.of(qwen)
    share = t.sf.mlp / 3 / t.sf.total
    assert tile_rerun_share(replace(qwen, memory=qwen.memory.replace(recompute=False)), t) == share > 0
    assert tile_rerun_share(replace(qwen, memory=qwen.memory.replace(recompute=True)), t) == 0.0
    from megaseq.plan import plan

    glm = _planned(monkeypatch, 0, 0, lambda: plan(get_preset("glm5-flash-1gpu"), 64 * 1024))["run"]
    tg = CostTerms.of(glm)
    assert tile_rerun_share(replace(glm, memory=glm.memory.replace(recompute=True)), tg) == tg.sf.mlp / 3 / tg.sf.total
