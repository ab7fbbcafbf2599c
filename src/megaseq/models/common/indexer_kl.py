"""The lightning indexer's objective: KL(main attention || indexer), a chunk of queries at a time.

Shapes: c queries of one chunk, Hh attention heads, C latent width (R, or R + Dr with DeepSeek's RoPE part),
S keys, W selected slots per query, n candidate pools of a chunk, kp tokens per pool, K selected pools,
I indexer heads, D indexer head dim.

DeepSeek-V3.2 (section 2.1) trains the indexer by distillation from the main attention:

- the target of query t is the main attention's probabilities summed over the heads and L1-normalised over
  the keys: every visible key in the dense warm-up, the selected keys in the sparse stage;
- the loss is ``KL(target || softmax(I_t))`` over the same keys, ``I_t`` the indexer's scores;
- the indexer's inputs (the layer input and the query latent) are detached: the term trains only the indexer,
  and the LM loss trains only the main model.

Megatron-Core's ``compute_dsa_indexer_loss`` is the same formula (mean over queries, times
``dsa_indexer_loss_coeff``); ``DSAIndexerLossAutoScaler`` hands the term's gradient in at the layer output
(``AttachLoss`` here, the dense warm-up's way), so it composes with recompute, sequence segments and context
parallelism. The sparse stage's term runs in the backward instead, right after the layer's attention, whose
backward leaves the target (``models.common.indexer_objective.SparseObjective``).

A pooled indexer (GLM's ``index_kpool``) scores complete pools of kp tokens, not tokens: the target of a pool
is the sum of its tokens' probabilities (the attention mass the pool's selection buys), over the candidate
pools only. The query's own incomplete tail pool is read by every query without being scored, so its mass
is left out before normalising (``docs/indexer.md``).

Memory: never ``[S, S]``. The target and the indexer's log-softmax are built a query chunk at a time; the
loss's gradient with respect to the indexer's inputs (pooled keys ``[P, D]``, head weights ``[Q, I]``, the
query projection's weight) is taken chunk by chunk (``chunk_grads``, Liger's fused-loss way), so nothing
of size ``c * n`` outlives its chunk. One chunk holds ``c * Hh * n`` scores of the warm-up's target (``n`` the
visible keys); the sparse stage's target is the attention's head-summed probabilities its backward left
(``given``), else op ``indexer_target`` (``ops/indexer/target.py``): the reference gathers ``c * W`` latents and
``c * Hh * W`` scores, the Triton kernel (``model.kernels fast`` on a GPU) only its ``[c, W]`` output; both
normalise each head with the attention's own log-sum-exp (``lse``), so the kernel makes one pass over the
selected latents. The indexer side holds
``c * I * n`` scores (``ops.workspace.indexer_kl_bytes``); in the sparse stage it is op ``indexer_kl``
(``ops/indexer/kl.py``: ``index_scores`` and ``kl_rows`` over the gathered selected keys, or one Triton kernel
that also writes the gradients).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from megaseq.ops.indexer.kl import index_scores as index_scores  # the indexer's scores and KL: op indexer_kl's
from megaseq.ops.indexer.kl import kl_rows as kl_rows
from megaseq.ops.indexer.scoring import topk_lowest_index_ties
from megaseq.ops.indexer.target import head_summed_probs, indexer_target_reference, selected

# op indexer_target's contract: (q_abs [c, Hh, C], latents [S, C], idx [c, W], scale, lse=[c, Hh] | None) -> m [c, W]
TargetProbs = Callable[..., torch.Tensor]

# score elements per chunk of the dense warm-up's attention (as the reference sparse attention's blocks)
DENSE_BLOCK_ELEMS: int = 1 << 26


@dataclass
class IndexerStats:
    """What the objective saw since the last ``reset``: KL summed over queries, the queries, and the recall
    of the dense attention's top pools (hits over the picks, with random selection's expected hits)."""

    kl_sum: float = 0.0
    rows: int = 0
    recall_hits: float = 0.0
    recall_picks: float = 0.0
    random_hits: float = 0.0
    _pending: list[torch.Tensor] = field(default_factory=list, repr=False)

    def add(self, *values: torch.Tensor) -> None:
        """Device scalars (kl, rows, hits, picks, random hits), read back at ``read()`` (one sync a step)."""
        self._pending.append(torch.stack([v.double() for v in values]))

    def read(self) -> IndexerStats:
        if self._pending:
            kl, rows, hits, picks, rnd = torch.stack(self._pending).sum(0).tolist()
            self._pending.clear()
            self.kl_sum += kl
            self.rows += int(rows)
            self.recall_hits += hits
            self.recall_picks += picks
            self.random_hits += rnd
        return self

    def reset(self) -> None:
        self._pending.clear()
        self.kl_sum = self.recall_hits = self.recall_picks = self.random_hits = 0.0
        self.rows = 0


class AttachLoss(torch.autograd.Function):
    """``out`` unchanged; in backward the loss gets the gradient ``scale`` (Megatron's
    ``DSAIndexerLossAutoScaler``): the term joins the step's loss wherever the layer output's gradient flows."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, loss: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        ctx.loss_meta = (loss.dtype, loss.device)
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        dtype, device = ctx.loss_meta
        return grad, torch.full((), ctx.scale, dtype=dtype, device=device), None


