"""One DSA layer's indexer objective: the formula of ``indexer_kl`` over this layer's queries, keys and pools.

Shapes: B batch, Q this rank's queries, S keys (the whole sequence), Hh heads, C latent width, I indexer
heads, D indexer head dim, P complete pools, kp tokens per pool, K selected pools per query, W slots.

The dense warm-up: ``indexer_loss(layer, prep, q, c, w)`` returns ``sum over this rank's queries of
KL(target || indexer)`` over every visible key, with a graph to the indexer's parameters only: the pooled keys,
the head weights and ``wq_b``'s weight (merged with its adapter, if any) enter ``indexer_kl.ChunkedKL``; the main
attention's queries, latents and ``kv_b_proj`` weight are read detached. The layer attaches it with
``coef * scale`` (``AttachLoss``).

The sparse stage: ``SparseObjective`` runs the same formula over the selected slots in the backward, right after
the layer's attention, and hands the same inputs their gradient times ``coef * scale``. Its target is the
head-summed probabilities the attention's backward left (``ops.sparse_mla.reference.HeadProbs``), else op
``indexer_target`` given the attention's per-head log-sum-exp ``lse [B, Q, Hh]`` (base 2, what
``sparse_attention`` computed over the same queries, latents, selection and scale and hands out with
``return_lse``): each chunk passes its rows ``lse[b, s:e]``, and the target is one pass over the selected latents.
That op's implementation (the Triton kernel under ``model.kernels fast`` on a GPU, else the torch reference) is
chosen once per batch row and runs every chunk of the row, whose size is ``ops.workspace.indexer_kl_chunk`` of
that implementation's bytes (``fused_target``; a given target counts as the kernel's), and of op
``indexer_kl``'s (``fused_kl``: its Triton kernel where ``model.kernels`` prefers it).

Context parallelism: queries are this rank's, keys the gathered sequence's (``Indexer.prepare`` gathers them
with a graph: the pooled keys' gradient goes back to the ranks that own the tokens through the gather's
reduce-scatter). Sequence segments: the same, the keys of earlier segments a leaf of the segment's rerun.

Also measured (no gradient), into ``layer.indexer.stats``: the summed KL, the queries, and the recall of the
dense attention's top-K pools: every query in the warm-up (the indexer's own top-K against the target's),
``ops.workspace.RECALL_ROWS`` evenly spaced queries per batch row in the sparse stage (their selection against
dense attention's top-K over every visible key).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from megaseq.models.common import indexer_kl as kl
from megaseq.models.common import rope
from megaseq.models.common.lora import linear_weight
from megaseq.ops import dispatch, workspace
from megaseq.ops.amp import compute_dtype


def indexer_loss(layer: Any, prep: Any, q_BQHD: torch.Tensor, c_BSC: torch.Tensor,
                 kv_b_weight: torch.Tensor) -> torch.Tensor:
    """The dense warm-up's summed KL of this layer's queries, with its gradient taken in the forward (see the
    module docstring; the sparse stage's is ``SparseObjective``)."""
    w_uk, q_det, c_det, cd = _detached(layer, q_BQHD, c_BSC, kv_b_weight)
    wq = linear_weight(layer.indexer.wq_b)
    total = None
    with torch.autocast(q_BQHD.device.type, enabled=False):
        for b in range(q_BQHD.shape[0]):
            if prep.pools[b][0].shape[0] == 0:  # no complete pool in this row (its documents are short): no term
                continue
            row = _Row(layer, prep, b, q_det, c_det, w_uk, None, cd)
            part = kl.ChunkedKL.apply(row.loss, row.bounds(), row.keys_PD, prep.weights_BQI[b], wq)
            total = part if total is None else total + part
    return total if total is not None else torch.zeros((), dtype=cd, device=q_BQHD.device)


def _detached(layer: Any, q_BQHD: torch.Tensor, c_BSC: torch.Tensor,
              kv_b_weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.dtype]:
    """The target's inputs, detached: ``W_uk [Hh, Dn, R]``, the queries and the latents in the attention's work
    dtype (the queries'; the target's softmax and sums run in fp32, the compute dtype returned last)."""
    Hh, Dq = q_BQHD.shape[2:]
    R = c_BSC.shape[-1] - layer.rope_dim
    wd = q_BQHD.dtype
    w_uk = kv_b_weight.detach().to(wd).view(Hh, -1, R)[:, :Dq - layer.rope_dim]
    return w_uk, q_BQHD.detach(), c_BSC.detach().to(wd), compute_dtype(wd)


class SparseObjective:
    """The sparse stage's objective of one layer, computed in the backward right after the attention's.

    ``attach(q)`` hands the attention its queries through ``_AfterAttention``, an identity whose backward runs
    once the attention's backward has given the queries their gradient. By then the attention has left its
    head-summed probabilities in ``head_probs`` (``ops.sparse_mla.reference.HeadProbs``: ``absorbed`` and
    ``triton`` recompute them in their backward anyway), so the target is read, not computed again; where they
    are not there (``torch_masked``, or the attention's output got no gradient) op ``indexer_target`` makes them
    from ``lse``, as ``indexer_loss`` does. The KL and its gradient are then taken chunk by chunk
    (``indexer_kl.chunk_grads``), the gradient times ``coef * scale`` handed to the indexer's inputs, the KL and
    the recall into ``layer.indexer.stats``. The term's value is not part of the step's loss (as with
    ``AttachLoss``); the metrics read it from the stats after the backward."""

    def __init__(self, layer: Any, prep: Any, q_BQHD: torch.Tensor, c_BSC: torch.Tensor,
                 kv_b_weight: torch.Tensor, idx_BQW: torch.Tensor) -> None:
        from megaseq.ops.sparse_mla.reference import HeadProbs

        self.layer, self.prep, self.idx = layer, prep, idx_BQW
        self.w_uk, self.q_det, self.c_det, self.cd = _detached(layer, q_BQHD, c_BSC, kv_b_weight)
        self.rows = [b for b in range(q_BQHD.shape[0]) if prep.pools[b][0].shape[0] > 0]  # rows with a pool
        self.head_probs = HeadProbs()
        self.lse_BQH: torch.Tensor | None = None  # the attention's, set once it has run

    def attach(self, q_BQHD: torch.Tensor) -> torch.Tensor:
        """``q`` for the attention, carrying the objective (``q`` itself where no row has a complete pool)."""
        if not self.rows:
            return q_BQHD
        wq = linear_weight(self.layer.indexer.wq_b)
        leaves = [self.prep.pools[b][0] for b in self.rows] + [self.prep.weights_BQI, wq]
        return _AfterAttention.apply(self, q_BQHD, *leaves)

    def grads(self, leaves: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
        """The objective's gradient times ``coef * scale`` for each of ``attach``'s leaves."""
        ix = self.layer.indexer
        *keys, weights_BQI, wq = leaves
        given = self.head_probs.m_BQW
        self.head_probs.m_BQW = None
        g_keys, g_weights, g_wq = [], torch.zeros_like(weights_BQI), torch.zeros_like(wq)
        coef = ix.kl_coef * ix.kl_scale
        with torch.autocast(self.q_det.device.type, enabled=False):
            for b, keys_PD in zip(self.rows, keys, strict=True):
                row = _Row(self.layer, self.prep, b, self.q_det, self.c_det, self.w_uk, self.idx, self.cd,
                           self.lse_BQH, None if given is None else given[b])
                _, (gk, gw, gq) = kl.chunk_grads(row.loss, row.bounds(), [keys_PD, weights_BQI[b], wq])
                row.sampled_recall()
                g_keys.append((gk * coef).to(keys_PD.dtype))
                g_weights[b] = gw * coef
                g_wq += gq * coef
        return [*g_keys, g_weights, g_wq]


class _AfterAttention(torch.autograd.Function):
    """The queries unchanged; the backward passes their gradient on and adds the objective's to the leaves."""

    @staticmethod
    def forward(ctx, objective: SparseObjective, q_BQHD: torch.Tensor, *leaves: torch.Tensor) -> torch.Tensor:
        ctx.objective = objective
        ctx.save_for_backward(*leaves)
        return q_BQHD.view_as(q_BQHD)

    @staticmethod
    def backward(ctx, grad_q: torch.Tensor):
        objective, ctx.objective = ctx.objective, None
        with torch.profiler.record_function("indexer_objective"):  # its own row in a profile of the step
            grads = objective.grads(ctx.saved_tensors)
        return None, grad_q, *grads


class _Row:
    """One batch row: its pools, its target inputs (detached) and the chunk loss ``ChunkedKL`` calls."""

    def __init__(self, layer: Any, prep: Any, b: int, q_det: torch.Tensor, c_det: torch.Tensor,
                 w_uk: torch.Tensor, idx_BQW: torch.Tensor | None, cd: torch.dtype,
                 lse_BQH: torch.Tensor | None = None, given_QW: torch.Tensor | None = None) -> None:
        ix = layer.indexer
        self.ix, self.b, self.cd, self.scale, self.Dr = ix, b, cd, layer.scaling, layer.rope_dim
        self.keys_PD, tok_Pk = prep.pools[b]
        self.pools = kl.Pools(tok_Pk, prep.doc_BS[b])
        self.q_resid = prep.q_resid_BQR[b]
        self.q_pos = prep.q_pos_Q
        self.rot = None if prep.cos is None else (prep.cos[b].unsqueeze(1), prep.sin[b].unsqueeze(1))
        self.q_det, self.c_det, self.w_uk = q_det[b], c_det[b], w_uk
        self.idx = None if idx_BQW is None else idx_BQW[b]
        self.lse_QH = None if lse_BQH is None or idx_BQW is None else lse_BQH[b]  # the attention's, base 2
        self.given_QW = given_QW  # op indexer_target's result, from the attention's backward (HeadProbs)
        self.K = min(ix.index_topk // ix.kpool, tok_Pk.shape[0])
        tail = ix.kpool - 1 if ix.select_tail and ix.kpool > 1 else 0
        self.num_pools = 0 if self.idx is None else (self.idx.shape[-1] - tail) // ix.kpool
        self._target: dispatch.Impl | None = None
        self._kl: dispatch.Impl | None = None

    def bounds(self) -> list[tuple[int, int]]:
        """The row's query chunks, sized for the implementation of the target that runs them (``target_impl``)."""
        Q, S, Hh = self.q_det.shape[0], self.c_det.shape[0], self.q_det.shape[1]
        P, I, D, C = self.keys_PD.shape[0], self.ix.n_heads, self.ix.head_dim, self.c_det.shape[-1]
        size = torch.finfo(self.cd).bits // 8
        width = self.q_resid.shape[-1]
        if self.idx is None:
            rows = workspace.indexer_kl_chunk(Hh, S, I, P, D, itemsize=size, query_width=width)
        else:
            W = self.idx.shape[-1]
            # a given target is a view: at most the kernel's [c, W] output is counted for it
            fused = self.given_QW is not None or not self.target_impl().reference
            rows = workspace.indexer_kl_chunk(Hh, W, I, self.num_pools, D, gathered=W, latent=C, itemsize=size,
                                              gathered_itemsize=self.c_det.element_size(), fused_target=fused,
                                              query_width=width, given_lse=self.lse_QH is not None,
                                              fused_kl=not self.kl_impl().reference, num_pools=P,
                                              keys_itemsize=self.keys_PD.element_size())
        if self.ix.query_chunk is not None:
            rows = min(rows, int(self.ix.query_chunk))
        return kl.chunk_bounds(Q, rows)

    def target_impl(self) -> dispatch.Impl:
        """Op ``indexer_target``'s implementation for every chunk of this row, chosen once (on the row's first
        query: the dispatcher's order under ``model.kernels``, the same checks on every chunk's arguments)."""
        if self._target is None:
            q_abs = kl.absorbed_query(self.q_det[:1], self.w_uk, self.Dr)
            lse = None if self.lse_QH is None else self.lse_QH[:1]
            self._target = dispatch.select("indexer_target", self.ix.layer, q_abs, self.c_det, self.idx[:1],
                                           self.scale, lse=lse)
        return self._target

    def kl_impl(self) -> dispatch.Impl:
        """Op ``indexer_kl``'s implementation for every chunk of this row (sparse stage), chosen once before the
        chunks are sized for it: the dispatcher's order under ``model.kernels`` asked with one row of the chunks'
        dtypes and devices (the queries in the latents' dtype, the head weights in the work dtype, the keys)."""
        if self._kl is None:
            ix, K, dev = self.ix, self.num_pools, self.c_det.device
            q = torch.zeros(1, ix.n_heads, ix.head_dim, dtype=self.c_det.dtype, device=dev)
            w = torch.zeros(1, ix.n_heads, dtype=self.cd, device=dev)
            pools = torch.zeros(1, K, dtype=torch.int64, device=dev)
            target = torch.zeros(1, K, dtype=torch.float32, device=dev)
            cand = torch.zeros(1, K, dtype=torch.bool, device=dev)
            self._kl = dispatch.select("indexer_kl", ix.layer, q, w, self.keys_PD, pools, target, cand,
                                       ix.softmax_scale)
        return self._kl

    def _queries(self, s: int, e: int, wq: torch.Tensor) -> torch.Tensor:
        """The indexer's queries of the chunk with a graph to ``wq``, in the attention's work dtype (bf16 under
        autocast: the selection's operands; float64 in the exact tests)."""
        ix, md = self.ix, self.c_det.dtype
        q_cID = F.linear(self.q_resid[s:e].to(md), wq.to(md)).view(e - s, ix.n_heads, ix.head_dim)
        if self.rot is not None:
            q_cID = rope.apply(q_cID, self.rot[0][s:e].to(md), self.rot[1][s:e].to(md))
        return q_cID

    def loss(self, s: int, e: int, leaves: list[torch.Tensor]) -> torch.Tensor:
        keys_PD, w_QI, wq = leaves
        q_cID, w_cI = self._queries(s, e, wq), w_QI[s:e].to(self.cd)
        with torch.no_grad():
            given = self.idx is not None and self.given_QW is not None
            q_abs = None if given else kl.absorbed_query(self.q_det[s:e], self.w_uk, self.Dr)
            if self.idx is None:
                target, cand = kl.dense_target(q_abs, self.c_det, self.q_pos[s:e], self.pools, self.scale)
                pools = None
            else:
                if given:
                    target, cand = kl.sparse_target(None, self.c_det, self.idx[s:e], self.ix.kpool, self.num_pools,
                                                    self.scale, given=self.given_QW[s:e])
                else:
                    lse = None if self.lse_QH is None else self.lse_QH[s:e]
                    target, cand = kl.sparse_target(q_abs, self.c_det, self.idx[s:e], self.ix.kpool,
                                                    self.num_pools, self.scale, probs=self.target_impl().fn, lse=lse)
                pools = self._selected_pools(self.idx[s:e])
        if pools is None:
            score = kl.index_scores(q_cID, w_cI, keys_PD[:target.shape[1]], self.ix.softmax_scale)
            rows_kl = kl.kl_rows(target, score, cand)
        else:  # op indexer_kl (the implementation the chunks were sized for): the selected keys gathered by pool,
            # the scores and the KL, or one fused kernel
            rows_kl = self.kl_impl().fn(q_cID, w_cI, keys_PD, pools, target, cand, self.ix.softmax_scale)
        with torch.no_grad():
            if pools is None:
                hits = kl.recall_counts(target, kl.topk_mask(score.detach(), cand, self.K), cand, self.K)
            else:
                z = rows_kl.new_zeros(())
                hits = (z, z, z)
            self.ix.stats.add(rows_kl.detach().sum(), cand.any(-1).sum(), *hits)
        return rows_kl.sum()

    def _selected_pools(self, idx_cW: torch.Tensor) -> torch.Tensor:
        """Pool index of each selected pool slot group ``[c, K]`` (0 for an empty one, masked by the target)."""
        first_P = self.pools.tok_Pk[:, 0].contiguous()
        tok = idx_cW[:, :self.num_pools * self.ix.kpool:self.ix.kpool].long()
        pool = torch.searchsorted(first_P, tok.clamp_min(0))
        return pool.clamp_max(first_P.shape[0] - 1)

    @torch.no_grad()
    def sampled_recall(self) -> None:
        """The sparse stage's recall on ``RECALL_ROWS`` evenly spaced queries: their selected pools against
        the dense attention's top-K pools over every visible key, ``indexer_recall_rows`` rows at a time."""
        Q, Hh, S = self.q_det.shape[0], self.q_det.shape[1], self.c_det.shape[0]
        # evenly spaced and distinct (at most Q of them: their spacing is 1 or more, so none round together), made
        # on the device: no unique() and no copy from pageable host memory, either of which would sync the stream
        every = torch.linspace(0, Q - 1, min(workspace.RECALL_ROWS, Q), device=self.q_det.device).round().long()
        # the scores' softmax is fp32 (or the compute dtype where wider), as the plan counts them
        g = workspace.indexer_recall_rows(Hh, S, every.shape[0], max(4, torch.finfo(self.cd).bits // 8))
        for i in range(0, every.shape[0], g):
            rows = every[i:i + g]
            q_abs = kl.absorbed_query(self.q_det[rows], self.w_uk, self.Dr)
            # every key and pool, masked per query: the same target without reading the rows' last position back
            target, cand = kl.dense_target(q_abs, self.c_det, self.q_pos[rows], self.pools, self.scale,
                                           bounded=False)
            idx = self.idx[rows]
            ok = idx[:, :self.num_pools * self.ix.kpool:self.ix.kpool] >= 0
            pools = self._selected_pools(idx)
            chosen = torch.zeros_like(cand)
            n = cand.shape[1]
            chosen.scatter_(-1, pools.clamp_max(max(n - 1, 0)), ok & (pools < n))
            z = target.new_zeros(())
            self.ix.stats.add(z, z, *kl.recall_counts(target, chosen & cand, cand, self.K))
