"""Sequence segments' cost falls with their length (``plan.fixes.segment_join_seconds``): the planner's estimates of
the two measured 1M steps of glm5-flash-1gpu on an H100 differ as the measured steps do, and it chooses the faster
one. The measured rows are read from their result file."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from megaseq.config.loading import load_config
from megaseq.plan import fixes as F
from megaseq.plan import plan_from_config

ROOT = Path(__file__).resolve().parents[2]
RESULT = ROOT / "benchmarks/results/speed/glm5-flash-1gpu/2026-12-07_1m_segments_h100.json"
H100_BYTES = 81559 * 2**20  # torch.cuda's total memory of an H100 80GB HBM3
SETTINGS = ("model_segment_tokens", "optimizer_offload", "indexer_query_chunk", "chunked_loss", "loss_chunk_tokens")


def _rows() -> dict[str, dict]:
    return {r["name"]: r for r in json.loads(RESULT.read_text())["rows"]}


def _plan(memory: dict | None):
    over = ["data.seq_len=1M"]
    if memory is not None:
        over += ["memory.auto=false"] + [f"memory.{k}={memory[k]}" for k in SETTINGS]
    cfg = load_config(ROOT / "recipes/glm5-flash-1gpu.yaml", over)
    # every fast kernel the recipe names, as the GPU that measured the rows ran them (not this machine's packages)
    return plan_from_config(cfg, world_size=1, gpu_bytes=H100_BYTES)


def _estimate(p) -> float:
    """The step the planner estimates, in units of its plain step: 1 plus each fix's cost."""
    return 1 + sum(cost for _, cost, _ in p.fixes)


def test_the_estimates_of_the_two_measured_steps_differ_as_the_measurements():
    rows = _rows()
    short, long = rows["planner"], rows["seg16k_offload"]
    assert (short["memory_plan"]["model_segment_tokens"], long["memory_plan"]["model_segment_tokens"]) == (8192, 16384)
    plans = [_plan(r["memory_plan"]) for r in (short, long)]
    for r, p in zip((short, long), plans, strict=True):  # the plans the rows were measured against
        assert p.peak_gpu / 2**30 == pytest.approx(r["predicted_gpu_gib"], rel=1e-3)
    measured = short["step_s"] / long["step_s"]
    estimated = _estimate(plans[0]) / _estimate(plans[1])
    assert estimated == pytest.approx(measured, rel=0.01), (estimated, measured)


def test_the_planner_chooses_the_faster_of_the_two_at_1m_on_an_h100():
    p = _plan(None)
    faster = min(_rows().values(), key=lambda r: r["step_s"])["memory_plan"]
    assert (p.memory["model_segment_tokens"], p.memory["optimizer_offload"]) == \
        (faster["model_segment_tokens"], faster["optimizer_offload"]) == (16384, True)


def test_longer_segments_cost_less_and_the_sum_is_of_the_segments_ends():
    def run(T, S=1 << 20):
        return SimpleNamespace(segment=T, seq_len=S, batch=1)

    costs = [F.segment_join_seconds(run(T)) for T in (8192, 16384, 65536)]
    assert costs[0] > costs[1] > costs[2] > 0
    # three segments of 4 tokens over 10: ends 4, 8, 10
    assert F.segment_join_seconds(run(4, 10)) == pytest.approx(F.SEGMENT_JOIN_S * 22)