# ---- the target -------------------------------------------------------------------------------------------
def absorbed_query(q_cHD: torch.Tensor, w_uk_HDR: torch.Tensor, rope_dim: int) -> torch.Tensor:
    """``[c, Hh, C]``: queries against the latent (``q_nope W_uk | q_rot``), so ``q . k_s = q_abs . c_s``."""
    Dn = q_cHD.shape[-1] - rope_dim
    q_abs = torch.einsum("chd,hdr->chr", q_cHD[..., :Dn], w_uk_HDR)
    return torch.cat([q_abs, q_cHD[..., Dn:]], dim=-1) if rope_dim else q_abs


def normalise(mass_cn: torch.Tensor, cand_cn: torch.Tensor) -> torch.Tensor:
    """L1-normalised over the candidates (rows without any: zeros)."""
    mass = mass_cn.masked_fill(~cand_cn, 0.0)
    return mass / mass.sum(-1, keepdim=True).clamp_min(torch.finfo(mass.dtype).tiny)


@dataclass
class Pools:
    """One batch row's candidates: complete pools (token indices ``tok [P, kp]``, in sequence order), their
    ends and documents, and the documents of the keys."""

    tok_Pk: torch.Tensor
    doc_S: torch.Tensor

    @property
    def end_P(self) -> torch.Tensor:
        return self.tok_Pk[:, -1]

    def visible(self, q_pos_c: torch.Tensor, n: int) -> torch.Tensor:
        """``[c, n]``: pool p is a candidate of the query (it ends at or before it, in its document)."""
        end = self.end_P[:n]
        return (end[None] <= q_pos_c[:, None]) & (self.doc_S[end][None] == self.doc_S[q_pos_c][:, None])


