"""One DSA layer's indexer objective: the formula of ``indexer_kl`` over this layer's queries, keys and pools.

Shapes: B batch, Q this rank's queries, S keys (the whole sequence), Hh heads, C latent width, I indexer
heads, D indexer head dim, P complete pools, kp tokens per pool, K selected pools per query, W slots.

``indexer_loss(layer, prep, q, c, w, idx, lse)`` returns ``sum over this rank's queries of KL(target || indexer)``
with a graph to the indexer's parameters only: the pooled keys, the head weights and ``wq_b``'s weight (merged
with its adapter, if any) enter ``indexer_kl.ChunkedKL``; the main attention's queries, latents and
``kv_b_proj`` weight are read detached. ``idx`` None: the dense warm-up's target (every visible key), else
the sparse stage's (the selected slots). The layer attaches it with ``coef * scale`` (``AttachLoss``).

The sparse stage's target is op ``indexer_target`` given the attention's per-head log-sum-exp ``lse [B, Q, Hh]``
(base 2, what ``sparse_attention`` computed over the same queries, latents, selection and scale and hands out with
``return_lse``): each chunk passes its rows ``lse[b, s:e]``, and the target is one pass over the selected latents
(``lse`` None: the target computes its own, two passes). Its implementation (the Triton kernel under ``model.kernels
fast`` on a GPU, else the torch reference) is chosen once per batch row and runs every chunk of the row, whose
size is ``ops.workspace.indexer_kl_chunk`` of that implementation's bytes (``fused_target``), and of op
``indexer_kl``'s (``fused_kl``: its Triton kernel where ``model.kernels`` prefers it).

Context parallelism: queries are this rank's, keys the gathered sequence's (``Indexer.prepare`` gathers them
with a graph: the pooled keys' gradient goes back to the ranks that own the tokens through the gather's
reduce-scatter). Sequence segments: the same, the keys of earlier segments a leaf of the segment's rerun.

Also measured (no gradient), into ``layer.indexer.stats``: the summed KL, the queries, and the recall of the
dense attention's top-K pools: every query in the warm-up (the indexer's own top-K against the target's),
``indexer_kl.RECALL_ROWS`` evenly spaced queries per batch row in the sparse stage (their selection against
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


def indexer_loss(layer: Any, prep: Any, q_BQHD: torch.Tensor, c_BSC: torch.Tensor, kv_b_weight: torch.Tensor,
                 idx_BQW: torch.Tensor | None, lse_BQH: torch.Tensor | None = None) -> torch.Tensor:
    """The summed KL of this layer's queries (see the module docstring)."""
    ix = layer.indexer
    B, Q, Hh, Dq = q_BQHD.shape
    cd = compute_dtype(q_BQHD.dtype)
    Dr = layer.rope_dim
    R = c_BSC.shape[-1] - Dr
    # the target's matmuls in the attention's work dtype (the queries'), its softmax and sums in fp32
    wd = q_BQHD.dtype
    w_uk = kv_b_weight.detach().to(wd).view(Hh, -1, R)[:, :Dq - Dr]
    q_det, c_det = q_BQHD.detach(), c_BSC.detach().to(wd)
    wq = linear_weight(ix.wq_b)
    total = None
    with torch.autocast(q_BQHD.device.type, enabled=False):
        for b in range(B):
            if prep.pools[b][0].shape[0] == 0:  # no complete pool in this row (its documents are short): no term
                continue
            row = _Row(layer, prep, b, q_det, c_det, w_uk, idx_BQW, cd, lse_BQH)
            part = kl.ChunkedKL.apply(row.loss, row.bounds(), row.keys_PD, prep.weights_BQI[b], wq)
            if idx_BQW is not None:
                row.sampled_recall()
            total = part if total is None else total + part
    return total if total is not None else torch.zeros((), dtype=cd, device=q_BQHD.device)


class _Row:
    """One batch row: its pools, its target inputs (detached) and the chunk loss ``ChunkedKL`` calls."""

    def __init__(self, layer: Any, prep: Any, b: int, q_det: torch.Tensor, c_det: torch.Tensor,
                 w_uk: torch.Tensor, idx_BQW: torch.Tensor | None, cd: torch.dtype,
                 lse_BQH: torch.Tensor | None = None) -> None:
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
            fused = not self.target_impl().reference
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
            q_abs = kl.absorbed_query(self.q_det[s:e], self.w_uk, self.Dr)
            if self.idx is None:
                target, cand = kl.dense_target(q_abs, self.c_det, self.q_pos[s:e], self.pools, self.scale)
                pools = None
            else:
                lse = None if self.lse_QH is None else self.lse_QH[s:e]
                target, cand = kl.sparse_target(q_abs, self.c_det, self.idx[s:e], self.ix.kpool, self.num_pools,
                                                self.scale, probs=self.target_impl().fn, lse=lse)
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
        the dense attention's top-K pools over every visible key."""
        Q = self.q_det.shape[0]
        # evenly spaced and distinct (at most Q of them: their spacing is 1 or more, so none round together), made
        # on the device: no unique() and no copy from pageable host memory, either of which would sync the stream
        rows = torch.linspace(0, Q - 1, min(kl.RECALL_ROWS, Q), device=self.q_det.device).round().long()
        q_abs = kl.absorbed_query(self.q_det[rows], self.w_uk, self.Dr)
        target, cand = kl.dense_target(q_abs, self.c_det, self.q_pos[rows], self.pools, self.scale)
        idx = self.idx[rows]
        ok = idx[:, :self.num_pools * self.ix.kpool:self.ix.kpool] >= 0
        pools = self._selected_pools(idx)
        chosen = torch.zeros_like(cand)
        n = cand.shape[1]
        chosen.scatter_(-1, pools.clamp_max(max(n - 1, 0)), ok & (pools < n))
        z = target.new_zeros(())
        self.ix.stats.add(z, z, *kl.recall_counts(target, chosen & cand, cand, self.K))
