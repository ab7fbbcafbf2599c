"""FSDP2 over the data-parallel ranks (or dp x cp), applied per block by a family's ``parallelize``.

Shapes: P parameters of one block, N ranks the parameters are sharded over (``dp``, or ``dp * cp``).

``apply_fsdp(model, blocks, env)`` calls ``torch.distributed.fsdp.fully_shard`` on every block (a decoder
layer), on the embedding when the head is not tied to it, and on the root (the final norm and the head):

- each block's parameters are sharded over ``parallel.fsdp``'s ranks (dim 0, torch's uneven chunks); its
  forward all-gathers them (``N - 1`` shards in) and frees them after the block (``reshard_after_forward``);
  its backward gathers them again, and reduce-scatters the block's gradients in ``parallel.reduce_dtype``
  (fp32, or the parameters' dtype when wider) with a plain SUM: the loss is already divided by the global
  token count (``parallel.grads``);
- the next block's all-gather is issued before this block runs (``prefetch_plan``: forward i -> i + 1,
  backward i -> i - 1), so at most two blocks are gathered at once: what the planner counts
  (``plan.components.fsdp_buffers``);
- the root keeps the head gathered from the forward to its backward (torch's rule for the root), so the
  trainer's losses (chunked, Ring-DTP) read ``model.lm_head.weight`` whole after ``model(...)``;
- parameters whose dtype differs from the model's (the router, KDA conv and decay, mHC base/scale that a
  bf16 model keeps in fp32) are left whole on every rank (FSDP2 groups need one dtype); ``reduce_gradients``
  all-reduces them. With a frozen base (LoRA adapters, ``train.trainable``: ``lora.has_frozen_base``) only
  the frozen parameters are sharded (bf16 under bf16 autocast, as the one-GPU path stores them: no gradient,
  no optimizer state, nothing reduce-scattered); what trains (the fp32 adapters, the trained base tensors)
  is left whole on every rank, its gradient all-reduced by ``reduce_gradients`` and its AdamW state whole:
  an FSDP group needs one dtype (bf16 frozen + fp32 adapters cannot share one), and the adapters cannot be
  units of their own: the routed experts' factors and ``kv_b_proj``'s merged adapter are read as tensors,
  not through the factor module's forward whose hooks would gather them. The cost: the trained state is
  not divided by the shard count (``plan.components.state_mesh``).
  With ``parallel.fsdp dp`` and cp > 1 the shards are replicated over the cp ranks
  (HSDP: a 2-D mesh, cp x dp): FSDP all-reduces the reduce-scattered shards over cp in each backward, so a
  shard's gradient is complete when FSDP hands it over (the optimizer may fold it into an fp32 sum).

Under expert parallelism (``parallel.ep > 1``) the routed experts (and their LoRA factors) are already DTensors
over the ep axis when FSDP is applied: they are left out (whole on their rank, their gradients reduced by
``DistributedEnv.reduce_gradients`` over the ranks holding the same experts), and everything else is sharded over
dp x ep (the ranks that read different sequences), x cp with ``dp_cp`` (``shard_mesh``).

Composes with the memory schemes (applied first: recompute and tiling wrap the blocks' forwards, FSDP's
hooks surround them, so a recomputed block runs on gathered weights), Ulysses CP (activations only),
Ring-DTP (the head is whole on every rank) and sequence segments (every segment's forward and backward
gather each block again: ``plan.flops.fsdp_traffic`` counts it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from megaseq.models.common.lora import has_frozen_base

MODES = ("off", "dp", "dp_cp")
REDUCE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def reduce_dtype(param_dtype: torch.dtype, setting: str) -> torch.dtype:
    """The gradient reduction dtype: ``parallel.reduce_dtype``, or the parameters' own when wider (fp64)."""
    want = REDUCE_DTYPES[setting]
    return param_dtype if torch.finfo(param_dtype).bits > torch.finfo(want).bits else want


@dataclass
class ShardedModel:
    """What ``apply_fsdp`` did: the FSDP units in forward order, the parameters left whole, the mesh."""

    mesh: Any  # the DeviceMesh the parameters are sharded over (1-D; 2-D (cp, dp) for HSDP)
    units: list[nn.Module]  # fully_shard-ed modules in forward order (embedding, blocks), root last
    replicated: list[nn.Parameter] = field(default_factory=list)  # kept whole: reduced by reduce_gradients

    @property
    def blocks(self) -> list[nn.Module]:
        return self.units[:-1]


