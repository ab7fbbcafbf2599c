"""The DSA indexer's KL objective against its written-out formula, float64 on the CPU, under autograd.

The reference below builds every ``[Q, S]`` tensor at once: the main attention's probabilities per head from
the expanded keys (masked causal + same document in the warm-up, to the selection in the sparse stage), summed
over heads, a pool's tokens summed, restricted to the candidate (or selected) pools and L1-normalised; the
indexer's scores of every pool from its parameters on the detached layer input; ``sum_q KL``. Its gradient
with respect to the indexer's parameters must equal what the layer's ``AttachLoss`` hands them, and the main
model's gradients must be those of the LM loss alone. Broken variants (an undetached indexer input, a target
normalised per head) must fail the same checks.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from megaseq.models.common import indexer_kl, mla_dsa
from megaseq.models.common.context import SeqContext, positions_from_doc_ids
from megaseq.models.common.mla_dsa import MLASparseAttention
from megaseq.models.glm5.spec import glm5_flash_tiny
from megaseq.ops.sparse_mla import reference as sparse_mla_ref
from megaseq.ops.sparse_mla.reference import expand_latent

TOL = dict(atol=1e-10, rtol=1e-9)
COEF, SCALE = 0.7, 1.0 / 37


def spec(kp: int):
    return glm5_flash_tiny().replace(index_kpool=kp, index_topk=8 * kp if kp > 1 else 6, index_n_heads=4)


def layer(kp: int, seed: int = 0) -> MLASparseAttention:
    """A GLM layer with pools of ``kp`` (``kp`` 0: DeepSeek-V3.2's indexer, RoPE, every token scored)."""
    torch.manual_seed(seed)
    if kp == 0:
        from megaseq.models.deepseek_v32.spec import deepseek_v32_tiny

        m = MLASparseAttention(deepseek_v32_tiny().replace(index_topk=6), 0, indexer="deepseek").double()
    else:
        m = MLASparseAttention(spec(kp), 0).double()
    with torch.no_grad():
        for p in m.indexer.parameters():  # away from HF's init (zero ape, unit gate): every term matters
            p.add_(0.3 * torch.randn_like(p))
    m.indexer.kl_coef, m.indexer.kl_scale = COEF, SCALE
    return m


def doc_ids(S: int, packed: bool) -> torch.Tensor | None:
    if not packed:
        return None
    d = torch.zeros(1, S, dtype=torch.int64)
    d[0, S // 3:] = 1
    d[0, S // 3 + 7:] = 2
    return d


# ---- the written-out formula ------------------------------------------------------------------------------
def pools_of(doc_S: torch.Tensor, kp: int) -> list[list[int]]:
    """Complete pools of kp consecutive tokens from each document's first token, in sequence order."""
    pos = positions_from_doc_ids(doc_S[None])[0].tolist()
    return [list(range(t - kp + 1, t + 1)) for t in range(len(pos)) if (pos[t] + 1) % kp == 0]


def reference_kl(m: MLASparseAttention, x: torch.Tensor, doc_S: torch.Tensor, idx: torch.Tensor | None,
                 per_head: bool = False) -> torch.Tensor:
    """``sum_q KL(target_q || softmax(I_q))`` over the candidate (``idx`` None) or selected pools."""
    ix, S = m.indexer, x.shape[1]
    kp = ix.kpool
    ctx = SeqContext(position_ids=positions_from_doc_ids(doc_S[None]))
    with torch.no_grad():
        q, latent, q_resid = m.project(x, ctx)
        R = m.kv_lora_rank
        k, _ = expand_latent(latent[..., :R], m.kv_b_proj.weight, m.num_heads, m.nope_dim)
        if m.rope_dim:  # DeepSeek: the rotated key part every head shares
            k = torch.cat([k, latent[..., R:].unsqueeze(1).expand(-1, m.num_heads, -1, -1)], dim=-1)
        s = torch.einsum("bqhd,bhkd->bhqk", q, k)[0] * m.scaling  # [Hh, Q, S]
    xd, qr = x.detach()[0], q_resid.detach()[0]
    keys = ix.k_norm(ix.wk(xd))
    qi = (qr @ ix.wq_b.weight.T).view(S, ix.n_heads, ix.head_dim)
    if ix.rope_dim:  # RoPE on the first rope_dim dims of the indexer's queries and keys, at their positions
        from megaseq.models.common import rope

        freq, factor = rope.inv_freq(ix.rope_dim, ix.rope_theta, ix.rope_scaling, ix.max_positions, x.device)
        cos, sin = rope.cos_sin(ctx.position_ids, freq, factor, x.dtype)
        keys = rope.apply(keys, cos[0], sin[0])
        qi = rope.apply(qi, cos[0].unsqueeze(1), sin[0].unsqueeze(1))
    pools = pools_of(doc_S, kp)
    if ix.pooled:
        gate = xd @ ix.index_kpool_compress_gate.T
        pool_keys = torch.stack([(torch.softmax(gate[p] + ix.index_kpool_compress_ape, 0) * keys[p]).sum(0)
                                 for p in pools])
    else:
        pool_keys = keys
    w = (xd @ ix.weights_proj.weight.T) * ix.n_heads**-0.5
    index = torch.einsum("qh,qhp->qp", w, torch.relu(torch.einsum("qhd,pd->qhp", qi, pool_keys) * ix.softmax_scale))
    total = x.new_zeros(())
    for t in range(S):
        same = doc_S == doc_S[t]
        if idx is None:
            visible = same & (torch.arange(S) <= t)
            cand = [j for j, p in enumerate(pools) if p[-1] <= t and bool(same[p[-1]])]
        else:
            sel = [int(i) for i in idx[0, t] if i >= 0]
            visible = torch.zeros(S, dtype=torch.bool)
            visible[sel] = True
            firsts = [int(i) for i in idx[0, t, :(idx.shape[-1] - (kp - 1 if kp > 1 else 0)):kp] if i >= 0]
            cand = [j for j, p in enumerate(pools) if p[0] in firsts]
        if not cand:
            continue
        with torch.no_grad():
            probs = torch.softmax(s[:, t].masked_fill(~visible, float("-inf")), -1)  # [Hh, S]
            mass = torch.stack([probs[:, pools[j]].sum(-1) for j in cand], -1)  # [Hh, n]
            target = mass.sum(0) / mass.sum() if not per_head else (mass / mass.sum(-1, keepdim=True)).mean(0)
        logp = torch.log_softmax(index[t, cand], -1)
        total = total + (target * (target.log() - logp)).sum()
    return total


def run_layer(m: MLASparseAttention, x: torch.Tensor, docs: torch.Tensor | None, dense: bool):
    m.dense_attention = dense
    m.zero_grad()
    x = x.clone().requires_grad_(True)
    out = m(x, SeqContext(doc_ids=docs))
    g_out = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)
    out.backward(g_out)
    return out, g_out, x.grad


def check(kp: int, packed: bool, dense: bool, per_head_reference: bool = False) -> None:
    S = 41
    m = layer(kp)
    x = torch.randn(1, S, m.q_a_proj.in_features, dtype=torch.float64)
    docs = doc_ids(S, packed)
    doc_S = docs[0] if docs is not None else torch.zeros(S, dtype=torch.int64)
    out, g_out, x_grad = run_layer(m, x, docs, dense)
    got = {n: p.grad.clone() for n, p in m.indexer.named_parameters()}
    main = {n: p.grad.clone() for n, p in m.named_parameters() if not n.startswith("indexer.")}
    stats = m.indexer.stats.read()
    # the reference: the same layer without the objective (the main model's gradient), then the formula's
    m.indexer.kl_coef = 0.0
    ref_out, _, ref_x_grad = run_layer(m, x, docs, dense)
    torch.testing.assert_close(out, ref_out, atol=0, rtol=0)
    torch.testing.assert_close(x_grad, ref_x_grad, **TOL, msg=lambda s: f"main grad of the layer input: {s}")
    for n, p in m.named_parameters():
        if not n.startswith("indexer."):
            torch.testing.assert_close(main[n], p.grad, **TOL, msg=lambda s, n=n: f"main grad {n}: {s}")
    idx = None if dense else m.indexer(x, m.project(x, SeqContext(doc_ids=docs))[2], SeqContext(doc_ids=docs))
    m.zero_grad()
    ref = reference_kl(m, x, doc_S, idx, per_head=per_head_reference)
    ref = ref.detach()
    assert abs(stats.kl_sum - float(ref)) <= 1e-9 * max(1.0, abs(float(ref))), ("kl", stats.kl_sum, float(ref))
    (reference_kl(m, x, doc_S, idx, per_head=per_head_reference) * COEF * SCALE).backward()
    for n, p in m.indexer.named_parameters():
        torch.testing.assert_close(got[n], p.grad, **TOL, msg=lambda s, n=n: f"indexer grad {n}: {s}")


@pytest.mark.parametrize("kp", [1, 4, 0])  # 0: DeepSeek-V3.2's indexer
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("dense", [False, True])
def test_objective_matches_formula(kp: int, packed: bool, dense: bool) -> None:
    check(kp, packed, dense)


def test_undetached_input_fails(monkeypatch) -> None:
    """An indexer reading the layer input with its graph sends the KL's gradient into the main model."""
    monkeypatch.setattr(mla_dsa, "indexer_inputs", lambda x, q: (x, q))
    with pytest.raises(AssertionError, match="main grad"):
        check(4, False, False)


def test_per_head_target_fails(monkeypatch) -> None:
    """A target normalised per head (then averaged) is another distribution: the formula's check fails."""
    from megaseq.ops import dispatch

    with pytest.raises(AssertionError):
        check(4, True, False, per_head_reference=True)

    def per_head(q_abs, c_SC, idx_cW, kp, num_pools, scale, probs=None, lse=None):
        S = c_SC.shape[0]
        ok = (idx_cW >= 0) & (idx_cW < S)
        keys = c_SC.index_select(0, torch.where(ok, idx_cW.long(), 0).reshape(-1)).view(*idx_cW.shape, -1)
        s = torch.einsum("chr,cnr->chn", q_abs, keys) * scale
        p = s.masked_fill(~ok[:, None], float("-inf")).softmax(-1)
        mass = p[..., :num_pools * kp].reshape(*p.shape[:2], num_pools, kp).sum(-1)
        cand = ok[:, :num_pools * kp:kp]
        mass = mass.masked_fill(~cand[:, None], 0.0)
        t = (mass / mass.sum(-1, keepdim=True).clamp_min(1e-300)).mean(1)
        return t, cand

    def attention(*args, head_probs=None, **kw):  # none left: the target is made from the lse
        return attention_original(*args, **kw)

    monkeypatch.setattr(indexer_kl, "sparse_target", per_head)
    with dispatch.override("sparse_attention", "absorbed", attention) as attention_original:
        with pytest.raises(AssertionError):
            check(4, True, False)


# ---- the sparse stage's target reads the attention's log-sum-exp ----------------------------------------------
ATTENTION_IMPL = {4: "absorbed", 0: "torch_masked"}  # float64 on the CPU: GLM's NoPE latent, DeepSeek's with RoPE


@pytest.mark.parametrize("kp", [4, 0])
def test_the_sparse_target_reads_the_attentions_lse(kp: int) -> None:
    """Every chunk's target gets its queries' rows of the lse ``sparse_attention`` returned (base 2, ``[c, Hh]``):
    the formula's check passes on that path; the warm-up's target takes none."""
    from megaseq.ops import dispatch

    seen, attn = [], []

    def target(q_abs, c_SC, idx_cW, scale, lse=None):
        seen.append(lse)
        return original(q_abs, c_SC, idx_cW, scale, lse=lse)

    def attention(*args, head_probs=None, **kw):  # none left: the target is made from the lse
        res = attention_original(*args, **kw)
        attn.append(res[1] if kw.get("return_lse") else None)
        return res

    with dispatch.override("indexer_target", "torch_gather", target) as original, \
            dispatch.override("sparse_attention", ATTENTION_IMPL[kp], attention) as attention_original:
        check(kp, True, False)
        assert seen and all(lse is not None and lse.dtype == torch.float64 for lse in seen)
        assert attn[0] is not None and torch.equal(torch.cat(seen), attn[0][0])  # one batch row, its chunks
        seen.clear()
        check(kp, True, True)
        assert not seen


BROKEN_LSE = {"natural_base": lambda lse: lse / math.log2(math.e), "heads_permuted": lambda lse: lse.roll(1, -1)}


@pytest.mark.parametrize("kp", [4, 0])
@pytest.mark.parametrize("name", list(BROKEN_LSE))
def test_a_broken_attention_lse_fails(monkeypatch, kp: int, name: str) -> None:
    """The attention's lse in the natural base, or with its heads permuted: the formula's check fails."""
    from megaseq.ops import dispatch

    def attention(*args, head_probs=None, **kw):  # none left: the target is made from the lse
        res = attention_original(*args, **kw)
        return (res[0], BROKEN_LSE[name](res[1])) if kw.get("return_lse") else res

    with dispatch.override("sparse_attention", ATTENTION_IMPL[kp], attention) as attention_original:
        with pytest.raises(AssertionError):
            check(kp, False, False)


# ---- the sparse stage's target read from the probabilities the attention's backward recomputes ----------------
def test_the_sparse_target_reads_the_attentions_head_probs() -> None:
    """``absorbed`` leaves the head-summed probabilities in its backward: the objective reads them (op
    ``indexer_target`` never runs) and the formula's check passes, packed documents or not."""
    from megaseq.ops import dispatch

    def target(*args, **kw):
        raise AssertionError("indexer_target ran: the attention's head probabilities were not read")

    left = []

    def attention(*args, head_probs=None, **kw):
        left.append(head_probs)
        return attention_original(*args, head_probs=head_probs, **kw)

    with dispatch.override("indexer_target", "torch_gather", target), \
            dispatch.override("sparse_attention", "absorbed", attention) as attention_original:
        check(4, True, False)
        check(4, False, False)
    handed = [h for h in left if h is not None]  # the objective's runs (check's reference run has none)
    assert len(handed) == 2 and all(h.m_BQW is None for h in handed)  # read, then released


BROKEN_PROBS = {"one_head": "the first head's probabilities alone", "slots_rolled": "each slot given its neighbour's"}


@pytest.mark.parametrize("name", list(BROKEN_PROBS))
def test_broken_head_probs_fail(monkeypatch, name: str) -> None:
    """The attention's backward leaving another quantity (one head's probabilities, or the slots shifted by one):
    the formula's check fails."""
    from megaseq.ops.sparse_mla import absorbed

    real = absorbed._block_backward

    def broken(blk, b, s, e, q, g, lse, w_uk, w_uv, empty, scale, grads, probs_QW=None):
        real(blk, b, s, e, q, g, lse, w_uk, w_uv, empty, scale, grads, probs_QW)
        if probs_QW is not None:
            p = blk.probs(lse[b, s:e])
            probs_QW.copy_(p[:, 0] if name == "one_head" else p.sum(1).roll(1, -1))

    monkeypatch.setattr(absorbed, "_block_backward", broken)
    with pytest.raises(AssertionError, match="indexer grad|kl"):
        check(4, True, False)


def test_dense_attention_is_sparse_over_every_visible_key() -> None:
    """The warm-up's attention equals the sparse op given every visible key (packed documents)."""
    S = 29
    m = layer(4)
    x = torch.randn(1, S, m.q_a_proj.in_features, dtype=torch.float64)
    docs = doc_ids(S, True)
    q, latent, _ = m.project(x, SeqContext(doc_ids=docs))
    pos = torch.arange(S)
    same = docs[0][None] == docs[0][:, None]
    idx = torch.where(same & (pos[None] <= pos[:, None]), pos[None], -1).to(torch.int32)[None]
    want = sparse_mla_ref.sparse_mla_reference(q, latent, m.kv_b_proj.weight, idx, m.scaling)
    got = indexer_kl.dense_latent_attention(q, latent, m.kv_b_proj.weight, pos, docs, m.scaling, 0)
    torch.testing.assert_close(got, want, **TOL)


def test_kl_rows_formula() -> None:
    """``kl_rows`` against ``F.kl_div`` on rows with some candidates masked, and zero on a row without any."""
    g = torch.Generator().manual_seed(1)
    index = torch.randn(3, 5, generator=g, dtype=torch.float64)
    cand = torch.tensor([[1, 1, 0, 1, 1], [1, 0, 0, 0, 1], [0, 0, 0, 0, 0]], dtype=torch.bool)
    t = indexer_kl.normalise(torch.rand(3, 5, generator=g, dtype=torch.float64), cand)
    got = indexer_kl.kl_rows(t, index, cand)
    for r in range(2):
        c = cand[r]
        want = F.kl_div(index[r, c].log_softmax(-1), t[r, c], reduction="sum")
        torch.testing.assert_close(got[r], want, **TOL)
    assert got[2] == 0


# ---- composition: context parallelism (gather-KV over gloo) and sequence segments ------------------------
class _TrainedFullThenShared(torch.nn.Module):
    """``test_parallel_dsa.FullThenShared`` with the objective on (the sparse stage, or the dense warm-up)."""

    dense = False

    def __init__(self) -> None:
        super().__init__()
        from test_parallel_dsa import FullThenShared

        self.inner = FullThenShared()
        self.inner.full.indexer.kl_coef, self.inner.full.indexer.kl_scale = COEF, SCALE
        for m in (self.inner.full, self.inner.shared):
            m.dense_attention = self.dense

    def forward(self, x: torch.Tensor, ctx) -> torch.Tensor:
        return self.inner(x, ctx)


class _DenseFullThenShared(_TrainedFullThenShared):
    dense = True


@pytest.mark.parametrize("block", [_TrainedFullThenShared, _DenseFullThenShared])
def test_objective_under_context_parallelism(block) -> None:
    """Each rank's queries against the gathered keys; the keys' gradient reduce-scattered to their owners: the
    loss's every gradient (the indexer's too) equals one process's."""
    from test_parallel_ulysses import block_parity

    from megaseq.parallel.launch import spawn_local

    spawn_local(block_parity, 2, args=(block, 1, 2, 2, 24, 10))


def _objective_model():
    from megaseq.models.build import build_model
    from megaseq.train import indexer_training

    s = glm5_flash_tiny()
    s = s.replace(num_layers=5, layer_types=s.layer_types[:5], mlp_types=("dense",) * 5,
                  indexer_types=("full",) * 3 + ("full", "shared"), index_kpool=4, index_topk=16)
    model = build_model(s, dtype=torch.float64, seed=0)
    indexer_training.enable(model, COEF)
    indexer_training.loss_scale(model, 37)
    return s, model


@pytest.mark.parametrize("scheme", ["recompute", "recompute_offload"])
def test_objective_under_recompute(scheme: str) -> None:
    """Full recompute (and SCO): the layer runs without a graph, then again with one in backward; the term is
    computed there once, and every gradient equals the plain step's."""
    from megaseq.memory.offload import BoundaryOffloader, checkpoint_layers

    s, model = _objective_model()
    ids = torch.randint(1, s.vocab_size, (1, 40), generator=torch.Generator().manual_seed(3))
    model.zero_grad()
    model(ids).square().mean().backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    kl_ref = [m.stats.read().kl_sum for m in model.modules() if getattr(m, "kl_coef", 0)]
    for m in model.modules():
        if getattr(m, "kl_coef", 0):
            m.stats.reset()
    checkpoint_layers(model.layers, BoundaryOffloader(10**9) if scheme == "recompute_offload" else None)
    model.zero_grad()
    model(ids).square().mean().backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    assert got.keys() == ref.keys() and any(".indexer." in n for n in ref)
    for n in ref:
        torch.testing.assert_close(got[n], ref[n], **TOL, msg=lambda m, n=n: f"{n}: {m}")
    kl_got = [m.stats.read().kl_sum for m in model.modules() if getattr(m, "kl_coef", 0)]
    assert kl_got == pytest.approx(kl_ref, rel=1e-12)  # once per step, not once per run of the layer


@pytest.mark.parametrize("dense", [False, True])
def test_objective_under_sequence_segments(dense: bool) -> None:
    """Segments (KDA + full and shared DSA, packed documents): loss and every gradient equal the plain step's;
    the indexer's keys of earlier segments carry their gradient back."""
    from megaseq.memory import model_segments as ms
    from megaseq.memory.vocab_loss import linear_cross_entropy
    from megaseq.train import indexer_training

    s, model = _objective_model()
    for _, m in indexer_training.dsa_layers(model):
        m.dense_attention = dense
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(1, s.vocab_size, (1, 45), generator=g)
    labels = torch.randint(1, s.vocab_size, (1, 45), generator=g)
    docs = doc_ids(45, True)

    def loss_fn(hidden, lab):
        return linear_cross_entropy(hidden.reshape(-1, hidden.shape[-1]), model.lm_head.weight, lab.reshape(-1),
                                    reduction="sum")

    model.zero_grad()
    (loss_fn(model(ids, doc_ids=docs), labels) / 37).backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    assert any(".indexer." in n for n in ref)
    model.zero_grad()
    ms.segmented_loss_backward(model, ids, labels, loss_fn, 1 / 37, 16, doc_ids=docs)
    got = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    assert got.keys() == ref.keys()
    for n in ref:
        torch.testing.assert_close(got[n], ref[n], **TOL, msg=lambda m, n=n: f"{n}: {m}")


# ---- memory: one chunk at a time, never [S, S] ---------------------------------------------------------------
def _objective_peak(S: int, dense: bool) -> tuple[int, int]:
    """Peak bytes of one layer's objective (the warm-up's ``indexer_loss``, the sparse stage's
    ``SparseObjective.grads``; their inputs made before) and the formula's."""
    import warnings

    from torch.distributed._tools.mem_tracker import MemTracker

    from megaseq.models.common.indexer_objective import SparseObjective, indexer_loss
    from megaseq.models.common.lora import linear_weight
    from megaseq.ops.workspace import indexer_kl_bytes

    m = layer(4)
    m.indexer.query_chunk = 32
    x = torch.randn(1, S, m.q_a_proj.in_features, dtype=torch.float64)
    ctx = SeqContext()
    q, latent, q_resid = m.project(x, ctx)
    prep = m.indexer.prepare(x.detach(), q_resid.detach(), ctx)
    objective = None
    if not dense:  # the sparse stage's objective as its backward runs it, from the attention's lse
        idx = m.indexer.select(prep)
        objective = SparseObjective(m, prep, q, latent, m.kv_b_proj.weight, idx)
        with torch.no_grad():
            objective.lse_BQH = sparse_mla_ref.sparse_mla_reference(q, latent, m.kv_b_proj.weight, idx, m.scaling,
                                                                    return_lse=True)[1]
        leaves = (prep.pools[0][0], prep.weights_BQI, linear_weight(m.indexer.wq_b))
    tracker = MemTracker()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with tracker:
            if dense:
                indexer_loss(m, prep, q, latent, m.kv_b_proj.weight)
            else:
                objective.grads(leaves)
    measured = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
    ix = m.indexer
    P, K = S // 4, ix.index_topk // 4
    W = K * 4 + 3
    predicted = indexer_kl_bytes(S, S, m.num_heads, ix.n_heads, ix.head_dim, P, K, W, latent.shape[-1], dense,
                                 itemsize=8, budget=32 * 10**9)
    return measured, predicted


@pytest.mark.parametrize("dense", [False, True])
def test_objective_memory_is_chunked(dense: bool) -> None:
    """Doubling the sequence at a fixed chunk: the sparse stage's peak grows about linearly (its chunk is
    fixed, the summed gradients per token), never as an ``[S, S]`` tensor would."""
    (m1, _), (m2, _) = _objective_peak(256, dense), _objective_peak(512, dense)
    quadratic = 8 * (512 * 512 - 256 * 256)  # what one fp64 [S, S] tensor would add
    print(f"\npeak {m1} -> {m2} bytes (an [S, S] tensor would add {quadratic})")
    assert m2 - m1 < quadratic


# ---- on the GPU: bf16 with the fast kernels against the float64 computation -------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dense", [False, True])
def test_objective_on_gpu_bf16_matches_float64(dense: bool) -> None:
    """A glm5-shaped layer (pools of 4) at 2K tokens in bf16 autocast with the fast set (Triton sparse MLA and
    selection): the KL and the indexer's gradients against the same layer in float64 attending the same
    selection (the bf16 run's: in float64 a near-tie would select another pool in a few rows, and the sparse
    objective's gradient would follow that pool instead of measuring the kernels)."""
    from megaseq.ops import dispatch

    S = 2048
    spec_ = glm5_flash_tiny().replace(index_kpool=4, index_topk=64, index_n_heads=8, index_head_dim=32,
                                      kv_lora_rank=64, qk_nope_head_dim=32, v_head_dim=32, num_attention_heads=8)
    torch.manual_seed(0)
    ref = MLASparseAttention(spec_, 0).double().cuda()
    ref.indexer.kl_coef, ref.indexer.kl_scale = COEF, SCALE
    ref.dense_attention = dense
    x = torch.randn(1, S, ref.q_a_proj.in_features, dtype=torch.float64, device="cuda")
    fast = MLASparseAttention(spec_, 0).cuda()
    fast.load_state_dict({k: v.float() for k, v in ref.state_dict().items()})
    fast.indexer.kl_coef, fast.indexer.kl_scale = COEF, SCALE
    fast.dense_attention = dense
    chosen = []
    select = fast.indexer.select
    fast.indexer.select = lambda prep: chosen.append(select(prep)) or chosen[-1]
    with dispatch.configured(preferred={"sparse_attention": ["triton"], "indexer_topk": ["triton"]}):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            fast(x.float(), SeqContext()).float().sum().backward()
    got_kl = fast.indexer.stats.read().kl_sum
    assert len(chosen) == (0 if dense else 1)
    if chosen:
        ref.indexer.select = lambda prep: chosen[0]
    ref(x, SeqContext()).sum().backward()
    want_kl = ref.indexer.stats.read().kl_sum
    want = {n: p.grad.clone() for n, p in ref.indexer.named_parameters()}
    assert abs(got_kl - want_kl) <= 0.05 * abs(want_kl) + 1e-3, (got_kl, want_kl)
    for n, p in fast.indexer.named_parameters():
        err = (p.grad.double() - want[n]).norm() / want[n].norm().clamp_min(1e-30)
        assert err < 0.1, (n, float(err))


# ---- the recall statistics, and no host read in the sparse stage's backward -------------------------------------
def test_recall_counts_formula() -> None:
    """Hits of the target's top K among the chosen pools, picks and random selection's expected hits, over the
    rows with more than K candidates, against the loops written out; rows with K or fewer candidates count for
    nothing."""
    g = torch.Generator().manual_seed(3)
    c, n, K = 9, 11, 3
    target = torch.rand(c, n, generator=g, dtype=torch.float64)
    cand = torch.rand(c, n, generator=g) < 0.6
    cand[0] = False
    cand[1, :K] = True
    cand[1, K:] = False  # exactly K candidates: not counted
    chosen = torch.rand(c, n, generator=g) < 0.4
    hits, picks, rnd = indexer_kl.recall_counts(target, chosen, cand, K)
    want = [0.0, 0.0, 0.0]
    for r in range(c):
        idx = [j for j in range(n) if cand[r, j]]
        if len(idx) <= K:
            continue
        top = sorted(idx, key=lambda j: (-float(target[r, j]), j))[:K]
        want[0] += sum(bool(chosen[r, j]) for j in top)
        want[1] += K
        want[2] += K * K / len(idx)
    assert [float(hits), float(picks)] == want[:2] and abs(float(rnd) - want[2]) < 1e-12
    z = indexer_kl.recall_counts(target[:, :K], chosen[:, :K], cand[:, :K], K)  # no row can have more than K
    assert all(float(v) == 0.0 for v in z)


def test_the_unbounded_dense_target_is_the_bounded_one_wider() -> None:
    """``dense_target(bounded=False)`` (every key and pool, no host read) gives the bounded target on its pools
    and nothing on the pools past the chunk's last query (packed documents)."""
    from megaseq.models.common.indexer_kl import Pools

    g = torch.Generator().manual_seed(5)
    S, Hh, C, kp = 40, 3, 6, 4
    doc = torch.zeros(S, dtype=torch.int64)
    doc[17:] = 1
    pos = positions_from_doc_ids(doc[None])[0]
    ends = [t for t in range(S) if (int(pos[t]) + 1) % kp == 0]
    pools = Pools(torch.tensor([list(range(t - kp + 1, t + 1)) for t in ends]), doc)
    c_SC = torch.randn(S, C, generator=g, dtype=torch.float64)
    q_pos = torch.tensor([3, 9, 18, 25])
    q_abs = torch.randn(len(q_pos), Hh, C, generator=g, dtype=torch.float64)
    t_b, c_b = indexer_kl.dense_target(q_abs, c_SC, q_pos, pools, 0.3)
    t_u, c_u = indexer_kl.dense_target(q_abs, c_SC, q_pos, pools, 0.3, bounded=False)
    n = c_b.shape[1]
    assert c_u.shape[1] == len(ends) > n
    torch.testing.assert_close(t_u[:, :n], t_b, atol=1e-15, rtol=0)
    assert torch.equal(c_u[:, :n], c_b) and not c_u[:, n:].any() and not t_u[:, n:].any()


# aten ops that read a tensor's values back to the host (on a GPU: a sync of the stream); indexing by a boolean
# mask (``index``, ``index_put_``) counts its true entries on the host to size its result
HOST_READS = ("_local_scalar_dense", "nonzero", "masked_select", "_unique2", "unique_dim", "unique_consecutive",
              "index(bool)", "index_put(bool)", "index_put_(bool)")


def test_the_sparse_objective_reads_nothing_back_to_the_host(monkeypatch) -> None:
    """The sparse stage's objective runs in the backward between the attention's and the rest of the layer's: a
    host read there would stall the GPU's queue once per layer and step. Its whole backward (target, KL, gradient,
    sampled recall, statistics) is recorded op by op; none may read values back (packed documents, pools of 4)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from megaseq.models.common import indexer_objective

    class Record(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            masks = name.startswith("index") and len(args) > 1 and isinstance(args[1], (list, tuple)) and any(
                isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1])
            self.ops.append(f"{name}(bool)" if masks else name)
            return func(*args, **(kwargs or {}))

    rec = Record()
    real = indexer_objective.SparseObjective.grads

    def recorded(self, leaves):
        with rec:
            return real(self, leaves)

    monkeypatch.setattr(indexer_objective.SparseObjective, "grads", recorded)
    S = 80  # the last document's late queries see more than K = 8 pools: the recall counts them
    m = layer(4)
    x = torch.randn(1, S, m.q_a_proj.in_features, dtype=torch.float64)
    run_layer(m, x, doc_ids(S, True), dense=False)
    assert rec.ops, "the sparse objective ran"
    assert m.indexer.stats.read().recall_picks > 0, "the sampled recall counted rows"
    read = sorted({op for op in rec.ops if op in HOST_READS})
    assert not read, f"host reads in the sparse objective's backward: {read}"


def _recall_row(S: int):
    """One batch row of a pools-of-4 layer's sparse stage, float64, ready for ``sampled_recall``."""
    from megaseq.models.common.indexer_objective import SparseObjective, _Row

    m = layer(4)
    x = torch.randn(1, S, m.q_a_proj.in_features, dtype=torch.float64)
    ctx = SeqContext()
    with torch.no_grad():
        q, latent, q_resid = m.project(x, ctx)
        prep = m.indexer.prepare(x, q_resid, ctx)
        idx = m.indexer.select(prep)
    o = SparseObjective(m, prep, q, latent, m.kv_b_proj.weight, idx)
    return m, _Row(m, prep, 0, o.q_det, o.c_det, o.w_uk, idx, o.cd)


def test_the_sampled_recall_in_groups_counts_the_same(monkeypatch) -> None:
    """The sampled recall one row at a time (``RECALL_BLOCK_BYTES`` too small for two) counts what all its rows at
    once count."""
    from megaseq.ops import workspace

    m, row = _recall_row(96)
    row.sampled_recall()
    whole = m.indexer.stats.read()
    assert whole.recall_picks > 0
    got = (whole.recall_hits, whole.recall_picks, whole.random_hits)
    m.indexer.stats.reset()
    monkeypatch.setattr(workspace, "RECALL_BLOCK_BYTES", 1)
    assert workspace.indexer_recall_rows(m.num_heads, 96, itemsize=8) == 1
    row.sampled_recall()
    one = m.indexer.stats.read()
    assert (one.recall_hits, one.recall_picks, one.random_hits) == pytest.approx(got, abs=1e-12)


def test_the_sampled_recalls_memory_is_planned(monkeypatch) -> None:
    """The sampled recall's measured peak (``MemTracker``, float64), all eight rows at once against one row at a
    time: what the rows add is ``indexer_recall_bytes``' difference within 15%. (The rest, the same at any group
    size, is the latents' copy CPU matmuls make of their transposed operand, about ``C`` values a key.)"""
    import warnings

    from torch.distributed._tools.mem_tracker import MemTracker

    from megaseq.ops import workspace

    S = 2048

    def peak(block: int) -> tuple[int, int]:
        monkeypatch.setattr(workspace, "RECALL_BLOCK_BYTES", block)
        m, row = _recall_row(S)
        tracker = MemTracker()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with tracker:
                row.sampled_recall()
        return (tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"],
                workspace.indexer_recall_bytes(m.num_heads, S, itemsize=8))

    (all_rows, want_all), (one_row, want_one) = peak(1 << 30), peak(1)
    print(f"\nsampled recall: 8 rows at once {all_rows}, one {one_row} bytes; planned {want_all}, {want_one}")
    assert want_all == 8 * want_one
    assert abs((all_rows - one_row) - (want_all - want_one)) <= 0.15 * (want_all - want_one)
