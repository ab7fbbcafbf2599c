"""Expert parallelism: each ep rank holds E / ep experts; routed rows travel by all-to-all (docs/expert_parallel.md).

Shapes: N tokens of this rank, H hidden, I expert intermediate size, K experts per token, P ep ranks,
E experts, Ep = E / P held per rank, n tokens of a chunk, M = n * K routed rows of a chunk, R rows this
rank receives in a chunk, F experts spilled to this rank.

``EPDispatch`` is the ``models.common.moe.ExpertDispatch`` a family's ``parallelize`` installs on each MoE
(through ``DistributedEnv.shard_moe``); the model never imports this module. One call:

1. ``expert_route.build_route``: two integer all-gathers, the chunks and every chunk's plan (``plain``:
   each expert serves its own rows; ``llep`` / ``pipelined_llep``: LLEP above its threshold);
2. the weights of spilled experts travel from their native rank to their helper (one variable-split
   all-to-all, an autograd function: the helper's weight gradient comes back the same way);
3. per chunk: the rows all-to-all to their experts (``ep_dispatch``), the SwiGLU experts, the outputs back
   (``ep_combine``), weighted and summed over K at the source as in one process. ``pipelined_llep`` runs
   the chunks through ``memory.replay`` (no graph; each chunk replayed in backward, the spilled weights
   read whole by every chunk), so one chunk's buffers are alive at a time; ``plain`` / ``llep`` run one
   chunk with a graph (the buffers live until backward, growing with the routing's imbalance).

Every collective adds the bytes leaving this rank to ``ulysses.COMM_BYTES[(scope, op, direction)]``
(``plan.flops.ep_comm_bytes`` predicts them). All ranks of the ep group call the same collectives in
the same order: the chunk count comes from the group's largest token count and every plan is computed
from the same gathered counts.

Composition: ep ranks read different sequences (``DistributedEnv``: data rank = dp_rank * ep + ep_rank),
so every non-expert parameter is replicated over dp x ep x cp and reduced over the world, the experts
over the dp x cp ranks holding the same ones (``mesh.expert_group``). Under cp each rank dispatches its
own sequence shard. The held experts are DTensors ``Shard(0)`` over the mesh's ep axis (``shard_experts``):
DCP saves each slice once and reshards it on load, the HF export gathers them (``full_tensor``), and the
shard-aware clipping sums their squares over the ep group. Under FSDP (``parallel.fsdp``) the experts stay as
they are (FSDP leaves DTensors out) and every other parameter is sharded over dp x ep (x cp). With LoRA on the
experts (``LoRAExperts``) the factors are per-expert tensors like the weights (``Experts.expert_tensors``): split
over ep, sent with a spilled expert, their gradients returned and reduced the same way.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from megaseq.config import ExpertDispatchSettings
from megaseq.memory.master_adam import REDUCED_AFTER_BACKWARD, is_dtensor
from megaseq.models.common.moe import ExpertDispatch, Experts
from megaseq.ops.amp import autocast_as, autocast_state
from megaseq.ops.moe_glue.reference import combine
from megaseq.parallel.expert_route import ChunkRoute, Route, build_route, destinations, group_by_served, strided_order
from megaseq.parallel.ulysses import count_bytes


# ---- all-to-all of rows with variable split sizes ----------------------------------------------------
def all_to_all_rows(x: torch.Tensor, send: list[int], recv: list[int], group: Any, op: str, direction: str,
                    scope: str) -> torch.Tensor:
    """Rows ``x[sum(send[:r]):sum(send[:r+1])]`` go to rank r; the result stacks what each rank sent here."""
    if len(send) == 1:
        return x
    me = dist.get_rank(group)
    row_bytes = math.prod(x.shape[1:]) * x.element_size()
    count_bytes(op, direction, (sum(send) - send[me]) * row_bytes, scope)  # the block to itself stays
    out = x.new_empty((sum(recv), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), recv, send, group=group)
    return out


class AllToAll(torch.autograd.Function):
    """``all_to_all_rows`` whose backward sends the gradient back (split sizes swapped)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, send: list[int], recv: list[int], group: Any, op: str,
                scope: str) -> torch.Tensor:
        ctx.args = (send, recv, group, op, scope)
        return all_to_all_rows(x, send, recv, group, op, "fwd", scope)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple:
        send, recv, group, op, scope = ctx.args
        return all_to_all_rows(g, recv, send, group, op, "bwd", scope), None, None, None, None, None


