"""Op ``indexer_topk``: the DSA lightning indexer's pool selection, scored on tensor cores, selected exactly.

Shapes: Q queries, P complete pools, I indexer heads, D indexer head dim, K pools selected per query
(``min(num_select, P)``), c query rows of one chunk, n pools scored for the chunk (its causal prefix),
M = min(K + margin, n) candidates per row, r rows of a sub-block.

Contract (``megaseq.ops.indexer.scoring.select_pools``, the reference
``torch_fp32``): ``index[q, p] = sum_h w[q, h] * relu(scale * q[q, h] . k[p])`` over the pools visible to
the query (pool end at or before it, same document; the others score the dtype's min), each row's top-K
with ties to the lowest pool index, returned ascending, with the validity of each pick.

The fast implementation ``triton`` computes the same selection, per chunk of rows:

1. ``topk_kernel.index_scores``: the scores ``L [c, n]`` on tensor cores (bf16 operands, an fp32
   operand split into bf16 ``hi + lo``, fp32 accumulation), masked as the reference; no ``[c, I, n]``.
2. Candidates: ``torch.topk(L, M)``, sorted.
3. Certificate and band (``select``): with ``|L - E| <= e`` per row (``score_error_bound``;
   ``E`` the fp32 score) the sorted candidates split into sure-in, an ambiguous band and sure-out; every
   pool outside the candidates is sure out when the M-th candidate is (``L_(M) < L_(K) - 2e``) or when
   every visible pool is a candidate. Rows that fail go to the fallback: the reference on those rows.
4. Exact re-check of the band only: its fp32 scores in the reference's op order (torch matmuls over the
   gathered fp32 keys), the best of them with the lowest-index rule. Rows with fewer than K visible pools
   need no scores: the reference picks all visible pools plus the lowest-index invalid ones.

So the selection equals fp32 scoring exactly: pools outside the band are placed by a proof, and the pick
inside it uses fp32 scores computed as the reference computes them (the GPU runs:
``benchmarks/results/kernels/indexer_topk/``). "fp32 scoring" is the re-check's: where a BLAS sums in another
order than the reference's ``[c * I, D] x [D, n]`` GEMM, a tie at the last bit (1e-7 relative) can go either way, as
between two chunkings of the reference itself. Rows with a non-finite candidate score go to the fallback.

Memory: ``indexer_topk_bytes`` (chunk rows from ``resolve_query_chunk``, ``SCORING_BUDGET_BYTES`` when no
chunk is given). The fallback scores its rows in chunks no larger than the main working set.
``STATS`` counts rows, few-pool rows, rows whose band needed exact scores and fallback rows since the
last ``STATS.reset()``.
"""

from __future__ import annotations

import importlib.util
import os

import torch

from megaseq.ops.indexer.select import STATS as STATS  # re-exported: the op's counters
from megaseq.ops.indexer.select import Run
from megaseq.ops.indexer.select import score_error_bound as score_error_bound  # re-exported: the op's bound
from megaseq.ops.workspace import TOPK_MARGIN, resolve_query_chunk
from megaseq.ops.workspace import indexer_topk_bytes as indexer_topk_bytes  # re-exported: the op's memory formula

MARGIN: int = TOPK_MARGIN  # candidates beyond K per row
SPLIT: bool = True  # split fp32 operands into bf16 hi + lo (False: round them to bf16, a 64x looser bound)
DTYPES = (torch.float32, torch.bfloat16)


# ---- the op --------------------------------------------------------------------------------------------------
# the reference, ``torch_fp32``, is ``ops.indexer.scoring.select_pools`` (rows: ``ops.table``)


def indexer_topk_supports(q_QID: torch.Tensor, weights_QI: torch.Tensor, keys_PD: torch.Tensor,
                          pool_end_P: torch.Tensor, pool_doc_P: torch.Tensor, q_pos_Q: torch.Tensor,
                          q_doc_Q: torch.Tensor, num_select: int, scale: float, query_chunk: int | None = None,
                          margin: int | None = None, split: bool | None = None,
                          row_len: int | None = None, visible: int | None = None) -> str | None:
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
                        row_len: int | None = None, visible: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``select_pools``'s contract and result: ``(sel [Q, K] int64 ascending, ok [Q, K] bool)``.

    ``margin`` (default ``MARGIN``) and ``split`` (default ``SPLIT``) are knobs for tests and benchmarks;
    they change the speed and the number of fallback rows, never the result. ``visible``: as ``select_pools``'s
    (a call of one chunk then makes one host sync, the row sets' sizes).
    """
    Q, I, D = q_QID.shape
    P = keys_PD.shape[0]
    k = min(num_select, P)
    sel = torch.zeros(Q, k, dtype=torch.int64, device=q_QID.device)
    ok = torch.zeros(Q, k, dtype=torch.bool, device=q_QID.device)
    if k == 0 or Q == 0:
        return sel, ok
    margin = MARGIN if margin is None else margin
    run = Run(q_QID, weights_QI, keys_PD, pool_end_P.contiguous(), pool_doc_P, q_pos_Q, q_doc_Q, k, scale,
               SPLIT if split is None else split)
    chunk = resolve_query_chunk(query_chunk, P, I, k, "triton", margin, D)
    bounds = [(s, min(s + chunk, Q)) for s in range(0, Q, chunk)]
    for (s, e), n in zip(bounds, run.pools_scored(bounds, visible), strict=True):
        sel[s:e], ok[s:e] = run.chunk(s, e, n, margin)
    return sel, ok
