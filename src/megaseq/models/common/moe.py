"""Routed Mixture-of-Experts with an optional shared expert (GLM-5.3-Flash / DeepSeek and Qwen3-MoE).

Shapes: N tokens (all leading dims of the input flattened), H hidden, E routed experts, K experts per
token, I expert intermediate size, M = N * K routed rows.

Where the experts run is the ``expert_dispatch`` strategy's business (``ExpertDispatch``: all here; a
family's ``parallelize`` installs the expert-parallel one of ``megaseq.parallel.expert`` from outside).

    x_NH --gate--> weights_NK, experts_NK          (router; scores [N, E] are its only dense tensor)
         --sort rows by expert--> x_MH             (only the N*K routed rows are gathered)
         --grouped_mm(gate_up_proj)--> gu_M2I --swiglu--> a_MI --grouped_mm(down_proj)--> y_MH
         --* weights, unsort, sum over K--> out_NH (+ shared_experts(x_NH))

Working memory of the routed path: about ``M * (2H + 3I)`` elements (x_MH, gu_M2I, a_MI, y_MH and its
weighted/unsorted copy), never an ``[N, E]`` one-hot. The module is token-separable, so
``memory.tiling`` can run it over sequence chunks (the fix for skewed real-data routing) from outside.

Routers (``spec.router``), each matching its HF reference op for op; c below is the router's compute
dtype ``promote_types(x.dtype, float32)``, HF's float32 for bf16/fp32 inputs:
  ``sigmoid_bias``  ``Glm5NextTextTopkRouter``: logits in c, sigmoid scores, choice on scores + bias
                    (``e_score_correction_bias``) with group-limited top-k (groups ranked by the sum of
                    their top-2 scores), weights from the unbiased scores, renormalised when
                    ``norm_topk_prob`` (``+ 1e-20``), times ``routed_scaling_factor``.
  ``softmax``       ``Qwen3MoeTopKRouter``: logits in the input dtype, softmax in c, top-k,
                    renormalised when ``norm_topk_prob``, cast back to the logits' dtype.
  ``topk_softmax``  ``GptOssTopKRouter``: logits (with the router's ``bias``) in the input dtype, top-k of
                    them, softmax over the K chosen in the logits' dtype (as HF); the auxiliary loss reads
                    the softmax over all experts.

Why c and not HF's literal float32: in a float64 model a float32 router GEMM rounds differently when
the number of tokens per call changes (sequence tiling, packed documents, context-parallel shards), so
routing weights move by ~1e-7 and expert choices can flip; in c the result is independent of how the
tokens are split. bf16/fp32 numerics are HF's bit for bit.

The router's ``weight`` (and the bias buffer) are created in float32, as HF keeps them
(``_keep_in_fp32_modules_strict``); ``FP32_PARAM_SUFFIXES`` lists them for a builder that casts the
rest of the model to bf16. The forward casts as described whatever their stored dtype.

Balancing during training (``megaseq.train.balance`` drives it; the model only keeps the statistics):
every forward leaves ``last_tokens_per_expert`` (and, with an auxiliary loss, ``last_router_prob_sum``,
the router probabilities summed over the tokens); memory schemes that run the MoE in chunks sum both
over the chunks (``_tile_summed_attrs``). The auxiliary load-balancing loss (Switch / HF
``load_balancing_loss_func``) is ``coef * E * sum_i f_i P_i`` with ``f_i`` the fraction of routed
assignments to expert i (no gradient) and ``P_i`` the mean router probability: its gradient with
respect to each token's probability of expert i is the same constant for every token, known once the
whole batch has been routed. So instead of a loss term the router hands that constant to its
probabilities in backward (``_AuxLossGrad``, Megatron's ``MoEAuxLossAutoScaler`` idea): exact under
tiling, recompute and sequence segments, whose replays all run backward after the statistics are known.
The trainer sets ``aux_grad_E`` after each forward from the statistics of the whole (global) batch.
The sigmoid routers' sequence-wise loss (DeepSeek-V3, beside the bias) works the same way on the scores
normalised over the experts, with one constant per sequence and expert (``[B, E]``).

Expert weights use the HF v5 fused layout: ``gate_up_proj [E, 2I, H]`` (gate rows first) and
``down_proj [E, H, I]``. The per-expert matmuls go through op ``grouped_mm`` of ``megaseq.ops.dispatch``.
gpt-oss's experts (``spec.expert_bias``, ``spec.swiglu_alpha``) add ``gate_up_proj_bias [E, 2I]`` (gate
first) and ``down_proj_bias [E, H]`` to each routed row's products, and run op ``clamped_swiglu``
(``(up + 1) * g * sigmoid(alpha * g)`` with gpt-oss's clamps) in place of ``swiglu``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megaseq.models.common.mlp import MLP
from megaseq.models.common.routing import balanced_experts, check_routing
from megaseq.models.spec import ModelSpec
from megaseq.ops import dispatch
from megaseq.ops.moe_glue.reference import _mm_dtype

ROUTERS = ("sigmoid_bias", "softmax", "topk_softmax")
# parameters/buffers HF keeps in float32 in a bf16 model (names end with these)
FP32_PARAM_SUFFIXES = ("mlp.gate.weight", "mlp.gate.e_score_correction_bias")


# ---- op grouped_mm: y_MO[rows of e] = x_MD[rows of e] @ w_EOD[e].T, rows sorted by expert ------------


def expert_counts(experts_M: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Rows per expert ``[E]`` int64, as ``torch.bincount(experts_M, minlength=E)`` but without a host sync:
    CUDA's bincount reads the input's min and max back to the host to size its output (two syncs per MoE
    layer and pass, each draining the GPU's queue of launched work)."""
    counts_E = torch.zeros(num_experts, dtype=torch.int64, device=experts_M.device)
    return counts_E.scatter_add_(0, experts_M, torch.ones_like(experts_M, dtype=torch.int64))