# ---- sharding ----------------------------------------------------------------------------------------
def shard_experts(experts: Experts, ep: int, rank: int, device_mesh: Any = None, mesh_dim: str = "ep") -> None:
    """Keep experts ``[rank * E / ep, (rank + 1) * E / ep)`` of ``experts`` (in place; again: no-op).

    With ``device_mesh`` (the run's ``(dp, ep, cp)`` mesh) each kept slice becomes a DTensor parameter of
    global shape ``[E, ...]``, ``Shard(0)`` over ``mesh_dim`` and replicated over the other dims: what DCP
    saves once per shard and reshards on load, what ``full_tensor`` gathers for the HF export, and what the
    shard-aware clipping (``memory.master_adam.clip_grad_norm_``) sums over the ep group. The dispatch reads
    the local slice (``local_weights``); the gradient comes back as a DTensor of the same placements. Such a
    parameter is marked ``reduced_after_backward`` (``memory.master_adam``): its gradient is summed over the
    ranks holding the same experts after the backward, so no optimizer hook may take it earlier."""
    E = experts.num_experts
    if E % ep:
        raise ValueError(f"parallel.ep = {ep} must divide num_experts = {E}: pick an ep among "
                         f"{[d for d in range(1, E + 1) if E % d == 0]}")
    Ep = E // ep
    held = range(rank * Ep, (rank + 1) * Ep)
    if experts.held == held:
        return
    assert experts.held == range(E), f"experts already sharded as {experts.held}, not {held}"
    for owner, name, w in _per_expert(experts):
        part = w.detach()[held.start:held.stop].clone()
        if device_mesh is not None:
            part = _as_ep_dtensor(part, device_mesh, mesh_dim, tuple(w.shape))
        p = nn.Parameter(part, requires_grad=w.requires_grad)
        if device_mesh is not None:
            setattr(p, REDUCED_AFTER_BACKWARD, True)
        if isinstance(owner, nn.ParameterDict):
            owner[name] = p
        else:
            setattr(owner, name, p)
    experts.held = held


def _per_expert(experts: Experts) -> list[tuple[nn.Module, str, nn.Parameter]]:
    """``(owner, name, parameter)`` of each tensor of ``experts.expert_tensors()`` (the weights, then the LoRA
    factors of ``LoRAExperts``: ``lora_A`` / ``lora_B`` entries), as ``shard_experts`` replaces them."""
    wanted = {id(t) for t in experts.expert_tensors()}
    found = {}
    for m in experts.modules():
        for name, p in m.named_parameters(recurse=False):
            if id(p) in wanted:
                found[id(p)] = (m, name, p)
    return [found[id(t)] for t in experts.expert_tensors()]


