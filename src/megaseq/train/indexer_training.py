"""Training the DSA lightning indexer: its KL objective's settings, the dense warm-up, the metrics.

DeepSeek-V3.2 trains its indexer in two stages (``docs/indexer.md``):

- the dense warm-up (``model.dsa_warmup_steps`` optimizer steps): every DSA layer attends every visible key,
  the main model is frozen and only the indexers train, fitted to the dense attention by KL;
- the sparse stage: the DSA layers attend their selected keys, the indexers train on the KL over those keys
  with their inputs detached, and the main model trains on the LM loss (as ``train.trainable`` / LoRA say).

``enable(model, cfg)`` (before the optimizer is built: the indexers' parameters train, so it keeps state for
them) sets each full indexer's coefficient (``model.indexer_loss_coef``); ``loss_scale(model, total)`` tells
them the step's token count (the objective is a mean over every token of the global batch, as the LM loss);
``begin_step(model, step)`` switches the stage; ``metrics(model, env)`` reads what they measured: per layer
``indexer_kl/L`` (mean KL per query), ``indexer_recall/L`` (the share of dense attention's top pools the
indexer picks, over queries with more candidates than picks) and ``indexer_recall_random/L`` (random
selection's expected share on the same queries).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from torch import nn

STATE = "_megaseq_indexer_training"


@dataclass
class IndexerTraining:
    """The run's indexer layers and stage; the parameters the warm-up froze (to restore after it)."""

    layers: list[tuple[int, nn.Module]]
    warmup_steps: int
    coef: float
    frozen_by_warmup: list[nn.Parameter] = field(default_factory=list)
    dense: bool = False


def dsa_layers(model: nn.Module) -> list[tuple[int, nn.Module]]:
    """``(layer index, MLASparseAttention)`` of every DSA layer (shared ones too: they attend densely in the
    warm-up)."""
    from megaseq.models.common.mla_dsa import MLASparseAttention

    return [(m.layer_idx, m) for m in model.modules() if isinstance(m, MLASparseAttention)]


def enable(model: nn.Module, coef: float, warmup_steps: int = 0, dtype: Any = None) -> IndexerTraining | None:
    """Train the indexers of ``model`` with coefficient ``coef`` (their parameters made trainable, in ``dtype``
    when given: a frozen base stores what it freezes in the compute dtype); None when the model has no full
    indexer (a ValueError then, when ``warmup_steps`` asks for a warm-up)."""
    layers = dsa_layers(model)
    full = [m for _, m in layers if m.indexer is not None]
    if not full:
        if warmup_steps:
            raise ValueError(f"model.dsa_warmup_steps {warmup_steps}: the model has no DSA indexer to warm up; "
                             "set --model.dsa_warmup_steps 0")
        return None
    for m in full:
        m.indexer.kl_coef = coef
        for p in m.indexer.parameters():
            if dtype is not None and p.dtype != dtype:
                p.data = p.data.to(dtype)
            p.requires_grad_(True)
    state = IndexerTraining(layers, warmup_steps, coef)
    model.__dict__[STATE] = state
    return state


def adam_groups(model: nn.Module) -> tuple[set[int], float] | None:
    """``(ids of the trained indexers' parameters, the objective's coefficient)``, or None when no indexer trains.
    Their gradient is the coefficient times the KL's (the inputs are detached: nothing else reaches them), so at
    the default 0.001 most of it is smaller than AdamW's epsilon (1e-8), which then shrinks their updates several
    times below the learning rate's; ``train.optim.param_groups`` gives them an epsilon scaled by the coefficient,
    so that their AdamW update is the one they would take at coefficient 1."""
    state = _state(model)
    if state is None:
        return None
    ids = {id(p) for _, m in state.layers if m.indexer is not None for p in m.indexer.parameters()}
    return ids, state.coef


def check(cfg: Any, spec: Any) -> None:
    """``model.train_indexer`` for a model without a DSA layer: a ValueError naming the setting, before anything is
    built. (Beside a frozen base the warm-up freezes what trains, the adapters included, and they train after it;
    a checkpoint written in the warm-up still holds them: ``thawed``.)"""
    m = cfg.model
    if m.train_indexer and "dsa" not in spec.layer_types:
        raise ValueError(f"model.train_indexer: {m.name} has no DSA indexer to train (its layers: "
                         f"{', '.join(sorted(set(spec.layer_types)))}); set --model.train_indexer false")


@contextmanager
def thawed(model: nn.Module, optimizer: Any = None) -> Iterator[None]:
    """The parameters the warm-up froze marked trainable again while inside (a checkpoint's "what trains" and a
    frozen base's fingerprint are the run's, not the warm-up's), frozen again after; ``optimizer`` (torch's
    Adam / AdamW) given the state it would make for them at their first update (``initial_adam_state``), so a
    checkpoint written in the warm-up holds every trained parameter's state, as a resume's optimizer expects."""
    state = _state(model)
    frozen = list(state.frozen_by_warmup) if state is not None else []
    for p in frozen:
        p.requires_grad_(True)
    initial_adam_state(optimizer, frozen)
    try:
        yield
    finally:
        for p in frozen:
            p.requires_grad_(False)


