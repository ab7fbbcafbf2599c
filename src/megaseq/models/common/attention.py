"""Softmax attention with GQA, RoPE, per-head q/k RMSNorm and document masking (Qwen3-MoE).

Shapes: B batch, S_loc tokens on this rank, S full sequence, H hidden, Hq query heads, Hkv key/value
heads, D head dim, L one document's length. ``x_BSH`` is this rank's shard of the sequence.

Flow (Ulysses context parallelism through the ``SeqContext`` hooks; identities with one rank):

    x_BSH --q/k/v_proj, q/k_norm, RoPE at this shard's positions--> q [B,S_loc,Hq,D], k/v [B,S_loc,Hkv,D]
          --ctx.seq_to_heads--> [B,S,Hq/cp,D], [B,S,Hkv'/cp,D]   (all of the sequence, this rank's heads)
          --op "attention": causal within each document--> o [B,S,Hq/cp,D]
          --ctx.heads_to_seq, o_proj--> [B,S_loc,H]

Sequence segments (``memory/model_segments.py``): the attention goes through ``ctx.attend_seq``, which
joins the earlier segments' cached k and v (post-norm, post-RoPE, this rank's heads after ``seq_to_heads``)
before this segment's; the op's queries are then the last of its keys.

RoPE is applied before ``seq_to_heads``: a rotation depends only on the token's own position, so
rotating locally with the shard's ``position_ids`` (which restart at each document start) is exact.

KV heads and cp: after ``seq_to_heads`` rank r holds query heads ``[r*Hq/cp, (r+1)*Hq/cp)`` and KV
heads ``[r*Hkv/cp, ...)``; the GQA grouping (query head i reads KV head ``i // (Hq/Hkv)``) survives
the split only when cp divides Hkv. Otherwise each KV head is repeated ``rep`` times first (the
smallest ``rep`` with cp | Hkv*rep and rep | Hq/Hkv; at worst up to Hq heads), which keeps the grouping
exact at the cost of ``rep`` x the KV all-to-all volume.

Numerics follow HF's eager path op for op so float64 parity holds to ~1e-13: cos/sin in float32
(``inv_freq`` and ``position * inv_freq`` in float32, then cast), scores ``(q @ k^T) * D^-0.5``,
softmax in float32 then cast back (in float64 too, as HF does). The reference op attends each
document on its own (its softmax rows have the document's length), so a packed batch gives the
same numbers as running each document alone.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megaseq.models.common import rope
from megaseq.models.common.context import SeqContext, doc_spans, positions_from_doc_ids
from megaseq.models.common.norm import make_norm
from megaseq.models.spec import ModelSpec
from megaseq.ops import dispatch
from megaseq.ops.amp import lowered
from megaseq.ops.workspace import kv_repeats, sdpa_head_groups  # noqa: F401  (kv_repeats: also mla.py's)

# score elements one block of queries may hold in the reference (x Hq): bounds its memory at long S
REFERENCE_BLOCK_ELEMS = 1 << 22


# ---- op "attention": o_BSHD = causal, document-masked softmax(q k^T * scale) v ------------------
# The queries are the last Sq of the Sk key tokens (Sq = Sk: the plain case; Sq < Sk: a sequence segment's
# queries over the keys of every token so far); ``doc_ids_BS`` are the keys' documents ``[B, Sk]``.
def _doc_attention(q_HLD: torch.Tensor, k_KLD: torch.Tensor, v_KLD: torch.Tensor,
                   scale: float, softmax_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Causal attention within one document, blocked over queries (the last ``Lq`` of its ``L`` keys); rows
    keep the document's length."""
    Hq, Lq, D = q_HLD.shape
    Hkv, L = k_KLD.shape[:2]
    first = L - Lq  # the first query's position among the keys
    q_KGLD = q_HLD.view(Hkv, Hq // Hkv, Lq, D)
    block = max(1, min(Lq, REFERENCE_BLOCK_ELEMS // max(Hq * L, 1)))
    key_pos = torch.arange(L, device=q_HLD.device)
    out = []
    for s0 in range(0, Lq, block):
        s1 = min(Lq, s0 + block)
        scores_KGbL = torch.matmul(q_KGLD[:, :, s0:s1], k_KLD.transpose(-1, -2).unsqueeze(1)) * scale
        future_bL = key_pos[None, :] > torch.arange(first + s0, first + s1, device=q_HLD.device)[:, None]
        scores_KGbL = scores_KGbL.masked_fill(future_bL, float("-inf"))
        probs = F.softmax(scores_KGbL, dim=-1, dtype=softmax_dtype).to(q_HLD.dtype)
        out.append(torch.matmul(probs, v_KLD.unsqueeze(1)))
    return torch.cat(out, dim=2).reshape(Hq, Lq, -1)


def query_spans(doc_ids_BS: torch.Tensor | None, num_queries: int, num_keys: int,
                batch: int) -> list[list[tuple[int, int, int]]]:
    """Per batch row, ``(first key, first query, end)`` of each document that has queries (key positions; the
    queries are the last ``num_queries`` of the ``num_keys`` tokens)."""
    first = num_keys - num_queries
    spans = doc_spans(doc_ids_BS, num_keys) if doc_ids_BS is not None else [[(0, num_keys)]] * batch
    return [[(s0, max(s0, first), s1) for s0, s1 in row if s1 > first] for row in spans]


def attention_reference(q_BSHD: torch.Tensor, k_BSKD: torch.Tensor, v_BSKD: torch.Tensor,
                        doc_ids_BS: torch.Tensor | None, scale: float,
                        softmax_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Explicit masked softmax per (batch row, document); memory ``Hq * block * L`` per step."""
    B, Sq, Sk = q_BSHD.shape[0], q_BSHD.shape[1], k_BSKD.shape[1]
    first = Sk - Sq
    q, k, v = (t.transpose(1, 2) for t in (q_BSHD, k_BSKD, v_BSKD))  # [B, heads, S, D]
    rows = []
    for b, spans in enumerate(query_spans(doc_ids_BS, Sq, Sk, B)):
        docs = [_doc_attention(q[b, :, q0 - first:s1 - first], k[b, :, s0:s1], v[b, :, s0:s1], scale, softmax_dtype)
                for s0, q0, s1 in spans]
        rows.append(torch.cat(docs, dim=1))
    return torch.stack(rows).transpose(1, 2)


def attention_exact(q_BSHD: torch.Tensor, k_BSKD: torch.Tensor, v_BSKD: torch.Tensor,
                    doc_ids_BS: torch.Tensor | None, scale: float) -> torch.Tensor:
    """The reference with the softmax in ``promote_types(dtype, float32)`` (HF's eager path takes it in float32
    even for a float64 model): a float64 computation whose rounding does not depend on how many masked keys a
    row has, for comparing two schedules of the same attention (sequence segments against one pass)."""
    return attention_reference(q_BSHD, k_BSKD, v_BSKD, doc_ids_BS, scale,
                               torch.promote_types(q_BSHD.dtype, torch.float32))


def _sdpa_supports(q_BSHD: torch.Tensor, k_BSKD: torch.Tensor, v_BSKD: torch.Tensor,
                   doc_ids_BS: torch.Tensor | None, scale: float) -> str | None:
    if q_BSHD.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return f"dtype {q_BSHD.dtype} (float64 runs the reference, HF's eager numerics)"
    if v_BSKD.shape[-1] > q_BSHD.shape[-1]:
        return "v head dim larger than q/k's"
    return None


def kv_for_sdpa(q_BHSD: torch.Tensor, k_BKSD: torch.Tensor, v_BKSD: torch.Tensor,
                repeat: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The key/value heads SDPA is given. On CUDA, float32 with ``enable_gqa`` (fewer KV heads than query
    heads) has only the math kernel, which materialises the S x S scores (512 GiB at 128K, 8 heads): the
    float32 references at long lengths ran out of memory. There the KV heads are repeated (query head h reads
    KV head h // (H / K), as ``enable_gqa`` does) so that the memory-efficient kernel runs: the same values,
    H / K times the KV bytes. ``repeat``: force it on or off (the CPU test of the equality)."""
    H, K = q_BHSD.shape[1], k_BKSD.shape[1]
    if repeat is None:
        repeat = q_BHSD.is_cuda and q_BHSD.dtype == torch.float32
    if not repeat or H == K:
        return k_BKSD, v_BKSD
    return k_BKSD.repeat_interleave(H // K, dim=1), v_BKSD.repeat_interleave(H // K, dim=1)


def attention_sdpa(q_BSHD: torch.Tensor, k_BSKD: torch.Tensor, v_BSKD: torch.Tensor,
                   doc_ids_BS: torch.Tensor | None, scale: float) -> torch.Tensor:
    """torch SDPA (flash / cuDNN / efficient on GPU), one causal call per document: no S x S mask. With fewer
    KV heads than query heads, one call per group of query heads and the KV head they read
    (``sdpa_head_groups``: the backward's per-head temporaries of one group at a time). A value head narrower
    than q/k's (MLA: Dv < Dn + Dr) is zero-padded to it and the output sliced back (exact)."""
    Dv = v_BSKD.shape[-1]
    if Dv < q_BSHD.shape[-1]:
        v_pad = F.pad(v_BSKD, (0, q_BSHD.shape[-1] - Dv))
        return attention_sdpa(q_BSHD, k_BSKD, v_pad, doc_ids_BS, scale)[..., :Dv]
    spans = None if doc_ids_BS is None else query_spans(doc_ids_BS, q_BSHD.shape[1], k_BSKD.shape[1],
                                                        q_BSHD.shape[0])
    Hq, Hkv = q_BSHD.shape[2], k_BSKD.shape[2]
    calls = sdpa_head_groups(Hq, Hkv)
    if calls > 1:  # query heads in groups, each with the KV head it reads: see sdpa_head_groups
        qs, ks, vs = q_BSHD.split(Hq // calls, dim=2), k_BSKD.split(1, dim=2), v_BSKD.split(1, dim=2)
        per_kv = calls // Hkv  # calls per KV head
        return torch.cat([_sdpa_causal(q, ks[j // per_kv], vs[j // per_kv], spans, scale)
                          for j, q in enumerate(qs)], dim=2)
    return _sdpa_causal(q_BSHD, k_BSKD, v_BSKD, spans, scale)


def _sdpa_causal(q_BSHD: torch.Tensor, k_BSKD: torch.Tensor, v_BSKD: torch.Tensor,
                 doc_spans_B: list | None, scale: float) -> torch.Tensor:
    """One SDPA call per batch row and document (``doc_spans_B``: ``query_spans``; None: causal over whole
    rows). Queries fewer than the keys (a sequence segment) are the last ones: causal aligned to the lower
    right (``causal_lower_right``, which flash and the efficient kernels run without a mask tensor)."""
    q, k, v = (t.transpose(1, 2) for t in (q_BSHD, k_BSKD, v_BSKD))
    k, v = kv_for_sdpa(q, k, v)
    if doc_spans_B is None and q.shape[2] == k.shape[2]:
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
        return o.transpose(1, 2)
    first = k.shape[2] - q.shape[2]
    if doc_spans_B is None:
        doc_spans_B = query_spans(None, q.shape[2], k.shape[2], q.shape[0])
    rows = []
    for b, spans in enumerate(doc_spans_B):
        qb, kb, vb = (_part(t, b, b + 1, 0) for t in (q, k, v))
        docs = [_sdpa_lower_right(_part(qb, q0 - first, s1 - first, 2), _part(kb, s0, s1, 2), _part(vb, s0, s1, 2),
                                  scale)
                for s0, q0, s1 in spans]
        rows.append(docs[0] if len(docs) == 1 else torch.cat(docs, dim=2))
    return (rows[0] if len(rows) == 1 else torch.cat(rows)).transpose(1, 2)


def _part(t: torch.Tensor, lo: int, hi: int, dim: int) -> torch.Tensor:
    """``t``'s ``[lo, hi)`` along ``dim``; ``t`` itself where that is all of it: a slice's backward makes a zero
    gradient of the whole tensor and copies the part's into it (at a million keys, one more copy of dk and dv)."""
    return t if lo == 0 and hi == t.shape[dim] else t.narrow(dim, lo, hi - lo)


def _sdpa_lower_right(q_BHLD: torch.Tensor, k_BKLD: torch.Tensor, v_BKLD: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal SDPA where the ``Lq`` queries are the last of the ``L`` keys."""
    Lq, L = q_BHLD.shape[2], k_BKLD.shape[2]
    if Lq == L:
        return F.scaled_dot_product_attention(q_BHLD, k_BKLD, v_BKLD, is_causal=True, scale=scale, enable_gqa=True)
    from torch.nn.attention.bias import causal_lower_right
    from torch.utils._python_dispatch import _disable_current_modes

    # the mask's own dispatch validates the inputs before autocast would cast them: cast them as it would
    dt = lowered(q_BHLD)
    q_BHLD, k_BKLD, v_BKLD = (t.to(dt) for t in (q_BHLD, k_BKLD, v_BKLD))
    with _disable_current_modes():  # the mask (a tensor subclass holding no data) cannot be made under a dispatch
        mask = causal_lower_right(Lq, L)  # mode (a FLOP counter, a memory census): made outside the mode
    return F.scaled_dot_product_attention(q_BHLD, k_BKLD, v_BKLD, attn_mask=mask, scale=scale, enable_gqa=True)


# ---- RoPE (models/common/rope.py) -----------------------------------------------------------------


def rope_cos_sin(position_ids_BS: torch.Tensor, head_dim: int, theta: float,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos, sin [B, S, D]`` of HF's default RoPE (float32, then cast to ``dtype``)."""
    freq, factor = rope.inv_freq(head_dim, theta, device=position_ids_BS.device)
    return rope.cos_sin(position_ids_BS, freq, factor, dtype)


def positions_for(ctx: SeqContext, B: int, S_loc: int, device: torch.device) -> torch.Tensor:
    """This shard's position ids: ``ctx.position_ids``, else derived from the documents, else 0..S-1."""
    if ctx.position_ids is not None:
        return ctx.position_ids
    offset = ctx.seq_offset()
    full = ctx.full_doc_ids()
    if full is not None:
        return positions_from_doc_ids(full)[:, offset:offset + S_loc]
    return (torch.arange(S_loc, device=device) + offset).expand(B, S_loc)


# ---- module -------------------------------------------------------------------------------------
class Attention(nn.Module):
    """GQA softmax attention with RoPE; HF names q_proj, k_proj, v_proj, o_proj, q_norm, k_norm.

    The options each family's reference has (``ModelSpec``): q/k RMSNorm per head (Qwen3, GLM-4.5) or over
    all heads' channels before the head split (``qk_norm_scope = "all"``, OLMoE), ``clip_qkv`` (OLMoE),
    partial rotation (``partial_rotary_factor``: GLM-4.5, Qwen3-Next), linear / YaRN RoPE
    (``rope_scaling``), an output projection bias apart from q/k/v's (``o_proj_bias``), and Qwen3-Next's
    gated attention (``attn_output_gate``: ``q_proj`` gives each head's query and a gate,
    ``o = attn * sigmoid(gate)`` before ``o_proj``) with its zero-centered norms.
    """

    def __init__(self, spec: ModelSpec, layer: str = "self_attn") -> None:
        super().__init__()
        H, D = spec.hidden_size, spec.head_dim or spec.hidden_size // spec.num_attention_heads
        Hq, Hkv = spec.num_attention_heads, spec.num_key_value_heads
        if Hkv < 1 or Hq % Hkv:
            raise ValueError(f"num_key_value_heads ({Hkv}) must divide num_attention_heads ({Hq})")
        if spec.qk_norm_scope not in ("head", "all"):
            raise ValueError(f"qk_norm_scope must be 'head' or 'all', got {spec.qk_norm_scope!r}")
        self.num_heads, self.num_kv_heads, self.head_dim = Hq, Hkv, D
        self.scale, self.layer, self.clip_qkv, self.gated = D**-0.5, layer, spec.clip_qkv, spec.attn_output_gate
        self.rope_theta, self.rope_scaling = spec.rope_theta, dict(spec.rope_scaling)
        self.rotary_dim = rope.rotary_dim(D, spec.partial_rotary_factor)
        self.max_positions = spec.max_position_embeddings
        bias = spec.attention_bias
        self.q_proj = nn.Linear(H, Hq * D * (2 if self.gated else 1), bias=bias)
        self.k_proj = nn.Linear(H, Hkv * D, bias=bias)
        self.v_proj = nn.Linear(H, Hkv * D, bias=bias)
        self.o_proj = nn.Linear(Hq * D, H, bias=spec.o_proj_bias)
        self.per_head_norm = spec.qk_norm_scope == "head"
        q_dim, k_dim = (D, D) if self.per_head_norm else (Hq * D, Hkv * D)
        eps, zc = spec.rms_norm_eps, spec.norm_zero_centered
        self.q_norm = make_norm(q_dim, eps, zc) if spec.qk_norm else None
        self.k_norm = make_norm(k_dim, eps, zc) if spec.qk_norm else None

    def _qkv(self, x_BSH: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """q ``[B, S, Hq, D]``, k, v ``[B, S, Hkv, D]`` after the norms and the clamp; the output gate or None."""
        B, S_loc, _ = x_BSH.shape
        Hq, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
        q, gate = self.q_proj(x_BSH), None
        if self.gated:  # per head [query | gate]
            q, gate = q.view(B, S_loc, Hq, 2 * D).chunk(2, dim=-1)
            gate = gate.reshape(B, S_loc, Hq * D)
        k, v = self.k_proj(x_BSH), self.v_proj(x_BSH)
        if self.q_norm is not None and not self.per_head_norm:  # over all heads' channels (OLMoE)
            q, k = self.q_norm(q), self.k_norm(k)
        if self.clip_qkv is not None:
            q, k, v = (t.clamp(min=-self.clip_qkv, max=self.clip_qkv) for t in (q, k, v))
        q, k, v = q.reshape(B, S_loc, Hq, D), k.view(B, S_loc, Hkv, D), v.view(B, S_loc, Hkv, D)
        if self.q_norm is not None and self.per_head_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        return q, k, v, gate

    def forward(self, x_BSH: torch.Tensor, ctx: SeqContext) -> torch.Tensor:
        B, S_loc, _ = x_BSH.shape
        q, k, v, gate = self._qkv(x_BSH)
        positions_BS = positions_for(ctx, B, S_loc, x_BSH.device)
        freq, factor = rope.inv_freq(self.rotary_dim, self.rope_theta, self.rope_scaling, self.max_positions,
                                     x_BSH.device)
        cos, sin = rope.cos_sin(positions_BS, freq, factor, q.dtype)
        q, k = dispatch.call("rope", q, k, cos, sin, layer=self.layer)
        rep = kv_repeats(self.num_heads, self.num_kv_heads, ctx.cp_size) if ctx.cp_size > 1 else 1
        if rep > 1:  # copies; KV head j becomes heads j*rep .. j*rep+rep-1, so the GQA grouping holds
            k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
        q, k, v = ctx.seq_to_heads(q), ctx.seq_to_heads(k), ctx.seq_to_heads(v)

        def attend(q_: torch.Tensor, k_: torch.Tensor, v_: torch.Tensor) -> torch.Tensor:
            return self._attend(q_, k_, v_, ctx)

        # the keys of every token so far: these (one pass), or joined to the earlier segments' (segments)
        o = ctx.attend_seq(q, (k, v), self.layer, attend)
        o = ctx.heads_to_seq(o).reshape(B, S_loc, self.num_heads * self.head_dim)
        if gate is not None:
            o = o * torch.sigmoid(gate)
        return self.o_proj(o)

    def _attend(self, q_BSHD: torch.Tensor, k_BSKD: torch.Tensor, v_BSKD: torch.Tensor,
                ctx: SeqContext) -> torch.Tensor:
        """The attention of this rank's heads over the whole sequence (a subclass changes only this)."""
        return dispatch.call("attention", q_BSHD, k_BSKD, v_BSKD, ctx.full_doc_ids(), self.scale, layer=self.layer)
