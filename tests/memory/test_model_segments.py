"""Sequence segments (the whole model a segment at a time, carried KDA state + DSA caches) vs the plain
step: the loss and every parameter gradient (float64, CPU), the MoE counts, the errors; and that the
carry is needed (a segment that forgets its state is caught)."""

from __future__ import annotations

import pytest
import torch

from megaseq.memory import model_segments as ms
from megaseq.memory.vocab_loss import linear_cross_entropy
from megaseq.models.build import build_model
from megaseq.models.spec import from_hf_config
from megaseq.ops import dispatch

pytest.importorskip("transformers")
from test_glm5_parity import make_config, randomize_, rel_err  # noqa: E402

torch.set_num_threads(1)
F64 = torch.float64


def _model(mlp: str = "mixed", seed: int = 0, **kw):
    cfg = make_config(mlp, **kw)
    model = build_model(from_hf_config(cfg.to_dict()), dtype=F64, seed=seed)
    randomize_(model, seed=seed + 1)
    return model, cfg


def _loss_fn(model):
    def fn(hidden, labels):
        return linear_cross_entropy(hidden.reshape(-1, hidden.shape[-1]), model.lm_head.weight,
                                    labels.reshape(-1), reduction="sum")
    return fn


def _batch(cfg, B: int, S: int, seed: int = 5):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, cfg.vocab_size, (B, S), generator=gen)
    labels = torch.randint(1, cfg.vocab_size, (B, S), generator=gen)
    labels[0, 3] = -100  # an ignored label
    return ids, labels


def _plain(model, ids, labels, scale, doc_ids=None):
    model.zero_grad(set_to_none=True)
    loss = _loss_fn(model)(model(ids, doc_ids=doc_ids), labels)
    (loss * scale).backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _segmented(model, ids, labels, scale, T, doc_ids=None):
    model.zero_grad(set_to_none=True)
    loss = ms.segmented_loss_backward(model, ids, labels, _loss_fn(model), scale, T, doc_ids=doc_ids)
    return loss, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("mlp,B,S,T,impl", [("mixed", 2, 61, 16, "torch_masked"), ("mixed", 1, 53, 7, "absorbed"),
                                            ("dense", 1, 40, 2, "torch_masked"), ("mixed", 1, 24, 24, "absorbed"),
                                            ("dense", 2, 33, 11, "absorbed")])
def test_segments_equal_plain_step(mlp, B, S, T, impl):
    """Loss and every gradient: KDA x5 (state + conv halo carried), full and shared DSA (latents with
    gradient, indexer keys carried; the reference and the absorbed sparse attention, which runs on the
    GPU), dense + MoE, an uneven last segment, segments shorter than the halo (T 2 < K - 1 = 3), one
    segment (T = S)."""
    model, cfg = _model(mlp)
    ids, labels = _batch(cfg, B, S)
    scale = 1.0 / int((labels != -100).sum())
    dispatch.configure(preferred={"sparse_attention": [impl]})
    try:
        l0, g0 = _plain(model, ids, labels, scale)
        dispatch.reset_records()
        l1, g1 = _segmented(model, ids, labels, scale, T)
        assert {r.impl for _, r in dispatch.records() if r.op == "sparse_attention"} == {impl}
    finally:
        dispatch.configure()
    assert g1.keys() == g0.keys()
    worst = max(rel_err(g1[n], g0[n]) for n in g0)
    print(f"\nsegments {T} over {B}x{S} ({mlp}): loss {rel_err(l1, l0):.2e}, worst grad {worst:.2e}")
    assert rel_err(l1, l0) < 1e-12
    assert worst < 1e-10
    # every token mixer's parameters are in play (the DSA latent path, KDA's state path)
    assert any(".kv_a_proj_with_mqa." in n for n in g1) and any(".forget_gate." in n for n in g1)


