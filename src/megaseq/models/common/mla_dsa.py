"""MLA attention with DeepSeek sparse attention: GLM's pooled lightning indexer (NoPE) and DeepSeek-V3.2's.

Shapes: B batch, Q = S_loc queries on this rank, S the full sequence (keys), Hh attention heads,
R kv_lora_rank, Dn qk_nope_head_dim, Dv v_head_dim (qk_rope_head_dim is 0: GLM's MLA is NoPE),
I indexer heads, Di indexer head dim, kp = index_kpool, P complete pools, K = index_topk // kp,
W = K * kp + kp - 1 selected key slots per query (-1 = empty).

    x --q_a_proj, q_a_layernorm--> q_resid --q_b_proj--> q [B, Q, Hh, Dn]            (local)
    x --kv_a_proj_with_mqa, kv_a_layernorm--> c [B, Q, R] --gather_seq--> latent c [B, S, R]
    indexer (no grad): top-K pools of kp keys per query + the query's own incomplete pool -> idx [B, Q, W]
    op sparse_attention(q, c, kv_b_proj.weight, idx, scale) -> [B, Q, Hh, Dv] -> o_proj

Op ``sparse_attention`` (``megaseq.ops.dispatch``) takes the latent, not expanded keys: the reference
``torch_masked`` here expands ``k [B, Hh, S, Dn]``, ``v [B, Hh, S, Dv]`` with ``kv_b_proj`` and attends
with a mask (HF's computation, O(block * S) scores); ``absorbed`` (``megaseq.ops.sparse_mla.absorbed``) folds the
key part of ``kv_b_proj`` into the query and attends over the gathered latents of the selected keys
only, O(block * W * R), which is what runs at long context.

Indexer (``Glm5NextTextIndexer``): keys ``k_norm(wk x)`` are pooled in groups of ``kp`` consecutive
tokens from each document's first token, weighted per channel by ``softmax(gate x + ape)``; only
complete pools are candidates, and a pool is selectable by a query only when its last token is
visible. The incomplete tail pool (the ``pos % kp`` most recent tokens) is always appended. A
``shared`` layer reuses the previous full layer's selection (``ctx.carry["topk"]``). The selection runs
under ``no_grad`` like the reference, so the LM loss never reaches the indexer; with ``Indexer.kl_coef`` set
(``train.indexer_training``) the layer adds the indexer's KL objective on detached inputs
(``models.common.indexer_objective``, ``docs/indexer.md``): in the warm-up attached to its output
(``AttachLoss``); in the sparse stage run in the backward right after the attention's (``SparseObjective``), from
the head-summed probabilities that backward leaves (``head_probs``) or the attention's per-head log-sum-exp
(``return_lse``), the target's normaliser. With
``dense_attention`` set (the indexer's warm-up) the layer attends every visible key instead of its selection.

DeepSeek-V3.2 (``indexer="deepseek"``): the MLA rotates a shared key part (``Dr`` dims, ``models.common.mla``),
so the gathered latent is ``[c | k_rot]`` ``[B, S, R + Dr]`` and q carries ``Dn + Dr`` dims; the op's
reference appends ``k_rot`` to every head's keys. Its indexer scores every token (no pools: kp = 1, no
gate, no ape, no tail) with RoPE on the first ``Dr`` dims of its queries and keys (half-split, not
interleaved, as HF's ``DeepseekV32Indexer``).

Context parallelism (gather-KV): queries stay local at global positions ``ctx.seq_offset() + i``;
latents and indexer keys of the whole sequence are gathered. Documents: a query only selects keys
of its own document, and pools never straddle documents, which equals running each document alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from megaseq.models.common import rope
from megaseq.models.common.attention import positions_for
from megaseq.models.common.context import SeqContext, positions_from_doc_ids
from megaseq.models.common.indexer_kl import AttachLoss, IndexerStats, dense_latent_attention
from megaseq.models.common.lora import linear_weight
from megaseq.models.common.mla import MultiLatentAttention
from megaseq.models.spec import ModelSpec
from megaseq.ops import dispatch
from megaseq.ops.amp import compute_dtype
from megaseq.ops.indexer import scoring as indexer_scoring

# score elements per query block of the reference sparse attention (bounds its working set)


# ---- op sparse_attention -----------------------------------------------------------------------------


# ---- indexer -------------------------------------------------------------------------------------------
@dataclass
class Prepared:
    """``Indexer.prepare``'s result: per batch row the pooled keys ``[P, Di]`` and pool tokens ``[P, kp]``."""

    q_resid_BQR: torch.Tensor
    weights_BQI: torch.Tensor
    doc_BS: torch.Tensor
    pos_BS: torch.Tensor
    q_pos_Q: torch.Tensor
    pools: list[tuple[torch.Tensor, torch.Tensor]]
    q_start: int  # q_pos_Q[0] on the host: the queries are q_start, q_start + 1, ...
    cos: torch.Tensor | None = None
    sin: torch.Tensor | None = None
    # ties as transformers' torch.topk breaks them where its row can be rebuilt: on the CPU, one document
    # scored whole (its row: the complete pools, as its indexer keeps them); else (None) the lowest pools win
    row_len: int | None = None


