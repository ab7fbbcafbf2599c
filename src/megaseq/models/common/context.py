"""The sequence context every token-mixing block receives.

Shapes: B batch, S_loc tokens held by this rank, S full sequence (S = S_loc * cp), Hh heads, D head dim.

Token-mixing blocks (KDA, MLA/DSA, softmax attention) receive sequence-sharded activations
``[B, S_loc, ...]`` and this context. They never import ``megaseq.parallel``: they call the hooks
below, which are identities with one rank. ``megaseq.parallel`` subclasses ``SeqContext`` to
implement them with all-to-all / all-gather collectives (Ulysses, gather-KV).

Document boundaries travel as ``doc_ids`` (one integer per token, equal within a document,
increasing along the sequence); every token-mixing block must keep tokens of different
documents apart (the KDA conv and recurrence, attention masks, the indexer's pools).
``position_ids`` count from 0 at each document start.

Sequence segments (``megaseq.memory.model_segments``) run the whole model over the sequence a segment
at a time; their context subclasses this one and implements the hooks of state carried from the
tokens before the segment: ``gather_seq(x, key)`` (the keyed latents and keys of all tokens so far),
``attend_seq`` (softmax attention over the keys of all tokens so far: K/V or an MLA latent cached per
layer) and ``carried_in`` / ``carried_out`` (a recurrent layer's state and conv halo). With one rank and
no segments all are identities.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch


def positions_from_doc_ids(doc_ids: torch.Tensor) -> torch.Tensor:
    """Position of each token within its document: ``[B, S]`` int64."""
    B, S = doc_ids.shape
    idx = torch.arange(S, device=doc_ids.device).expand(B, S)
    start = torch.ones_like(doc_ids, dtype=torch.bool)
    start[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    first = torch.where(start, idx, torch.zeros_like(idx)).cummax(dim=1).values
    return idx - first


def doc_spans(doc_ids: torch.Tensor | None, seq_len: int) -> list[list[tuple[int, int]]]:
    """Per batch row, the ``[start, end)`` spans of its documents (one span when ``doc_ids`` is None)."""
    if doc_ids is None:
        return [[(0, seq_len)]]
    out = []
    for row in doc_ids.tolist():
        spans, start = [], 0
        for i in range(1, len(row)):
            if row[i] != row[i - 1]:
                spans.append((start, i))
                start = i
        spans.append((start, len(row)))
        out.append(spans)
    return out


@dataclass
class SeqContext:
    """One-rank context: every hook is the identity. Subclassed by megaseq.parallel for cp > 1."""

    doc_ids: torch.Tensor | None = None  # [B, S_loc] this rank's shard
    position_ids: torch.Tensor | None = None  # [B, S_loc]
    cp_size: int = 1
    cp_rank: int = 0
    # state carried from layer to layer (e.g. the DSA selection a 'shared' indexer layer reuses)
    carry: dict[str, Any] = field(default_factory=dict)

    # ---- the full sequence's metadata ---------------------------------------------------
    def full_doc_ids(self) -> torch.Tensor | None:
        """doc_ids of the whole sequence ``[B, S]`` (all ranks' shards in order)."""
        return self.doc_ids

    def seq_offset(self) -> int:
        """Index of this rank's first token in the full sequence."""
        return 0

    # ---- Ulysses: sequence-sharded <-> head-sharded --------------------------------------
    def seq_to_heads(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, S_loc, Hh, D] -> [B, S, Hh / cp, D]``: all of the sequence, this rank's heads."""
        return x

    def heads_to_seq(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, S, Hh / cp, D] -> [B, S_loc, Hh, D]``: the inverse of ``seq_to_heads``."""
        return x

    def head_slice(self, num_heads: int) -> slice:
        """The heads this rank owns after ``seq_to_heads`` (for per-head parameters)."""
        return slice(0, num_heads)

    # ---- gather-KV: queries stay local, keys/values of the whole sequence gathered ------
    def gather_seq(self, x: torch.Tensor, key: str | None = None) -> torch.Tensor:
        """``[B, S_loc, ...] -> [B, S, ...]`` with a backward that reduce-scatters the gradient. ``key``
        names the tensor (unique per layer) for contexts that keep it across sequence segments."""
        return x

    # ---- sequence segments: a recurrent layer's state from the tokens before these ----------
    segmented: ClassVar[bool] = False  # True in megaseq.memory.model_segments' context

    def carried_in(self, key: str, x: torch.Tensor, halo: int) -> tuple[torch.Tensor, int, torch.Tensor | None]:
        """``(x with up to halo earlier tokens before it, how many, the recurrent state before x or None)``
        for the recurrent layer ``key``; here the sequence starts with ``x``."""
        return x, 0, None

    def reuse(self, key: str, make: Callable[[], torch.Tensor]) -> torch.Tensor:
        """``make()``, or what an earlier run of the same tokens kept under ``key`` (sequence segments keep
        the DSA selection of the forward pass for the backward's rerun); no-grad results only."""
        return make()

    def attend_seq(self, q: torch.Tensor, kv: tuple[torch.Tensor, ...], key: str,
                   attend: Callable[..., torch.Tensor], gathered: bool = True,
                   params: tuple[torch.Tensor, ...] = ()) -> torch.Tensor:
        """``attend(q, *kv_all, *params)``: softmax attention of these queries over the keys of every token so far.
        ``kv`` are this layer's key-side tensors of these tokens (``[B, L, ...]``: softmax attention's k and v
        after ``seq_to_heads``, ``gathered``; MLA's latent, this rank's shard, gathered over the cp group
        here when not ``gathered``); ``kv_all`` the same over all tokens up to these queries' last, whose
        last ``L`` rows are these. Here the sequence starts with these tokens: ``attend(q, *kv)`` (after
        the cp gather where asked). Sequence segments join the earlier segments' cached ``kv`` (``key``).
        ``params``: tensors ``attend`` reads besides (MLA's ``kv_b_proj`` weights), passed to it as arguments so
        that a schedule which reruns ``attend`` in its backward gives them their gradients."""
        if not gathered:
            kv = tuple(self.gather_seq(t, f"{key}.{i}") for i, t in enumerate(kv))
        return attend(q, *kv, *params)

    def carried_out(self, key: str, tail: torch.Tensor, state: torch.Tensor | None) -> None:
        """The layer's last ``halo`` inputs and its recurrent state after these tokens (for the next
        segment); nothing to keep here."""
        return None