def dense_target(q_abs_cHC: torch.Tensor, c_SC: torch.Tensor, q_pos_c: torch.Tensor, pools: Pools,
                 scale: float, bounded: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Warm-up target over the candidate pools a query sees: ``(target [c, n], candidates [c, n])``, ``n`` the
    pools ending at or before the chunk's last query (``bounded``: the keys and pools past the chunk's last
    query are left out, which reads that position back to the host), or every complete pool (not ``bounded``:
    the same target and candidates, wider, without a host read). The attention runs over every visible key
    (causal, same document), as the dense attention does."""
    last = int(q_pos_c.max()) + 1 if bounded else c_SC.shape[0]
    keys = torch.arange(last, device=q_pos_c.device)
    doc = pools.doc_S
    valid_cS = (keys[None] <= q_pos_c[:, None]) & (doc[:last][None] == doc[q_pos_c][:, None])
    m_cS = head_summed_probs(q_abs_cHC, c_SC[:last], valid_cS, scale)
    n = (int(torch.searchsorted(pools.end_P.contiguous(), q_pos_c.max(), right=True)) if bounded
         else pools.tok_Pk.shape[0])
    cand = pools.visible(q_pos_c, n)
    mass = m_cS[:, pools.tok_Pk[:n]].sum(-1)  # a pool's probability: the sum of its tokens'
    return normalise(mass, cand), cand


def sparse_target(q_abs_cHC: torch.Tensor | None, c_SC: torch.Tensor, idx_cW: torch.Tensor, kp: int,
                  num_pools: int, scale: float, probs: TargetProbs = indexer_target_reference,
                  lse: torch.Tensor | None = None,
                  given: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse-stage target over each query's selected pools: ``(target [c, K], selected-and-valid [c, K])``.
    The main attention's probabilities over all selected slots (the tail too), summed over heads (``probs``: an
    implementation of op ``indexer_target``, the torch reference by default; ``lse [c, Hh]``: the attention's
    base-2 log-sum-exp of these queries, each head's normaliser; ``given [c, W]``: that op's result already made,
    by the attention's backward, ``ops.sparse_mla.reference.HeadProbs``), a pool's slots summed, the tail dropped,
    normalised over the selected pools."""
    ok = selected(idx_cW, c_SC.shape[0])
    m_cW = given if given is not None else probs(q_abs_cHC, c_SC, idx_cW, scale, lse=lse)
    width = num_pools * kp
    mass = m_cW[:, :width].reshape(-1, num_pools, kp).sum(-1)
    cand = ok[:, :width:kp]
    return normalise(mass, cand), cand


