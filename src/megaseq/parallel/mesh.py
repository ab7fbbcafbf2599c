"""The device mesh (dp x ep x cp) and the sequence sharding of a batch over the cp axis.

Ranks are laid out row-major over ``(dp, ep, cp)``: cp is the fastest axis, so one cp group is a
run of consecutive ranks (one host's GPUs, where the Ulysses all-to-all is cheap). The mesh is
built from torchrun's environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``,
``MASTER_PORT``) or from explicit arguments (Ray workers, tests). NCCL on GPUs, gloo on CPUs.

Every user mistake (a world size the axes do not divide, a sequence the cp group cannot split, a
head count Ulysses cannot shard) raises one ValueError before any process group is created.

Data: each cp group reads each sequence once. The group's cp-rank 0 reads the whole batch and
scatters the contiguous shards to its group (``distribute_batch``); the other ranks read nothing.
dp and ep ranks read different sequences (keyed by ``dp_rank * ep + ep_rank``): expert parallelism is
a data axis for every parameter but the experts (``parallel/expert.py``).

Shapes: B batch, S full sequence, S_loc = S / cp tokens held by one rank.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from megaseq.config import ParallelConfig
from megaseq.models.common.context import positions_from_doc_ids

SEQ_KEYS = ("input_ids", "labels", "doc_ids", "position_ids")  # per-token tensors [B, S]
IGNORE_INDEX = -100


@dataclass(frozen=True)
class MeshShape:
    """Resolved axis sizes; ``world_size == dp * ep * cp``."""

    dp: int
    ep: int
    cp: int

    @property
    def world_size(self) -> int:
        return self.dp * self.ep * self.cp

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(dp_rank, ep_rank, cp_rank) of a global rank."""
        return rank // (self.ep * self.cp), (rank // self.cp) % self.ep, rank % self.cp


def resolve_shape(cfg: ParallelConfig, world_size: int) -> MeshShape:
    """Axis sizes from the config and the world size; one clear ValueError for each misfit."""
    dp, _, _ = cfg.axis_sizes(world_size)
    return MeshShape(dp=dp, ep=cfg.ep, cp=cfg.cp)


def validate_cp(cp: int, seq_len: int, spec: Any | None = None, mla_mode: str = "gather_kv") -> None:
    """Check that a cp group can split this sequence and this model's heads (before any work)."""
    if seq_len % cp:
        raise ValueError(
            f"data.seq_len = {seq_len} is not divisible by parallel.cp = {cp}: each rank holds seq_len / cp "
            f"tokens; pick a seq_len that is a multiple of {cp}"
        )
    if spec is None or cp == 1:
        return
    kinds = set(spec.layer_types)
    checks = []
    if "attention" in kinds:
        # KV heads need no check: the block repeats them until cp splits them along the GQA groups
        checks.append(("num_attention_heads", spec.num_attention_heads, False))
    if "kda" in kinds:
        checks.append(("linear_num_heads", spec.linear_num_heads, False))
    if "dsa" in kinds and mla_mode == "ulysses":
        raise ValueError("parallel.mla_mode ulysses is not available for DSA layers: the MLA/DSA block "
                         "gathers its latent KV and splits the indexer by query (docs/context_parallel.md); "
                         "set --parallel.mla_mode gather_kv (or auto)")
    for name, heads, replicable in checks:
        check_heads(heads, cp, name, replicable)


def check_heads(num_heads: int, cp: int, what: str = "heads", replicable: bool = False) -> None:
    """Ulysses shards heads over cp ranks: cp must divide them (KV heads may instead be replicated)."""
    if num_heads % cp == 0 or (replicable and cp % num_heads == 0):
        return
    fix = f"a cp that divides {num_heads}" + (" or is a multiple of it" if replicable else "")
    raise ValueError(
        f"{what} = {num_heads} cannot be split over parallel.cp = {cp} ranks (Ulysses gives each rank "
        f"heads / cp of them): set --parallel.cp to {fix}"
    )


def resolve_backend(backend: str, device: torch.device) -> str:
    if backend == "auto":
        return "nccl" if device.type == "cuda" else "gloo"
    if backend not in ("nccl", "gloo"):
        raise ValueError(f"parallel.backend must be auto, nccl or gloo, got {backend!r}")
    if backend == "nccl" and device.type != "cuda":
        raise ValueError("parallel.backend nccl needs CUDA GPUs; use --parallel.backend gloo on the CPU")
    return backend


