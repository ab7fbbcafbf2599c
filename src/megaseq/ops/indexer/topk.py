"""Op ``indexer_topk``: the DSA lightning indexer's pool selection, scored on tensor cores, selected exactly.

Shapes: Q queries, P complete pools, I indexer heads, D indexer head dim, K pools selected per query
(``min(num_select, P)``), c query rows of one chunk, n pools scored for the chunk (its causal prefix),
M = min(K + margin, n) candidates per row, r rows of a sub-block.

Contract (``megaseq.ops.indexer.scoring.select_pools``, registered here as the reference
``torch_fp32``): ``index[q, p] = sum_h w[q, h] * relu(scale * q[q, h] . k[p])`` over the pools visible to
the query (pool end at or before it, same document; the others score the dtype's min), each row's top-K
with ties to the lowest pool index, returned ascending, with the validity of each pick.

The fast implementation ``triton`` computes the same selection, per chunk of rows:

1. ``indexer_topk_kernel.index_scores``: the scores ``L [c, n]`` on tensor cores (bf16 operands, an fp32
   operand split into bf16 ``hi + lo``, fp32 accumulation), masked as the reference; no ``[c, I, n]``.
2. Candidates: ``torch.topk(L, M)``, sorted.
3. Certificate and band (``indexer_topk_select``): with ``|L - E| <= e`` per row (``score_error_bound``;
   ``E`` the fp32 score) the sorted candidates split into sure-in, an ambiguous band and sure-out; every
   pool outside the candidates is sure out when the M-th candidate is (``L_(M) < L_(K) - 2e``) or when
   every visible pool is a candidate. Rows that fail go to the fallback: the reference on those rows.
4. Exact re-check of the band only: its fp32 scores in the reference's op order (torch matmuls over the
   gathered fp32 keys), the best of them with the lowest-index rule. Rows with fewer than K visible pools
   need no scores: the reference picks all visible pools plus the lowest-index invalid ones.

So the selection equals fp32 scoring exactly: pools outside the band are placed by a proof, and the pick
inside it uses fp32 scores computed as the reference computes them. On an H200 (torch 2.11, cuBLAS) the
selection equalled the reference in every row measured (32K queries x 4 dtype cases, 8K queries at 1M x 3
margins, 2 more 1M chunks). "fp32 scoring" is the re-check's: where a BLAS sums in another order than the
reference's ``[c * I, D] x [D, n]`` GEMM, a tie at the last bit (1e-7 relative) can go either way, as
between two chunkings of the reference itself. Rows with a non-finite candidate score go to the fallback.

Memory: ``indexer_topk_bytes`` (chunk rows from ``resolve_query_chunk``, ``SCORING_BUDGET_BYTES`` when no
chunk is given). The fallback scores its rows in chunks no larger than the main working set.
``STATS`` counts rows, few-pool rows, rows whose band needed exact scores and fallback rows since the
last ``STATS.reset()``.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass

import torch

from megaseq.ops.workspace import TOPK_MARGIN, TOPK_RECHECK_BYTES
from megaseq.ops.workspace import indexer_topk_bytes as indexer_topk_bytes  # re-exported: the op's memory formula
from megaseq.ops.workspace import topk_row_bytes as _row_bytes

MARGIN: int = TOPK_MARGIN  # candidates beyond K per row
SPLIT: bool = True  # split fp32 operands into bf16 hi + lo (False: round them to bf16, a 64x looser bound)
SCORING_BUDGET_BYTES: int = 2 << 30  # one chunk's working set when no query_chunk is given
BAND: int = 32  # band positions re-checked per row (rows with a wider band re-check all M candidates)
RECHECK_BYTES: int = TOPK_RECHECK_BYTES  # one re-check sub-block (gathered fp32 keys [r, W, D], head scores [r, I, W])
DTYPES = (torch.float32, torch.bfloat16)
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


# ---- memory ------------------------------------------------------------------------------------------------
def resolve_query_chunk(query_chunk: int | None, num_pools: int, num_heads: int, num_select: int,
                        margin: int = MARGIN, head_dim: int = 128) -> int:
    """Rows per chunk: ``query_chunk`` when given, else as many as fit ``SCORING_BUDGET_BYTES``."""
    if query_chunk is not None:
        return max(1, int(query_chunk))
    per_row, _ = _row_bytes(num_pools, num_heads, num_select, margin, head_dim)
    return max(1, (SCORING_BUDGET_BYTES - RECHECK_BYTES) // per_row)


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


# ---- the op --------------------------------------------------------------------------------------------------
# the reference, ``torch_fp32``, is ``ops.indexer.scoring.select_pools`` (registered there)


def indexer_topk_supports(q_QID: torch.Tensor, weights_QI: torch.Tensor, keys_PD: torch.Tensor,
                          pool_end_P: torch.Tensor, pool_doc_P: torch.Tensor, q_pos_Q: torch.Tensor,
                          q_doc_Q: torch.Tensor, num_select: int, scale: float, query_chunk: int | None = None,
                          margin: int | None = None, split: bool | None = None,
                          row_len: int | None = None) -> str | None:
    """None when ``triton`` can run these arguments, else the reason."""
    if row_len is not None:
        return "transformers' tie order (row_len) is the reference's"
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


@torch.no_grad()
@torch.autocast("cuda", enabled=False)
@torch.autocast("cpu", enabled=False)
def indexer_topk_triton(q_QID: torch.Tensor, weights_QI: torch.Tensor, keys_PD: torch.Tensor,
                        pool_end_P: torch.Tensor, pool_doc_P: torch.Tensor, q_pos_Q: torch.Tensor,
                        q_doc_Q: torch.Tensor, num_select: int, scale: float, query_chunk: int | None = None,
                        margin: int | None = None, split: bool | None = None,
                        row_len: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
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
    from megaseq.ops.indexer.select import Run

    run = Run(q_QID, weights_QI, keys_PD, pool_end_P.contiguous(), pool_doc_P, q_pos_Q, q_doc_Q, k, scale,
               SPLIT if split is None else split)
    chunk = resolve_query_chunk(query_chunk, P, I, k, margin, D)
    bounds = [(s, min(s + chunk, Q)) for s in range(0, Q, chunk)]
    for (s, e), n in zip(bounds, run.pools_scored(bounds), strict=True):
        sel[s:e], ok[s:e] = run.chunk(s, e, n, margin)
    return sel, ok