def shard_mesh(mesh: Any, mode: str) -> Any:
    """The DeviceMesh FSDP shards over for ``parallel.fsdp = mode`` on a ``parallel.mesh.Mesh``: the dp ranks
    (1-D), dp x cp flattened (``dp_cp``), or with ``dp`` and cp > 1 a 2-D (cp, dp) mesh (HSDP: replicated
    over cp, sharded over dp). Under expert parallelism the ep ranks are data ranks for every parameter FSDP
    shards (the routed experts are not among them: ``apply_fsdp``), so "dp" is dp x ep there."""
    from torch.distributed.device_mesh import DeviceMesh

    dm = mesh.device_mesh
    data = ("dp", "ep") if mesh.ep > 1 else ("dp",)
    if mode == "dp_cp" and mesh.cp > 1:
        return dm[(*data, "cp")]._flatten("_".join((*data, "cp")))
    assert mode in ("dp", "dp_cp"), mode
    if mesh.cp == 1:
        return dm[data]._flatten("dp_ep") if mesh.ep > 1 else dm["dp"]
    ranks_CD = dm.mesh.reshape(-1, mesh.cp).t().contiguous()  # (dp, ep, cp) row-major -> (cp, dp x ep)
    return DeviceMesh(dm.device_type, ranks_CD, mesh_dim_names=("cp_replicate", "dp_shard"))


def prefetch_plan(num_units: int) -> tuple[dict[int, int], dict[int, int]]:
    """(forward, backward) prefetch: unit i issues the all-gather of unit i + 1 before it runs forward, and
    of unit i - 1 before its backward; one unit ahead, so two are gathered at most."""
    forward = {i: i + 1 for i in range(num_units - 1)}
    backward = {i: i - 1 for i in range(1, num_units)}
    return forward, backward


def _dominant_dtype(params: list[nn.Parameter]) -> torch.dtype:
    """The dtype of most parameter elements (bf16 in a bf16 model whose router stays fp32)."""
    count: dict[torch.dtype, int] = {}
    for p in params:
        count[p.dtype] = count.get(p.dtype, 0) + p.numel()
    return max(count, key=count.get)


def apply_fsdp(model: nn.Module, blocks: list[nn.Module], env: Any, stream_base: bool = False) -> ShardedModel | None:
    """Shard ``model`` per block as ``env`` says (``env.fsdp``: the mode, None or "off" for none); returns
    what was sharded, or None. Memory schemes must already be applied (they wrap the blocks' forwards).
    ``stream_base`` (``memory.stream_base``, a frozen base): the blocks' shards live in host memory (pinned on
    CUDA), torch's ``CPUOffloadPolicy``: each unit's all-gather copies this rank's shard to the GPU first,
    prefetched one unit ahead, and frees the gathered weights after the forward and after the backward."""
    from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard

    mode = getattr(env, "fsdp", None)
    if isinstance(model, FSDPModule):  # applying the memory schemes again keeps the sharding
        done = model.__dict__.get("_megaseq_sharded")
        if mode in (None, "off") or done is None:
            raise ValueError("this model is already sharded (FSDP): build a new model to turn parallel.fsdp off")
        return done
    if mode in (None, "off"):
        return None
    device_mesh = shard_mesh(env.mesh, mode)
    frozen_base = has_frozen_base(model)  # LoRA / train.trainable: shard the frozen base, keep what trains whole
    # the routed experts under expert parallelism are already DTensors over the ep axis (and their adapters):
    # left to the environment, which reduces their gradients over the ranks holding the same experts
    shard = [p for p in model.parameters() if not (frozen_base and p.requires_grad) and not is_sharded(p)]
    dtype = _dominant_dtype(shard)
    mp = MixedPrecisionPolicy(param_dtype=None, reduce_dtype=reduce_dtype(dtype, env.reduce_dtype))
    kept = {id(p) for p in shard if p.dtype == dtype}
    ignored = {p for p in model.parameters() if id(p) not in kept}
    kw = dict(mesh=device_mesh, mp_policy=mp, ignored_params=ignored or None)
    units: list[nn.Module] = []
    tied = model.lm_head.weight is model.embed_tokens.weight
    if not tied:  # the embedding is needed at the start of the forward and the end of the backward only
        units.append(fully_shard(model.embed_tokens, reshard_after_forward=True, **kw))
    offload = {}
    if stream_base and frozen_base:  # what trains is whole (ignored): only the frozen shards go to the host
        offload = dict(offload_policy=CPUOffloadPolicy(pin_memory=torch.cuda.is_available() and
                                                        device_mesh.device_type == "cuda"))
    units += [fully_shard(b, reshard_after_forward=True, **kw, **offload) for b in blocks]
    units.append(fully_shard(model, **kw))  # the root: norm and head, gathered through the step
    for unit in units:
        unit.set_gradient_divide_factor(1.0)  # the loss is already a global mean: sum, never average
        unit.set_force_sum_reduction_for_comms(True)  # SUM, no PREMUL_SUM (gloo has none)
    forward, backward = prefetch_plan(len(units) - 1)
    for i, j in forward.items():
        units[i].set_modules_to_forward_prefetch([units[j]])
    for i, j in backward.items():
        units[i].set_modules_to_backward_prefetch([units[j]])
    done = ShardedModel(device_mesh, units, [p for p in model.parameters() if p in ignored])
    model.__dict__["_megaseq_sharded"] = done
    return done


def is_sharded(t: torch.Tensor) -> bool:
    """A DTensor parameter or gradient (FSDP's shard), as opposed to a whole tensor."""
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)
