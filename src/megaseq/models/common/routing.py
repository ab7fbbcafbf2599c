"""Which experts the routed rows go to: the router's own choice, or a balanced assignment for speed benchmarks.

Shapes: N tokens, K experts per token, E routed experts.

``natural``   the router's top-k (training, genome windows, real checkpoints).
``balanced``  the router runs in full (logits, scores, top-k, the weights and their gradient), then each
              token's K expert ids are replaced by ``perm[(n * K + j) mod E]`` for j < K, ``perm`` a fixed
              permutation of the experts: every expert gets ``N * K / E`` rows (exactly, when E divides
              N * K), as Megatron-Core's ``moe_router_force_load_balancing`` does. The routing weights stay
              the router's top-k values, so the grouped GEMMs run at the real shapes on evenly spread rows,
              and the backward reaches the router as in training.

A model with random weights routes almost every token to the same K experts (its router logits are nearly
equal for every token): a step then runs K large GEMMs instead of E grouped ones, which is not what a
trained checkpoint does. ``megaseq bench`` uses ``balanced`` there (``bench.run.resolve_routing``); a
megaseq model's routers take it through ``moe.set_routing``, a transformers model's experts through
``balance_hf_experts``.
K distinct experts per token: ``(n * K + j) mod E`` are K consecutive residues and ``perm`` is a bijection.
"""

from __future__ import annotations

import torch
from torch import nn

ROUTINGS = ("natural", "balanced")
_PERM_SEED = 0
_perms: dict[tuple[int, str], torch.Tensor] = {}


def expert_permutation(num_experts: int, device: torch.device) -> torch.Tensor:
    """The fixed permutation ``[E]`` int64 of the balanced assignment (seeded, the same in every process)."""
    key = (num_experts, str(device))
    if key not in _perms:
        gen = torch.Generator().manual_seed(_PERM_SEED)
        _perms[key] = torch.randperm(num_experts, generator=gen).to(device)
    return _perms[key]


def balanced_experts(num_tokens: int, top_k: int, num_experts: int, device: torch.device) -> torch.Tensor:
    """``experts_NK`` int64: token n's j-th expert is ``perm[(n * K + j) mod E]``."""
    slot_NK = torch.arange(num_tokens * top_k, device=device).view(num_tokens, top_k) % num_experts
    return expert_permutation(num_experts, device)[slot_NK]


def check_routing(routing: str, setting: str = "--routing") -> str:
    if routing not in ROUTINGS:
        raise ValueError(f"{setting} must be one of {', '.join(ROUTINGS)}, got {routing!r}")
    return routing


def _balanced_hf_hook(num_experts: int):
    """A forward pre-hook for a transformers fused-experts module ``experts(hidden, top_k_index, top_k_weights)``:
    the same call with the balanced expert ids (the weights are the router's). ``num_experts`` is read once:
    under PEFT's ``target_parameters`` reading ``gate_up_proj`` would merge the adapter into it."""

    def hook(module: nn.Module, args: tuple) -> tuple:
        if len(args) < 2:
            raise RuntimeError(f"{type(module).__name__} was called without positional expert ids: balanced "
                               "routing cannot replace them (use --routing natural for this model)")
        hidden, index_NK = args[0], args[1]
        balanced_NK = balanced_experts(index_NK.shape[0], index_NK.shape[1], num_experts, index_NK.device)
        return (hidden, balanced_NK.to(index_NK.dtype), *args[2:])

    return hook


def balance_hf_experts(model: nn.Module) -> int:
    """Balanced routing in a transformers MoE model (the bench's peer): a pre-hook on every fused experts
    module (one with ``gate_up_proj``) replaces the router's expert ids as ``balanced_experts`` does. Returns
    how many modules it hooked; a model whose experts do not take ``(hidden, top_k_index, top_k_weights)``
    positionally is refused."""
    hooked = 0
    for m in model.modules():
        if type(m).__name__.endswith("Experts") and isinstance(getattr(m, "gate_up_proj", None), torch.Tensor):
            m.register_forward_pre_hook(_balanced_hf_hook(m.gate_up_proj.shape[0]))
            hooked += 1
    return hooked
