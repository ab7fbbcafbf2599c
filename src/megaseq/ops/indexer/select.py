"""The exact selection of op ``indexer_topk`` from the kernel's scores: candidates, certificate, re-check.

Shapes: c rows of one chunk, r rows of a sub-block, n pools scored, M candidates per row (sorted by the
kernel score ``L``, descending), K pools selected, W positions of a row's ambiguous band, D head dim,
I heads.

With ``|L - E| <= e`` per row (``score_error_bound``; E the fp32 score) the sorted candidates
split in three (positions 0-based, ``L_(K)`` the K-th largest):

- sure in: positions ``p < s``, where at most K pools (p included) have ``L >= L_p - 2e``: no pool can
  reach or tie ``E_p`` but those, so p is in the top K whatever the exact scores;
- sure out: ``L_p < L_(K) - 2e``: the K first positions all beat p strictly;
- the band ``[s, b)`` between them. Pools outside the candidates are sure out when the M-th candidate is
  (``b < M``, the certificate), or when every visible pool is a candidate.

The top K is then the sure-in pools plus the best ``K - s`` of the band by exact score with the lowest
pool index among ties (removing part of a top K from a set leaves the rest of it on top). When the band
holds exactly ``K - s`` pools (``b = K``) no exact score is needed; otherwise the band's fp32 scores are
computed with the reference's op order (fp32 matmul over the gathered keys, ``mul_(scale)``, ``relu_``,
the weighted head sum as a matmul: a Triton fp32 kernel summing in its own order can flip a row at an
fp32-level tie; ``benchmarks/results/kernels/indexer_topk/`` holds the GPU runs).
Rows that fail the certificate or hold a non-finite score go to the reference (the fallback). Rows with
fewer than K visible pools need no score: all of them plus the lowest-index invalid pools.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megaseq.ops.indexer import scoring as indexer_scoring
from megaseq.ops.workspace import TOPK_RECHECK_BYTES, indexer_topk_bytes

BIG = torch.iinfo(torch.int64).max
BAND: int = 32  # band positions re-checked per row (rows with a wider band re-check all M candidates)
RECHECK_BYTES: int = TOPK_RECHECK_BYTES  # one re-check sub-block (gathered fp32 keys [r, W, D], head scores [r, I, W])
F32_UNIT = 2.0**-24  # fp32 unit roundoff


@dataclass
class TopkStats:
    """Rows seen, rows with fewer than K visible pools (no scores needed), rows whose band needed exact
    scores, the widest such band, rows rescored by the fallback."""

    rows: int = 0
    few_pool_rows: int = 0
    exact_rows: int = 0
    band_max: int = 0
    fallback_rows: int = 0
    chunks: int = 0

    def reset(self) -> None:
        self.rows = self.few_pool_rows = self.exact_rows = self.band_max = self.fallback_rows = self.chunks = 0


STATS = TopkStats()


# ---- the error bound of the kernel's scores ------------------------------------------------------------------
def score_error_bound(q_cID: torch.Tensor, w_cI: torch.Tensor, key_dtype: torch.dtype,
                      key_norm_max: float | torch.Tensor, scale: float, split: bool) -> torch.Tensor:
    """Per row, a bound ``e [c]`` (float64) on ``|L - E|``: kernel scores vs the fp32 scores of the re-check.

    With ``A_h = ||q_h|| * max_p ||k_p||`` (Cauchy-Schwarz bounds ``sum_d |q_hd k_pd|`` by it):

    - operands: an operand exact in the low dtype (bf16 in bf16) has no error; a split one
      ``|x - hi - lo| <= u^2 |x| + t``, a rounded one ``u |x| + t`` (``u`` the low dtype's unit
      roundoff, 2^-8 for bf16; ``t`` its smallest normal, for flushed subnormals). The dot's error is then
      ``<= (e_q + e_k + e_q e_k) A_h + t sqrt(D) (||q_h|| + max ||k||)``, plus ``u^2 A_h`` for the dropped
      ``lo . lo`` when both are split;
    - tensor-core accumulation of ``D * (number of dots)`` products in fp32: taken as
      ``2 * terms * 2^-23 * A_h`` (products of bf16 are exact in fp32; the factor 2 covers truncating,
      non-IEEE accumulation; an assumption about the hardware, not a theorem);
    - relu is 1-Lipschitz; ``w * scale``, the product and the head sum in fp32: ``(I + 2) 2^-24`` of
      ``sum_h |w_h| scale |d_h|``;
    - the re-check's own fp32 error (dot of D terms, the scale, the head sum): ``(D + I + 3) 2^-24``.

    Summed with the weights: ``e = 1.05 * scale * sum_h |w_h| (c_rel A_h + abs_h)`` (5% for the rounding
    of this bound's own arithmetic).
    """
    from megaseq.ops.indexer import topk_kernel as kern

    c, I, D = q_cID.shape
    low = kern.low_dtype()
    u = torch.finfo(low).eps / 2  # unit roundoff: 2^-8 for bf16
    tiny = torch.finfo(low).tiny if not kern.INTERPRET else torch.finfo(low).smallest_normal * 2.0**-11
    sq, sk = kern.splits(q_cID.dtype, key_dtype, split)
    e_q = 0.0 if q_cID.dtype == low else (u * u if sq else u)
    e_k = 0.0 if key_dtype == low else (u * u if sk else u)
    dots = 1 + int(sk) + int(sq)
    c_rel = e_q + e_k + e_q * e_k + (u * u if sq and sk else 0.0)
    c_rel += 2 * D * dots * 2.0**-23 + (I + 2) * F32_UNIT * (1 + c_rel) + (D + I + 3) * F32_UNIT
    qn_cI = torch.linalg.vector_norm(q_cID, dim=-1, dtype=torch.float32).double()
    abs_cI = tiny * D**0.5 * (qn_cI + key_norm_max) * 1.1
    per_head = c_rel * qn_cI * key_norm_max + abs_cI
    return 1.05 * scale * (w_cI.double().abs() * per_head).sum(-1)


@dataclass
class _Band:
    """Per row of a chunk: the sure-in count ``first``, the band's end ``end`` (the band is ``[first, end)``), the
    certificate, whether the band needs exact scores, its width there (0 elsewhere), and whether it fits ``BAND``."""

    first_c: torch.Tensor
    end_c: torch.Tensor
    cert_c: torch.Tensor
    need_c: torch.Tensor
    width_c: torch.Tensor
    narrow_c: torch.Tensor


class Run:
    """The inputs of one call and the per-chunk steps (kernel, candidates, certificate, re-check, fallback)."""

    def __init__(self, q_QID, w_QI, keys_PD, ends_P, pool_doc_P, q_pos_Q, q_doc_Q, k, scale, split) -> None:
        self.q_QID, self.w_QI, self.keys_PD, self.ends_P = q_QID, w_QI, keys_PD, ends_P
        self.pool_doc_P, self.q_pos_Q, self.q_doc_Q = pool_doc_P, q_pos_Q, q_doc_Q
        self.k, self.scale, self.split = k, scale, split
        self.floor = torch.finfo(torch.float32).min
        self.keys_f32_PD = keys_PD.float()  # the re-check's keys, as the reference casts them
        # a 0-d float64 tensor, not a float: reading it back would be a host sync a call
        self.key_norm_max = torch.linalg.vector_norm(self.keys_f32_PD, dim=-1).max().double()

    def pools_scored(self, bounds: list[tuple[int, int]], visible: int | None = None) -> list[int]:
        """Per chunk ``[s, e)``, the pools its kernel scores: those ending at or before its last query (at least
        k). ``visible``: at least that count for the call's last query, where the caller knows it without reading
        anything back: a call of one chunk then needs no host sync; else every chunk's is read in one."""
        if visible is not None and len(bounds) == 1:
            return [max(self.k, min(visible, self.keys_PD.shape[0]))]
        last = torch.stack([self.q_pos_Q[s:e].max() for s, e in bounds])
        counts = torch.searchsorted(self.ends_P, last, right=True).tolist()
        return [max(self.k, n) for n in counts]

    def chunk(self, s: int, e: int, n: int, margin: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The selection of rows ``[s, e)`` from the scores of their first ``n`` pools (``pools_scored``)."""
        from megaseq.ops.indexer.topk_kernel import index_scores

        k, floor = self.k, self.floor
        pos_c, doc_c = self.q_pos_Q[s:e], self.q_doc_Q[s:e]
        L_cn = index_scores(self.q_QID[s:e], self.w_QI[s:e], self.keys_PD, self.ends_P, self.pool_doc_P, pos_c,
                            doc_c, n, self.scale, floor, self.split)
        M = min(k + margin, n)
        vals_cM, cand_cM = L_cn.topk(M, dim=-1)  # sorted, descending
        head_cK = L_cn[:, :k].clone()  # the few-pool rows' first k columns
        del L_cn
        bad_c = ~torch.isfinite(vals_cM).all(-1)
        few_c = (vals_cM[:, k - 1] == floor) & ~bad_c  # fewer than k visible pools
        many_c = ~few_c & ~bad_c
        band = self._band(s, e, vals_cM, M == n, many_c)
        redo_c = bad_c | (many_c & ~band.cert_c)
        # the sizes of every row set read back together: one host sync, then index lists without one
        num_few, num_need, num_narrow, band_max, num_redo = torch.stack(
            [few_c.sum(), band.need_c.sum(), band.narrow_c.sum(), band.width_c.max(), redo_c.sum()]).tolist()
        # every row's candidates as the selection where the band is exactly the free slots; the others below
        sel_cK = cand_cM[:, :k].sort(dim=-1).values
        if num_few:
            few = _rows_of(few_c, num_few)
            sel_cK[few] = few_pool_selection(head_cK[few], vals_cM[few], cand_cM[few], k, floor)
        del head_cK
        if num_need:
            STATS.exact_rows += num_need
            STATS.band_max = max(STATS.band_max, band_max)
            for mask, count, W in ((band.narrow_c, num_narrow, BAND),
                                   (band.need_c & ~band.narrow_c, num_need - num_narrow, M)):
                if count:
                    group = _rows_of(mask, count)
                    sel_cK[group] = self._band_selection(s + group, cand_cM[group], band.first_c[group],
                                                         band.end_c[group], min(W, M))
        STATS.rows += e - s
        STATS.chunks += 1
        STATS.few_pool_rows += num_few
        if num_redo:
            redo = _rows_of(redo_c, num_redo)
            STATS.fallback_rows += num_redo
            sel_cK[redo] = self._fallback(s + redo, e - s, margin)
        ok_cK = (self.ends_P[sel_cK] <= pos_c[:, None]) & (self.pool_doc_P[sel_cK] == doc_c[:, None])
        return sel_cK, ok_cK

    def _band(self, s: int, e: int, vals_cM: torch.Tensor, all_pools: bool, many_c: torch.Tensor) -> _Band:
        """The certificate and the ambiguous band of every row of a chunk, on the device: computed for all rows
        (a few-pool or non-finite row's are not used), so the chunk reads its row sets back in one sync."""
        k, M = self.k, vals_cM.shape[1]
        err_c = score_error_bound(self.q_QID[s:e], self.w_QI[s:e], self.keys_PD.dtype, self.key_norm_max,
                                  self.scale, self.split)
        neg_cM = -vals_cM.double()  # ascending
        two_e = 2 * err_c[:, None]
        first_c = (torch.searchsorted(neg_cM, neg_cM + two_e, right=True) <= k).sum(-1)  # sure in: p < first
        end_c = torch.searchsorted(neg_cM, neg_cM[:, k - 1:k] + two_e, right=True).squeeze(-1)  # band: p < end
        cert_c = (end_c < M) | (vals_cM[:, -1] == self.floor) | all_pools
        need_c = many_c & cert_c & (end_c > k)
        width_c = torch.where(need_c, end_c - first_c, 0)
        return _Band(first_c, end_c, cert_c, need_c, width_c, need_c & (width_c <= BAND))

    def _band_selection(self, rows_r, cand_rM, first_r, end_r, W: int) -> torch.Tensor:
        """Sure-in pools + the best of the band ``[first, end)`` by fp32 score (ties: lowest pool index)."""
        k, M = self.k, cand_rM.shape[1]
        out = torch.empty(len(rows_r), k, dtype=torch.int64, device=cand_rM.device)
        D, I = self.keys_PD.shape[1], self.q_QID.shape[1]
        block = max(1, RECHECK_BYTES // (W * (4 * D + 4 * I + 64)))
        offs_W = torch.arange(W, device=cand_rM.device)
        for b0 in range(0, len(rows_r), block):
            sl = slice(b0, b0 + block)
            first, end, cand = first_r[sl], end_r[sl], cand_rM[sl]
            in_band = offs_W[None] < (end - first)[:, None]
            band_rW = cand.gather(-1, (first[:, None] + offs_W).clamp_(max=M - 1)).masked_fill_(~in_band, BIG)
            band_rW, perm = band_rW.sort(dim=-1)  # pool order: the stable sort below keeps it among ties
            exact_rW = self._exact(rows_r[sl], band_rW.clamp(max=self.keys_PD.shape[0] - 1))
            exact_rW.masked_fill_(~in_band.gather(-1, perm), -float("inf"))
            order = exact_rW.sort(dim=-1, descending=True, stable=True).indices
            best_rW = band_rW.gather(-1, order).masked_fill_(offs_W[None] >= (k - first)[:, None], BIG)
            sure_rK = cand[:, :k].masked_fill(torch.arange(k, device=cand.device)[None] >= first[:, None], BIG)
            out[sl] = torch.cat([sure_rK, best_rW], dim=-1).sort(dim=-1).values[:, :k]
        return out

    def _exact(self, rows_r: torch.Tensor, pools_rW: torch.Tensor) -> torch.Tensor:
        """fp32 scores ``[r, W]`` of rows against pools, in the reference's op order."""
        keys_rDW = self.keys_f32_PD[pools_rW].transpose(1, 2)
        scores_rIW = torch.matmul(self.q_QID[rows_r].float(), keys_rDW).mul_(self.scale).relu_()
        return torch.matmul(self.w_QI[rows_r].float().unsqueeze(-2), scores_rIW).squeeze(-2)

    def _fallback(self, rows_f: torch.Tensor, chunk_rows: int, margin: int) -> torch.Tensor:
        """The reference on the rows that failed the certificate, in chunks within this call's working set."""
        P, I, D = self.keys_PD.shape[0], self.q_QID.shape[1], self.q_QID.shape[2]
        budget = indexer_topk_bytes(chunk_rows, P, I, self.k, margin, D)
        ref_chunk = max(1, budget // indexer_scoring.indexer_scoring_bytes(1, P, I, self.k))
        sel_fK, _ = indexer_scoring.select_pools(
            self.q_QID[rows_f], self.w_QI[rows_f], self.keys_PD, self.ends_P, self.pool_doc_P,
            self.q_pos_Q[rows_f], self.q_doc_Q[rows_f], self.k, self.scale, query_chunk=ref_chunk)
        return sel_fK


def _rows_of(mask: torch.Tensor, count: int) -> torch.Tensor:
    """The indices where ``mask`` (1-d) holds, ascending, given their number: no host sync (``nonzero`` reads
    the count back)."""
    return torch.nonzero_static(mask, size=count).squeeze(-1)


def few_pool_selection(head_rK: torch.Tensor, vals_rM: torch.Tensor, cand_rM: torch.Tensor, k: int,
                       floor: float) -> torch.Tensor:
    """Rows with fewer than k visible pools: all of them (all among the candidates) plus the lowest-index
    invalid pools, as the reference's tie rule picks at the cut ``floor``; at most v of the first k columns
    are visible, so the invalid ones needed lie there (``head_rK`` = those columns of the scores)."""
    visible_rM = vals_rM > floor
    room_r1 = k - visible_rM.sum(-1, keepdim=True)
    invalid_rK = head_rK == floor
    take_rK = invalid_rK & (invalid_rK.cumsum(-1) <= room_r1)
    col_K = torch.arange(k, device=head_rK.device)
    keys = torch.cat([cand_rM.masked_fill(~visible_rM, BIG), col_K.expand_as(take_rK).masked_fill(~take_rK, BIG)], -1)
    return keys.sort(dim=-1).values[:, :k]