# ---- the indexer's side -------------------------------------------------------------------------------------
def recall_counts(target_cn: torch.Tensor, chosen_cn: torch.Tensor, cand_cn: torch.Tensor,
                  K: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Over rows with more than K candidates: (the dense target's top-K pools that were chosen, the picks
    ``rows * K``, random selection's expected hits ``sum K * K / n``). Every row is computed and the others
    masked out, so nothing is read back to the host."""
    z = target_cn.new_zeros(())
    if K == 0 or cand_cn.shape[-1] <= K:  # no row has more than K candidates
        return z, z, z
    n = cand_cn.sum(-1)
    rows = n > K
    t = target_cn.masked_fill(~cand_cn, -1.0)
    top = torch.zeros_like(t, dtype=torch.bool).scatter_(-1, topk_lowest_index_ties(t, K), True)
    hits = (top & chosen_cn & rows[:, None]).sum().to(target_cn.dtype)
    picks = rows.sum().to(target_cn.dtype) * K
    random = torch.where(rows, K * K / n.clamp_min(1).to(target_cn.dtype), z).sum()
    return hits, picks, random


def topk_mask(score_cn: torch.Tensor, cand_cn: torch.Tensor, K: int) -> torch.Tensor:
    """The indexer's own pick among the candidates (its top-K, ties to the lowest index) as a mask."""
    x = score_cn.masked_fill(~cand_cn, torch.finfo(score_cn.dtype).min)
    k = min(K, x.shape[-1])
    return torch.zeros_like(cand_cn).scatter_(-1, topk_lowest_index_ties(x, k), True) & cand_cn


# ---- the chunked loss -----------------------------------------------------------------------------------
ChunkLoss = Callable[[int, int, list[torch.Tensor]], torch.Tensor]  # (start, end, input leaves) -> KL sum


class ChunkedKL(torch.autograd.Function):
    """``sum_chunks loss(s, e, inputs)`` whose gradient with respect to ``inputs`` is taken chunk by chunk in
    the forward (each chunk's graph freed before the next): the backward scales the sums."""

    @staticmethod
    def forward(ctx, loss: ChunkLoss, bounds: list[tuple[int, int]], *inputs: torch.Tensor) -> torch.Tensor:
        total, grads = chunk_grads(loss, bounds, inputs)
        ctx.save_for_backward(*grads)
        ctx.dtypes = [t.dtype for t in inputs]
        return total

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        scaled = [(g * grad).to(dt) for g, dt in zip(ctx.saved_tensors, ctx.dtypes, strict=True)]
        return (None, None, *scaled)


def chunk_grads(loss: ChunkLoss, bounds: list[tuple[int, int]],
                inputs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """``(sum_chunks loss(s, e, inputs), its gradient with respect to each input)``, one chunk's graph at a time
    (fp32 or wider sums; an input no chunk reaches gets zeros)."""
    grads = [torch.zeros(t.shape, dtype=torch.promote_types(t.dtype, torch.float32), device=t.device)
             for t in inputs]
    total = torch.zeros((), dtype=grads[0].dtype if grads else torch.float32, device=inputs[0].device)
    for s, e in bounds:
        with torch.enable_grad():
            leaves = [t.detach().requires_grad_(True) for t in inputs]
            kl = loss(s, e, leaves)
            got = torch.autograd.grad(kl, leaves, allow_unused=True)
        for acc, g in zip(grads, got, strict=True):
            if g is not None:
                acc += g
        total += kl.detach()
    return total, grads


def chunk_bounds(Q: int, chunk: int) -> list[tuple[int, int]]:
    return [(s, min(s + chunk, Q)) for s in range(0, Q, max(1, chunk))]


# ---- dense attention (the warm-up's main attention) --------------------------------------------------------
def _dense_block(q_cHC: torch.Tensor, c_SC: torch.Tensor, w_uv_HVR: torch.Tensor, valid_cS: torch.Tensor,
                 scale: float, R: int) -> torch.Tensor:
    s = torch.einsum("chr,sr->chs", q_cHC, c_SC) * scale
    s = s.masked_fill(~valid_cS[:, None, :], float("-inf"))
    p = s.softmax(-1, dtype=torch.promote_types(s.dtype, torch.float32)).to(c_SC.dtype)
    o_lat = torch.einsum("chs,sr->chr", p, c_SC[:, :R])
    return torch.einsum("chr,hvr->chv", o_lat, w_uv_HVR)


def dense_latent_attention(q_BQHD: torch.Tensor, c_BSC: torch.Tensor, kv_b_weight: torch.Tensor,
                           q_pos_Q: torch.Tensor, doc_BS: torch.Tensor, scale: float, rope_dim: int) -> torch.Tensor:
    """Softmax attention of each query over every visible key (causal, same document), in the absorbed form
    over the latent: ``[B, Q, Hh, Dv]``, the same result as ``sparse_attention`` given every visible key.
    Queries go in blocks of about ``DENSE_BLOCK_ELEMS`` scores, each recomputed in backward."""
    from torch.utils.checkpoint import checkpoint

    B, Q, Hh, Dq = q_BQHD.shape
    S, C = c_BSC.shape[1:]
    R = C - rope_dim
    w = kv_b_weight.view(Hh, -1, R)
    w_uk, w_uv = w[:, :Dq - rope_dim], w[:, Dq - rope_dim:]
    block = max(1, DENSE_BLOCK_ELEMS // max(1, Hh * S))
    keys = torch.arange(S, device=q_BQHD.device)
    outs = []
    for b in range(B):
        rows = []
        for s, e in chunk_bounds(Q, block):
            pos = q_pos_Q[s:e]
            valid = (keys[None] <= pos[:, None]) & (doc_BS[b][None] == doc_BS[b, pos][:, None])
            q_abs = absorbed_query(q_BQHD[b, s:e], w_uk, rope_dim)
            grad = torch.is_grad_enabled() and (q_abs.requires_grad or c_BSC.requires_grad or w_uv.requires_grad)
            args = (q_abs, c_BSC[b], w_uv, valid, scale, R)
            rows.append(checkpoint(_dense_block, *args, use_reentrant=False) if grad else _dense_block(*args))
        outs.append(torch.cat(rows, dim=0))
    return torch.stack(outs)
