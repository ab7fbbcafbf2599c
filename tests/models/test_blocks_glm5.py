"""GLM-5.3-Flash blocks: KDA, conv and document restarts, mHC, the pooled indexer and its chunked
scoring, blocked sparse attention, context-parallel seams (threads standing in for ranks), init."""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from megaseq.models.build import build_model
from megaseq.models.common.context import SeqContext
from megaseq.models.common.kda import ForgetGate, cu_seqlens_from_doc_ids
from megaseq.models.common.mhc import HyperConnection
from megaseq.models.common.mla_dsa import Indexer, MLASparseAttention
from megaseq.models.spec import from_hf_config
from megaseq.ops.indexer import scoring as indexer_scoring
from megaseq.ops.kda.reference import causal_conv_reference, kda_reference
from megaseq.ops.sparse_mla import reference as mla_dsa
from megaseq.ops.sparse_mla.reference import sparse_attention_reference

pytest.importorskip("transformers")
from test_glm5_parity import hf_glm5_module, make_config, randomize_, rel_err  # noqa: E402

torch.set_num_threads(1)
F64 = torch.float64


def _randn(*shape, gen, scale=1.0):
    return torch.randn(*shape, generator=gen, dtype=F64) * scale


# ---- KDA -----------------------------------------------------------------------------------------
def _kda_inputs(gen, B=2, S=45, H=3, D=5):
    q, k, v = (_randn(B, S, H, D, gen=gen) for _ in range(3))
    g = -5.0 * torch.sigmoid(_randn(B, S, H, D, gen=gen))  # safe-gate range (-5, 0)
    beta = torch.sigmoid(_randn(B, S, H, gen=gen))
    return [t.requires_grad_() for t in (q, k, v, g, beta)]


@pytest.mark.parametrize("chunk", [16, 64])
def test_kda_chunked_matches_naive_recurrence(chunk):
    gen = torch.Generator().manual_seed(0)
    inputs = _kda_inputs(gen)
    naive = hf_glm5_module().recurrent_kimi_delta_attention
    ref, _ = naive(*inputs[:3], g=inputs[3], beta=inputs[4], initial_state=None, output_final_state=False,
                   use_qk_l2norm_in_kernel=True)
    out = kda_reference(*inputs, chunk_size=chunk)
    w = _randn(*out.shape, gen=gen)
    g_ref = torch.autograd.grad((ref * w).sum(), inputs)
    g_out = torch.autograd.grad((out * w).sum(), inputs)
    assert rel_err(out, ref) < 1e-12
    for a, b in zip(g_out, g_ref):
        assert rel_err(a, b) < 1e-10


def test_conv_and_recurrence_restart_at_documents():
    gen = torch.Generator().manual_seed(1)
    doc_ids = torch.tensor([[0] * 7 + [1] * 12 + [2] * 3, [5] * 22])
    cu = cu_seqlens_from_doc_ids(doc_ids)
    assert cu.tolist() == [0, 7, 19, 22, 44]
    x = _randn(1, 44, 6, gen=gen)
    w = _randn(6, 4, gen=gen)
    packed = causal_conv_reference(x, w, "silu", cu)
    alone = torch.cat([causal_conv_reference(x[:, s:e], w, "silu") for s, e in zip(cu[:-1], cu[1:])], dim=1)
    assert torch.equal(packed, alone)
    x2 = x.clone()
    x2[:, :7] += 1.0  # change document 0 only: nothing after it may move
    assert torch.equal(causal_conv_reference(x2, w, "silu", cu)[:, 7:], packed[:, 7:])
    q, k, v, g, beta = (t.detach().reshape(1, 44, *t.shape[2:]) for t in _kda_inputs(gen, B=2, S=22))
    out = kda_reference(q, k, v, g, beta, cu, chunk_size=8)
    for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
        one = kda_reference(q[:, s:e], k[:, s:e], v[:, s:e], g[:, s:e], beta[:, s:e], chunk_size=8)
        assert rel_err(out[:, s:e], one) < 1e-13