@dataclass
class Mesh:
    """This process's place in the mesh and the process groups of its axes (None with one rank)."""

    shape: MeshShape
    rank: int = 0
    local_rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    backend: str = "gloo"
    cp_group: Any = None
    dp_group: Any = None
    ep_group: Any = None
    expert_group: Any = None  # the dp x cp ranks holding the same experts (ep > 1): their gradients' group
    device_mesh: Any = None  # torch DeviceMesh over ("dp", "ep", "cp") when distributed

    @property
    def world_size(self) -> int:
        return self.shape.world_size

    @property
    def dp(self) -> int:
        return self.shape.dp

    @property
    def cp(self) -> int:
        return self.shape.cp

    @property
    def ep(self) -> int:
        return self.shape.ep

    @property
    def dp_rank(self) -> int:
        return self.shape.coords(self.rank)[0]

    @property
    def ep_rank(self) -> int:
        return self.shape.coords(self.rank)[1]

    @property
    def cp_rank(self) -> int:
        return self.shape.coords(self.rank)[2]

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def reads_data(self) -> bool:
        """Whether this rank reads sequences from disk (one reader per cp group)."""
        return self.cp_rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def torchrun_env() -> dict[str, Any] | None:
    """RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT when launched by torchrun (or Ray)."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return None
    return {"rank": int(os.environ["RANK"]), "world_size": int(os.environ["WORLD_SIZE"]),
            "local_rank": int(os.environ.get("LOCAL_RANK", 0)),
            "master_addr": os.environ.get("MASTER_ADDR", "127.0.0.1"),
            "master_port": int(os.environ.get("MASTER_PORT", 29500))}


def init_mesh(cfg: ParallelConfig, seq_len: int, spec: Any | None = None, *, rank: int | None = None,
              world_size: int | None = None, local_rank: int | None = None, master_addr: str | None = None,
              master_port: int | None = None, device: torch.device | str | None = None,
              timeout_s: float = 600.0) -> Mesh:
    """Validate the layout, then create the process group and the per-axis groups.

    Explicit arguments win over the environment; with neither, one process (world size 1, no
    process group). A process group that already exists (a host framework made it) is reused.
    """
    env = torchrun_env() or {}
    rank = env.get("rank", 0) if rank is None else rank
    world_size = env.get("world_size", 1) if world_size is None else world_size
    local_rank = env.get("local_rank", 0) if local_rank is None else local_rank
    shape = resolve_shape(cfg, world_size)
    validate_cp(shape.cp, seq_len, spec, mla_mode=resolve_mla_mode(cfg.mla_mode))
    if device is None:
        # a Ray actor sees only its own GPU (CUDA_VISIBLE_DEVICES), torchrun's processes see the host's
        n_gpu = torch.cuda.device_count() if torch.cuda.is_available() else 0
        device = torch.device("cuda", local_rank if local_rank < n_gpu else 0) if n_gpu else "cpu"
    device = torch.device(device)
    backend = resolve_backend(cfg.backend, device)
    mesh = Mesh(shape=shape, rank=rank, local_rank=local_rank, device=device, backend=backend)
    if world_size == 1:
        return mesh
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        os.environ["MASTER_ADDR"] = master_addr or env.get("master_addr", "127.0.0.1")
        os.environ["MASTER_PORT"] = str(master_port or env.get("master_port", 29500))
        dist.init_process_group(backend, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout_s))
    assert dist.get_world_size() == world_size and dist.get_rank() == rank, "process group and mesh disagree"
    _build_groups(mesh)
    return mesh


def _build_groups(mesh: Mesh) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    s = mesh.shape
    dm = init_device_mesh(mesh.device.type, (s.dp, s.ep, s.cp), mesh_dim_names=("dp", "ep", "cp"))
    mesh.device_mesh = dm
    mesh.cp_group = dm.get_group("cp")
    mesh.dp_group = dm.get_group("dp")
    mesh.ep_group = dm.get_group("ep")
    if s.ep > 1:  # every rank creates every group, in the same order
        for e in range(s.ep):
            group = dist.new_group([r for r in range(s.world_size) if s.coords(r)[1] == e])
            if mesh.ep_rank == e:
                mesh.expert_group = group


def resolve_mla_mode(mode: str) -> str:
    """auto -> gather_kv: the mode that splits the DSA indexer by query (docs/context_parallel.md)."""
    if mode not in ("auto", "ulysses", "gather_kv"):
        raise ValueError(f"parallel.mla_mode must be auto, ulysses or gather_kv, got {mode!r}")
    return "gather_kv" if mode == "auto" else mode


def shutdown(mesh: Mesh) -> None:
    if mesh.distributed and dist.is_initialized():
        dist.destroy_process_group()


# ---- batches ------------------------------------------------------------------------------
def complete_batch(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Fill labels / position_ids from the full sequence, before it is cut (a shard cannot see its successor).

    ``labels[t]`` is the target of token ``t`` (already shifted); when absent it is ``input_ids[t+1]``
    within a document and ``IGNORE_INDEX`` at each document's last token.
    """
    out = {k: v for k, v in batch.items() if v is not None}  # an absent entry may come as None
    ids = out["input_ids"]
    doc = out.get("doc_ids")
    if "labels" not in out:
        labels = torch.full_like(ids, IGNORE_INDEX)
        labels[:, :-1] = ids[:, 1:]
        if doc is not None:
            labels[:, :-1][doc[:, 1:] != doc[:, :-1]] = IGNORE_INDEX
        out["labels"] = labels
    if "position_ids" not in out and doc is not None:
        out["position_ids"] = positions_from_doc_ids(doc)
    return out


