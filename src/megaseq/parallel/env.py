"""``DistributedEnv``: the trainer's view of a dp x ep x cp run (the multi-process ``ParallelEnv``).

``megaseq.train.parallel_env.setup_parallel`` returns it when torchrun or a Ray worker set
WORLD_SIZE > 1. It owns the mesh and exposes what the training loop needs: the batch shard, the
sequence context, the vocabulary loss (Ring-DTP over the cp group), the global token count and
the gradient reduction. Parameters are replicated but the routed experts, which ``shard_moe`` spreads
over the ep group (a family's ``parallelize`` calls it); see ``grads`` for why the loss is divided by
the *global* token count and gradients are summed. ``dp_rank`` / ``dp_size`` count the ranks that read
different sequences: dp x ep.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist

from megaseq.models.common.context import SeqContext
from megaseq.parallel import grads
from megaseq.parallel.mesh import Mesh, distribute_batch, init_mesh, resolve_mla_mode, shutdown
from megaseq.parallel.ring_dtp import ring_dtp_loss, vocab_shard
from megaseq.parallel.ulysses import _gather_seq, make_context

logger = logging.getLogger(__name__)


class ParallelEnv:
    """One process: every collective is the identity. ``DistributedEnv`` overrides what differs."""

    rank = 0
    world_size = 1
    dp_rank = 0
    dp_size = 1
    cp_size = 1
    ep_size = 1
    ep_rank = 0
    is_main = True
    reads_data = True
    fsdp: str | None = None  # parallel.fsdp: how parameters are sharded (None: one process, nothing to shard)
    reduce_dtype = "fp32"

    def __init__(self, device: torch.device | None = None) -> None:
        self.device = device or torch.device("cpu")

    def to_device(self, batch: dict[str, Any]) -> dict[str, Any]:
        return {k: (v.to(self.device, non_blocking=True) if torch.is_tensor(v) else v) for k, v in batch.items()}

    def context(self, batch: dict[str, Any]) -> SeqContext:
        return SeqContext(doc_ids=batch.get("doc_ids"), position_ids=batch.get("position_ids"))

    def shard_batch(self, batch: dict[str, Any], segment_tokens: int = 0) -> dict[str, Any]:
        return batch

    def gather_seq(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def loss_sum(self, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                 chunk_tokens: int | None = None) -> torch.Tensor:
        """Sum of the per-token losses (chunked when ``chunk_tokens`` is set)."""
        from megaseq.memory.vocab_loss import linear_cross_entropy

        h_NH = hidden.reshape(-1, hidden.shape[-1])
        return linear_cross_entropy(h_NH, weight, labels.reshape(-1), chunk_tokens=chunk_tokens, reduction="sum")

    def all_reduce_count(self, n: int) -> int:
        return n

    def all_reduce_sum(self, x: float) -> float:
        return x

    def all_reduce_tensor(self, t: torch.Tensor) -> torch.Tensor:
        """Sum over every rank (dp x cp x ep): statistics such as the experts' loads."""
        return t.clone()

    def reduce_gradients(self, model: torch.nn.Module) -> None:
        return None

    def clip_grad_norm(self, params: list[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
        """The global gradient norm, the gradients clipped to ``max_norm`` first when it is > 0."""
        if max_norm > 0:
            return torch.nn.utils.clip_grad_norm_(params, max_norm)
        return torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params]))

    def shard_moe(self, moe: torch.nn.Module) -> None:
        raise ValueError("expert parallelism needs parallel.ep > 1 processes; with one process every expert "
                         "stays here (nothing to shard)")

    def broadcast_object(self, obj: Any) -> Any:
        return obj

    def barrier(self) -> None:
        return None

    def log(self, msg: str) -> None:
        if self.is_main:
            logger.info(msg)

    def shutdown(self) -> None:
        return None


