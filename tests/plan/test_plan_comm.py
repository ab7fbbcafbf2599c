"""A plan's traffic: an expert-parallel plan carries the bytes the runtime's dispatch moves per step.

``plan.expert.layer_bytes`` gives, from every rank's routing, the bytes each collective of
``parallel.expert`` sends (test_parallel_expert_comm checks it against a traced multi-process step to the
byte). Here the plan's ``comm["moe"]`` must equal it for evenly spread routing, in every dispatch mode."""

from __future__ import annotations

import pytest

from megaseq.config import build_config
from megaseq.models.presets import get_preset
from megaseq.plan.expert import chunk_counts, layer_bytes
from megaseq.plan.planner import plan_from_config
from megaseq.plan.report import format_plan

NAME, EP, S = "qwen3-moe-tiny", 2, 1024


def _even_routing(tokens: int, k: int, num_experts: int, ranks: int) -> list[list[list[int]]]:
    """Every rank's tokens over the experts in turn: each expert gets the same rows from every rank."""
    return [[[(t * k + j) % num_experts for j in range(k)] for t in range(tokens)] for _ in range(ranks)]


@pytest.mark.parametrize("mode", ["plain", "llep", "pipelined_llep"])
def test_ep_plan_carries_the_expert_traffic(mode):
    cfg = build_config(None, [f"model.name={NAME}", "model.dtype=fp32", "data.kind=random", f"data.seq_len={S}",
                              f"parallel.ep={EP}", f"parallel.ep_dispatch={mode}"])
    p = plan_from_config(cfg, world_size=EP)
    spec, d = get_preset(NAME), cfg.parallel.ep_dispatch_settings()
    counts = chunk_counts(_even_routing(S, spec.num_experts_per_tok, spec.num_experts, EP), spec.num_experts, d)
    want = sum(layer_bytes(counts, 0, d, spec.hidden_size, spec.moe_intermediate_size, 4, 4, 4).values())
    moe = p.comm.get("moe")
    assert moe is not None, f"an ep={EP} plan carries no expert traffic: {p.comm}"
    assert moe["mode"] == mode and moe["per_layer"] == want > 0
    assert moe["per_step"] == want * spec.mlp_types.count("moe")
    assert "expert parallel: " + mode in format_plan(p)  # the report reads the entry


def test_one_rank_plan_has_no_expert_traffic():
    cfg = build_config(None, [f"model.name={NAME}", "data.kind=random", f"data.seq_len={S}"])
    assert "moe" not in plan_from_config(cfg, world_size=1).comm
