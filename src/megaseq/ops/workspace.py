"""The working sets of the compute ops, as byte formulas: one definition for the op (which sizes its blocks
with them) and for the planner (which counts them). Torch-free, so ``megaseq.plan`` imports it.

Itemsizes are plain byte counts: ``d`` the work dtype's, ``c = max(d, 4)`` the compute dtype's
(``promote_types(dtype, float32)``: the softmax, the scores).
"""

from __future__ import annotations


# ---- op attention (models/common/attention.py: attention_sdpa) -------------------------------------
def kv_repeats(num_heads: int, num_kv_heads: int, cp_size: int) -> int:
    """Smallest KV repeat that lets ``cp`` split the KV heads along the GQA groups (``models/common/attention.py``'s
    module doc; the planner counts the repeated heads with it)."""
    if num_heads % cp_size:
        raise ValueError(f"context parallel size {cp_size} must divide num_attention_heads ({num_heads}); "
                         "choose parallel.cp among the divisors of the head count")
    group = num_heads // num_kv_heads
    for rep in range(1, group + 1):
        if group % rep == 0 and (num_kv_heads * rep) % cp_size == 0:
            return rep
    return group  # unreachable: rep = group gives Hq heads, divisible by cp


def sdpa_head_groups(num_heads: int, num_kv_heads: int) -> int:
    """SDPA calls ``attention_sdpa`` makes (per batch row and document), each on ``num_heads / calls`` query
    heads and the KV head they read: with fewer KV heads than query heads (GQA, MQA) one call per KV head,
    and the query heads of each KV head split in halves while there are fewer than 4 calls (a rank's one KV
    head under Ulysses); else one call. Flash's backward with GQA allocates a per-query-head dk and dv
    (``dk_expanded``, ``dv_expanded``: 2 x the query's bytes) and a float32 dq accumulator (2 x again) for
    every head of the call; the calls' backwards run one after another, so each holds only its share, at the
    cost of the output's concatenation (a copy, which is also ``o_proj``'s input) and the query gradient's
    (the split's backward). For Qwen3-30B-A3B (32 query heads on 4 KV heads), four calls hold about a quarter
    of one call's backward temporaries (``plan.layers.attention_temp``; ``tests/models/test_attention.py``
    checks it on a GPU). Each head's output is
    computed as in one call."""
    if num_kv_heads >= num_heads:
        return 1
    per_kv, split = num_heads // num_kv_heads, 1
    while num_kv_heads * split < 4 and per_kv % (2 * split) == 0:
        split *= 2
    return num_kv_heads * split


MLA_SEGMENT_GROUP_BYTES: int = 4 << 30  # dense MLA under sequence segments: one head group's expanded keys