class DistributedEnv(ParallelEnv):
    """One process of a dp x ep x cp world."""

    def __init__(self, cfg: Any, spec: Any | None = None, **mesh_kwargs: Any) -> None:
        if spec is None:
            from megaseq.models.presets import resolve_spec

            spec = resolve_spec(cfg.model.name)
        device = mesh_kwargs.pop("device", None)
        if device is None and cfg.train.device != "auto":
            device = "cpu" if cfg.train.device == "cpu" else None
        self.cfg = cfg
        self.mla_mode = resolve_mla_mode(cfg.parallel.mla_mode)
        self.mesh: Mesh = init_mesh(cfg.parallel, cfg.data.seq_len, spec, device=device, **mesh_kwargs)
        self.device = self.mesh.device
        m = self.mesh
        self.rank, self.world_size, self.is_main = m.rank, m.world_size, m.is_main
        self.cp_size, self.cp_rank, self.ep_size, self.ep_rank = m.cp, m.cp_rank, m.ep, m.ep_rank
        self.dp_size, self.dp_rank = m.dp * m.ep, m.dp_rank * m.ep + m.ep_rank  # ranks reading their own data
        self.reads_data = m.reads_data
        self.ep_settings = cfg.parallel.ep_dispatch_settings()
        self.expert_params: list[torch.nn.Parameter] = []  # the ep-sharded parameters (shard_moe)
        if self.ep_size > 1 and spec.num_experts % self.ep_size:
            raise ValueError(f"parallel.ep = {self.ep_size} must divide num_experts = {spec.num_experts}")
        self.fsdp, self.reduce_dtype = cfg.parallel.fsdp, cfg.parallel.reduce_dtype

    # ---- data --------------------------------------------------------------------------------
    def shard_batch(self, batch: dict[str, Any] | None, segment_tokens: int = 0) -> dict[str, Any]:
        """This rank's sequence shard. Only the cp group's reader's batch is used (others may pass None).
        With ``segment_tokens`` (sequence segments) the shard is this rank's piece of every segment."""
        return distribute_batch(batch if self.reads_data else None, self.mesh, segment_tokens)

    def context(self, batch: dict[str, Any]) -> Any:
        return make_context(self.mesh, batch, self.mla_mode)

    def gather_seq(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, S_loc, ...] -> [B, S, ...]`` over the cp group (no gradient: evaluation)."""
        if self.cp_size == 1:
            return x
        return _gather_seq(x.detach(), self.mesh.cp_group, self.cp_size)

    # ---- loss and gradients ---------------------------------------------------------------
    def uses_ring_dtp(self) -> bool:
        return self.cp_size > 1 and self.cfg.parallel.loss_parallel in ("auto", "ring_dtp")

    def loss_sum(self, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                 chunk_tokens: int | None = None) -> torch.Tensor:
        """Sum of this rank's per-token losses (``hidden [..., H]``, ``labels [...]``); Ring-DTP over cp."""
        if not self.uses_ring_dtp():
            return super().loss_sum(hidden, weight, labels, chunk_tokens)
        h_NH, labels_N = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1)
        shard = vocab_shard(weight, self.cp_rank, self.cp_size)
        return ring_dtp_loss(h_NH, shard, labels_N, weight.shape[0], self.mesh.cp_group).sum()

    def all_reduce_count(self, n: int) -> int:
        return grads.all_reduce_int(n)

    def all_reduce_sum(self, x: float) -> float:
        return grads.all_reduce_float(x)

    def all_reduce_tensor(self, t: torch.Tensor) -> torch.Tensor:
        return grads.all_reduce_tensor(t)

    def reduce_gradients(self, model: torch.nn.Module) -> None:
        """Replicated parameters summed over the world; the ep-sharded experts over their ``expert_group``;
        FSDP's shards (DTensors) are skipped: FSDP reduce-scattered them in the backward."""
        sharded = {id(p) for p in self.expert_params}
        params = [p for p in model.parameters() if p.requires_grad]
        grads.reduce_gradients([p for p in params if id(p) not in sharded])
        if self.expert_params:  # DTensors over the ep axis: their local slices, summed over the dp x cp ranks
            grads.reduce_gradients([p for p in params if id(p) in sharded], group=self.mesh.expert_group,
                                   dtensors=True)

    def clip_grad_norm(self, params: list[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
        """The global norm: the experts' squares summed over the ep group (each rank holds other experts)."""
        if not self.expert_params:
            return super().clip_grad_norm(params, max_norm)
        return grads.clip_grad_norm(params, max_norm, self.expert_params, group=self.mesh.ep_group)

    # ---- expert parallelism ----------------------------------------------------------------------
    def shard_moe(self, moe: torch.nn.Module) -> None:
        """Keep this rank's ``num_experts / ep`` of ``moe.experts`` (DTensors ``Shard(0)`` over the mesh's ep
        axis: ``parallel.expert.shard_experts``) and install the expert-parallel dispatch
        (``parallel.expert.EPDispatch``) on ``moe.expert_dispatch``; its experts' gradients are then reduced
        over the ranks holding the same experts. Applying again is a no-op."""
        from megaseq.parallel.expert import EPDispatch, shard_experts

        if self.ep_size == 1:
            return
        shard_experts(moe.experts, self.ep_size, self.ep_rank, self.mesh.device_mesh)
        moe.expert_dispatch = EPDispatch(group=self.mesh.ep_group, ep=self.ep_size, rank=self.ep_rank,
                                         settings=self.ep_settings, scope=moe.experts.layer)
        known = {id(p) for p in self.expert_params}
        self.expert_params += [p for p in moe.experts.parameters() if id(p) not in known]

    # ---- misc ------------------------------------------------------------------------------
    def broadcast_object(self, obj: Any) -> Any:
        if not self.mesh.distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def barrier(self) -> None:
        if self.mesh.distributed:
            dist.barrier()

    def shutdown(self) -> None:
        shutdown(self.mesh)