def _as_ep_dtensor(part: torch.Tensor, device_mesh: Any, mesh_dim: str, shape: tuple[int, ...]) -> torch.Tensor:
    """This rank's expert slice as a DTensor of global ``shape``: ``Shard(0)`` over ``mesh_dim``, replicated
    over the mesh's other dims."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    names = device_mesh.mesh_dim_names
    placements = [Shard(0) if d == mesh_dim else Replicate() for d in names]
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(part, device_mesh, placements, run_check=False, shape=torch.Size(shape),
                              stride=stride)


def local_weights(experts: Experts) -> tuple[torch.Tensor, ...]:
    """``(gate_up [Ep, 2I, H], down [Ep, H, I], *LoRA factors [Ep, ...])`` (``experts.expert_tensors()``): the
    per-expert tensors this rank holds, as plain tensors (a DTensor's local slice through ``to_local``,
    differentiable: its gradient lands on the DTensor)."""
    return tuple(w.to_local() if is_dtensor(w) else w for w in experts.expert_tensors())


# ---- the dispatch ------------------------------------------------------------------------------------
Weights = tuple[torch.Tensor, ...]  # (gate_up [*, 2I, H], down [*, H, I], *LoRA factors): expert_tensors()


@dataclass
class EPDispatch(ExpertDispatch):
    """The expert-parallel ``ExpertDispatch`` of one MoE layer (see the module docstring)."""

    group: Any
    ep: int
    rank: int
    settings: ExpertDispatchSettings = field(default_factory=ExpertDispatchSettings)
    scope: str = "moe"  # the traffic counter's label
    last: dict[str, Any] = field(default_factory=dict)  # the last call's route statistics

    def __call__(self, experts: Experts, x_NH: torch.Tensor, experts_NK: torch.Tensor,
                 weights_NK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        E = experts.num_experts
        assert experts.held == range(self.rank * E // self.ep, (self.rank + 1) * E // self.ep), \
            "EPDispatch needs its rank's experts: install it with shard_experts (DistributedEnv.shard_moe)"
        counts_E = torch.bincount(experts_NK.reshape(-1), minlength=E)
        route = build_route(experts_NK, E, self.group, self.ep, self.rank, self.settings, self.scope,
                            self.token_order)
        self.last = route.stats()
        order = route.order_N
        held = local_weights(experts)
        ins = (x_NH[order], weights_NK[order], experts_NK[order], *held)
        if torch.is_grad_enabled() and any(t.requires_grad for t in ins):
            y_NH = _DispatchFn.apply(self, experts, route, *ins)
        else:
            y_NH = self.run(experts, route, *ins[:3], held, keep_graph=False)[0]
        out_NH = x_NH.new_zeros((x_NH.shape[0], y_NH.shape[1]), dtype=y_NH.dtype)
        return out_NH.index_put((order,), y_NH), counts_E

    def token_order(self, N: int, Kc: int, device: torch.device) -> tuple[torch.Tensor, list]:
        """The strided chunking (a method: tests replace it with a broken one)."""
        return strided_order(N, Kc, device)

    # ---- forward ------------------------------------------------------------------------------------
    def run(self, experts: Experts, route: Route, x_NH: torch.Tensor, w_NK: torch.Tensor, e_NK: torch.Tensor,
            held: Weights, keep_graph: bool) -> tuple[torch.Tensor, Weights]:
        """Every chunk (tokens in strided order): ``(y_NH, the spilled experts' tensors received)``. With
        ``keep_graph`` (plain / llep: one chunk) the chunk's graph is built and kept until backward."""
        foreign = self.send_weights(held, route)
        if keep_graph:  # the received tensors are leaves of the kept graph: their gradients come out of it
            foreign = tuple(f.detach().requires_grad_(h.requires_grad) for f, h in zip(foreign, held))
            return self.chunk(experts, route, route.parts[0], x_NH, w_NK, e_NK, held, foreign), foreign
        y_NH = None
        for c, part in zip(route.chunks, route.parts):
            y = self.chunk(experts, route, part, x_NH[c.start:c.end], w_NK[c.start:c.end], e_NK[c.start:c.end],
                           held, foreign)
            if y_NH is None:
                y_NH = y.new_empty((x_NH.shape[0], y.shape[1]))
            y_NH[c.start:c.end] = y
            del y
        if y_NH is None:  # no chunk at all (no tokens anywhere)
            y_NH = x_NH.new_zeros((0, held[0].shape[2]))
        return y_NH, foreign

    def send_weights(self, held: Weights, route: Route) -> Weights:
        """``(gate_up [F, 2I, H], down [F, H, I], *factors [F, ...])`` of the experts spilled here, sent by their
        native ranks (no graph: ``return_weight_grads`` sends their gradients back); ``()`` when none move."""
        if not route.moves_weights:
            return ()
        with torch.no_grad():
            idx = torch.tensor([e - route.held_start for e, _ in route.weight_send], dtype=torch.long,
                               device=held[0].device)
            got = self._exchange([t[idx] for t in held], route.weight_send_splits, route.weight_recv_splits, "fwd")
        F = len(route.foreign)
        return tuple(g.reshape(F, *t.shape[1:]) for g, t in zip(got, held))

    def _exchange(self, tensors: list[torch.Tensor], send: list[int], recv: list[int],
                  direction: str) -> list[torch.Tensor]:
        """Rows of each per-expert tensor all-to-all (one flat exchange per dtype: a bf16 frozen base and its
        fp32 adapters travel in their own dtypes); each returned ``[rows, *]`` flattened past dim 0."""
        out: list[torch.Tensor | None] = [None] * len(tensors)
        for dtype in dict.fromkeys(t.dtype for t in tensors):
            idx = [i for i, t in enumerate(tensors) if t.dtype == dtype]
            flat = torch.cat([tensors[i].flatten(1) for i in idx], dim=1)
            got = all_to_all_rows(flat, send, recv, self.group, "ep_weights", direction, self.scope)
            for i, part in zip(idx, got.split([math.prod(tensors[i].shape[1:]) for i in idx], dim=1)):
                out[i] = part
        return out

    def chunk(self, experts: Experts, route: Route, part: ChunkRoute, x_nH: torch.Tensor, w_nK: torch.Tensor,
              e_nK: torch.Tensor, held: Weights, foreign: Weights) -> torch.Tensor:
        """One chunk: rows out to their experts, the experts, outputs back, combined (``[n, H]``)."""
        K = e_nK.shape[1]
        dest_M = destinations(e_nK, part, self.ep)
        send_M = torch.argsort(dest_M * experts.num_experts + e_nK.reshape(-1), stable=True)
        assert torch.bincount(dest_M, minlength=self.ep).tolist() == part.send, "rows and plan disagree"
        # the received rows are passed on without a name here, so they are freed once regrouped
        y_RH = self.serve(experts, route, part, AllToAll.apply(x_nH[send_M // K], part.send, part.recv,
                                                               self.group, "ep_dispatch", self.scope), held, foreign)
        y_MH = AllToAll.apply(y_RH, part.recv, part.send, self.group, "ep_combine", self.scope)
        del y_RH
        inverse = torch.empty_like(send_M)
        inverse[send_M] = torch.arange(send_M.numel(), device=send_M.device)
        return combine(y_MH[inverse], w_nK, x_nH.dtype)

    def serve(self, experts: Experts, route: Route, part: ChunkRoute, x_RH: torch.Tensor, held: Weights,
              foreign: Weights) -> torch.Tensor:
        """The received rows through the experts this rank serves: its own, then the spilled ones."""
        order_R, per_served = group_by_served(part, route.served_E)
        x_RH = x_RH[order_R]
        Ep = route.num_held
        held_rows = int(per_served[:Ep].sum())
        ys = [experts.routed_rows(x_RH[:held_rows], held, per_served[:Ep])]
        if foreign and x_RH.shape[0] > held_rows:
            ys.append(experts.routed_rows(x_RH[held_rows:], foreign, per_served[Ep:]))
        del x_RH
        y_RH = torch.cat(ys) if len(ys) > 1 else ys[0]
        del ys
        inverse = torch.empty_like(order_R)
        inverse[order_R] = torch.arange(order_R.numel(), device=order_R.device)
        return y_RH[inverse]

    # ---- backward -----------------------------------------------------------------------------------
    def return_weight_grads(self, route: Route, g_foreign: Weights, g_gate_up: torch.Tensor,
                            g_down: torch.Tensor, *g_factors: torch.Tensor) -> None:
        """Send the spilled experts' gradients to their native ranks, added into ``g_gate_up`` / ``g_down`` (and
        the LoRA factors' ``g_factors``) there (the reverse of ``send_weights``)."""
        if not route.moves_weights:
            return
        g_held = (g_gate_up, g_down, *g_factors)
        back = self._exchange(list(g_foreign), route.weight_recv_splits, route.weight_send_splits, "bwd")
        for row, (e, _) in enumerate(route.weight_send):
            i = e - route.held_start
            for g, part in zip(g_held, back):
                g[i] += part[row].view_as(g[i])


class _DispatchFn(torch.autograd.Function):
    """One MoE call's expert-parallel dispatch as one autograd node, so that its backward's collectives
    run in program order on every rank whatever each rank's routing (separate autograd nodes for the
    weights' transfer would leave their order to the engine's scheduling, which follows each rank's own
    graph). pipelined: the chunks run without a graph, only the inputs and the received weights are
    saved, and each chunk is replayed in backward; plain / llep: the one chunk's graph is kept."""

    @staticmethod
    def forward(ctx, d: EPDispatch, experts: Experts, route: Route, x_NH, w_NK, e_NK, *held):
        ctx.d, ctx.experts, ctx.route, ctx.autocast = d, experts, route, autocast_state()
        ctx.keep, ctx.num_held = not d.settings.pipelined, len(held)
        if ctx.keep:
            leaves = [t.detach().requires_grad_(t.requires_grad) for t in (x_NH, w_NK, *held)]
            with torch.enable_grad():
                y, foreign = d.run(experts, route, leaves[0], leaves[1], e_NK, tuple(leaves[2:]), True)
            ctx.graph = (y, leaves + list(foreign))
            return y.detach()
        y, foreign = d.run(experts, route, x_NH, w_NK, e_NK, held, keep_graph=False)
        ctx.save_for_backward(x_NH, w_NK, e_NK, *held, *foreign)
        return y

    @staticmethod
    def backward(ctx, g_NH):
        d, route, n = ctx.d, ctx.route, ctx.num_held
        if ctx.keep:
            y, leaves = ctx.graph
            del ctx.graph
            gx, gw, *g = _grads(y, leaves, g_NH, n)
        else:
            gx, gw, *g = _replay_chunks(ctx, g_NH)
        g_held, g_for = g[:n], g[n:]
        if route.moves_weights:  # the native rank receives its helpers' gradients even if it used none itself
            held, need = local_weights(ctx.experts), ctx.needs_input_grad[6:6 + n]
            g_held = [(torch.zeros_like(t) if gi is None else gi) if q else None
                      for t, gi, q in zip(held, g_held, need)]
            trained = [i for i, q in enumerate(need) if q]
            if trained:  # the gradients of what trains go back (a frozen base's weights have none)
                d.return_weight_grads(route, tuple(g_for[i] for i in trained), *(g_held[i] for i in trained))
        return None, None, None, gx, gw, None, *g_held


def _grads(y: torch.Tensor, leaves: list[torch.Tensor], g: torch.Tensor, num_held: int) -> list[torch.Tensor | None]:
    """``d y / d leaves`` (None for leaves without grad; zeros for received tensors that train but the chunk did
    not use: index ``2 + num_held`` on)."""
    wrt = [t for t in leaves if t.requires_grad]
    got = iter(torch.autograd.grad(y, wrt, g, allow_unused=True))
    out = [next(got) if t.requires_grad else None for t in leaves]
    k = 2 + num_held
    return out[:k] + [torch.zeros_like(t) if o is None and t.requires_grad else o for t, o in zip(leaves[k:], out[k:])]


def _replay_chunks(ctx: Any, g_NH: torch.Tensor) -> list[torch.Tensor | None]:
    """pipelined backward: each chunk rerun with a graph (under the forward's autocast) and backpropagated;
    input gradients written per chunk, the held and received tensors' gradients summed over the chunks."""
    d, route, experts, n = ctx.d, ctx.route, ctx.experts, ctx.num_held
    x, w, e, *tensors = ctx.saved_tensors
    need = ctx.needs_input_grad
    held_need = need[6:6 + n]
    weights = [t.detach().requires_grad_(q) for t, q in zip(tensors[:n], held_need)]
    weights += [f.detach().requires_grad_(q) for f, q in zip(tensors[n:], held_need)]
    gx = torch.zeros_like(x) if need[3] else None
    gw = torch.zeros_like(w) if need[4] else None
    sums: list[torch.Tensor | None] = [None] * len(weights)
    with torch.enable_grad(), autocast_as(ctx.autocast):
        for c, part in zip(route.chunks, route.parts):
            xc = x[c.start:c.end].detach().requires_grad_(need[3])
            wc = w[c.start:c.end].detach().requires_grad_(need[4])
            y = d.chunk(experts, route, part, xc, wc, e[c.start:c.end], tuple(weights[:n]), tuple(weights[n:]))
            g = _grads(y, [xc, wc, *weights], g_NH[c.start:c.end], n)
            del y
            if gx is not None:
                gx[c.start:c.end] = g[0]
            if gw is not None:
                gw[c.start:c.end] = g[1]
            for i, gi in enumerate(g[2:]):
                if gi is not None:
                    sums[i] = gi if sums[i] is None else sums[i] + gi
    return [gx, gw, *sums]
