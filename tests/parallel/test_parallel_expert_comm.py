"""The planner's expert-parallel traffic against the bytes a traced multi-process step sends, to the byte.

One training step (forward + backward) of glm5-flash-tiny (its first 4 layers, every kind once, 3 of them MoE:
``conftest.glm5_tiny4``; the 8-layer preset's cp traffic is test_parallel_comm_volume's) runs over ep (x cp)
gloo processes in float32; every collective of ``parallel.expert`` adds the bytes leaving its rank to
``ulysses.COMM_BYTES`` under its MoE layer's name (and the context-parallel ones under their layer kind). The
routing each rank's router chose in each MoE layer is recorded, gathered, and handed to
``plan.expert.chunk_counts`` / ``layer_bytes``, which re-derive the chunks and the LLEP plans and must give
every (layer, collective, direction) its traced bytes exactly. The routing is skewed towards expert 0 so that
LLEP spills and expert weights travel (and their gradients come back). With cp the context-parallel scopes
must still equal ``plan.flops.comm_volume`` (``test_parallel_comm_volume.check_against_planner``).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from test_parallel_comm_volume import check_against_planner, global_batch, scope_layers

from conftest import glm5_tiny4
from megaseq.config import MemorySettings, build_config
from megaseq.models.build import build_model
from megaseq.models.registry import parallelize
from megaseq.parallel import ulysses
from megaseq.parallel.env import DistributedEnv
from megaseq.parallel.launch import spawn_local
from megaseq.plan.expert import chunk_counts, layer_bytes

NAME = "glm5-flash-tiny"
EP_FLAGS = {"parallel.ep_chunk_tokens": 16, "parallel.ep_max_chunks": 4, "parallel.llep_min_tokens": 2}


def _recording(route, routing: dict, name: str):
    """``route`` (what ``MoE.forward`` calls) that also records the chosen experts under ``name``."""

    def wrapped(x_NH: torch.Tensor):
        out = route(x_NH)
        routing[name] = out[1].tolist()
        return out

    return wrapped


def _rank(rank: int, cases: list[tuple[int, int, str, int]]) -> None:
    """Every case ``(ep, cp, mode, S)`` of this world size in one process group."""
    env = None
    for ep, cp, mode, S in cases:
        try:
            env = _case(ep, cp, mode, S)
        except AssertionError as e:
            raise AssertionError(f"ep {ep} x cp {cp}, {mode}: {e}") from e
    env.shutdown()


def _case(ep: int, cp: int, mode: str, S: int) -> DistributedEnv:
    torch.set_num_threads(1)
    spec = glm5_tiny4()
    cfg = build_config(overrides={"parallel.ep": ep, "parallel.cp": cp, "parallel.backend": "gloo", "data.seq_len": S,
                                  "parallel.loss_parallel": "ring_dtp", "parallel.ep_dispatch": mode,
                                  "train.device": "cpu", **EP_FLAGS})
    env = DistributedEnv(cfg, spec=spec)
    model = build_model(spec, dtype=torch.float32, seed=0)
    routing: dict[str, list] = {}
    for i, (layer, kind) in enumerate(zip(model.layers, spec.mlp_types)):
        if kind == "moe":
            layer.mlp.gate.e_score_correction_bias[0] = 0.3  # skewed: LLEP spills, weights travel
            layer.mlp.gate.route = _recording(layer.mlp.gate.route, routing, f"layers.{i}.mlp")
    parallelize(model, MemorySettings(), env)
    scope_layers(model, spec.layer_types)
    full = global_batch(ep, S)
    mine = {k: v[env.dp_rank:env.dp_rank + 1] for k, v in full.items()}
    batch = env.shard_batch(mine if env.reads_data else None)
    ulysses.reset_comm_bytes()
    hidden = model(batch["input_ids"], ctx=env.context(batch))
    with ulysses.comm_scope("loss"):
        loss = env.loss_sum(hidden, model.lm_head.weight, batch["labels"])
    loss.backward()
    traced = ulysses.comm_bytes()
    everyone = [None] * env.world_size
    dist.all_gather_object(everyone, routing)
    group_ranks = dist.get_process_group_ranks(env.mesh.ep_group)  # my ep group, in ep-rank order
    d = cfg.parallel.ep_dispatch_settings()
    moved = 0
    for name in routing:
        counts = chunk_counts([everyone[r][name] for r in group_ranks], spec.num_experts, d)
        want = layer_bytes(counts, env.ep_rank, d, spec.hidden_size, spec.moe_intermediate_size, 4, 4, 4)
        got = {(op, direction): v for (scope, op, direction), v in traced.items() if scope == name and v}
        assert got == want, (name, got, want)
        moved += want.get(("ep_weights", "fwd"), 0) + want.get(("ep_weights", "bwd"), 0)
    flags = [None] * env.world_size
    dist.all_gather_object(flags, moved)
    assert (sum(flags) > 0) == (mode != "plain"), flags  # LLEP moved expert weights somewhere
    if cp > 1:
        check_against_planner({k: v for k, v in traced.items() if k[0] not in routing}, NAME, 1, S, cp, spec)
    else:
        assert {k[0] for k in traced} == set(routing)  # nothing else moved
    return env


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


CASES = {2: [(2, 1, "plain", 64), (2, 1, "llep", 64)],  # by world size: (ep, cp, mode, S)
         4: [(4, 1, "pipelined_llep", 64), (2, 2, "pipelined_llep", 128)]}


@pytest.mark.parametrize("world", sorted(CASES))
def test_traced_bytes_equal_planner(world):
    spawn_local(_rank, world, args=(CASES[world],))
