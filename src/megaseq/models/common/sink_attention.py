"""Softmax attention with attention sinks and an optional sliding window (gpt-oss).

Shapes: B batch, S full sequence (this rank's heads after Ulysses), Hq query heads, Hkv key/value heads,
G = Hq / Hkv, D head dim, L one document's length, W the window, b a block of queries.

Each query head h has a learned sink logit ``s_h`` that joins every softmax's denominator and attends to
nothing (``GptOssAttention``'s ``eager_attention_forward``)::

    p_ij = exp(l_ij) / (exp(s_h) + sum_{j' visible} exp(l_ij'))     o_i = sum_j p_ij v_j

A query sees the keys of its own document at or before it and, in a sliding layer, only the ``W`` latest of
them (itself included: ``i - W < j <= i``, transformers' ``sliding_window_overlay``). Positions restart at
each document (``doc_ids``), so a packed row equals each document run alone.

Op ``sink_attention(q_BSHD, k_BSKD, v_BSKD, doc_ids_BS, scale, sinks_H, window)``:

- ``torch_reference``: explicit scores per document in blocks of queries, the sink as one more column of
  the softmax (computed in ``promote_types(dtype, float32)``, cast back); a sliding block reads only the
  ``b + W - 1`` keys it can see. Float64 parity with transformers; autograd keeps every block's
  probabilities (``Hq x S x keys``), so it is the CPU and test path, not a long-sequence one.
- ``sdpa`` (CUDA, bf16/fp16/fp32): torch SDPA with the sink as a key. One head dim more: each query gets
  ``s_h / scale`` there, each real key 0 and a sink key put before the document 1, so the sink key's score is
  exactly ``s_h`` and every other score is unchanged; its value is zero (then padded to a multiple of 8
  dims). Full layers: a dummy query before the document keeps SDPA's top-left causal mask right (query i
  then sees the sink and keys 0..i) and is dropped. Sliding layers: queries in blocks of ``SLIDE_BLOCK``, each
  with the ``b + W - 1`` keys before it and the sink, under one ``[G b, keys]`` band mask; the blocks are
  batched in one call (keys before the document scored ``-PAD_SCORE`` through one more dim, so the mask is
  the same for every block). The working set is SDPA's (no ``S x S`` tensor) plus the padded copies of q,
  k, v (``ops.workspace``-free: ``plan.layers.attention_saved`` counts them).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megaseq.models.common.attention import REFERENCE_BLOCK_ELEMS, Attention, kv_for_sdpa
from megaseq.models.common.context import SeqContext, doc_spans
from megaseq.models.spec import ModelSpec
from megaseq.ops import dispatch
from megaseq.ops.workspace import SLIDE_BLOCK, sink_attention_dims

PAD_SCORE = 30000.0  # minus the score of a padding key before a document: exp(-30000) is 0 in every dtype


# ---- op "sink_attention": the reference --------------------------------------------------------------
def _doc_sink_attention(q_HLD: torch.Tensor, k_KLD: torch.Tensor, v_KLD: torch.Tensor, scale: float,
                        sinks_H: torch.Tensor, window: int) -> torch.Tensor:
    """One document: causal (and windowed) attention with the sinks, blocked over queries."""
    Hq, L, D = q_HLD.shape
    Hkv = k_KLD.shape[0]
    q_KGLD = q_HLD.view(Hkv, Hq // Hkv, L, D)
    c = torch.promote_types(q_HLD.dtype, torch.float32)
    span = min(L, 2 * window) if window else L
    block = max(1, min(L, REFERENCE_BLOCK_ELEMS // max(Hq * span, 1), window or L))
    sink_KG11 = sinks_H.to(c).view(Hkv, Hq // Hkv, 1, 1)
    out = []
    for s0 in range(0, L, block):
        s1 = min(L, s0 + block)
        lo = max(0, s0 - window + 1) if window else 0
        scores_KGbL = torch.matmul(q_KGLD[:, :, s0:s1], k_KLD[:, lo:s1].transpose(-1, -2).unsqueeze(1)) * scale
        q_pos = torch.arange(s0, s1, device=q_HLD.device)[:, None]
        k_pos = torch.arange(lo, s1, device=q_HLD.device)[None, :]
        hidden_bL = k_pos > q_pos
        if window:
            hidden_bL = hidden_bL | (k_pos <= q_pos - window)
        scores_KGbL = scores_KGbL.to(c).masked_fill(hidden_bL, float("-inf"))
        combined = torch.cat([scores_KGbL, sink_KG11.expand(*scores_KGbL.shape[:3], 1)], dim=-1)
        probs = F.softmax(combined, dim=-1)[..., :-1].to(q_HLD.dtype)  # the sink's column dropped
        out.append(torch.matmul(probs, v_KLD[:, lo:s1].unsqueeze(1)))
    return torch.cat(out, dim=2).reshape(Hq, L, -1)


def sink_attention_reference(q_BSHD: torch.Tensor, k_BSKD: torch.Tensor, v_BSKD: torch.Tensor,
                             doc_ids_BS: torch.Tensor | None, scale: float, sinks_H: torch.Tensor,
                             window: int) -> torch.Tensor:
    """Explicit masked softmax with the sink column, per (batch row, document)."""
    B, S = q_BSHD.shape[:2]
    spans = doc_spans(doc_ids_BS, S) if doc_ids_BS is not None else [[(0, S)]] * B
    q, k, v = (t.transpose(1, 2) for t in (q_BSHD, k_BSKD, v_BSKD))  # [B, heads, S, D]
    rows = []
    for b in range(B):
        rows.append(torch.cat([_doc_sink_attention(q[b, :, s0:s1], k[b, :, s0:s1], v[b, :, s0:s1], scale, sinks_H,
                                                   window) for s0, s1 in spans[b]], dim=1))
    return torch.stack(rows).transpose(1, 2)


# ---- op "sink_attention": SDPA with the sink as a key ---------------------------------------------------
def _sdpa_supports(q_BSHD: torch.Tensor, k_BSKD: torch.Tensor, v_BSKD: torch.Tensor,
                   doc_ids_BS: torch.Tensor | None, scale: float, sinks_H: torch.Tensor,
                   window: int) -> str | None:
    if q_BSHD.device.type != "cuda":
        return f"device {q_BSHD.device.type} (the reference is the CPU path)"
    if q_BSHD.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return f"dtype {q_BSHD.dtype} (float64 runs the reference, HF's eager numerics)"
    return None


def with_sink_dims(q_BHLD: torch.Tensor, k_BKLD: torch.Tensor, v_BKLD: torch.Tensor, sinks_H: torch.Tensor,
                   scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v of one span with a sink key first: q gets ``s_h / scale`` in dim D, the keys 0 there and the sink
    key 1 (its score is ``s_h``), the sink's value 0; q/k padded to a multiple of 8 dims, at least D + 2 (dim
    D + 1 is the sliding path's: ``_sliding_span``)."""
    B, Hq, L, D = q_BHLD.shape
    Dp = sink_attention_dims(D)
    extra = (sinks_H.to(q_BHLD.dtype) / scale).view(1, Hq, 1, 1).expand(B, Hq, L, 1)
    q = torch.cat([q_BHLD, extra, q_BHLD.new_zeros(B, Hq, L, Dp - D - 1)], dim=-1)
    k = F.pad(k_BKLD, (0, Dp - D, 1, 0))  # a zero row first (the sink key), zero dims after
    k[:, :, 0, D] = 1.0
    v = F.pad(v_BKLD, (0, 0, 1, 0))
    return q, k, v


