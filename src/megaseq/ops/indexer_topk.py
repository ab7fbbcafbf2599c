"""Op ``indexer_topk``: the DSA lightning indexer's pool selection, scored on tensor cores, selected exactly.

Shapes: Q queries, P complete pools, I indexer heads, D indexer head dim, K pools selected per query
(``min(num_select, P)``), c query rows of one chunk, n pools scored for the chunk (its causal prefix),
M = min(K + margin, n) candidates per row, r rows of a sub-block.

Contract (``megaseq.memory.indexer_scoring.select_pools``, registered here as the reference
``torch_fp32``): ``index[q, p] = sum_h w[q, h] * relu(scale * q[q, h] . k[p])`` over the pools visible to
the query (pool end at or before it, same document; the others score the dtype's min), each row's top-K
with ties to the lowest pool index, returned ascending, with the validity of each pick.

The fast implementation ``triton`` computes the same selection in four steps per chunk of rows:

1. ``indexer_topk_kernel.index_scores``: the scores ``L [c, n]`` on tensor cores (bf16 operands, an fp32
   operand split into bf16 ``hi + lo``, fp32 accumulation), masked as the reference; no ``[c, I, n]``.
2. Candidates: ``torch.topk(L, M)``.
3. Re-check: ``indexer_topk_kernel.recheck_scores``, the candidates' scores ``E`` recomputed in fp32
   arithmetic (fp32 inputs, IEEE fp32 dots, ``* scale``, relu, the weighted head sum; keys gathered in
   registers), top-K of ``E`` with the lowest-index rule.
4. Certificate: with ``|L - E| <= e`` per row (``score_error_bound``), every pool outside the candidates has
   ``E <= t + e`` where ``t`` is the M-th largest ``L``; when ``t + e < E_K`` (the K-th largest exact
   candidate score) none of them can enter the top-K, not even by a tie, so step 3's pick is the exact
   top-K. It also holds when every visible pool is a candidate. Rows that fail go to the fallback: the
   reference on those rows. Rows with fewer than K visible pools need no scores: the reference picks all
   visible pools plus the lowest-index invalid ones, which lie in the first K columns.

So the selection equals fp32 scoring exactly: pools outside the candidates are excluded by a proof,
and the pick among candidates uses fp32 scores computed as the reference does. "fp32 scoring" is the
re-check's: cuBLAS (or the CPU BLAS) sums the reference's ``[c * I, D] x [D, n]`` GEMM in its own order,
so the two can differ in the last bit, and a tie at that level (1e-7 relative) can go either way, as
between two chunkings of the reference itself. Rows with a non-finite
candidate score go to the fallback.

Memory: ``indexer_topk_bytes`` (chunk rows from ``resolve_query_chunk``, ``SCORING_BUDGET_BYTES`` when no
chunk is given). The fallback scores its rows in chunks no larger than the main working set.
``STATS`` counts rows, few-pool rows and fallback rows since the last ``STATS.reset()``.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass

import torch

from megaseq.memory import indexer_scoring
from megaseq.ops import dispatch

MARGIN: int = 32  # candidates beyond K per row
SPLIT: bool = True  # split fp32 operands into bf16 hi + lo (False: round them to bf16, a 64x looser bound)
SCORING_BUDGET_BYTES: int = 2 << 30  # one chunk's working set when no query_chunk is given
RECHECK_ROWS: int = 16384  # rows per re-check sub-block (the sort and tie masks of [r, M])
DTYPES = (torch.float32, torch.bfloat16)
F32_UNIT = 2.0**-24  # fp32 unit roundoff


@dataclass
class TopkStats:
    """Rows seen, rows with fewer than K visible pools (no scores needed), rows rescored by the fallback."""

    rows: int = 0
    few_pool_rows: int = 0
    fallback_rows: int = 0
    chunks: int = 0

    def reset(self) -> None:
        self.rows = self.few_pool_rows = self.fallback_rows = self.chunks = 0


STATS = TopkStats()


# ---- memory ------------------------------------------------------------------------------------------------
def indexer_topk_bytes(query_chunk: int, num_pools: int, num_heads: int, num_select: int, margin: int = MARGIN,
                       head_dim: int = 128) -> int:
    """Peak bytes of one chunk of ``triton`` beyond its inputs, for the planner.

    Per row of the chunk: the scores ``L [P]`` fp32 (4P); the candidates' values fp32 and indices int64
    (12M), the few-pool keys (int64, 8(M + K)) and the selection and validity (9K). Per row of one
    re-check sub-block (``RECHECK_ROWS`` rows at most): the sorted candidates, their permutation and
    values (20M), the exact scores ``E`` (4M) and the tie-break masks, ranks and picks
    (``topk_lowest_index_ties``, about 24M). The candidates' keys are gathered in the kernel's
    registers (never ``[M, D]`` in memory). ``num_heads`` and ``head_dim`` do not enter: no
    ``[c, I, P]`` head scores exist. The fallback's chunks stay within this total (``_fallback``).
    """
    del num_heads, head_dim
    P, K = num_pools, min(num_select, num_pools)
    M = min(K + margin, P)
    per_row = 4 * P + 12 * M + 8 * (M + K) + 9 * K
    per_recheck_row = 48 * M
    return query_chunk * per_row + min(query_chunk, RECHECK_ROWS) * per_recheck_row


def resolve_query_chunk(query_chunk: int | None, num_pools: int, num_heads: int, num_select: int,
                        margin: int = MARGIN, head_dim: int = 128) -> int:
    """Rows per chunk: ``query_chunk`` when given, else as many as fit ``SCORING_BUDGET_BYTES``."""
    if query_chunk is not None:
        return max(1, int(query_chunk))
    fixed = indexer_topk_bytes(0, num_pools, num_heads, num_select, margin, head_dim)
    one = indexer_topk_bytes(1, num_pools, num_heads, num_select, margin, head_dim) - fixed
    recheck = indexer_topk_bytes(RECHECK_ROWS, num_pools, num_heads, num_select, margin, head_dim)
    recheck -= RECHECK_ROWS * one
    return max(1, (SCORING_BUDGET_BYTES - recheck) // one)


# ---- the error bound of the kernel's scores ------------------------------------------------------------------
def score_error_bound(q_cID: torch.Tensor, w_cI: torch.Tensor, key_dtype: torch.dtype, key_norm_max: float,
                      scale: float, split: bool) -> torch.Tensor:
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
    from megaseq.ops import indexer_topk_kernel as kern

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


# ---- the op --------------------------------------------------------------------------------------------------
@dispatch.register("indexer_topk", "torch_fp32", reference=True)
def indexer_topk_reference(*args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """``indexer_scoring.select_pools`` unchanged (looked up at call time, so a patched one runs)."""
    kwargs.pop("margin", None)
    kwargs.pop("split", None)
    return indexer_scoring.select_pools(*args, **kwargs)


def indexer_topk_supports(q_QID: torch.Tensor, weights_QI: torch.Tensor, keys_PD: torch.Tensor,
                          pool_end_P: torch.Tensor, pool_doc_P: torch.Tensor, q_pos_Q: torch.Tensor,
                          q_doc_Q: torch.Tensor, num_select: int, scale: float, query_chunk: int | None = None,
                          margin: int | None = None, split: bool | None = None) -> str | None:
    """None when ``triton`` can run these arguments, else the reason."""
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed"
    dev = q_QID.device.type
    if dev != "cuda" and not (dev == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"):
        return f"device {dev} (needs cuda, or cpu under TRITON_INTERPRET=1)"
    tensors = (weights_QI, keys_PD, pool_end_P, pool_doc_P, q_pos_Q, q_doc_Q)
    if any(t.device != q_QID.device for t in tensors):
        return "inputs on different devices"
    if q_QID.dtype not in DTYPES or keys_PD.dtype not in DTYPES or weights_QI.dtype not in DTYPES:
        return f"dtypes q {q_QID.dtype}, keys {keys_PD.dtype}, weights {weights_QI.dtype} (runs fp32/bf16)"
    if q_QID.dim() != 3 or keys_PD.dim() != 2 or q_QID.shape[-1] != keys_PD.shape[-1]:
        return f"shapes q {tuple(q_QID.shape)}, keys {tuple(keys_PD.shape)} (needs [Q, I, D], [P, D])"
    if weights_QI.shape != q_QID.shape[:2]:
        return f"weights {tuple(weights_QI.shape)} vs q {tuple(q_QID.shape)}"
    if q_QID.shape[-1] % 16:
        return f"head dim {q_QID.shape[-1]} is not a multiple of 16 (tensor-core dot)"
    if not scale > 0:
        return f"scale {scale} <= 0 (folded into the head weight through relu)"
    return None


@dispatch.register("indexer_topk", "triton", supports=indexer_topk_supports)
@torch.no_grad()
@torch.autocast("cuda", enabled=False)
@torch.autocast("cpu", enabled=False)
def indexer_topk_triton(q_QID: torch.Tensor, weights_QI: torch.Tensor, keys_PD: torch.Tensor,
                        pool_end_P: torch.Tensor, pool_doc_P: torch.Tensor, q_pos_Q: torch.Tensor,
                        q_doc_Q: torch.Tensor, num_select: int, scale: float, query_chunk: int | None = None,
                        margin: int | None = None, split: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``select_pools``'s contract and result: ``(sel [Q, K] int64 ascending, ok [Q, K] bool)``.

    ``margin`` (default ``MARGIN``) and ``split`` (default ``SPLIT``) are knobs for tests and benchmarks;
    they change the speed and the number of fallback rows, never the result.
    """
    Q, I, D = q_QID.shape
    P = keys_PD.shape[0]
    k = min(num_select, P)
    sel = torch.zeros(Q, k, dtype=torch.int64, device=q_QID.device)
    ok = torch.zeros(Q, k, dtype=torch.bool, device=q_QID.device)
    if k == 0 or Q == 0:
        return sel, ok
    margin = MARGIN if margin is None else margin
    run = _Run(q_QID, weights_QI, keys_PD, pool_end_P.contiguous(), pool_doc_P, q_pos_Q, q_doc_Q, k, scale,
               SPLIT if split is None else split)
    chunk = resolve_query_chunk(query_chunk, P, I, k, margin, D)
    for s in range(0, Q, chunk):
        e = min(s + chunk, Q)
        sel[s:e], ok[s:e] = run.chunk(s, e, margin)
    return sel, ok