@pytest.mark.parametrize("lower_bound", [-5.0, None])
def test_forget_gate_matches_hf(lower_bound):
    cfg = make_config(linear_lower_bound=lower_bound)
    hf = hf_glm5_module().Glm5NextTextForgetGate(cfg).double()
    randomize_(hf, seed=12)
    ours = ForgetGate(from_hf_config(cfg.to_dict())).double()
    ours.load_state_dict(hf.state_dict())
    x = _randn(2, 7, cfg.hidden_size, gen=torch.Generator().manual_seed(13), scale=3.0)
    assert rel_err(ours(x), hf(x)) < 1e-13


# ---- mHC -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("iters", [1, 3, 20])
def test_hyper_connection_matches_hf(iters):
    cfg = make_config(hc_sinkhorn_iters=iters)
    hf = hf_glm5_module().Glm5NextTextHyperConnection(cfg).double()
    randomize_(hf, seed=2)
    ours = HyperConnection(from_hf_config(cfg.to_dict())).double()
    ours.load_state_dict(hf.state_dict())
    h = _randn(2, 5, cfg.hc_mult, cfg.hidden_size, gen=torch.Generator().manual_seed(3))
    for a, b in zip(ours(h), hf(h)):
        assert rel_err(a, b) < 1e-13
    if iters == 20:  # doubly stochastic up to the eps terms
        comb = ours(h)[1]
        assert (comb.sum(-1) - 1).abs().max() < 1e-4 and (comb.sum(-2) - 1).abs().max() < 1e-4


# ---- indexer and sparse attention ----------------------------------------------------------------
def _indexer_pair(seed, **kw):
    cfg = make_config(**kw)
    hf = hf_glm5_module().Glm5NextTextIndexer(cfg, 3).double()
    randomize_(hf, seed)
    ours = Indexer(from_hf_config(cfg.to_dict())).double()
    ours.load_state_dict(hf.state_dict())
    gen = torch.Generator().manual_seed(seed + 1)
    x, q_resid = _randn(2, 41, cfg.hidden_size, gen=gen), _randn(2, 41, cfg.q_lora_rank, gen=gen)
    return hf, ours, x, q_resid


def _selection_sets(idx: torch.Tensor) -> list[list[set[int]]]:
    return [[set(v for v in row.tolist() if v >= 0) for row in batch] for batch in idx]


@pytest.mark.parametrize("tail", [True, False])
def test_indexer_selects_the_same_keys_as_hf(tail):
    hf, ours, x, q_resid = _indexer_pair(4, index_kpool_always_select_tail=tail)
    ref = hf(x, q_resid, torch.ones(x.shape[:2], dtype=torch.bool), None)
    got = ours(x, q_resid, SeqContext())
    assert _selection_sets(got) == _selection_sets(ref)
    counts = (got >= 0).sum(-1)
    assert counts.max() <= hf.index_topk + (hf.index_kpool - 1 if tail else 0)
    assert (counts[:, -1] < 41).all()  # the selection drops keys: sparse attention is exercised


def test_chunked_scoring_gives_identical_indices():
    _, ours, x, q_resid = _indexer_pair(6)
    full = ours(x, q_resid, SeqContext())
    for chunk in (1, 7):
        ours.query_chunk = chunk  # what the family's parallelize sets from the plan
        assert torch.equal(ours(x, q_resid, SeqContext()), full)
    one = indexer_scoring.indexer_scoring_bytes(1, 4096, 32, 128)
    assert indexer_scoring.indexer_scoring_bytes(256, 4096, 32, 128) == 256 * one
    assert one >= 4096 * 32 * 4  # at least one query's head scores