def _full_span(q_BHLD: torch.Tensor, k_BKLD: torch.Tensor, v_BKLD: torch.Tensor, sinks_H: torch.Tensor,
               scale: float) -> torch.Tensor:
    """Causal attention with the sink over one span: a dummy query first keeps the top-left causal mask."""
    D = v_BKLD.shape[-1]
    q, k, v = with_sink_dims(q_BHLD, k_BKLD, v_BKLD, sinks_H, scale)
    q = F.pad(q, (0, 0, 1, 0))
    k, v = kv_for_sdpa(q, k, v)
    v = F.pad(v, (0, q.shape[-1] - D))
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    return o[:, :, 1:, :D]


def _sliding_span(q_BHLD: torch.Tensor, k_BKLD: torch.Tensor, v_BKLD: torch.Tensor, sinks_H: torch.Tensor,
                  scale: float, window: int) -> torch.Tensor:
    """Windowed attention with the sink over one span: n blocks of b queries batched, each with its
    ``b + W - 1`` keys and the sink under one band mask shared by every block and head; a KV head's G query
    heads stacked along the rows. The first block's keys before the document are padding: each query has 1
    in dim D + 1 and those keys ``-PAD_SCORE / scale``, so their scores are ``-PAD_SCORE`` (exp is 0), and
    the mask needs no per-block rows."""
    B, Hq, L, D = q_BHLD.shape
    Hkv = k_BKLD.shape[1]
    G, b = Hq // Hkv, min(SLIDE_BLOCK, L)
    n, pad = -(-L // b), window - 1  # pad: keys before a block's first query (zeros before the document)
    q, k, v = with_sink_dims(q_BHLD, k_BKLD, v_BKLD, sinks_H, scale)
    v = F.pad(v, (0, q.shape[-1] - D))
    q[..., D + 1] = 1.0
    Dp, width = q.shape[-1], b + pad
    align = -(1 + width) % 16  # masked keys after the block's: the mask's rows 16-aligned, as SDPA's kernels want

    def blocks(t_BKLD: torch.Tensor, pad_key: float = 0.0) -> torch.Tensor:  # [B * n, Hkv, 1 + width + align, Dp]
        keys = F.pad(t_BKLD[:, :, 1:], (0, 0, pad, n * b - L))
        if pad_key:
            keys[:, :, :pad, D + 1] = pad_key
        keys = F.pad(keys.unfold(2, width, b).permute(0, 2, 1, 4, 3), (0, 0, 0, align))
        return torch.cat([t_BKLD[:, None, :, :1].expand(B, n, Hkv, 1, Dp), keys], dim=3).flatten(0, 1)

    q = F.pad(q, (0, 0, 0, n * b - L)).view(B, Hkv, G, n, b, Dp).permute(0, 3, 1, 2, 4, 5)
    q = q.reshape(B * n, Hkv, G * b, Dp)
    i = torch.arange(b, device=q.device)[:, None]
    j = torch.arange(width, device=q.device)[None, :] - pad  # a key's offset from the block's first query
    seen = (j <= i) & (j > i - window)  # [b, width]: the band
    mask = torch.cat([seen.new_ones(b, 1), seen, seen.new_zeros(b, align)], dim=-1).repeat(G, 1)[None, None]
    o = F.scaled_dot_product_attention(q, blocks(k, -PAD_SCORE / scale), blocks(v), attn_mask=mask, scale=scale)
    o = o.view(B, n, Hkv, G, b, Dp).permute(0, 2, 3, 1, 4, 5).reshape(B, Hq, n * b, Dp)
    return o[:, :, :L, :D]


def sink_attention_sdpa(q_BSHD: torch.Tensor, k_BSKD: torch.Tensor, v_BSKD: torch.Tensor,
                        doc_ids_BS: torch.Tensor | None, scale: float, sinks_H: torch.Tensor,
                        window: int) -> torch.Tensor:
    """SDPA per batch row and document with the sink as a key (see the module's docstring)."""
    B, S = q_BSHD.shape[:2]
    spans = doc_spans(doc_ids_BS, S) if doc_ids_BS is not None else [[(0, S)]] * B
    q, k, v = (t.transpose(1, 2) for t in (q_BSHD, k_BSKD, v_BSKD))
    rows = []
    for b in range(B):
        docs = []
        for s0, s1 in spans[b]:
            args = (q[b:b + 1, :, s0:s1], k[b:b + 1, :, s0:s1], v[b:b + 1, :, s0:s1], sinks_H, scale)
            docs.append(_sliding_span(*args, window) if window else _full_span(*args))
        rows.append(torch.cat(docs, dim=2))
    return torch.cat(rows).transpose(1, 2)


# ---- module -------------------------------------------------------------------------------------------
class SinkAttention(Attention):
    """``Attention`` (GQA, RoPE, biases) with a sink logit per query head (``sinks [Hq]``, HF's name) and the
    layer's window (``spec.sliding_window`` where ``index`` is in ``spec.sliding_layers``, else 0: full)."""

    def __init__(self, spec: ModelSpec, index: int, layer: str = "self_attn") -> None:
        super().__init__(spec, layer)
        self.window = spec.sliding_window if index in spec.sliding_layers else 0
        self.sinks = nn.Parameter(torch.zeros(self.num_heads))

    @torch.no_grad()
    def init_weights(self, std: float) -> None:
        """HF's ``_init_weights``: the sinks normal(0, std); the projections as every linear (their own walk)."""
        self.sinks.normal_(0.0, std)

    def _attend(self, q_BSHD: torch.Tensor, k_BSKD: torch.Tensor, v_BSKD: torch.Tensor,
                ctx: SeqContext) -> torch.Tensor:
        sinks_H = self.sinks[ctx.head_slice(self.num_heads)]
        return dispatch.call("sink_attention", q_BSHD, k_BSKD, v_BSKD, ctx.full_doc_ids(), self.scale, sinks_H,
                             self.window, layer=self.layer)
