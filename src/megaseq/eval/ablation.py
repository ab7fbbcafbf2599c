"""The context ablation: the same late tokens scored with their full preceding context and with it cut.

Shapes: B batch, S window length, NB buckets, C chunk length, W windows.

A model scored past the length it was trained at degrades with position, so a before/after gain in the
late buckets can be mere length repair. The ablation separates the two: one model scores the late
buckets' tokens twice, once from the window's start (the full context) and once with its context cut to
``cut_to`` tokens (a sliding window). The cut arm walks each bucket chunk by chunk: a chunk of C tokens
is scored from a forward over the ``cut_to`` tokens before its first token and the chunk itself, so a
scored token sees at least ``cut_to`` and at most ``cut_to + C - 1`` tokens. Both arms score exactly
the same tokens (the window's scored mask), so the difference ``cut - full`` is what reading further
back than ``cut_to`` is worth.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import torch

from megaseq.eval.by_position import LossFn, scored_mask
from megaseq.eval.spread import WindowBuckets, beyond_noise, paired_gain

SLICED = ("input_ids", "labels", "doc_ids")


def context_start(chunk_start: int, cut_to: int) -> int:
    """First input position of the forward that scores a chunk from ``chunk_start``: the label at position
    p predicts token p + 1 from inputs ``[start, p]``, so the chunk's first label sees exactly ``cut_to``."""
    return max(0, chunk_start + 1 - cut_to)


def _slice(batch: dict[str, Any], start: int, end: int) -> dict[str, Any]:
    out = {}
    for key in SLICED:
        v = batch.get(key)
        if v is None:
            out[key] = None
            continue
        v = v[:, start:end]
        out[key] = v - v[:, :1] if key == "doc_ids" else v  # document ids count from 0 in each row
    return out


def cut_context_loss(per_token_loss: LossFn, batch: dict[str, Any], start: int, end: int, cut_to: int,
                     chunk: int, scored_S: np.ndarray | None = None) -> torch.Tensor:
    """Per-token loss ``[B, end - start]`` of positions [start, end), each chunk of ``chunk`` positions scored
    from a forward that begins ``cut_to`` tokens before the chunk (``context_start``). A chunk with no
    position in ``scored_S`` (bool ``[S]``, any row) is skipped: its loss is left at 0."""
    B = batch["input_ids"].shape[0]
    parts = []
    for c in range(start, end, chunk):
        e = min(c + chunk, end)
        if scored_S is not None and not scored_S[c:e].any():
            parts.append(torch.zeros(B, e - c, dtype=torch.float64))
            continue
        s = context_start(c, cut_to)
        loss_BT = per_token_loss(_slice(batch, s, e))
        loss_BT = loss_BT if isinstance(loss_BT, torch.Tensor) else torch.as_tensor(loss_BT)
        parts.append(loss_BT[:, c - s:].detach().double().cpu())
    return torch.cat(parts, dim=1)