def shard_batch(batch: dict[str, torch.Tensor], mesh: Mesh | None = None, *, cp: int | None = None,
                cp_rank: int | None = None) -> dict[str, torch.Tensor]:
    """This rank's contiguous sequence shard ``[B, S_loc]`` of every per-token tensor of a full batch."""
    cp = mesh.cp if cp is None else cp
    cp_rank = mesh.cp_rank if cp_rank is None else cp_rank
    batch = complete_batch(batch)
    S = batch["input_ids"].shape[1]
    if S % cp:
        raise ValueError(f"sequence length {S} is not divisible by parallel.cp = {cp}; set data.seq_len "
                         f"to a multiple of {cp}")
    n = S // cp
    return {k: (v[:, cp_rank * n:(cp_rank + 1) * n] if k in SEQ_KEYS else v) for k, v in batch.items()}


def segment_stripes(S: int, segment_tokens: int, cp: int) -> torch.Tensor:
    """The token order whose contiguous ``S / cp`` shards are the sequence-segment layout: rank r holds, of
    every segment ``[s, e)`` of ``segment_tokens`` tokens (the last may be shorter), the r-th of its cp
    equal pieces, so segment j is rows ``[s / cp, e / cp)`` of every rank's shard (``model_segments``)."""
    order = []
    for r in range(cp):
        for s in range(0, S, segment_tokens):
            n = (min(s + segment_tokens, S) - s) // cp
            order.append(torch.arange(s + r * n, s + (r + 1) * n))
    return torch.cat(order)


def check_segment_split(S: int, segment_tokens: int, cp: int) -> None:
    """Every segment must split into cp equal pieces (one per rank)."""
    if segment_tokens % cp or S % cp:
        raise ValueError(f"memory.model_segment_tokens = {segment_tokens} with parallel.cp = {cp}: each segment is "
                         f"split over the cp ranks, so both it and data.seq_len ({S}) must be multiples of {cp}; "
                         f"set --memory.model_segment_tokens to a multiple of {cp}")


def distribute_batch(batch: dict[str, torch.Tensor] | None, mesh: Mesh,
                     segment_tokens: int = 0) -> dict[str, torch.Tensor]:
    """cp-rank 0 passes the batch it read; every rank of its cp group returns its own shard.

    The reader scatters the shards (one read per group, each rank receives only S_loc tokens). Other
    ranks pass ``None``. Other tensors are broadcast whole; non-tensor entries travel as objects. With
    ``segment_tokens`` (sequence segments, cp > 1) a shard is this rank's piece of every segment
    (``segment_stripes``), and ``position_ids`` always travel (a piece's positions are not its offset).
    """
    if mesh.cp == 1:
        assert batch is not None, "with cp = 1 every rank reads its own batch"
        return shard_batch(batch, cp=1, cp_rank=0)
    group, src = mesh.cp_group, dist.get_global_rank(mesh.cp_group, 0)
    if mesh.reads_data:
        assert batch is not None, "the cp group's reader (cp rank 0) must pass the batch"
        full = complete_batch(batch)
        S = full["input_ids"].shape[1]
        if segment_tokens and segment_tokens < S:
            check_segment_split(S, segment_tokens, mesh.cp)
            if "position_ids" not in full:
                full["position_ids"] = torch.arange(S).expand_as(full["input_ids"])
            order = segment_stripes(S, segment_tokens, mesh.cp)
            full = {k: (v[:, order] if k in SEQ_KEYS else v) for k, v in full.items()}
        assert full["input_ids"].shape[1] % mesh.cp == 0, "init_mesh checks that cp divides data.seq_len"
        meta = [{k: ((tuple(v.shape), v.dtype) if torch.is_tensor(v) else None) for k, v in full.items()},
                {k: v for k, v in full.items() if not torch.is_tensor(v)}]
    else:
        meta = [None, None]
    dist.broadcast_object_list(meta, src=src, group=group)
    out = dict(meta[1])
    for key, spec in meta[0].items():
        if spec is None:
            continue
        shape, dtype = spec
        if key in SEQ_KEYS:
            shard = torch.empty((shape[0], shape[1] // mesh.cp, *shape[2:]), dtype=dtype, device=mesh.device)
            parts = None
            if mesh.reads_data:
                parts = [p.contiguous().to(mesh.device) for p in full[key].chunk(mesh.cp, dim=1)]
            dist.scatter(shard, parts, src=src, group=group)
        else:
            shard = full[key].to(mesh.device) if mesh.reads_data else torch.empty(shape, dtype=dtype,
                                                                                   device=mesh.device)
            dist.broadcast(shard, src=src, group=group)
        out[key] = shard
    return out
