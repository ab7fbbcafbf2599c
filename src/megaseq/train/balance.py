"""Router load balancing in training, as each family's reference trains it.

Shapes: L MoE layers, E routed experts, K experts per token, N tokens of one (global) micro-batch.

Two rules, chosen by the family (``registry.Family.balance``) or by ``moe.balance``:

- ``bias``, auxiliary-loss-free balancing (DeepSeek-V3 section 2.1.2; GLM-4.5 / GLM-5, Kimi-Linear): after
  each optimizer step every sigmoid router's ``e_score_correction_bias`` moves by
  ``rate * sign(mean load - load_i)``, ``load_i`` the routed assignments to expert i over the whole step
  (every micro-batch, every rank), outside the gradient: Megatron-Core's ``get_updated_expert_bias``. The
  bias only shifts the choice of experts, never the weights (``models.common.moe``).
- ``aux_loss``, the load-balancing loss (Switch Transformer; HF ``load_balancing_loss_func``, which
  ``Qwen3MoeForCausalLM``, ``OlmoeForCausalLM`` and ``MixtralForCausalLM`` add times
  ``router_aux_loss_coef``): ``coef * E * sum_i f_i P_i`` over all MoE layers taken together, as HF
  concatenates their router logits: ``f_i`` = assignments to i / (L N), ``P_i`` = probabilities of i
  summed over the layers' tokens / (L N). One loss per micro-batch of the global batch, averaged over
  the step's micro-batches (the CE loss is a mean over all the step's tokens). Its gradient reaches the
  routers through ``MoE.aux_grad_E`` (``models.common.moe._AuxLossGrad``): ``coef * E * f_i / (L N)``
  per token and expert, set here between each forward and its backward.
- beside ``bias``, DeepSeek-V3's complementary sequence-wise balance loss (section 2.1.2, eq. 17-20;
  Megatron-Core's ``seq_aux_loss``), ``moe.seq_aux_loss_coef`` = alpha (0: off): per MoE layer and
  sequence of T tokens, ``alpha * sum_i f_i P_i`` with ``f_i = E / (K T) * assignments to i`` and
  ``P_i = mean_t s'_i`` over the sequence, ``s'`` the unbiased sigmoid scores normalised over the experts;
  summed over the layers, averaged over the step's sequences (every micro-batch). Its gradient:
  ``alpha * f_i / T / sequences`` per token of the sequence and expert, handed to ``s'`` the same way.
  The counts it reads are each sequence's own, so it runs where every sequence sits whole on one rank:
  one process or data parallelism (the per-rank gradient divided by the ranks as well, the gradients
  being summed over them; ``tests/parallel/test_balance_parallel.py``). A sequence split over context-parallel
  ranks (or routed over ep) would need its counts reduced over those ranks: refused there.

Statistics are reduced over every rank (dp x cp x ep; every token lives on exactly one rank) with one
all-reduce per micro-batch, so the update and the gradient equal one process on the whole global batch.
Counts are integers, exact in float64; the loss value (metrics only) sums floats in rank order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from megaseq.config import MoEConfig
from megaseq.models.common.moe import MoE
from megaseq.models.registry import family
from megaseq.models.spec import ModelSpec


@dataclass(frozen=True)
class BalanceSettings:
    """The rule a run trains its routers with (``resolve_balance``)."""

    mode: str  # "bias", "aux_loss" or "none"
    aux_loss_coef: float = 0.0
    bias_update_rate: float = 0.0
    seq_aux_loss_coef: float = 0.0  # beside "bias": the sequence-wise balance loss's alpha


def resolve_balance(cfg: MoEConfig, spec: ModelSpec) -> BalanceSettings:
    """``moe.*`` against the family's reference; a ValueError naming the setting when the router cannot
    train that way (a bias update needs a correction bias, the aux loss a softmax router)."""
    if "moe" not in spec.mlp_types:
        return BalanceSettings("none")
    fam = family(spec.family)
    mode = fam.balance if cfg.balance in (None, "auto") else cfg.balance
    coef = spec.router_aux_loss_coef if cfg.aux_loss_coef in (None, -1.0) else cfg.aux_loss_coef
    rate = fam.bias_update_rate if cfg.bias_update_rate in (None, -1.0) else cfg.bias_update_rate
    if mode == "bias" and spec.router != "sigmoid_bias":
        raise ValueError(f"moe.balance bias needs a router with a score-correction bias, but {spec.family} routes "
                         f"with {spec.router!r}: use --moe.balance aux_loss (or auto)")
    if mode == "aux_loss" and spec.router not in ("softmax", "topk_softmax"):
        raise ValueError(f"moe.balance aux_loss is the softmax routers' loss (HF load_balancing_loss_func); "
                         f"{spec.family} routes with {spec.router!r}: use --moe.balance bias (or auto)")
    if mode == "aux_loss" and coef == 0.0:
        if cfg.balance == "aux_loss":
            raise ValueError("moe.balance aux_loss with a coefficient of 0 trains nothing: set "
                             "--moe.aux_loss_coef (Qwen3-MoE uses 0.001, OLMoE 0.01, Mixtral 0.02)")
        mode = "none"  # the checkpoint says its reference trains without it
    seq = cfg.seq_aux_loss_coef or 0.0  # unset: the family's, off
    if seq and spec.router != "sigmoid_bias":
        raise ValueError(f"moe.seq_aux_loss_coef is the sequence-wise loss of the sigmoid routers (DeepSeek-V3); "
                         f"{spec.family} routes with {spec.router!r}: set it to 0 (--moe.aux_loss_coef is "
                         "the softmax routers' loss)")
    if seq and mode != "bias":
        raise ValueError(f"moe.seq_aux_loss_coef complements the bias update (DeepSeek-V3), but moe.balance "
                         f"resolves to {mode!r}: use --moe.balance bias (or auto), or set it to 0")
    if mode == "bias" and rate == 0.0 and not seq:
        mode = "none"
    return BalanceSettings(mode, coef if mode == "aux_loss" else 0.0, rate if mode == "bias" else 0.0,
                           seq if mode == "bias" else 0.0)


def check_seq_aux_mesh(cp: int, ep: int) -> None:
    """The sequence-wise loss runs where each sequence and its routing sit whole on one rank: one process or
    data parallelism; context parallelism would need each sequence's counts reduced over its cp group."""
    if cp > 1 or ep > 1:
        raise ValueError(f"moe.seq_aux_loss_coef with parallel.cp {cp} / parallel.ep {ep} is not implemented yet "
                         "(each sequence's counts would need reducing over the ranks that hold its tokens): set "
                         "--moe.seq_aux_loss_coef 0, or use data parallelism only (parallel.dp)")


