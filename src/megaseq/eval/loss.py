"""Per-token held-out loss of a model, for evaluation by position.

``per_token_loss_fn(model, env, autocast, chunk_tokens, segment_tokens)`` is the callable
``batch -> [B, S]`` nats that ``evaluate_by_position`` takes. The vocabulary projection runs chunk by
chunk (never ``S x V`` logits); a sequence longer than ``segment_tokens`` runs in sequence segments
(``memory.model_segments.segmented_forward``) as the run's training plan did; under context
parallelism each rank scores its shard and the losses are gathered.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch


def _autocast(dtype: torch.dtype | None, device: torch.device) -> contextlib.AbstractContextManager:
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def per_token_loss_fn(model: torch.nn.Module, env: Any, autocast: torch.dtype | None,
                      chunk_tokens: int, segment_tokens: int = 0) -> Any:
    """A callable batch -> per-token loss [B, S] in nats. ``segment_tokens`` (the plan's
    ``model_segment_tokens``): a longer sequence runs in sequence segments, as training did."""
    from megaseq.memory.vocab_loss import chunked_linear_cross_entropy

    def token_loss(hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        B, T, H = hidden.shape
        return chunked_linear_cross_entropy(hidden.reshape(-1, H), model.lm_head.weight, labels.reshape(-1),
                                            chunk_tokens, reduction="none").float().reshape(B, T)

    @torch.no_grad()
    def fn(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        b = env.to_device(batch)
        ids = b["input_ids"]
        if segment_tokens and ids.shape[1] > segment_tokens and env.cp_size == 1:
            from megaseq.memory.model_segments import segmented_forward

            out = torch.empty(ids.shape, dtype=torch.float32, device=ids.device)

            def put(hidden: torch.Tensor, s: int, e: int) -> None:
                out[:, s:e] = token_loss(hidden, b["labels"][:, s:e])

            with _autocast(autocast, env.device):
                segmented_forward(model, ids, segment_tokens, put, doc_ids=b.get("doc_ids"))
            return out
        with _autocast(autocast, env.device):
            hidden = model(ids, doc_ids=b.get("doc_ids"), ctx=env.context(b))
        return env.gather_seq(token_loss(hidden, b["labels"]))

    return fn