def mla_segment_heads(num_heads: int, rows: int, head_dim: int, itemsize: int) -> int:
    """Heads per SDPA call of dense MLA under sequence segments (``MultiLatentAttention._attend_carried``):
    each call expands the latent of ``rows`` keys (``B * e``, every token so far) to its heads' keys and
    values, ``head_dim`` wide (``max(Dn + Dr, Dv)``: v zero-padded to q's width), and its backward holds them
    with their gradients, ``4 * head_dim * itemsize`` bytes per key row and head. The largest divisor of
    ``num_heads`` whose group fits ``MLA_SEGMENT_GROUP_BYTES`` (4 GiB), at least one head: all heads in one
    call at short lengths, two of Kimi-Linear-48B-A3B's 32 at 1M (3 GiB)."""
    per_head = 4 * head_dim * itemsize * max(rows, 1)
    fit = max(1, MLA_SEGMENT_GROUP_BYTES // per_head)
    return max(d for d in range(1, num_heads + 1) if num_heads % d == 0 and d <= fit)


def mla_segment_group_bytes(num_heads: int, rows: int, head_dim: int, itemsize: int) -> int:
    """The bytes one head group of ``mla_segment_heads`` holds at its backward's peak."""
    return mla_segment_heads(num_heads, rows, head_dim, itemsize) * 4 * head_dim * itemsize * rows


# ---- op rms_norm (ops/rms_norm/reference.py: rms_norm_torch) -------------------------------------------
NORM_BACKWARD_ELEMENTS: int = 1 << 24  # rows of one backward chunk: at most this many elements


def norm_backward_rows(width: int) -> int:
    """Rows of ``[R, width]`` one chunk of ``rms_norm_torch``'s backward takes: its float32 temporaries
    (at most four chunk-sized tensors at once) stay near ``4 * 4 * NORM_BACKWARD_ELEMENTS`` bytes (256 MiB)
    whatever the length."""
    return max(1, NORM_BACKWARD_ELEMENTS // max(width, 1))


def norm_backward_temp(rows: int, width: int, out_bytes: int) -> int:
    """Peak bytes of ``rms_norm_torch``'s backward beyond its saved tensors and the incoming gradient: the
    input's gradient ``rows * width * out_bytes`` (a whole tensor, filled chunk by chunk), one chunk's
    float32 temporaries at their peak, and the weight's float32 partial sum. At the peak four float32
    chunk-sized tensors are live (``dxhat``, ``xhat``, their difference term and the result: ``16 * chunk``;
    the bf16 product before ``dxhat`` is freed by then); ``benchmarks/results/kernels/h200_ops.md`` holds the
    GPU check of this formula."""
    chunk = min(rows, norm_backward_rows(width)) * width
    return rows * width * out_bytes + 16 * chunk + 8 * width


# ---- op indexer_topk (ops/indexer/scoring.py): one scoring chunk ------------------------------------
SCORING_BUDGET_BYTES: int = 2 << 30  # the reference system's bound on one scoring chunk


def indexer_scoring_bytes(query_chunk: int, num_pools: int, num_heads: int, num_select: int,
                          itemsize: int = 4) -> int:
    """Peak bytes of one scoring chunk of the fp32 reference.

    Per query row: head scores ``[I, P]`` (computed and relu'd in place), the head-summed scores ``[P]``,
    the validity mask ``[P]`` (bool), the tie-break masks and ranks (8 bytes per pool) and the top-K values
    and int64 indices plus their validity: ``c * (P * ((I + 1) * itemsize + 9) + K * (itemsize + 9))``.
    """
    per_row = num_pools * ((num_heads + 1) * itemsize + 9) + num_select * (itemsize + 9)
    return query_chunk * per_row


def scoring_chunk(num_pools: int, num_heads: int, num_select: int, budget: int = SCORING_BUDGET_BYTES) -> int:
    """The most query rows whose scoring chunk stays within ``budget`` (at least one)."""
    return max(1, budget // indexer_scoring_bytes(1, max(num_pools, 1), num_heads, num_select))


# ---- the indexer's KL objective (models/common/indexer_kl.py) --------------------------------------------
INDEXER_KL_BUDGET_BYTES: int = 2 << 30  # one query chunk of the objective (as the absorbed op's block)
RECALL_ROWS: int = 8  # queries per layer and batch row whose recall the sparse stage measures against dense attention
RECALL_BLOCK_BYTES: int = 256 << 20  # the sampled recall's fp32 scores of one group of its rows, [g, Hh, S], at most


def indexer_recall_rows(num_heads: int, num_keys: int, rows: int = RECALL_ROWS, itemsize: int = 4) -> int:
    """Rows of the sparse stage's sampled recall taken at once: their scores over every key (fp32, or the
    compute dtype ``itemsize`` where wider) within ``RECALL_BLOCK_BYTES`` (at least one, at most ``rows``)."""
    return max(1, min(rows, RECALL_BLOCK_BYTES // max(1, itemsize * num_heads * num_keys)))


def indexer_recall_bytes(num_heads: int, num_keys: int, rows: int = RECALL_ROWS, itemsize: int = 4) -> int:
    """GPU bytes of one group of the sampled recall (``indexer_recall_rows``): the dense attention's scores over
    every key, ``[g, Hh, S]`` twice at the peak (the scaled scores and their softmax, fp32 or ``itemsize``), and
    per key the visibility mask, the head-summed probabilities and the comparisons that make the mask."""
    g = indexer_recall_rows(num_heads, num_keys, rows, itemsize)
    return g * num_keys * (2 * itemsize * num_heads + 16)


def indexer_target_row_bytes(num_heads: int, num_slots: int, latent: int, itemsize: int = 4,
                             work_itemsize: int = 0, fused: bool = False, given_lse: bool = False) -> int:
    """Bytes per query row of op ``indexer_target`` (``ops/indexer/target.py``) in one chunk of the sparse stage:
    the chunk's absorbed queries ``[Hh, C]`` (work dtype ``work_itemsize``, default ``itemsize``) and

    - the reference (``torch_gather``): the gathered latents ``[W, C]`` (work dtype) and the scores and
      probabilities ``[Hh, W]`` (compute dtype ``itemsize``);
    - ``fused`` (the Triton kernel): its output ``m [W]`` and ``lse2 [Hh]`` (fp32) and the slots' validity ``[W]``
      (bool); nothing of size ``W * C`` or ``Hh * W``.

    ``given_lse`` (the attention's log-sum-exp passed in, a view of a tensor that exists anyway): the kernel writes
    no ``lse2``; the reference exponentiates its scores in place (one ``[Hh, W]`` tensor, no softmax output).
    """
    work = work_itemsize or itemsize
    queries = num_heads * latent * work
    if fused:
        return queries + 4 * num_slots + (0 if given_lse else 4 * num_heads) + num_slots
    return queries + (1 if given_lse else 2) * num_heads * num_slots * itemsize + num_slots * latent * work


def indexer_kl_row_bytes(num_heads: int, num_keys: int, index_heads: int, num_cand: int, head_dim: int,
                         gathered: int = 0, latent: int = 0, itemsize: int = 4, gathered_itemsize: int = 0,
                         fused_target: bool = False, query_width: int = 0, given_lse: bool = False,
                         fused_kl: bool = False) -> int:
    """Bytes per query row of one chunk of the indexer objective (compute dtype ``itemsize``).

    Target: the main attention's scores and probabilities ``[Hh, n]`` (``n`` = every visible key in the warm-up);
    in the sparse stage (``gathered`` = its W selected slots, of width ``latent``, in the attention's work dtype
    ``gathered_itemsize``, default ``itemsize``) op ``indexer_target``'s working set
    (``indexer_target_row_bytes``: the reference's gathered latents ``[W, C]`` and ``[Hh, W]`` scores, or with
    ``fused_target`` the Triton kernel's ``[W]`` output; ``given_lse``: the attention's log-sum-exp read, none
    written). Indexer: its queries (the projection's input of width
    ``query_width``, kept for its weight's gradient, and its output ``[I, D]`` with the rotated copy; counted at
    ``itemsize``, an upper bound where they run in a narrower work dtype), its head scores ``[I, m]`` kept for the
    chunk's backward with their relu mask and gradient, the
    gathered pool keys ``[m, D]`` and their int64 pool indices of the sparse stage, and ``[m]`` rows of target,
    log-softmax and their gradient (``m`` = the candidate pools).

    ``fused_kl`` (the sparse stage's indexer side in op ``indexer_kl``'s Triton kernel): no head scores and no
    gathered keys; what the kernel allocates (``indexer_kl_kernel_row_bytes``; ``indexer_kl_fixed_bytes`` is its
    per-chunk part) and the pools, target and candidates it reads.
    """
    if gathered:
        target = indexer_target_row_bytes(num_heads, gathered, latent, itemsize, gathered_itemsize, fused_target,
                                          given_lse)
    else:
        target = 2 * num_heads * num_keys * itemsize
    queries = (query_width + 2 * index_heads * head_dim) * itemsize
    if fused_kl and gathered:  # the pools (int64), target (fp32) and candidates the objective hands the kernel
        kernel = indexer_kl_kernel_row_bytes(index_heads, head_dim, num_cand, gathered_itemsize or itemsize)
        return target + queries + kernel + 13 * num_cand
    indexer = index_heads * num_cand * (3 * itemsize + 1) + (num_cand * (head_dim * itemsize + 16) if gathered else 0)
    return target + queries + indexer + 6 * num_cand * itemsize


def indexer_kl_kernel_row_bytes(index_heads: int, head_dim: int, num_cand: int, work_itemsize: int) -> int:
    """Bytes per query row that op ``indexer_kl``'s Triton kernel allocates, through its backward: the KL and the
    row weight, ``dq [I, D]`` and ``dw [I]`` fp32 kept for the backward and scaled there, ``dq`` cast to the
    queries' work dtype (none in fp32), and the pools as int32."""
    cast = work_itemsize * index_heads * head_dim if work_itemsize != 4 else 0
    return 8 + 8 * index_heads * (head_dim + 1) + cast + 4 * num_cand


def indexer_kl_fixed_bytes(num_pools: int, head_dim: int, keys_itemsize: int = 4) -> int:
    """Bytes of one chunk of op ``indexer_kl``'s Triton kernel whatever its rows: the pooled keys' gradient
    ``[P, D]`` fp32, kept for the backward and scaled there, and cast to the keys' dtype (none for fp32 keys)."""
    return (8 + (keys_itemsize if keys_itemsize != 4 else 0)) * num_pools * head_dim


def indexer_kl_chunk(num_heads: int, num_keys: int, index_heads: int, num_cand: int, head_dim: int,
                     gathered: int = 0, latent: int = 0, itemsize: int = 4,
                     budget: int = INDEXER_KL_BUDGET_BYTES, gathered_itemsize: int = 0,
                     fused_target: bool = False, query_width: int = 0, given_lse: bool = False,
                     fused_kl: bool = False, num_pools: int = 0, keys_itemsize: int = 4) -> int:
    """Query rows of one chunk of the objective within ``budget`` (at least one); ``fused_kl``: op ``indexer_kl``'s
    kernel, whose chunk also holds ``indexer_kl_fixed_bytes`` of the ``num_pools`` pooled keys."""
    fused_kl = fused_kl and bool(gathered)
    per_row = indexer_kl_row_bytes(num_heads, num_keys, index_heads, num_cand, head_dim, gathered, latent, itemsize,
                                   gathered_itemsize, fused_target, query_width, given_lse, fused_kl)
    fixed = indexer_kl_fixed_bytes(num_pools, head_dim, keys_itemsize) if fused_kl else 0
    return max(1, (budget - fixed) // max(per_row, 1))


def indexer_kl_bytes(Q: int, S: int, num_heads: int, index_heads: int, head_dim: int, num_pools: int,
                     num_select: int, W: int, latent: int, dense: bool, itemsize: int = 4,
                     budget: int = INDEXER_KL_BUDGET_BYTES, gathered_itemsize: int = 0,
                     fused_target: bool = False, query_width: int = 0, given_lse: bool = False,
                     lse_copy: bool = False, fused_kl: bool = False, keys_itemsize: int = 4,
                     recall: int = 0) -> int:
    """GPU bytes of one DSA layer's objective beyond its inputs: one chunk (``indexer_kl_chunk`` rows, at most Q;
    ``fused_target``: the sparse stage's target from the Triton kernel; ``given_lse``: it reads the attention's
    log-sum-exp) plus the gradients the chunks sum (pooled keys ``[P, D]``, head weights ``[Q, I]``, fp32) and the
    pooled keys themselves with their graph (``[S, D]`` keys and gates, ``[P, D]`` pools). ``lse_copy``: the
    attention's base-2 log-sum-exp ``[Q, Hh]`` is a tensor of its own (``absorbed``, ``torch_masked``; in the
    compute dtype ``itemsize``) kept from the attention to the objective; the Triton op's is a view of what it
    saves for its backward (counted there). The last two: ``indexer_kl_kept_bytes``. ``fused_kl``: the sparse stage's
    indexer side in op ``indexer_kl``'s kernel, whose chunk also holds the pooled keys' gradient cast to their dtype
    (``keys_itemsize``). ``recall``: the sampled recall's bytes (``indexer_recall_bytes``), which run after the
    chunks, beside the sums: the larger of the two counts."""
    keys, cand = (S, num_pools) if dense else (W, num_select)
    gathered = 0 if dense else W
    given_lse = given_lse and not dense
    fused_kl = fused_kl and not dense
    rows = min(Q, indexer_kl_chunk(num_heads, keys, index_heads, cand, head_dim, gathered, latent, itemsize, budget,
                                   gathered_itemsize, fused_target, query_width, given_lse, fused_kl, num_pools,
                                   keys_itemsize))
    chunk = rows * indexer_kl_row_bytes(num_heads, keys, index_heads, cand, head_dim, gathered, latent, itemsize,
                                        gathered_itemsize, fused_target, query_width, given_lse, fused_kl)
    chunk += indexer_kl_fixed_bytes(num_pools, head_dim, keys_itemsize) if fused_kl else 0
    sums = 4 * (num_pools * head_dim + Q * index_heads)
    kept = indexer_kl_kept_bytes(Q, S, num_heads, head_dim, num_pools, dense, itemsize, given_lse, lse_copy)
    return max(chunk, 0 if dense else recall) + sums + kept


def indexer_kl_kept_bytes(Q: int, S: int, num_heads: int, head_dim: int, num_pools: int, dense: bool,
                          itemsize: int = 4, given_lse: bool = False, lse_copy: bool = False) -> int:
    """What of ``indexer_kl_bytes`` exists from the layer's forward to the objective: the pooled keys with their
    graph (``[S, D]`` keys and gates, ``[P, D]`` pools) and, with ``lse_copy`` in the sparse stage, the
    attention's log-sum-exp ``[Q, Hh]`` (its own tensor under ``absorbed`` and ``torch_masked``)."""
    graph = itemsize * (2 * S * head_dim + num_pools * head_dim)
    return graph + (Q * num_heads * itemsize if given_lse and lse_copy and not dense else 0)


# ---- op linear_cross_entropy, implementation liger (ops/vocab_loss/liger.py) --------------------------------
LIGER_CHUNK_ROWS: int = 4096  # rows of one chunk of logits at most (a power of two)


# ---- op indexer_topk, implementation triton (ops/indexer/topk.py) -----------------------------------
TOPK_MARGIN: int = 32  # candidates beyond K per row
TOPK_RECHECK_BYTES: int = 256 << 20  # one re-check sub-block (gathered fp32 keys [r, W, D], head scores [r, I, W])


def indexer_topk_bytes(query_chunk: int, num_pools: int, num_heads: int, num_select: int, margin: int = TOPK_MARGIN,
                       head_dim: int = 128) -> int:
    """Peak bytes of one chunk of ``triton`` beyond its inputs, for the planner.

    Per row of the chunk: the scores ``L [P]`` fp32 (4P); the sorted candidates' values fp32 and indices
    int64 (12M); the error bound, the band limits and the searchsorted counts (16M + 32); the few-pool
    keys (int64, 8(M + K)); the selection and validity (9K). One re-check sub-block (``TOPK_RECHECK_BYTES``,
    rows whose band is ambiguous): the gathered fp32 keys ``[W, D]``, the head scores ``[I, W]`` and the
    sorts (4WD + 4IW + 64W a row). The fallback's chunks stay within this total (``ops.indexer.select``).
    """
    per_row, recheck_row = topk_row_bytes(num_pools, num_heads, num_select, margin, head_dim)
    return query_chunk * per_row + min(TOPK_RECHECK_BYTES, query_chunk * recheck_row)


def topk_row_bytes(num_pools: int, num_heads: int, num_select: int, margin: int, head_dim: int) -> tuple[int, int]:
    P, K = num_pools, min(num_select, num_pools)
    M = min(K + margin, P)
    return 4 * P + 28 * M + 32 + 8 * (M + K) + 9 * K, M * (4 * head_dim + 4 * num_heads + 64)


def resolve_query_chunk(query_chunk: int | None, num_pools: int, num_heads: int, num_select: int,
                        impl: str = "torch_fp32", margin: int = TOPK_MARGIN, head_dim: int = 128) -> int:
    """Rows per scoring chunk of op ``indexer_topk``: ``query_chunk`` (``model.index_query_chunk``) when given,
    else as many as fit ``SCORING_BUDGET_BYTES`` under the working set of ``impl``: the reference's
    ``torch_fp32`` (``indexer_scoring_bytes``) or ``triton`` (``topk_row_bytes``, one re-check sub-block
    ``TOPK_RECHECK_BYTES`` set aside)."""
    if query_chunk is not None:
        return max(1, int(query_chunk))
    if impl == "torch_fp32":
        return scoring_chunk(num_pools, num_heads, num_select)
    if impl != "triton":
        raise ValueError(f"indexer_topk has no implementation {impl!r} (torch_fp32 or triton)")
    per_row, _ = topk_row_bytes(num_pools, num_heads, num_select, margin, head_dim)
    return max(1, (SCORING_BUDGET_BYTES - TOPK_RECHECK_BYTES) // per_row)


# ---- op sparse_attention, implementation absorbed (ops/sparse_mla/absorbed.py) --------------------------------
ABSORBED_BLOCK_BYTES: int = 2 << 30  # one query block's budget (forward or backward)


def absorbed_per_query(W: int, R: int, Hh: int, d: int, c: int) -> int:
    """One query of a block: the gathered latents ``W * R`` (work dtype) and their gradient (compute dtype),
    about eight ``[Hh, W]`` score-sized tensors in the compute dtype, and two int64 index rows."""
    return W * R * (d + c) + 8 * Hh * W * c + 16 * W


def absorbed_block_queries(W: int, R: int, Hh: int, d: int, c: int, budget: int | None = None) -> int:
    """Queries per block so that one backward block (the larger) stays within ``budget`` bytes."""
    return max(1, int(budget if budget is not None else ABSORBED_BLOCK_BYTES) // absorbed_per_query(W, R, Hh, d, c))


def absorbed_bytes(Q: int, S: int, W: int, R: int, Hh: int, Dn: int, Dv: int, d: int, c: int,
                   budget: int | None = None) -> dict[str, int]:
    """GPU bytes of one call beyond its inputs (q, the latent, the weight and the selection). ``saved``: the
    latent cast to the work dtype (a copy when the latent is fp32 under autocast, else shared) and the
    compute-dtype log-sum-exp ``[Q, Hh]``. ``block``: one query block's working set. ``backward``: the
    output-sized gradient of q ``Q * Hh * Dn``, the compute-dtype latent gradient ``S * R`` and weight
    gradients, plus one block."""
    n = min(absorbed_block_queries(W, R, Hh, d, c, budget), Q)
    block = n * absorbed_per_query(W, R, Hh, d, c)
    return {"saved": S * R * d + Q * Hh * c, "block": block,
            "backward": block + Q * Hh * Dn * d + S * R * c + Hh * (Dn + Dv) * R * c}


# ---- op sparse_attention, implementation triton (ops/sparse_mla/fused.py) ---------------------------
POOL_SORT_BYTES: int = 64  # per (query, selected pool) while the pool pass's entries are sorted
POOL_QUERIES: int = 32768  # queries per batch row sorted at once (ops.sparse_mla.kernels.POOL_QUERIES)
SAVED_QUERIES: int = 8192  # dc="saved": queries of one batch row whose p and ds are held at once (the kernels')
DC_DEFAULT: str = "saved"  # the latent gradient's way unless MEGASEQ_MLA_DC says otherwise (the kernels read it)


def sparse_mla_pool_bytes(Q: int, W: int, kp: int, Hh: int, batch: int = 1, d: int = 2,
                          mode: str = DC_DEFAULT) -> int:
    """Bytes the key-major latent gradient (``ops.sparse_mla.kernels``, ``dc="saved"`` or ``"pool"``) adds to
    the backward's kernel moment, for ``Q`` queries (all batch rows together) of ``W`` slots in pools of ``kp`` (0
    where the selection has no pools, or ``mode="atomic"``: the atomics alone run), ``d`` bytes a work-dtype element.

    ``saved`` (the default): the slot pass's ``p`` and ``ds`` of the ``K = (W + 1) / kp - 1`` pool blocks of
    ``SAVED_QUERIES`` queries of one batch row at a time (``2 K Hh kp d`` bytes a query), and while ``pool_entries``
    sorts those queries' pool slots at most ``POOL_SORT_BYTES`` per slot. ``pool``: ``delta [Hh, Q]`` fp32, and the
    sort of ``POOL_QUERIES`` queries of each batch row at once. The sort's bytes: the slots' first keys (int64),
    validity (bool), sort keys, sorted keys and order (int64 each), torch's index input and the radix sort's double
    buffers (16 bytes). The layout check before it (``[4096, K, kp]`` int32 and bool temporaries, about 100 MB)
    runs before ``dq_abs`` and the latent gradient exist, which are larger."""
    if kp < 16 or (W + 1) % kp or W + 1 < 2 * kp or mode == "atomic":
        return 0
    K, per_row = (W + 1) // kp - 1, Q // max(batch, 1)
    if mode == "saved":
        return min(per_row, SAVED_QUERIES) * K * (POOL_SORT_BYTES + 2 * Hh * kp * d)
    return Q * Hh * 4 + batch * min(per_row, POOL_QUERIES) * K * POOL_SORT_BYTES


def triton_sparse_mla_bytes(Q: int, S: int, R: int, Hh: int, Dn: int, Dv: int, d: int,
                            pool: int = 0) -> dict[str, int]:
    """GPU bytes of one call beyond its inputs (q, c, the weight, idx) and its output, for the planner.

    ``saved``: the latent cast to the work dtype (a copy when it is fp32 under autocast, as
    ``sparse_mla_bytes`` counts it), ``o_lat [Q, Hh, R]`` in the work dtype and ``lse [Q, Hh]`` fp32.
    ``forward``: the working set on top of ``saved`` at its peak: the head-major copy of q and
    ``q_abs`` (``Q * Hh * (Dn + R)``) and the head-major output before its permute (``Q * Hh * Dv``).
    ``backward``: the peak on top of ``saved``, the largest of the moments of
    ``TritonSparseMLA.backward`` in its order (each tensor freed where the code deletes it): head-major dO
    and ``do_lat`` (``Q * Hh * (Dv + R)``); ``do_lat``, the head-major q and ``q_abs`` as q_abs is made
    (``Q * Hh * (2 R + Dn)``); in the kernel ``do_lat``, ``q_abs`` and ``dq_abs`` (``Q * Hh * 3 R``; the
    head-major q is made again after it) and the fp32 latent gradient ``4 S R``; then ``dq_abs``, dq's
    GEMM output and its batch-major copy (``Q * Hh * (R + 2 Dn)``) beside the fp32 latent gradient; at the
    return dq and the latent gradient with its cast (``Q * Hh * Dn + S * R * (4 + d)``); plus the weight
    gradients ``Hh * (Dn + Dv) * R * 2 d``. ``pool``: the key-major latent gradient's bytes in the kernel
    moment (``sparse_mla_pool_bytes``). Nothing per slot is stored (the kernels keep it)."""
    f = 4
    saved = S * R * d + Q * Hh * R * d + Q * Hh * f
    forward = Q * Hh * (Dn + R + Dv) * d
    moments = (Q * Hh * (Dv + R) * d, Q * Hh * (2 * R + Dn) * d, Q * Hh * 3 * R * d + S * R * f + pool,
               Q * Hh * (R + 2 * Dn) * d + S * R * f, Q * Hh * Dn * d + S * R * (f + d))
    backward = max(moments) + Hh * (Dn + Dv) * R * 2 * d
    return {"saved": saved, "forward": forward, "backward": backward}


# ---- attention with sinks (models.common.sink_attention's SDPA path) -------------------------------------
SLIDE_BLOCK = 1024  # queries per block of a sliding layer


def sink_attention_dims(head_dim: int) -> int:
    """The head dims q and k get in the SDPA path: the sink's dim and a spare one, rounded up to 8."""
    return (head_dim + 2 + 7) // 8 * 8


def sliding_key_rows(window: int, seq_len: int, block: int = SLIDE_BLOCK) -> float:
    """Keys SDPA holds per query token of a sliding layer: each block of ``b`` queries gets the sink, its
    ``b + W - 1`` keys and the padding to 16, all copied."""
    b = min(block, max(seq_len, 1))
    width = 1 + b + window - 1
    return (width + (-width % 16)) / b