# ---- router ---------------------------------------------------------------------------------------
class TopKRouter(nn.Module):
    """Chooses K experts per token and their weights; HF module name ``gate``."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        E, H = spec.num_experts, spec.hidden_size
        self.router = spec.router
        self.num_experts, self.top_k = E, spec.num_experts_per_tok
        self.n_group, self.topk_group = spec.n_group, spec.topk_group
        self.norm_topk_prob = spec.norm_topk_prob
        self.weights_fp32 = spec.router_weights_fp32  # Mixtral keeps its routing weights float32
        self.routed_scaling_factor = spec.routed_scaling_factor
        self.routing = "natural"  # or "balanced" (benchmarks on random weights: models.common.routing)
        self.weight = nn.Parameter(torch.empty(E, H, dtype=torch.float32).normal_(0.0, 0.02))
        self.bias = nn.Parameter(torch.zeros(E, dtype=torch.float32)) if spec.router_bias else None
        if self.router == "sigmoid_bias":
            self.register_buffer("e_score_correction_bias", torch.zeros(E, dtype=torch.float32))

    @torch.no_grad()
    def init_weights(self, std: float) -> None:
        self.weight.normal_(0.0, std)
        if self.bias is not None:  # HF's GptOssTopKRouter: normal, as the weight
            self.bias.normal_(0.0, std)
        if self.router == "sigmoid_bias":
            self.e_score_correction_bias.zero_()

    def forward(self, x_NH: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x_NH -> (weights_NK, experts_NK)``; weights in ``promote_types(x.dtype, float32)`` (sigmoid)
        or x's dtype (softmax)."""
        return self.route(x_NH)[:2]

    def route(self, x_NH: torch.Tensor, probs: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """``(weights_NK, experts_NK, probs_NE)``: ``probs_NE`` what an auxiliary loss reads: the softmax
        router's probabilities over all experts; for the sigmoid router, only when ``probs``, its unbiased
        scores normalised over all experts, ``s / (sum_j s_j + 1e-20)`` (DeepSeek-V3 eq. 19, Megatron-Core's
        ``compute_routing_scores_for_aux_loss``), else None. With ``routing`` balanced the expert ids are
        ``routing.balanced_experts``' and the weights the router's top-k values."""
        if self.router == "softmax":
            weights_NK, experts_NK, probs_NE = self._softmax(x_NH)
        elif self.router == "topk_softmax":
            weights_NK, experts_NK, probs_NE = self._topk_softmax(x_NH, probs)
        else:
            weights_NK, experts_NK, scores_NE = self._sigmoid_bias(x_NH)
            probs_NE = (scores_NE / (scores_NE.sum(dim=-1, keepdim=True) + 1e-20)) if probs else None
        if self.routing == "balanced":
            experts_NK = balanced_experts(experts_NK.shape[0], self.top_k, self.num_experts, experts_NK.device)
        return weights_NK, experts_NK, probs_NE

    def _softmax(self, x_NH: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        logits_NE = F.linear(x_NH, self.weight.to(x_NH.dtype))
        probs_NE = F.softmax(logits_NE, dim=-1, dtype=torch.promote_types(logits_NE.dtype, torch.float32))
        top_NK, experts_NK = torch.topk(probs_NE, self.top_k, dim=-1)
        if self.norm_topk_prob:
            top_NK = top_NK / top_NK.sum(dim=-1, keepdim=True)
        return (top_NK if self.weights_fp32 else top_NK.to(logits_NE.dtype)), experts_NK, probs_NE

    def _topk_softmax(self, x_NH: torch.Tensor, probs: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        bias = None if self.bias is None else self.bias.to(x_NH.dtype)
        logits_NE = F.linear(x_NH, self.weight.to(x_NH.dtype), bias)
        top_NK, experts_NK = torch.topk(logits_NE, self.top_k, dim=-1)
        weights_NK = F.softmax(top_NK, dim=-1, dtype=top_NK.dtype)
        if not probs:
            return weights_NK, experts_NK, None
        probs_NE = F.softmax(logits_NE, dim=-1, dtype=torch.promote_types(logits_NE.dtype, torch.float32))
        return weights_NK, experts_NK, probs_NE

    def _sigmoid_bias(self, x_NH: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        E, G = self.num_experts, self.n_group
        c = torch.promote_types(x_NH.dtype, torch.float32)
        logits_NE = F.linear(x_NH.to(c), self.weight.to(c))
        scores_NE = logits_NE.sigmoid()
        # no cast of the bias: the sum is in c or wider, as in HF (float32 scores + a float64 bias is float64)
        choice_NE = scores_NE + self.e_score_correction_bias
        # rank groups by the sum of their two best biased scores, keep topk_group of them
        group_NG = choice_NE.view(-1, G, E // G).topk(2, dim=-1)[0].sum(dim=-1)
        keep_NG = torch.zeros_like(group_NG)
        keep_NG.scatter_(1, torch.topk(group_NG, k=self.topk_group, dim=-1, sorted=False)[1], 1)
        keep_NE = keep_NG.unsqueeze(-1).expand(-1, G, E // G).reshape(-1, E)
        choice_NE = choice_NE.masked_fill(~keep_NE.bool(), float("-inf"))
        experts_NK = torch.topk(choice_NE, k=self.top_k, dim=-1, sorted=False)[1]
        weights_NK = scores_NE.gather(1, experts_NK)
        if self.norm_topk_prob:
            weights_NK = weights_NK / (weights_NK.sum(dim=-1, keepdim=True) + 1e-20)
        return weights_NK * self.routed_scaling_factor, experts_NK, scores_NE


def set_routing(model: nn.Module, routing: str) -> int:
    """Set every megaseq router of ``model`` to ``routing`` (``models.common.routing``: natural or balanced);
    returns how many routers it set."""
    check_routing(routing)
    routers = [m for m in model.modules() if isinstance(m, TopKRouter)]
    for r in routers:
        r.routing = routing
    return len(routers)


# ---- experts ----------------------------------------------------------------------------------------
class Experts(nn.Module):
    """E SwiGLU experts in the fused HF v5 layout; HF module name ``experts``.

    ``held`` are the global ids of the experts whose weights this module holds: all E in one process;
    under expert parallelism ``parallel.expert`` keeps a contiguous ``E / ep`` of them on each rank (the
    parameters' first dim is then ``len(held)``)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int,
                 swiglu_limit: float | None = None, layer: str = "moe", bias: bool = False,
                 swiglu_alpha: float | None = None) -> None:
        super().__init__()
        E, H, I = num_experts, hidden_size, intermediate_size
        self.num_experts = E
        self.held = range(E)
        self.gate_up_proj = nn.Parameter(torch.empty(E, 2 * I, H).normal_(0.0, 0.02))
        self.down_proj = nn.Parameter(torch.empty(E, H, I).normal_(0.0, 0.02))
        self.gate_up_proj_bias = nn.Parameter(torch.zeros(E, 2 * I)) if bias else None
        self.down_proj_bias = nn.Parameter(torch.zeros(E, H)) if bias else None
        self.swiglu_limit, self.swiglu_alpha = swiglu_limit, swiglu_alpha
        self.layer = layer  # name used in the dispatcher's per-layer record

    @torch.no_grad()
    def init_weights(self, std: float) -> None:
        self.gate_up_proj.normal_(0.0, std)
        self.down_proj.normal_(0.0, std)
        for b in (self.gate_up_proj_bias, self.down_proj_bias):
            if b is not None:
                b.zero_()

    def routed_mlp(self, x_MH: torch.Tensor, gate_up_EOH: torch.Tensor, down_EHI: torch.Tensor,
                   counts_E: torch.Tensor) -> torch.Tensor:
        """``y_MH``: rows grouped by expert (``counts_E`` rows for each expert of the weights given) through
        their SwiGLU experts; the weights may be this module's or experts received from other ranks."""
        gu_M2I = dispatch.call("grouped_mm", x_MH, gate_up_EOH, counts_E, layer=self.layer)
        gu_M2I = self.add_bias(gu_M2I, self.gate_up_proj_bias, counts_E)
        y_MH = dispatch.call("grouped_mm", self.activate(gu_M2I), down_EHI, counts_E, layer=self.layer)
        return self.add_bias(y_MH, self.down_proj_bias, counts_E)

    def expert_tensors(self) -> tuple[torch.Tensor, ...]:
        """The per-expert tensors (first dim: the held experts) the routed rows need, in a fixed order: the two
        weights (``LoRAExperts`` adds its factors). What expert parallelism shards, sends and reduces."""
        return (self.gate_up_proj, self.down_proj)

    def routed_rows(self, x_MH: torch.Tensor, tensors: tuple[torch.Tensor, ...],
                    counts_E: torch.Tensor) -> torch.Tensor:
        """``routed_mlp`` through experts given as ``expert_tensors`` (held here or received from another rank)."""
        return self.routed_mlp(x_MH, tensors[0], tensors[1], counts_E)

    def activate(self, gu_M2I: torch.Tensor) -> torch.Tensor:
        """The SwiGLU of the fused gate/up rows (gate first): op ``swiglu``, or ``clamped_swiglu`` (gpt-oss)."""
        gate_MI, up_MI = gu_M2I.chunk(2, dim=-1)
        if self.swiglu_alpha is not None:
            return dispatch.call("clamped_swiglu", gate_MI, up_MI, self.swiglu_alpha, self.swiglu_limit,
                                 layer=self.layer)
        return dispatch.call("swiglu", gate_MI, up_MI, self.swiglu_limit, layer=self.layer)

    def add_bias(self, y_MO: torch.Tensor, bias_EO: torch.Tensor | None, counts_E: torch.Tensor) -> torch.Tensor:
        """``y_MO`` plus each row's expert's bias (rows grouped by expert, ``counts_E`` each); as is without."""
        if bias_EO is None:
            return y_MO
        if bias_EO.shape[0] != counts_E.shape[0]:
            raise ValueError(f"{self.layer}: expert biases run with every expert in this process (parallel.ep 1)")
        expert_M = torch.repeat_interleave(torch.arange(counts_E.shape[0], device=y_MO.device), counts_E,
                                           output_size=y_MO.shape[0])  # output_size: no host sync
        return y_MO + bias_EO.to(y_MO.dtype)[expert_M]

    def forward(self, x_NH: torch.Tensor, experts_NK: torch.Tensor,
                weights_NK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``-> (out_NH, tokens_per_expert_E)``; only the N*K routed rows are materialised."""
        N, K = experts_NK.shape
        flat_M = experts_NK.reshape(-1)
        order_M = torch.argsort(flat_M, stable=True)  # routed rows grouped by expert
        counts_E = expert_counts(flat_M, self.num_experts)
        inverse_M = torch.empty_like(order_M)
        inverse_M[order_M] = torch.arange(order_M.numel(), device=order_M.device)
        x_MH = dispatch.call("moe_permute", x_NH, order_M, inverse_M, K, _mm_dtype(x_NH, self.gate_up_proj),
                             layer=self.layer)
        y_MH = self.routed_mlp(x_MH, self.gate_up_proj, self.down_proj, counts_E)
        del x_MH
        return dispatch.call("moe_combine", y_MH, order_M, inverse_M, weights_NK, x_NH.dtype,
                             layer=self.layer), counts_E


# ---- ops moe_permute / moe_combine: the routed rows out of token order and back ---------------------


class ExpertDispatch:
    """How an MoE's routed rows reach their experts and come back; this one: every expert in this process.

    ``MoE.expert_dispatch`` holds one; a family's ``parallelize`` installs another from outside the model
    (``parallel.expert.EPDispatch``: experts spread over the ep ranks, rows moved by all-to-all), whose
    result must equal this one's for the same tokens. ``(experts, x_NH, experts_NK, weights_NK) ->
    (out_NH, tokens_per_expert_E)``, the counts of this process's own routing."""

    def __call__(self, experts: Experts, x_NH: torch.Tensor, experts_NK: torch.Tensor,
                 weights_NK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return experts(x_NH, experts_NK, weights_NK)


class _AuxLossGrad(torch.autograd.Function):
    """Identity on the routing weights; in backward it gives the router probabilities ``probs_NE`` the
    auxiliary loss's gradient ``moe.aux_grad_E``, read when backward runs: the trainer sets it after the
    forward, from the whole batch's statistics. ``[E]``: one value per expert, the same for every token (the
    softmax routers' batch-wise loss); ``[B, E]``: one per sequence and expert (the sigmoid routers'
    sequence-wise loss), the N tokens being B sequences of N / B in a row."""

    @staticmethod
    def forward(ctx, weights_NK: torch.Tensor, probs_NE: torch.Tensor, moe: MoE, rows: int) -> torch.Tensor:
        ctx.moe, ctx.shape, ctx.dtype, ctx.rows = moe, probs_NE.shape, probs_NE.dtype, rows
        ctx.device = probs_NE.device
        return weights_NK.view_as(weights_NK)

    @staticmethod
    def backward(ctx, grad_NK: torch.Tensor):
        g_E = ctx.moe.aux_grad_E
        if g_E is None:
            raise RuntimeError(f"{ctx.moe.experts.layer}: the auxiliary balancing loss is on (aux_loss_coef "
                               f"{ctx.moe.aux_loss_coef}) but no aux_grad_E was set between the forward and the "
                               "backward: megaseq.train.balance.Balancer.after_forward sets it")
        # on the probabilities' device: under memory.stream_base the router's weight, whose device the balancer
        # puts aux_grad_E on, lives in host memory
        g_E = g_E.to(device=ctx.device, dtype=ctx.dtype)
        if g_E.dim() == 2:  # [B, E]: token n belongs to sequence n // (N / B)
            B, (N, E) = ctx.rows, ctx.shape
            g_E = g_E.unsqueeze(1).expand(B, N // B, E).reshape(N, E)
        return grad_NK, g_E.expand(ctx.shape), None, None


class MoE(nn.Module):
    """Router ``gate`` + routed ``experts`` + optional ``shared_experts`` (or Qwen3-Next's gated
    ``shared_expert``); input ``[..., H]``.

    ``aux_loss_coef`` (0: off; set by the trainer's balancing, not by the model) turns on the auxiliary
    loss's gradient (``_AuxLossGrad``) and the ``last_router_prob_sum`` statistic: summed over all tokens
    (``[E]``) for a softmax router; for a sigmoid router (the sequence-wise loss) per sequence (``[B, E]``,
    B the input's first dim), with ``last_seq_tokens_per_expert`` its assignments per sequence."""

    # per-forward statistics that memory schemes running the module in chunks sum over the chunks
    _tile_summed_attrs = ("last_tokens_per_expert", "last_router_prob_sum", "last_seq_tokens_per_expert")

    def __init__(self, spec: ModelSpec, layer: str = "moe") -> None:
        super().__init__()
        _check_spec(spec)
        self.gate = TopKRouter(spec)
        self.experts = Experts(spec.num_experts, spec.hidden_size, spec.moe_intermediate_size,
                               spec.swiglu_limit, layer=layer, bias=spec.expert_bias, swiglu_alpha=spec.swiglu_alpha)
        self.shared_experts = self.shared_expert = self.shared_expert_gate = None
        shared = spec.shared_expert_intermediate_size or spec.moe_intermediate_size * spec.num_shared_experts
        if spec.shared_expert_gate:  # Qwen3-Next: one gated shared expert, HF names shared_expert(_gate)
            self.shared_expert = MLP(spec.hidden_size, shared, spec.swiglu_limit, layer=f"{layer}.shared_expert")
            self.shared_expert_gate = nn.Linear(spec.hidden_size, 1, bias=False)
        elif spec.num_shared_experts > 0:
            self.shared_experts = MLP(spec.hidden_size, shared, spec.swiglu_limit, layer=f"{layer}.shared_experts")
        self.expert_dispatch = ExpertDispatch()
        self.last_tokens_per_expert = torch.zeros(spec.num_experts, dtype=torch.int64)
        self.aux_loss_coef = 0.0
        self.aux_grad_E: torch.Tensor | None = None
        self.last_router_prob_sum: torch.Tensor | None = None
        self.last_seq_tokens_per_expert: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x_NH = x.reshape(-1, x.shape[-1])
        # (route called with x alone unless the loss needs the probabilities: tests wrap it so)
        weights_NK, experts_NK, probs_NE = (self.gate.route(x_NH, probs=True) if self.aux_loss_coef
                                            else self.gate.route(x_NH))
        if self.aux_loss_coef and probs_NE is not None:
            rows = 1
            if self.gate.router in ("softmax", "topk_softmax"):
                self.last_router_prob_sum = probs_NE.detach().sum(dim=0)
            else:  # sequence-wise: the statistics of each sequence (row of x [B, S, H])
                if x.dim() != 3:
                    raise RuntimeError(f"{self.experts.layer}: moe.seq_aux_loss_coef (the sequence-wise balance loss) "
                                       f"needs each sequence's tokens, but this MoE got them flattened (shape "
                                       f"{tuple(x.shape)}: a token-tiled MLP, memory.tiled_mlp, is not implemented "
                                       "with it): set --moe.seq_aux_loss_coef 0 or --memory.tiled_mlp false")
                rows, E = x.shape[0], self.gate.num_experts
                self.last_router_prob_sum = probs_NE.detach().view(rows, -1, E).sum(dim=1)
                self.last_seq_tokens_per_expert = torch.zeros(rows, E, dtype=torch.int64, device=x.device).scatter_add_(
                    1, experts_NK.reshape(rows, -1), torch.ones_like(experts_NK, dtype=torch.int64).reshape(rows, -1))
            if probs_NE.requires_grad:
                weights_NK = _AuxLossGrad.apply(weights_NK, probs_NE, self, rows)
        out_NH, counts_E = self.expert_dispatch(self.experts, x_NH, experts_NK, weights_NK)
        self.last_tokens_per_expert = counts_E.detach().to(torch.int64)
        if self.shared_experts is not None:
            out_NH = out_NH + self.shared_experts(x_NH)
        elif self.shared_expert is not None:
            out_NH = out_NH + torch.sigmoid(self.shared_expert_gate(x_NH)) * self.shared_expert(x_NH)
        return out_NH.view(x.shape)


def _check_spec(spec: ModelSpec) -> None:
    """User-facing checks of the MoE settings (a HF config or preset with impossible routing)."""
    E, K = spec.num_experts, spec.num_experts_per_tok
    if spec.router not in ROUTERS:
        raise ValueError(f"model.router {spec.router!r} is not supported; use one of {', '.join(ROUTERS)}")
    if not 1 <= K <= E:
        raise ValueError(f"num_experts_per_tok ({K}) must be in [1, num_experts = {E}]")
    if spec.router != "sigmoid_bias":
        return
    G, TG = spec.n_group, spec.topk_group
    if G < 1 or E % G:
        raise ValueError(f"n_group ({G}) must divide num_experts ({E})")
    if E // G < 2:
        raise ValueError(f"each expert group needs >= 2 experts (groups are ranked by their top-2): "
                         f"num_experts {E} / n_group {G} < 2; lower n_group")
    if not 1 <= TG <= G or TG * (E // G) < K:
        raise ValueError(f"topk_group ({TG}) must be in [1, n_group = {G}] and keep at least "
                         f"num_experts_per_tok ({K}) experts ({TG} groups x {E // G} experts)")