def test_segments_moe_counts_are_the_whole_sequence():
    model, cfg = _model("mixed")
    ids, labels = _batch(cfg, 2, 45)
    model(ids)
    plain = {i: l.mlp.last_tokens_per_expert.clone() for i, l in enumerate(model.layers)
             if hasattr(l.mlp, "last_tokens_per_expert")}
    _segmented(model, ids, labels, 1.0, 8)
    for i, c in plain.items():
        assert torch.equal(model.layers[i].mlp.last_tokens_per_expert, c)


def test_forgetting_the_carry_is_caught(monkeypatch):
    """The test above can fail: a segment that drops the KDA state, or the earlier DSA latents' gradient,
    changes the gradients."""
    model, cfg = _model("mixed")
    ids, labels = _batch(cfg, 1, 40)
    _, g0 = _plain(model, ids, labels, 1.0)
    orig_in = ms.SegmentContext.carried_in

    def no_state(self, key, x, halo):
        x_in, h, state = orig_in(self, key, x, halo)
        return x_in, h, None if state is None else torch.zeros_like(state)

    monkeypatch.setattr(ms.SegmentContext, "carried_in", no_state)
    _, g1 = _segmented(model, ids, labels, 1.0, 10)
    assert max(rel_err(g1[n], g0[n]) for n in g0) > 1e-3
    monkeypatch.undo()
    orig_collect = ms.SegmentContext.collect

    def no_latent_grad(self):
        self.leaves = [leaf for leaf in self.leaves if leaf[0] != "cache"]
        orig_collect(self)

    monkeypatch.setattr(ms.SegmentContext, "collect", no_latent_grad)
    _, g2 = _segmented(model, ids, labels, 1.0, 10)
    bad = [n for n in g0 if rel_err(g2[n], g0[n]) > 1e-6]
    assert any("kv_a_proj_with_mqa" in n for n in bad)


def test_store_is_small_and_errors_name_the_setting():
    model, cfg = _model("mixed")
    ids, labels = _batch(cfg, 1, 64)
    store_bytes = []
    orig = ms.SegmentContext.collect

    def spy(self):
        orig(self)
        store_bytes.append(self.store.nbytes())

    ms.SegmentContext.collect = spy
    try:
        _segmented(model, ids, labels, 1.0, 16)
    finally:
        ms.SegmentContext.collect = orig
    R, Di = cfg.kv_lora_rank, cfg.index_head_dim
    dsa = cfg.layer_types.count("indexed_attention")
    # latents + gradients (8 B each in float64) and keys + gates of 64 tokens, and < 4 segments of KDA state
    # (the state and the K - 1 = 3 halo rows of the projected q, k, v: 3 * heads * head dim wide)
    Hh, D = cfg.linear_num_heads, cfg.linear_head_dim
    bound = dsa * 64 * (R * 16 + 2 * Di * 8) + 5 * 4 * (Hh * D * D * 8 + 3 * 3 * Hh * D * 8)
    assert 0 < max(store_bytes) <= bound
    with pytest.raises(ValueError, match="memory.model_segment_tokens.*no_such_family"):
        ms.check_model_segments("no_such_family", 4096)  # every family's mixers carry their state
    ms.check_model_segments("glm5_next", 4096, cp=2)  # each segment split over the cp ranks
    with pytest.raises(ValueError, match="cp=3.*multiple of 3"):
        ms.check_model_segments("glm5_next", 4096, cp=3)
    with pytest.raises(ValueError, match="recompute"):
        ms.check_model_segments("glm5_next", 4096, layer_schemes=("memory.recompute",))
    with pytest.raises(ValueError, match=">= 1"):
        ms.segment_bounds(10, 0)
    assert ms.segment_bounds(10, 4) == [(0, 4), (4, 8), (8, 10)]


