"""The mesh: layout validation (one ValueError each, before any process group), batch sharding, and
one read per cp group (several processes over gloo)."""

from __future__ import annotations

import pytest
import torch

from megaseq.config import ParallelConfig
from megaseq.models.presets import get_preset
from megaseq.parallel.launch import spawn_local
from megaseq.parallel.mesh import (
    IGNORE_INDEX,
    MeshShape,
    check_heads,
    complete_batch,
    distribute_batch,
    init_mesh,
    resolve_shape,
    shard_batch,
    shutdown,
    validate_cp,
)
from megaseq.parallel.ulysses import make_context


# ---- validation (no processes) ---------------------------------------------------------------
def test_resolve_shape_fills_dp_and_lays_cp_fastest():
    shape = resolve_shape(ParallelConfig(dp=-1, cp=2), 8)
    assert shape == MeshShape(dp=4, ep=1, cp=2)
    assert [shape.coords(r) for r in (0, 1, 2, 7)] == [(0, 0, 0), (0, 0, 1), (1, 0, 0), (3, 0, 1)]


@pytest.mark.parametrize("cfg, world, words", [
    (dict(dp=-1, cp=3), 8, ["not a multiple", "parallel.cp"]),
    (dict(dp=3, cp=2), 8, ["parallel.dp", "--parallel.dp 4"]),
    (dict(dp=0, cp=1), 2, ["parallel.dp must be"]),
    (dict(dp=1, cp=2, ep=2), 6, ["not a multiple", "parallel.ep"]),
])
def test_bad_layouts_are_refused(cfg, world, words):
    with pytest.raises(ValueError) as err:
        resolve_shape(ParallelConfig(**cfg), world)
    for w in words:
        assert w in str(err.value)


def test_seq_len_and_heads_are_checked():
    with pytest.raises(ValueError, match="data.seq_len = 10 is not divisible by parallel.cp = 4"):
        validate_cp(4, 10)
    tiny = get_preset("glm5-flash-tiny")  # 4 KDA heads
    validate_cp(4, 64, tiny)
    with pytest.raises(ValueError, match="linear_num_heads = 4 cannot be split over parallel.cp = 8"):
        validate_cp(8, 64, tiny)
    with pytest.raises(ValueError, match="num_attention_heads"):
        validate_cp(3, 63, get_preset("qwen3-moe-tiny"))
    with pytest.raises(ValueError, match="mla_mode ulysses is not available for DSA layers"):
        validate_cp(2, 64, tiny, mla_mode="ulysses")
    check_heads(2, 4, replicable=True)  # GQA KV heads replicated
    with pytest.raises(ValueError, match="cannot be split"):
        check_heads(3, 2, replicable=True)


def test_init_mesh_refuses_before_creating_a_group():
    with pytest.raises(ValueError, match="not a multiple"):
        init_mesh(ParallelConfig(cp=2), 16, rank=0, world_size=3)
    with pytest.raises(ValueError, match="nccl needs CUDA"):
        init_mesh(ParallelConfig(backend="nccl"), 16, rank=0, world_size=1, device="cpu")
    assert not torch.distributed.is_initialized()


# ---- sharding ---------------------------------------------------------------------------------
def _batch(B: int = 2, S: int = 12, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    doc = torch.tensor([[0] * 5 + [1] * 4 + [2] * 3, [0] * 7 + [1] * 5])[:B, :S]
    return {"input_ids": torch.randint(0, 16, (B, S), generator=g), "doc_ids": doc}


def test_complete_batch_shifts_labels_within_documents():
    b = complete_batch(_batch())
    ids, lab, pos = b["input_ids"], b["labels"], b["position_ids"]
    assert torch.equal(lab[0, :4], ids[0, 1:5]) and lab[0, 4] == IGNORE_INDEX  # last token of doc 0
    assert lab[1, 6] == IGNORE_INDEX and lab[1, -1] == IGNORE_INDEX
    assert pos[0].tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 3, 0, 1, 2]


def test_shard_batch_is_contiguous_and_complete():
    full = complete_batch(_batch())
    parts = [shard_batch(full, cp=3, cp_rank=r) for r in range(3)]
    for key in ("input_ids", "labels", "doc_ids", "position_ids"):
        assert torch.equal(torch.cat([p[key] for p in parts], dim=1), full[key])
    with pytest.raises(ValueError, match="not divisible by parallel.cp = 5"):
        shard_batch(full, cp=5, cp_rank=0)


def _distribute_worker(rank: int, dp: int, cp: int) -> None:
    mesh = init_mesh(ParallelConfig(dp=dp, cp=cp, backend="gloo"), 12)
    assert (mesh.dp_rank, mesh.cp_rank) == divmod(rank, cp)
    full = complete_batch(_batch(seed=mesh.dp_rank))  # each dp group reads its own sequences
    reads = []

    def loader() -> dict[str, torch.Tensor]:
        reads.append(rank)
        return _batch(seed=mesh.dp_rank)

    batch = loader() if mesh.reads_data else None
    if batch is not None:  # what a data source may add: an absent entry as None, a non-tensor value
        batch.update(position_ids=None, source=f"row of dp group {mesh.dp_rank}")
    shard = distribute_batch(batch, mesh)
    assert shard["source"] == f"row of dp group {mesh.dp_rank}"
    assert len(reads) == (1 if mesh.cp_rank == 0 else 0)
    n = 12 // cp
    for key in ("input_ids", "labels", "doc_ids", "position_ids"):
        assert torch.equal(shard[key], full[key][:, mesh.cp_rank * n:(mesh.cp_rank + 1) * n]), key
    ctx = make_context(mesh, shard)
    assert ctx.seq_offset() == mesh.cp_rank * n
    assert torch.equal(ctx.full_doc_ids(), full["doc_ids"])
    shutdown(mesh)


@pytest.mark.parametrize("dp, cp", [(1, 2), (2, 2), (1, 4)])
def test_distribute_batch_reads_once_per_cp_group(dp, cp):
    spawn_local(_distribute_worker, dp * cp, args=(dp, cp))


# ---- the rendezvous port of local runs -------------------------------------------------------------------------
def test_free_port_is_drawn_below_the_ephemeral_range_and_free(monkeypatch):
    """Outgoing connections and port-0 listeners of other processes (other runs' gloo pairs) take their ports
    from the OS's ephemeral range, so a port drawn below it cannot be taken between the pick and the
    rendezvous; the OS's own pick (a port inside that range) fails this."""
    import socket

    from megaseq.parallel import launch

    lo, _ = launch.ephemeral_ports()
    ports = {launch.free_port() for _ in range(8)}
    assert all(launch.PORT_FLOOR <= p < lo for p in ports), (ports, lo)
    for p in ports:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("", p))
    # where nothing below the range is free, the OS picks one
    monkeypatch.setattr(launch, "_bindable", lambda port: False)
    assert launch.free_port() >= lo