def test_topk_ties_go_to_the_lowest_index():
    gen = torch.Generator().manual_seed(17)
    x = torch.randint(0, 4, (60, 23), generator=gen).to(F64)  # many exact ties
    for k in (1, 5, 23):
        got = indexer_scoring.topk_lowest_index_ties(x, k)
        want = torch.sort(x, dim=-1, descending=True, stable=True).indices[:, :k]
        assert got.sort(-1).values.tolist() == want.sort(-1).values.tolist()


def test_blocked_sparse_attention_equals_single_block(monkeypatch):
    gen = torch.Generator().manual_seed(7)
    q, k, v = (_randn(2, 3, 29, 6, gen=gen).requires_grad_() for _ in range(3))
    idx = torch.randint(-1, 29, (2, 29, 5), generator=gen)
    idx[..., 0] = torch.arange(29)  # every query sees at least itself
    one = sparse_attention_reference(q, k, v, idx, 0.4)
    grads = torch.autograd.grad(one.square().sum(), (q, k, v))
    monkeypatch.setattr(mla_dsa, "ATTENTION_BLOCK_ELEMS", 2 * 3 * 29 * 4)  # blocks of 4 queries
    blocked = sparse_attention_reference(q, k, v, idx, 0.4)
    assert rel_err(blocked, one) < 1e-13
    for a, b in zip(torch.autograd.grad(blocked.square().sum(), (q, k, v)), grads):
        assert rel_err(a, b) < 1e-13


@pytest.mark.parametrize("bias", [False, True])
def test_mla_sparse_attention_matches_hf(bias):
    cfg = make_config(attention_bias=bias)
    hf = hf_glm5_module().Glm5NextTextAttention(cfg, 3).double()
    randomize_(hf, seed=14)
    ours = MLASparseAttention(from_hf_config(cfg.to_dict()), layer_idx=3).double()
    ours.load_state_dict(hf.state_dict())
    x = _randn(2, 33, cfg.hidden_size, gen=torch.Generator().manual_seed(15)).requires_grad_()
    ref = hf(x, torch.ones(2, 33, dtype=torch.bool))[0]
    out = ours(x, SeqContext())
    w = _randn(*out.shape, gen=torch.Generator().manual_seed(16))
    params = [p for n, p in hf.named_parameters() if not n.startswith("indexer.")]
    g_ref = torch.autograd.grad((ref * w).sum(), [x, *params])
    ours_params = [p for n, p in ours.named_parameters() if not n.startswith("indexer.")]
    g_out = torch.autograd.grad((out * w).sum(), [x, *ours_params])
    assert rel_err(out, ref) < 1e-12
    for a, b in zip(g_out, g_ref):
        assert rel_err(a, b) < 1e-10


def test_shared_layer_without_its_source_selection_raises():
    spec = from_hf_config(make_config().to_dict())
    shared = MLASparseAttention(spec, layer_idx=4, topk_source=3).double()
    with pytest.raises(ValueError, match="needs the selection of layer 3"):
        shared(_randn(1, 9, spec.hidden_size, gen=torch.Generator().manual_seed(0)), SeqContext())


# ---- context parallelism: ranks as threads, collectives as barriers + cat -------------------------
class _Group:
    def __init__(self, size: int) -> None:
        self.size, self.slots, self.barrier = size, [None] * size, threading.Barrier(size)

    def all_gather(self, rank: int, x: torch.Tensor) -> list[torch.Tensor]:
        self.slots[rank] = x
        self.barrier.wait()
        out = list(self.slots)
        self.barrier.wait()
        return out