def test_segments_in_bf16_are_as_close_to_fp32_as_the_plain_step():
    """Under bf16 autocast the segmented and the plain step round differently (their gradients differ by
    a few percent on a random model, as the GPU run shows); what matters is that neither is further from
    the fp32 step than the other: the carried state adds no error of its own."""
    from megaseq.models.glm5.spec import glm5_flash_tiny

    spec = glm5_flash_tiny().replace(num_layers=4, layer_types=("kda", "kda", "kda", "dsa"),
                                     mlp_types=("dense", "moe", "moe", "moe"), indexer_types=("full",) * 4,
                                     index_topk=512)
    model = build_model(spec, dtype=torch.float32, seed=0)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, spec.vocab_size, (1, 513), generator=gen)
    ids, labels = ids[:, :-1], ids[:, 1:]

    def loss_fn(h, lab):
        return linear_cross_entropy(h.reshape(-1, h.shape[-1]).to(torch.bfloat16),
                                    model.lm_head.weight.to(torch.bfloat16), lab.reshape(-1), reduction="sum")

    def grads(segmented: bool, amp: bool):
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
            if segmented:
                ms.segmented_loss_backward(model, ids, labels, loss_fn, 1 / 512, 128)
            else:
                (loss_fn(model(ids), labels) / 512).backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    def err(g, truth):
        r = sorted(float((g[n] - truth[n]).norm() / truth[n].norm()) for n in truth)
        return r[len(r) // 2]

    truth = grads(False, amp=False)
    plain, seg = err(grads(False, amp=True), truth), err(grads(True, amp=True), truth)
    print(f"\nbf16 vs fp32, median relative gradient error: plain {plain:.3g}, segmented {seg:.3g}")
    assert err(grads(True, amp=False), truth) < 1e-4  # fp32: the same step
    assert seg < 1.25 * plain


def test_evaluation_in_segments_equals_plain():
    """``per_token_loss_fn`` with the plan's segment length (what `megaseq eval` and the trainer's
    evaluation use for a run trained in segments): the same per-token losses, float64."""
    from megaseq.eval.loss import per_token_loss_fn
    from megaseq.parallel.env import ParallelEnv

    model, cfg = _model("mixed")
    ids, labels = _batch(cfg, 2, 45)
    env = ParallelEnv(torch.device("cpu"))
    batch = {"input_ids": ids, "labels": labels}
    plain = per_token_loss_fn(model, env, None, 16)(batch)
    seg = per_token_loss_fn(model, env, None, 16, segment_tokens=10)(batch)
    assert seg.shape == plain.shape == (2, 45)
    assert rel_err(seg, plain) < 1e-12
    assert not torch.equal(seg[:, 10:], per_token_loss_fn(model, env, None, 16)(
        {"input_ids": ids[:, 10:], "labels": labels[:, 10:]}))  # later segments did see the earlier ones


def test_progress_hears_every_segment_of_both_passes():
    model, cfg = _model("dense")
    ids, labels = _batch(cfg, 1, 25)
    heard = []
    ms.segmented_loss_backward(model, ids, labels, _loss_fn(model), 1.0, 10, progress=lambda *a: heard.append(a))
    assert heard == [("forward", 0, 3), ("forward", 1, 3), ("forward", 2, 3),
                     ("backward", 0, 3), ("backward", 1, 3), ("backward", 2, 3)]


@pytest.mark.parametrize("impl", ["torch_masked", "absorbed"])
def test_segments_with_packed_documents_equal_plain_step(impl):
    """Packed documents (text): a KDA layer restarts at every document start and carries only a
    document that goes on; the indexer keeps each query in its document. Documents that span several
    segments, one that starts exactly at a segment start (10 and 30), one shorter than the conv halo,
    and rows with different boundaries."""
    model, cfg = _model("mixed")
    ids, labels = _batch(cfg, 2, 50)
    doc_ids = torch.tensor([[0] * 10 + [1] * 2 + [2] * 18 + [3] * 20,
                            [0] * 23 + [1] * 27])
    scale = 1.0 / int((labels != -100).sum())
    dispatch.configure(preferred={"sparse_attention": [impl]})
    try:
        l0, g0 = _plain(model, ids, labels, scale, doc_ids)
        l1, g1 = _segmented(model, ids, labels, scale, 10, doc_ids)
        worse = _segmented(model, ids, labels, scale, 10, None)[1]  # the documents do matter here
    finally:
        dispatch.configure()
    assert g1.keys() == g0.keys()
    worst = max(rel_err(g1[n], g0[n]) for n in g0)
    print(f"\ndocuments, segments of 10 ({impl}): loss {rel_err(l1, l0):.2e}, worst grad {worst:.2e}")
    assert rel_err(l1, l0) < 1e-12 and worst < 1e-10
    assert max(rel_err(worse[n], g0[n]) for n in g0) > 1e-3


def test_trainer_step_in_segments_keeps_documents_apart():
    """The trainer's segmented step passes the batch's ``doc_ids`` on (packed text): its gradients equal
    the plain step's on a batch with documents."""
    from megaseq.parallel.env import ParallelEnv
    from megaseq.train.step import _segmented_step

    model, cfg = _model("dense")
    ids, labels = _batch(cfg, 1, 30)
    doc_ids = torch.tensor([[0] * 7 + [1] * 13 + [2] * 10])
    env = ParallelEnv(torch.device("cpu"))
    _, g0 = _plain(model, ids, labels, 1 / 29, doc_ids)
    model.zero_grad(set_to_none=True)
    batch = {"input_ids": ids, "labels": labels, "doc_ids": doc_ids}
    _segmented_step(model, batch, env, None, None, 8, 29)
    g1 = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    assert max(rel_err(g1[n], g0[n]) for n in g0) < 1e-10


def test_kept_selections_save_the_indexer_rerun():
    """``keep_selection``: the backward's reruns take the forward pass's DSA selections instead of scoring
    again (the indexer runs once per segment and full layer, not twice); the step is the same."""
    from megaseq.models.common.mla_dsa import Indexer

    model, cfg = _model("mixed")
    ids, labels = _batch(cfg, 2, 41)
    _, g0 = _segmented(model, ids, labels, 1.0, 10)
    calls = []
    real = Indexer.forward

    def counted(self, *a, **k):
        calls.append(1)
        return real(self, *a, **k)

    Indexer.forward = counted
    try:
        model.zero_grad(set_to_none=True)
        ms.segmented_loss_backward(model, ids, labels, _loss_fn(model), 1.0, 10, keep_selection=True)
    finally:
        Indexer.forward = real
    g1 = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    full_layers = sum(1 for layer in model.layers if getattr(layer.self_attn, "indexer", None) is not None)
    assert len(calls) == 5 * full_layers  # 5 segments, the forward pass only
    assert all(torch.equal(g1[n], g0[n]) for n in g0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("docs", [False, True])
def test_segments_on_gpu_are_as_close_to_fp64_as_the_plain_step(docs):
    """On a GPU under bf16 autocast (fla's KDA with carried per-document states, the absorbed sparse
    MLA): the segmented step is no further from the float64 step than the plain bf16 step is."""
    model, cfg = _model("mixed")
    ids, labels = _batch(cfg, 2, 200)
    doc_ids = torch.tensor([[0] * 70 + [1] * 90 + [2] * 40, [0] * 200]) if docs else None
    _, truth = _plain(model, ids, labels, 1 / 400, doc_ids)
    gpu = model.float().cuda()
    dev = {"ids": ids.cuda(), "labels": labels.cuda(), "docs": None if doc_ids is None else doc_ids.cuda()}

    def run(segmented: bool):
        gpu.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            if segmented:
                ms.segmented_loss_backward(gpu, dev["ids"], dev["labels"], _loss_fn(gpu), 1 / 400, 48,
                                           doc_ids=dev["docs"])
            else:
                (_loss_fn(gpu)(gpu(dev["ids"], doc_ids=dev["docs"]), dev["labels"]) / 400).backward()
        g = {n: p.grad.double().cpu() for n, p in gpu.named_parameters() if p.grad is not None}
        r = sorted(rel_err(g[n], truth[n]) for n in truth)
        return r[len(r) // 2]

    plain, seg = run(False), run(True)
    print(f"\nGPU bf16 vs float64, median relative gradient error: plain {plain:.3g}, segmented {seg:.3g}")
    assert seg < 1.25 * plain + 1e-3