class Balancer:
    """A run's balancing: ``after_forward()`` after each micro-batch's forward (before its backward),
    ``after_step()`` after the optimizer step; ``metrics()`` the last step's per-layer load."""

    def __init__(self, model: nn.Module, settings: BalanceSettings, env: Any, micro_batches: int = 1) -> None:
        self.settings, self.env, self.micro_batches = settings, env, micro_batches
        self.moes = [(name, m) for name, m in model.named_modules() if isinstance(m, MoE)]
        if settings.mode == "bias":
            bad = [name for name, m in self.moes if m.gate.router != "sigmoid_bias"]
            assert not bad, f"bias balancing on layers without a correction bias: {bad}"
        if settings.seq_aux_loss_coef:
            check_seq_aux_mesh(getattr(env, "cp_size", 1), getattr(env, "ep_size", 1))
        for _, m in self.moes:
            m.aux_loss_coef = settings.aux_loss_coef or settings.seq_aux_loss_coef
            m.aux_grad_E = None
        self._counts_LE: torch.Tensor | None = None  # this step's global loads, summed over micro-batches
        self._aux: list[torch.Tensor] = []
        self._seq_aux: list[float] = []  # the sequence-wise loss (no alpha) of each micro-batch
        self._last: dict[str, Any] = {}

    def after_forward(self) -> None:
        """Reduce this micro-batch's statistics over every rank; with the aux loss, give each router the
        gradient of ``coef * aux / micro_batches`` for the backward that follows."""
        if not self.moes:
            return
        L = len(self.moes)
        counts_LE = torch.stack([m.last_tokens_per_expert for _, m in self.moes]).to(torch.float64)
        E = counts_LE.shape[1]
        aux = self.settings.mode == "aux_loss"
        parts = [counts_LE.flatten()]
        if aux:
            parts.append(torch.stack([self._prob_sum(name, m) for name, m in self.moes]).to(counts_LE).flatten())
        reduced = self.env.all_reduce_tensor(torch.cat(parts))
        counts_LE = reduced[:L * E].view(L, E)
        self._counts_LE = counts_LE if self._counts_LE is None else self._counts_LE + counts_LE
        if self.settings.seq_aux_loss_coef:
            self._seq_aux_grads()
        if not aux:
            return
        K = self.moes[0][1].gate.top_k
        rows = L * counts_LE[0].sum() / K  # L * N: every MoE layer routes the same N tokens
        f_E = counts_LE.sum(dim=0) / rows
        p_E = reduced[L * E:].view(L, E).sum(dim=0) / rows
        self._aux.append(E * (f_E * p_E).sum())
        grad_E = self.settings.aux_loss_coef * E * f_E / rows / self.micro_batches
        for _, m in self.moes:  # where the router ran (not its weight's device: a streamed base keeps it on the host)
            m.aux_grad_E = grad_E.to(m.last_router_prob_sum.device)

    def _seq_aux_grads(self) -> None:
        """The sequence-wise loss of this micro-batch (each sequence whole on this rank: one process or data
        parallelism, ``check_seq_aux_mesh``): each router's ``[B, E]`` gradient
        ``alpha * f / T / (B * ranks * micro_batches)``, the mean over the global batch's sequences (the
        gradients are summed over the ranks), and the loss value (metrics: its mean over the ranks)."""
        alpha, total = self.settings.seq_aux_loss_coef, 0.0
        ranks = self.env.world_size
        for name, m in self.moes:
            c_BE = m.last_seq_tokens_per_expert
            if c_BE is None or m.last_router_prob_sum is None or m.last_router_prob_sum.dim() != 2:
                raise RuntimeError(f"{name}: no per-sequence router statistics from this forward")
            c_BE, p_BE = c_BE.to(torch.float64), m.last_router_prob_sum.to(torch.float64)
            B, E = c_BE.shape
            K = m.gate.top_k
            T_B1 = c_BE.sum(dim=1, keepdim=True) / K  # tokens of each sequence
            f_BE = E * c_BE / (K * T_B1)
            total += float((f_BE * p_BE / T_B1).sum(dim=1).mean())
            m.aux_grad_E = (alpha * f_BE / T_B1 / (B * ranks * self.micro_batches)).to(m.last_router_prob_sum.device)
        self._seq_aux.append(self.env.all_reduce_sum(total) / ranks if ranks > 1 else total)

    @staticmethod
    def _prob_sum(name: str, m: MoE) -> torch.Tensor:
        if m.last_router_prob_sum is None:
            raise RuntimeError(f"{name}: no router probabilities from this forward (is aux_loss_coef set?)")
        return m.last_router_prob_sum

    @torch.no_grad()
    def after_step(self) -> None:
        """The bias update over the step's loads (``bias`` mode); the step's metrics kept, its state reset."""
        counts_LE, self._counts_LE = self._counts_LE, None
        if counts_LE is None:
            return
        if self.settings.mode == "bias":
            # every layer's update in a few launches (one per layer and op ran on an idle GPU after the step's
            # read-back): sign(mean - load) * rate, in each bias's dtype, as one foreach add
            biases = [m.gate.e_score_correction_bias for _, m in self.moes]
            step_LE = self.settings.bias_update_rate * torch.sign(counts_LE.mean(dim=1, keepdim=True) - counts_LE)
            if len({(b.device, b.dtype) for b in biases}) == 1:
                step_LE = step_LE.to(biases[0].device, biases[0].dtype)
            torch._foreach_add_(biases, [row.to(b.device, b.dtype) for b, row in zip(biases, step_LE, strict=True)])
        mean = counts_LE.mean(dim=1)
        ratio = torch.where(mean > 0, counts_LE.max(dim=1).values / mean.clamp_min(1e-30), torch.zeros_like(mean))
        self._last = {"moe_max_over_mean": {name: float(r) for (name, _), r in zip(self.moes, ratio.tolist())}}
        if self._aux:
            self._last["moe_aux_loss"] = float(torch.stack(self._aux).mean())
        if self._seq_aux:
            self._last["moe_seq_aux_loss"] = sum(self._seq_aux) / len(self._seq_aux)
        self._aux, self._seq_aux = [], []
        for _, m in self.moes:
            m.aux_grad_E = None  # a backward without after_forward fails loudly

    def drop_step(self) -> None:
        """A step skipped as non-finite: its loads and aux losses are forgotten, the biases not updated."""
        self._counts_LE, self._aux, self._seq_aux = None, [], []
        for _, m in self.moes:
            m.aux_grad_E = None

    def metrics(self) -> dict[str, Any]:
        """The last step's ``moe_max_over_mean`` per MoE layer (global loads), ``moe_aux_loss`` and
        ``moe_seq_aux_loss`` (the sequence-wise loss summed over the layers, without alpha)."""
        return dict(self._last)