@dataclass
class ThreadCtx(SeqContext):
    """Ulysses + gather-KV over threads; differentiable (one autograd graph across ranks)."""

    group: Any = None
    full_docs: torch.Tensor | None = None
    extra: dict = field(default_factory=dict)

    def full_doc_ids(self):
        return self.full_docs

    def seq_offset(self) -> int:
        return self.cp_rank * self.extra["s_loc"]

    def head_slice(self, num_heads: int) -> slice:
        n = num_heads // self.cp_size
        return slice(self.cp_rank * n, (self.cp_rank + 1) * n)

    def seq_to_heads(self, x):
        full = torch.cat(self.group.all_gather(self.cp_rank, x), dim=1)
        return full[:, :, self.head_slice(x.shape[2])]

    def heads_to_seq(self, x):
        full = torch.cat(self.group.all_gather(self.cp_rank, x), dim=2)
        s = self.extra["s_loc"]
        return full[:, self.cp_rank * s:(self.cp_rank + 1) * s]

    def gather_seq(self, x, key=None):
        return torch.cat(self.group.all_gather(self.cp_rank, x), dim=1)


def test_context_parallel_model_equals_one_rank():
    cp, S = 3, 45
    cfg = make_config("dense")  # dense MLPs: the float32 router would differ by token count
    model = build_model(from_hf_config(cfg.to_dict()), dtype=F64, seed=0)
    randomize_(model, seed=8)
    gen = torch.Generator().manual_seed(9)
    ids = torch.randint(1, cfg.vocab_size, (2, S), generator=gen)
    doc_ids = torch.tensor([[0] * 17 + [1] * 28, [0] * 45])
    w = _randn(2, S, cfg.hidden_size, gen=gen)
    (model(ids, doc_ids=doc_ids) * w).sum().backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    group, s_loc, outs = _Group(cp), S // cp, [None] * cp

    def run(rank: int) -> None:
        sl = slice(rank * s_loc, (rank + 1) * s_loc)
        ctx = ThreadCtx(doc_ids=doc_ids[:, sl], cp_size=cp, cp_rank=rank, group=group, full_docs=doc_ids,
                        extra={"s_loc": s_loc})
        outs[rank] = model(ids[:, sl], ctx=ctx)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(cp)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    (torch.cat(outs, dim=1) * w).sum().backward()
    for name, p in model.named_parameters():
        assert (p.grad is None) == (name not in ref), name
        if p.grad is not None:
            assert rel_err(p.grad, ref[name]) < 1e-10, name


# ---- build and init --------------------------------------------------------------------------------
def test_build_model_init_follows_hf_and_keeps_fp32_tensors():
    cfg = make_config(hidden_size=64)
    spec = from_hf_config(cfg.to_dict())
    a, b = build_model(spec, dtype=F64, seed=11), build_model(spec, dtype=F64, seed=11)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    torch.manual_seed(0)  # HF draws from the global RNG: a fixed state, whatever ran before
    hf = hf_glm5_module(promote=False).Glm5NextTextModel(cfg).double()
    ours = a.state_dict()
    for name, t in hf.state_dict().items():
        o = ours[name]
        assert o.shape == t.shape, name
        if t.numel() > 1 and t.std() == 0:  # constant init (norms, hc base/scale, A_log, indexer pooling)
            assert torch.equal(o, t), name
        elif t.dim() >= 2 and t.numel() >= 1000:
            assert abs(o.std().item() - t.std().item()) < 0.1 * t.std().item(), name
    dt = F.softplus(ours["layers.0.self_attn.forget_gate.dt_bias"])
    assert dt.min() >= 1e-3 * (1 - 1e-6) and dt.max() <= 0.1 * (1 + 1e-6)
    bf = build_model(spec, dtype=torch.bfloat16, seed=0)
    dtypes = {n: t.dtype for n, t in list(bf.named_parameters()) + list(bf.named_buffers())}
    for n in ("layers.0.self_attn.conv1d.weight", "layers.0.self_attn.forget_gate.A_log",
              "layers.3.attn_hc.base", "layers.2.mlp.gate.weight",
              "layers.2.mlp.gate.e_score_correction_bias"):
        assert dtypes[n] == torch.float32, n
    assert dtypes["layers.0.self_attn.q_proj.weight"] == torch.bfloat16
    assert math.isfinite(bf(torch.randint(1, 53, (1, 9))).float().sum().item())