def initial_adam_state(optimizer: Any, params: list[nn.Parameter]) -> None:
    """For each of ``params`` without optimizer state, the state torch's Adam / AdamW create at a parameter's first
    update (step 0, zero moments): the update that follows is the same bit for bit. Their subclasses too
    (``master_adam.SplitAdamW``: FSDP's sharded indexers beside whole adapters). Other optimizers: nothing
    (MasterAdamW and OffloadStreamAdamW make every parameter's state when they are built)."""
    import torch
    from torch.optim.optimizer import _get_scalar_dtype

    if not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)) or not params:
        return
    group_of = {id(p): g for g in optimizer.param_groups for p in g["params"]}
    for p in params:
        group = group_of.get(id(p))
        if group is None or optimizer.state.get(p):
            continue
        on_device = group.get("capturable") or group.get("fused")
        st = {"step": torch.zeros((), dtype=_get_scalar_dtype(is_fused=group.get("fused")), device=p.device)
              if on_device else torch.tensor(0.0, dtype=_get_scalar_dtype()),
              "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
              "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format)}
        if group.get("amsgrad"):
            st["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        optimizer.state[p] = st


def _state(model: nn.Module) -> IndexerTraining | None:
    return model.__dict__.get(STATE)


def loss_scale(model: nn.Module, total_tokens: int) -> None:
    """The step's summed losses are divided by ``total_tokens``: so is the objective's gradient."""
    state = _state(model)
    if state is None:
        return
    for _, m in state.layers:
        if m.indexer is not None:
            m.indexer.kl_scale = 1.0 / max(total_tokens, 1)


def begin_step(model: nn.Module, step: int) -> None:
    """Steps ``1 .. warmup_steps`` (1-based) run the dense warm-up; the first one after it the sparse stage."""
    state = _state(model)
    if state is None:
        return
    dense = step <= state.warmup_steps
    if dense == state.dense and (dense or not state.frozen_by_warmup):
        return
    state.dense = dense
    indexer_params = {id(p) for _, m in state.layers if m.indexer is not None for p in m.indexer.parameters()}
    if dense:  # the main model frozen: only the indexers train
        state.frozen_by_warmup = [p for p in model.parameters() if p.requires_grad and id(p) not in indexer_params]
        for p in state.frozen_by_warmup:
            p.requires_grad_(False)
            p.grad = None
    else:
        for p in state.frozen_by_warmup:
            p.requires_grad_(True)
        state.frozen_by_warmup = []
    for _, m in state.layers:
        m.dense_attention = dense


def metrics(model: nn.Module, env: Any = None) -> dict[str, float]:
    """Per full indexer layer L, what the objective measured since the last call (summed over the ranks when
    ``env`` is given, one all-reduce): ``indexer_kl/L``, ``indexer_recall/L``, ``indexer_recall_random/L``; and
    the stage, ``indexer_dense``."""
    import torch

    state = _state(model)
    if state is None:
        return {}
    full = [(i, m.indexer) for i, m in state.layers if m.indexer is not None]
    values = []
    for _, ix in full:
        st = ix.stats.read()
        values.append([st.kl_sum, float(st.rows), st.recall_hits, st.recall_picks, st.random_hits])
        st.reset()
    if env is not None and getattr(env, "world_size", 1) > 1:
        values = env.all_reduce_tensor(torch.tensor(values, dtype=torch.float64, device=env.device)).tolist()
    out: dict[str, float] = {"indexer_dense": float(state.dense)}
    for (i, _), (kl_sum, rows, hits, picks, rnd) in zip(full, values, strict=True):
        if rows:
            out[f"indexer_kl/{i}"] = kl_sum / rows
        if picks:
            out[f"indexer_recall/{i}"] = hits / picks
            out[f"indexer_recall_random/{i}"] = rnd / picks
    return out


def recall(model: nn.Module, input_ids: Any, doc_ids: Any = None) -> dict[int, tuple[float, float]]:
    """Per full-indexer layer, ``(recall, random selection's recall)`` of the dense attention's top pools over
    every query of ``input_ids`` with more candidates than picks: the model run once with dense attention, the
    indexer's own top-K against the target's (the warm-up's measure), the model left as it was."""
    import torch

    layers = dsa_layers(model)
    saved = [(m, m.dense_attention, m.indexer.kl_coef if m.indexer is not None else 0.0) for _, m in layers]
    try:
        for _, m in layers:
            m.dense_attention = True
            if m.indexer is not None:
                m.indexer.kl_coef = m.indexer.kl_coef or 1.0
                m.indexer.stats.reset()
        with torch.enable_grad():
            model(input_ids, doc_ids=doc_ids)
        out = {}
        for i, m in layers:
            if m.indexer is not None:
                st = m.indexer.stats.read()
                out[i] = (st.recall_hits / max(st.recall_picks, 1.0), st.random_hits / max(st.recall_picks, 1.0))
                st.reset()
        return out
    finally:
        for m, dense, coef in saved:
            m.dense_attention = dense
            if m.indexer is not None:
                m.indexer.kl_coef = coef
