"""Expert parallelism's settings, mesh and refusals: typed settings whose every bad value names its flag and the
fix, the data and expert groups of a dp x ep x cp mesh, the planner's per-GPU parameters and dispatch
component under ep, and the one clear message for what cannot run yet."""

from __future__ import annotations

import pytest
import torch

from megaseq.config import ExpertDispatchSettings, build_config
from megaseq.models.common.moe import Experts
from megaseq.models.presets import get_preset
from megaseq.parallel.env import ParallelEnv
from megaseq.parallel.expert import EPDispatch, shard_experts
from megaseq.parallel.llep import dispatch_buffer_bound
from megaseq.parallel.mesh import MeshShape
from megaseq.plan.components import count_params, gpu_counts
from megaseq.plan.expert import dispatch_terms
from megaseq.plan.mesh import Mesh, precision_for


@pytest.mark.parametrize("override, words", [
    ({"parallel.ep_dispatch": "fast"}, ["parallel.ep_dispatch", "pipelined_llep"]),
    ({"parallel.ep_chunk_tokens": 0}, ["parallel.ep_chunk_tokens", ">= 1"]),
    ({"parallel.ep_max_chunks": 0}, ["parallel.ep_max_chunks"]),
    ({"parallel.llep_alpha": 0.9}, ["parallel.llep_alpha", ">= 1"]),
    ({"parallel.llep_alpha": 1.5, "parallel.llep_threshold": 1.2}, ["parallel.llep_threshold", "--parallel.llep"]),
    ({"parallel.llep_min_tokens": 0}, ["parallel.llep_min_tokens"]),
])
def test_bad_dispatch_settings_name_the_flag(override, words):
    with pytest.raises(ValueError) as e:
        build_config(overrides=override)
    assert all(w in str(e.value) for w in words), str(e.value)


def test_dispatch_settings_from_config():
    with pytest.warns(UserWarning, match="no effect with parallel.ep 1"):
        build_config(overrides={"parallel.ep_dispatch": "plain"})
    cfg = build_config(overrides={"parallel.ep": 2, "parallel.ep_chunk_tokens": "4K", "parallel.ep_dispatch": "llep"})
    d = cfg.parallel.ep_dispatch_settings()
    assert d == ExpertDispatchSettings(mode="llep", chunk_tokens=4096)
    assert d.balances and not d.pipelined
    assert not ExpertDispatchSettings(mode="plain").balances and ExpertDispatchSettings().pipelined


def test_mesh_groups_and_data_ranks():
    s = MeshShape(dp=2, ep=2, cp=2)
    coords = [s.coords(r) for r in range(8)]
    assert coords[:4] == [(0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1)]
    # the ranks holding expert shard e (its gradients' group): every dp and cp rank with ep coordinate e
    assert [r for r in range(8) if s.coords(r)[1] == 1] == [2, 3, 6, 7]
    # ep ranks read different sequences: the data rank dp_rank * ep + ep_rank covers 0 .. dp * ep - 1 once per cp
    data = sorted({(d * s.ep + e) for d, e, _ in coords})
    assert data == [0, 1, 2, 3]


def test_shard_experts_keeps_a_contiguous_slice():
    torch.manual_seed(0)
    full = Experts(8, 16, 8)
    part = Experts(8, 16, 8)
    part.load_state_dict(full.state_dict())
    shard_experts(part, 4, 2)
    assert part.held == range(4, 6) and torch.equal(part.gate_up_proj, full.gate_up_proj[4:6])
    shard_experts(part, 4, 2)  # again: a no-op
    assert part.gate_up_proj.shape[0] == 2
    with pytest.raises(ValueError, match="parallel.ep = 3 must divide num_experts = 8"):
        shard_experts(Experts(8, 16, 8), 3, 0)
    with pytest.raises(AssertionError, match="shard_experts"):
        EPDispatch(group=None, ep=2, rank=0)(Experts(8, 16, 8), torch.zeros(3, 16), torch.zeros(3, 2, dtype=torch.long),
                                             torch.zeros(3, 2))


def test_refusals_name_the_setting():
    with pytest.raises(ValueError, match="parallel.ep > 1"):
        ParallelEnv().shard_moe(None)
    for fsdp in ("dp", "dp_cp"):  # composed (tests/parallel/test_ep_fsdp.py): accepted
        assert build_config(overrides={"parallel.ep": 2, "parallel.fsdp": fsdp}).parallel.fsdp == fsdp


def test_planner_splits_experts_and_bounds_the_dispatch():
    spec = get_preset("glm5-flash")
    counts = count_params(spec)
    on8 = gpu_counts(counts, Mesh(ep=8, cp=8))
    assert counts.total - on8.total == sum(x - x // 8 for _, x, _ in counts.layers) > 0  # 36 of 288 experts each
    # under FSDP too the experts stay whole, split over ep; FSDP shards the rest (plan.components.gpu_counts)
    assert gpu_counts(counts, Mesh(ep=8, cp=8, fsdp=True)) == on8
    prec, n = precision_for("bf16"), 128 * 1024
    pipelined = dispatch_terms(spec, n, Mesh(ep=8, cp=8), ExpertDispatchSettings(), 4, prec, 4.0)
    assert pipelined.chunks == 16 and pipelined.c_eff == 8192
    assert pipelined.rows_in == 8 * 8 * 8192 and pipelined.buffer_bound == dispatch_buffer_bound(8, 8, 8192, 4096, 2)
    skewed = dispatch_terms(spec, n, Mesh(ep=8, cp=8), ExpertDispatchSettings(), 4, prec, 8.0)
    assert skewed.rows_in == pipelined.rows_in  # whatever the routing
    plain = [dispatch_terms(spec, n, Mesh(ep=8, cp=8), ExpertDispatchSettings(mode="plain"), 4, prec, imb).rows_in
             for imb in (1.0, 2.2, 4.0)]
    assert plain == sorted(plain) and plain[2] == 4 * n * 8  # plain EP grows with the imbalance
    llep = dispatch_terms(spec, n, Mesh(ep=8, cp=8), ExpertDispatchSettings(mode="llep"), 4, prec, 4.0)
    assert llep.rows_in == int(n * 8 * 1.1)  # LLEP above its threshold: alpha x the mean


class RecordingEnv(ParallelEnv):
    """An environment with ep > 1 that records which modules its ``shard_moe`` was handed."""

    ep_size = 2

    def __init__(self) -> None:
        super().__init__()
        self.sharded: list[torch.nn.Module] = []

    def shard_moe(self, moe: torch.nn.Module) -> None:
        self.sharded.append(moe)


@pytest.mark.parametrize("name", ["glm5-flash-tiny", "qwen3-moe-tiny"])
def test_each_family_shards_every_moe_layer(name):
    from megaseq.config import MemorySettings
    from megaseq.models.build import build_model
    from megaseq.models.common.moe import MoE
    from megaseq.models.registry import parallelize

    model = build_model(get_preset(name), dtype=torch.float32, seed=0)
    env = RecordingEnv()
    parallelize(model, MemorySettings(), env)
    assert env.sharded == [m for m in model.modules() if isinstance(m, MoE)] and env.sharded
    parallelize(model, MemorySettings(), ParallelEnv())  # ep 1: nothing to shard