def ablated_buckets(seq_len: int, bucket_width: int, cut_to: int) -> list[int]:
    """The buckets where cutting changes anything: those holding a position with more than ``cut_to`` tokens
    before it."""
    nb = -(-seq_len // bucket_width)
    return [i for i in range(nb) if min((i + 1) * bucket_width, seq_len) > cut_to]


def score_ablation(per_token_loss: LossFn, batches: Iterable[dict[str, Any]], bucket_width: int, cut_to: int,
                   chunk: int, score_ids: Sequence[int] | None = None,
                   buckets: Sequence[int] | None = None) -> tuple[WindowBuckets, WindowBuckets, list[int]]:
    """(full arm, cut arm, the ablated buckets): both arms score the same tokens of ``buckets`` (default:
    ``ablated_buckets``); other positions are left out of both."""
    if cut_to < 1 or chunk < 1:
        raise ValueError(f"eval.ablation_cut_to ({cut_to}) and eval.ablation_chunk ({chunk}) must be >= 1")
    full: WindowBuckets | None = None
    cut: WindowBuckets | None = None
    for batch in batches:
        mask_BS = scored_mask(batch, score_ids)
        S = mask_BS.shape[1]
        chosen = list(buckets) if buckets is not None else ablated_buckets(S, bucket_width, cut_to)
        if not chosen:
            raise ValueError(f"eval.ablation_cut_to {cut_to} is not shorter than the window ({S} tokens): no "
                             "position has more context to cut; set it to the start model's training length")
        keep_S = np.isin(np.arange(S) // bucket_width, chosen)
        mask_BS = mask_BS & keep_S[None, :]
        with torch.no_grad():
            loss_full = per_token_loss(batch)
            loss_full = (loss_full if isinstance(loss_full, torch.Tensor) else torch.as_tensor(loss_full))
            loss_full_BS = loss_full.detach().double().cpu().numpy()
            loss_cut_BS = np.zeros_like(loss_full_BS)
            for i in chosen:
                a, b = i * bucket_width, min((i + 1) * bucket_width, S)
                loss_cut_BS[:, a:b] = cut_context_loss(per_token_loss, batch, a, b, cut_to, chunk,
                                                       mask_BS.any(axis=0)).numpy()
        if full is None or cut is None:
            full, cut = WindowBuckets(bucket_width, S), WindowBuckets(bucket_width, S)
        full.add(loss_full_BS, mask_BS)
        cut.add(loss_cut_BS, mask_BS)
    if full is None or cut is None:
        raise ValueError("no held-out windows for the context ablation: set data.heldout or data.heldout_records")
    return full, cut, chosen


def ablation_block(full: WindowBuckets, cut: WindowBuckets, chosen: Sequence[int], cut_to: int, chunk: int,
                   model: str) -> dict[str, Any]:
    """The JSON block ``context_ablation``: per ablated bucket the bits of both arms, the value of the context
    beyond ``cut_to`` (``cut - full``) with its standard error across windows, and the words."""
    f, c = full.summary(), cut.summary()
    f_WN, c_WN = full.bucket_window_bits(), cut.bucket_window_bits()
    gains = [paired_gain(c_WN[:, i], f_WN[:, i]) for i in chosen]
    overall, overall_se = paired_gain(cut.window_bits(chosen), full.window_bits(chosen))
    block = {
        "model": model, "cut_to": cut_to, "chunk": chunk, "context_tokens_cut": [cut_to, cut_to + chunk - 1],
        "buckets": [int(i) for i in chosen],
        "bits_per_base_full": [f["bucket_bits_per_base"][i] for i in chosen],
        "bits_per_base_cut": [c["bucket_bits_per_base"][i] for i in chosen],
        "bits_per_base_full_se": [f["bucket_se"][i] for i in chosen],
        "bits_per_base_cut_se": [c["bucket_se"][i] for i in chosen],
        "context_gain": [g for g, _ in gains], "context_gain_se": [se for _, se in gains],
        "overall_full": f["bits_per_base"], "overall_cut": c["bits_per_base"],
        "overall_context_gain": overall, "overall_context_gain_se": overall_se,
        "bucket_tokens": [f["bucket_tokens"][i] for i in chosen], "num_windows": f["num_windows"],
        "window_bits_per_base_full": [[r[i] for i in chosen] for r in f["window_bucket_bits_per_base"]],
        "window_bits_per_base_cut": [[r[i] for i in chosen] for r in c["window_bucket_bits_per_base"]],
    }
    block["words"] = ablation_words(block)
    return block


def ablation_words(block: dict[str, Any]) -> str:
    g, se = block["overall_context_gain"], block["overall_context_gain_se"]
    head = (f"Context ablation ({block['model']}): with its context cut to {block['cut_to']:,} tokens the same "
            f"tokens score {block['overall_cut']:.4f} bits per base against {block['overall_full']:.4f} with the "
            f"full context")
    if g is None:
        return head + "."
    noise = f", 2 s.e. {2 * se:.4f} across windows" if se is not None else ", spread unknown (one window)"
    if not beyond_noise(g, se):
        verdict = "the context beyond the cut makes no difference that stands out from noise"
    elif g > 0:
        verdict = "the model uses context from further back than the cut"
    else:
        verdict = "the longer context hurts the model"
    return f"{head} ({g:+.4f} for the full context{noise}): {verdict}."