class Indexer(nn.Module):
    """The lightning indexer; HF name ``indexer``. ``pooled``: GLM's (parameters as ``Glm5NextTextIndexer``);
    else DeepSeek-V3.2's (``DeepseekV32Indexer``: kp = 1, no pooling tensors, RoPE on ``rope_dim`` dims)."""

    def __init__(self, spec: ModelSpec, pooled: bool = True) -> None:
        super().__init__()
        I, Di, kp = spec.index_n_heads, spec.index_head_dim, spec.index_kpool
        if not pooled and kp != 1:
            raise ValueError(f"DeepSeek's indexer scores single tokens: index_kpool must be 1, got {kp}")
        self.n_heads, self.head_dim, self.kpool, self.pooled = I, Di, kp, pooled
        self.rope_dim = 0 if pooled else spec.qk_rope_head_dim
        self.rope_theta, self.rope_scaling = spec.rope_theta, dict(spec.rope_scaling)
        self.max_positions = spec.max_position_embeddings
        self.index_topk = spec.index_topk
        self.select_tail = spec.index_kpool_always_select_tail
        self.softmax_scale = Di**-0.5
        self.wq_b = nn.Linear(spec.q_lora_rank, I * Di, bias=False)
        self.wk = nn.Linear(spec.hidden_size, Di, bias=False)
        self.k_norm = nn.LayerNorm(Di, eps=1e-6)
        self.weights_proj = nn.Linear(spec.hidden_size, I, bias=False)
        if pooled:
            self.index_kpool_compress_ape = nn.Parameter(torch.zeros(kp, Di))
            self.index_kpool_compress_gate = nn.Parameter(torch.ones(Di, spec.hidden_size))
        # scoring rows per chunk (None: as many as ``ops.indexer.scoring.SCORING_BUDGET_BYTES`` allows): the
        # op's working-set bound, which the family's ``parallelize`` sets from the memory plan
        self.query_chunk: int | None = None
        self.layer = "indexer"  # the owning layer's name (MLASparseAttention sets it)
        # the objective (models.common.indexer_objective), set by the trainer: its coefficient (0: off), the
        # gradient scale of the step's summed losses (1 / tokens), and what it measured
        self.kl_coef: float = 0.0
        self.kl_scale: float = 1.0
        self.stats = IndexerStats()

    @torch.no_grad()
    def init_weights(self, std: float) -> None:
        """HF's init of the pooling tensors (the linears and the key norm are initialised as modules)."""
        if self.pooled:
            self.index_kpool_compress_ape.zero_()
            self.index_kpool_compress_gate.fill_(1.0)

    def _rope(self, x_BQD: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None) -> torch.Tensor:
        return x_BQD if cos is None else rope.apply(x_BQD, cos, sin)

    def forward(self, x_BQH: torch.Tensor, q_resid_BQR: torch.Tensor, ctx: SeqContext) -> torch.Tensor:
        """Selected key indices (global, -1 = empty) ``[B, Q, W]`` int32."""
        with torch.no_grad():
            return self.select(self.prepare(x_BQH, q_resid_BQR, ctx))

    def prepare(self, x_BQH: torch.Tensor, q_resid_BQR: torch.Tensor, ctx: SeqContext) -> Prepared:
        """The keys of the whole sequence pooled per batch row, the head weights and the positions: what the
        selection and the objective read (with a graph to the indexer's parameters when grad is on)."""
        B, Q, _ = x_BQH.shape
        cos = sin = None
        if self.rope_dim:  # DeepSeek: the first rope_dim dims of keys and queries rotated at their positions
            freq, factor = rope.inv_freq(self.rope_dim, self.rope_theta, self.rope_scaling, self.max_positions,
                                         x_BQH.device)
            cos, sin = rope.cos_sin(positions_for(ctx, B, Q, x_BQH.device), freq, factor, x_BQH.dtype)
        k_BQD = self._rope(self.k_norm(self.wk(x_BQH)), cos, sin)
        if self.pooled:
            gate_BQD = F.linear(x_BQH, self.index_kpool_compress_gate)
            k_BSD, gate_BSD = ctx.gather_seq(torch.cat([k_BQD, gate_BQD], dim=-1), key=f"{self.layer}.keys").split(
                self.head_dim, dim=-1)
            del gate_BQD
        else:
            k_BSD, gate_BSD = ctx.gather_seq(k_BQD, key=f"{self.layer}.keys"), None
        del k_BQD
        weights_BQI = self.weights_proj(x_BQH).to(compute_dtype(x_BQH.dtype)) * self.n_heads**-0.5
        S = k_BSD.shape[1]
        assert S < 2**31, "key indices are int32"
        doc_BS = ctx.full_doc_ids()
        one_doc = doc_BS is None  # one document: the pools' ends are known without reading anything back
        if one_doc:
            doc_BS = torch.zeros(B, S, dtype=torch.int64, device=x_BQH.device)
        pos_BS = positions_from_doc_ids(doc_BS)
        q_pos_Q = ctx.seq_offset() + torch.arange(Q, device=x_BQH.device)
        pools = [self._pool_keys(k_BSD[b], None if gate_BSD is None else gate_BSD[b], pos_BS[b], one_doc)
                 for b in range(B)]
        whole = x_BQH.device.type == "cpu" and one_doc and ctx.seq_offset() == 0 and Q == S
        row_len = S // self.kpool if whole else None
        return Prepared(q_resid_BQR, weights_BQI, doc_BS, pos_BS, q_pos_Q, pools, ctx.seq_offset(), cos, sin,
                        row_len)

    @torch.no_grad()
    def select(self, prep: Prepared) -> torch.Tensor:
        """The selection from ``prepare``'s result: ``[B, Q, W]`` int32 (see ``forward``)."""
        q_resid_BQR, pools = prep.q_resid_BQR, prep.pools
        B, Q = q_resid_BQR.shape[:2]
        kp = self.kpool
        num = [min(self.index_topk // kp, tok_Pk.shape[0]) for _, tok_Pk in pools]
        tail = kp - 1 if self.select_tail and kp > 1 else 0
        # the selection is the big tensor ([Q, W] int32: 8 GiB at 1M tokens): written in place, once
        out = torch.full((B, Q, max(num) * kp + tail), -1, dtype=torch.int32, device=q_resid_BQR.device)
        for b, (keys_PD, tok_Pk) in enumerate(pools):
            rot = None if prep.cos is None else (prep.cos[b].unsqueeze(1), prep.sin[b].unsqueeze(1))
            self._select_row(out[b], num[b], q_resid_BQR[b], prep.weights_BQI[b], keys_PD, tok_Pk, prep.doc_BS[b],
                             prep.pos_BS[b], prep.q_pos_Q, prep.q_start, rot, prep.row_len)
        return out

    def _pool_keys(self, k_SD: torch.Tensor, gate_SD: torch.Tensor, pos_S: torch.Tensor, one_doc: bool = False):
        """Complete pools: (keys ``[P, Di]``, token indices ``[P, kp]``), in sequence order (unpooled: every
        token its own pool). ``one_doc``: ``pos_S`` counts from 0 (one document), so the pools end every kp
        tokens (else their ends are found on the device, a host sync)."""
        kp = self.kpool
        if gate_SD is None:
            return k_SD, torch.arange(k_SD.shape[0], device=k_SD.device)[:, None]
        if one_doc:
            ends_P = torch.arange(kp - 1, max(k_SD.shape[0], kp - 1), kp, device=k_SD.device)  # none below kp
        else:
            ends_P = torch.nonzero((pos_S + 1) % kp == 0).squeeze(-1)
        tok_Pk = ends_P[:, None] - (kp - 1) + torch.arange(kp, device=k_SD.device)
        cd = compute_dtype(k_SD.dtype)
        logits = gate_SD[tok_Pk].to(cd) + self.index_kpool_compress_ape.to(cd)[None]
        probs = logits.softmax(dim=1).to(k_SD.dtype)  # per channel, over the kp tokens of the pool
        return (probs * k_SD[tok_Pk]).sum(dim=1), tok_Pk

    def _select_row(self, out_QW, num_pools, q_resid_QR, w_QI, keys_PD, tok_Pk, doc_S, pos_S, q_pos_Q, q_start,
                    rot: tuple[torch.Tensor, torch.Tensor] | None = None, row_len: int | None = None) -> None:
        """One batch row into ``out_QW``: ``num_pools * kp`` selected pool tokens, then the tail pool.

        Queries go a scoring chunk at a time (``query_chunk``), their indexer queries projected per
        chunk: neither ``[Q, I * Di]`` nor ``[Q, P]`` is ever built. A chunk's queries end at key
        ``q_start + e - 1``, so at most ``(q_start + e) // kp`` pools (kp distinct keys each) end at or before
        it: the op's ``visible``, known without reading the pools' ends back.
        """
        kp, I, Di = self.kpool, self.n_heads, self.head_dim
        pool_end_P = tok_Pk[:, -1]
        pool_doc_P, q_doc_Q = doc_S[pool_end_P], doc_S[q_pos_Q]
        first_P = tok_Pk[:, 0].to(torch.int32)
        offs_k = torch.arange(kp, dtype=torch.int32, device=out_QW.device)
        Q, width = q_resid_QR.shape[0], num_pools * kp
        chunk = indexer_scoring.resolve_query_chunk(self.query_chunk, tok_Pk.shape[0], I, num_pools)
        for s in range(0, Q, chunk):
            e = min(s + chunk, Q)
            q_cID = self.wq_b(q_resid_QR[s:e]).view(e - s, I, Di)
            if rot is not None:  # DeepSeek: this chunk's queries rotated at their positions
                q_cID = rope.apply(q_cID, rot[0][s:e], rot[1][s:e])
            sel_cK, ok_cK = dispatch.call(
                "indexer_topk", q_cID, w_QI[s:e], keys_PD, pool_end_P, pool_doc_P, q_pos_Q[s:e], q_doc_Q[s:e],
                self.index_topk // kp, self.softmax_scale, query_chunk=e - s, row_len=row_len,
                visible=(q_start + e) // kp, layer=self.layer)
            # a pool's tokens are consecutive (tok_Pk[p] = first_P[p] + 0 .. kp - 1): written from the pools'
            # first tokens, not gathered as [c, K, kp] rows of tok_Pk (a slow gather of 64-byte rows)
            if sel_cK.shape != (e - s, num_pools):  # the add below would broadcast a single column silently
                raise RuntimeError(f"{self.layer}: indexer_topk returned {tuple(sel_cK.shape)} pools for "
                                   f"{(e - s, num_pools)}")
            dst = out_QW[s:e, :width].view(e - s, num_pools, kp)
            torch.add(first_P[sel_cK].unsqueeze(-1), offs_k, out=dst)
            dst.masked_fill_(~ok_cK.unsqueeze(-1), -1)
        if self.select_tail and kp > 1:
            # the query's own incomplete pool: the last (pos + 1) % kp tokens up to and including it
            tail_count = (pos_S[q_pos_Q] + 1) % kp
            offs = torch.arange(kp - 1, device=out_QW.device)
            tail = (q_pos_Q - tail_count + 1)[:, None] + offs
            out_QW[:, width:width + kp - 1] = tail.masked_fill_(offs[None, :] >= tail_count[:, None], -1)


# ---- attention -----------------------------------------------------------------------------------------
def indexer_inputs(x_BQH: torch.Tensor, q_resid_BQR: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What the indexer's objective reads: the layer input and query latent detached, so its gradient reaches
    the indexer's parameters only (DeepSeek-V3.2: "we detach the indexer input from the computational graph")."""
    return x_BQH.detach(), q_resid_BQR.detach()


class MLASparseAttention(MultiLatentAttention):
    """MLA + DSA token mixer; parameter names mirror ``Glm5NextTextAttention`` / ``DeepseekV32Attention``.

    ``topk_source`` is the index of the layer whose selection a ``shared`` layer reuses (None for a
    full layer); ``layer_idx`` is this layer's index, recorded with the selection it publishes.
    ``indexer``: "glm5" (pooled, NoPE; the latent norms at ``rms_norm_eps``) or "deepseek" (V3.2's: every
    token scored, RoPE; the latent norms at HF's default 1e-6).
    """

    def __init__(self, spec: ModelSpec, layer_idx: int, topk_source: int | None = None,
                 layer: str = "dsa", indexer: str = "glm5") -> None:
        if indexer not in ("glm5", "deepseek"):
            raise ValueError(f"indexer must be 'glm5' or 'deepseek', got {indexer!r}")
        if indexer == "glm5" and spec.qk_rope_head_dim:  # HF's glm5_next config refuses it too
            raise ValueError(f"qk_rope_head_dim = {spec.qk_rope_head_dim}: GLM-5.3-Flash's MLA is NoPE; set it to 0")
        super().__init__(spec, layer, latent_norm_eps=spec.rms_norm_eps if indexer == "glm5" else 1e-6)
        self.layer_idx, self.topk_source = layer_idx, topk_source
        self.indexer = Indexer(spec, pooled=indexer == "glm5") if topk_source is None else None
        self.dense_attention = False  # the indexer's warm-up: attend every visible key (set by the trainer)
        if self.indexer is not None:
            self.indexer.layer = f"{layer}.indexer"

    def _selection(self, x_BQH: torch.Tensor, q_resid: torch.Tensor, ctx: SeqContext,
                   prep: Prepared | None = None) -> torch.Tensor:
        if self.indexer is None:
            if ctx.carry.get("topk_layer") != self.topk_source:
                raise ValueError(
                    f"layer {self.layer_idx} (indexer 'shared') needs the selection of layer "
                    f"{self.topk_source} in ctx.carry['topk'], found layer {ctx.carry.get('topk_layer')}: "
                    "run the layers in order (and restore ctx.carry when recomputing a layer)")
            return ctx.carry["topk"]
        make = (lambda: self.indexer.select(prep)) if prep is not None else (
            lambda: self.indexer(x_BQH, q_resid, ctx))
        idx = ctx.reuse(f"{self.layer}.selection", make)
        ctx.carry["topk"], ctx.carry["topk_layer"] = idx, self.layer_idx
        return idx

    def trains_indexer(self) -> bool:
        """Whether this forward adds the indexer's objective: a full indexer, a coefficient, a graph."""
        return self.indexer is not None and self.indexer.kl_coef > 0 and torch.is_grad_enabled()

    def forward(self, x_BQH: torch.Tensor, ctx: SeqContext) -> torch.Tensor:
        B, Q, _ = x_BQH.shape
        q_BQHD, latent_BQC, q_resid = self.project(x_BQH, ctx)
        c_BSC = ctx.gather_seq(latent_BQC, key=f"{self.layer}.latent")
        prep = self.indexer.prepare(*indexer_inputs(x_BQH, q_resid), ctx) if self.trains_indexer() else None
        w = linear_weight(self.kv_b_proj)  # with a LoRA adapter, merged with it
        if self.dense_attention:  # the warm-up: every visible key
            if prep is None and self.indexer is not None and ctx.segmented:  # the segments' key cache is filled
                with torch.no_grad():
                    self.indexer.prepare(*indexer_inputs(x_BQH, q_resid), ctx)
            doc_BS = ctx.full_doc_ids()
            if doc_BS is None:
                doc_BS = torch.zeros(B, c_BSC.shape[1], dtype=torch.int64, device=x_BQH.device)
            q_pos = ctx.seq_offset() + torch.arange(Q, device=x_BQH.device)
            out = dense_latent_attention(q_BQHD, c_BSC, w, q_pos, doc_BS, self.scaling, self.rope_dim)
        else:
            idx = self._selection(x_BQH, q_resid, ctx, prep)
            if prep is None:
                out = dispatch.call("sparse_attention", q_BQHD, c_BSC, w, idx, self.scaling, layer=self.layer)
            else:  # the sparse stage's objective runs in the backward, after the attention's, from the
                # probabilities that backward leaves (else from the attention's per-head log-sum-exp)
                from megaseq.models.common.indexer_objective import SparseObjective

                objective = SparseObjective(self, prep, q_BQHD, c_BSC, w, idx)
                out, objective.lse_BQH = dispatch.call(
                    "sparse_attention", objective.attach(q_BQHD), c_BSC, w, idx, self.scaling, layer=self.layer,
                    return_lse=True, head_probs=objective.head_probs)
        out = self.o_proj(out.reshape(B, Q, -1))
        if prep is not None and self.dense_attention:
            from megaseq.models.common.indexer_objective import indexer_loss

            with torch.profiler.record_function("indexer_objective"):  # its own row in a profile of the step
                kl = indexer_loss(self, prep, q_BQHD, c_BSC, w)
            out = AttachLoss.apply(out, kl, self.indexer.kl_coef * self.indexer.kl_scale)
        return out