class _Run:
    """The inputs of one call and the per-chunk steps (kernel, candidates, re-check, certificate, fallback)."""

    def __init__(self, q_QID, w_QI, keys_PD, ends_P, pool_doc_P, q_pos_Q, q_doc_Q, k, scale, split) -> None:
        self.q_QID, self.w_QI, self.keys_PD, self.ends_P = q_QID, w_QI, keys_PD, ends_P
        self.pool_doc_P, self.q_pos_Q, self.q_doc_Q = pool_doc_P, q_pos_Q, q_doc_Q
        self.k, self.scale, self.split = k, scale, split
        self.floor = torch.finfo(torch.float32).min
        self.key_norm_max = float(torch.linalg.vector_norm(keys_PD, dim=-1, dtype=torch.float32).max())

    def chunk(self, s: int, e: int, margin: int) -> tuple[torch.Tensor, torch.Tensor]:
        from megaseq.ops.indexer_topk_kernel import index_scores

        k, floor = self.k, self.floor
        pos_c, doc_c = self.q_pos_Q[s:e], self.q_doc_Q[s:e]
        n = max(k, int(torch.searchsorted(self.ends_P, pos_c.max(), right=True)))
        L_cn = index_scores(self.q_QID[s:e], self.w_QI[s:e], self.keys_PD, self.ends_P, self.pool_doc_P, pos_c,
                            doc_c, n, self.scale, floor, self.split)
        M = min(k + margin, n)
        vals_cM, cand_cM = L_cn.topk(M, dim=-1, sorted=False)
        bad_c = ~torch.isfinite(vals_cM).all(-1)
        few_c = ((vals_cM > floor).sum(-1) < k) & ~bad_c  # fewer than k visible pools
        sel_cK = torch.empty(e - s, k, dtype=torch.int64, device=L_cn.device)
        num_few = int(few_c.sum())
        if num_few:
            sel_cK[few_c] = _few_pool_selection(L_cn[few_c, :k], vals_cM[few_c], cand_cM[few_c], k, floor)
        del L_cn
        many = torch.nonzero(~few_c & ~bad_c).squeeze(-1)
        cert_c = torch.ones(e - s, dtype=torch.bool, device=sel_cK.device)
        for r0 in range(0, many.numel(), RECHECK_ROWS):
            rows = many[r0:r0 + RECHECK_ROWS]
            sel_cK[rows], cert_c[rows] = self._recheck(s + rows, vals_cM[rows], cand_cM[rows], M == n)
        redo = torch.nonzero(bad_c | ~cert_c).squeeze(-1)
        STATS.rows += e - s
        STATS.chunks += 1
        STATS.few_pool_rows += num_few
        if redo.numel():
            STATS.fallback_rows += redo.numel()
            sel_cK[redo] = self._fallback(s + redo, e - s, margin)
        ok_cK = (self.ends_P[sel_cK] <= pos_c[:, None]) & (self.pool_doc_P[sel_cK] == doc_c[:, None])
        return sel_cK, ok_cK

    def _recheck(self, rows_r, vals_rM, cand_rM, all_pools: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Exact top-k among the candidates (ascending) and the certificate that it is the rows' top-k."""
        from megaseq.ops.indexer_topk_kernel import recheck_scores

        k, floor = self.k, self.floor
        cand_rM, perm_rM = cand_rM.sort(dim=-1)  # pool order, so the lowest-index rule sees pool indices
        vals_rM = vals_rM.gather(-1, perm_rM)
        exact_rM = recheck_scores(self.q_QID, self.w_QI, self.keys_PD, rows_r, cand_rM, self.scale)
        exact_rM.masked_fill_(vals_rM == floor, floor)  # the kernel writes floor exactly where not visible
        pick_rK = indexer_scoring.topk_lowest_index_ties(exact_rM, k)
        sel_rK = cand_rM.gather(-1, pick_rK).sort(dim=-1).values
        if all_pools:
            return sel_rK, torch.ones(len(rows_r), dtype=torch.bool, device=sel_rK.device)
        kth_r = exact_rM.gather(-1, pick_rK).min(dim=-1).values
        t_r = vals_rM.min(dim=-1).values  # the M-th largest kernel score
        err_r = score_error_bound(self.q_QID[rows_r], self.w_QI[rows_r], self.keys_PD.dtype, self.key_norm_max,
                                  self.scale, self.split)
        cert_r = (t_r == floor) | (t_r.double() + err_r < kth_r.double())
        return sel_rK, cert_r

    def _fallback(self, rows_f: torch.Tensor, chunk_rows: int, margin: int) -> torch.Tensor:
        """The reference on the rows that failed the certificate, in chunks within this call's working set."""
        P, I, D = self.keys_PD.shape[0], self.q_QID.shape[1], self.q_QID.shape[2]
        budget = indexer_topk_bytes(chunk_rows, P, I, self.k, margin, D)
        ref_chunk = max(1, budget // indexer_scoring.indexer_scoring_bytes(1, P, I, self.k))
        sel_fK, _ = indexer_scoring.select_pools(
            self.q_QID[rows_f], self.w_QI[rows_f], self.keys_PD, self.ends_P, self.pool_doc_P,
            self.q_pos_Q[rows_f], self.q_doc_Q[rows_f], self.k, self.scale, query_chunk=ref_chunk)
        return sel_fK


def _few_pool_selection(head_rK: torch.Tensor, vals_rM: torch.Tensor, cand_rM: torch.Tensor, k: int,
                        floor: float) -> torch.Tensor:
    """Rows with fewer than k visible pools: all of them (all among the candidates) plus the lowest-index
    invalid pools, as the reference's tie rule picks at the cut ``floor``; at most v of the first k columns
    are visible, so the invalid ones needed lie there (``head_rK`` = those columns of the scores)."""
    big = torch.iinfo(torch.int64).max
    visible_rM = vals_rM > floor
    room_r1 = k - visible_rM.sum(-1, keepdim=True)
    invalid_rK = head_rK == floor
    take_rK = invalid_rK & (invalid_rK.cumsum(-1) <= room_r1)
    col_K = torch.arange(k, device=head_rK.device)
    keys = torch.cat([cand_rM.masked_fill(~visible_rM, big), col_K.expand_as(take_rK).masked_fill(~take_rK, big)], -1)
    return keys.sort(dim=-1).values[:, :k]
