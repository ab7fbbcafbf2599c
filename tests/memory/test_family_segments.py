"""Sequence segments for every family (float64, CPU): the model run a segment at a time, each token mixer's
state carried (softmax attention's K/V, dense MLA's latent, KDA's and gated DeltaNet's recurrent state and
conv halo, DSA's latents and indexer keys), against one plain pass: the loss and every parameter gradient,
with packed documents and odd segment lengths; with LoRA; under Ulysses CP over gloo (2 ranks, FSDP). Broken
variants that must fail: a recurrent state not carried (zeroed), a K/V or latent gradient not accumulated
across segments, the documents not kept apart.

Attention runs the ``torch_exact`` reference here (the softmax in float64): HF's eager softmax is float32 even
in a float64 model, and its rounding depends on how many masked keys a row holds, which a segment changes
(about 1e-7 relative); with it the two schedules agree to float64 rounding. The attention op with fewer
queries than keys (a segment's queries over every key so far) is checked on its own below, reference against
SDPA and against the last rows of the full computation.
"""

from __future__ import annotations

import pytest
import torch

from family_parity import randomize_, rel_err
from megaseq.memory import model_segments as ms
from megaseq.memory.vocab_loss import linear_cross_entropy
from megaseq.models.build import build_model
from megaseq.models.common import attention as attn
from megaseq.models.presets import get_preset
from megaseq.ops import dispatch

F64 = torch.float64
FAMILIES = {"qwen3_moe": "qwen3-moe-tiny", "olmoe": "olmoe-tiny", "mixtral": "mixtral-tiny",
            "glm4_moe": "glm4-moe-tiny", "qwen3_next": "qwen3-next-tiny", "deepseek_v3": "deepseek-v3-tiny",
            "deepseek_v32": "deepseek-v32-tiny", "kimi_linear": "kimi-linear-tiny", "glm5": "glm5-flash-tiny"}
# documents across segment boundaries, one starting exactly at a segment start (9), one shorter than the conv
# halo (2 tokens), rows with different boundaries
DOCS = torch.tensor([[0] * 9 + [1] * 2 + [2] * 16 + [3] * 10, [0] * 20 + [1] * 17])
B, S = 2, 37

pytestmark = pytest.mark.usefixtures("one_thread", "exact_attention")


def _model(preset: str, seed: int = 0):
    model = build_model(get_preset(preset), dtype=F64, seed=seed)
    randomize_(model, seed + 1)
    return model


def _batch(model, seed: int = 3):
    g = torch.Generator().manual_seed(seed)
    V = model.spec.vocab_size
    ids, labels = torch.randint(1, V, (B, S), generator=g), torch.randint(1, V, (B, S), generator=g)
    labels[0, 4] = -100
    return ids, labels


def _loss_fn(model):
    def fn(hidden, labels):
        return linear_cross_entropy(hidden.reshape(-1, hidden.shape[-1]), model.lm_head.weight, labels.reshape(-1),
                                    reduction="sum")
    return fn


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def plain(model, ids, labels, doc_ids=None):
    model.zero_grad(set_to_none=True)
    loss = _loss_fn(model)(model(ids, doc_ids=doc_ids), labels)
    (loss / S).backward()
    return loss.detach(), _grads(model)


def segmented(model, ids, labels, T: int, doc_ids=None):
    model.zero_grad(set_to_none=True)
    loss = ms.segmented_loss_backward(model, ids, labels, _loss_fn(model), 1 / S, T, doc_ids=doc_ids)
    return loss, _grads(model)


def worst(got: dict, ref: dict) -> tuple[float, str]:
    assert got.keys() == ref.keys(), sorted(set(got) ^ set(ref))
    name = max(ref, key=lambda n: rel_err(got[n], ref[n]))
    return rel_err(got[name], ref[name]), name


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("T,docs", [(9, True), (5, False)])
def test_segments_equal_one_pass(family, T, docs):
    """Loss and every parameter gradient: segments of 9 (documents packed) and 5 tokens (no documents), the
    last segment shorter (37 tokens); every mixer's parameters get their gradient in both."""
    model = _model(FAMILIES[family])
    ids, labels = _batch(model)
    doc_ids = DOCS if docs else None
    l0, g0 = plain(model, ids, labels, doc_ids)
    l1, g1 = segmented(model, ids, labels, T, doc_ids)
    err, name = worst(g1, g0)
    print(f"\n{family} T={T} docs={docs}: loss {rel_err(l1, l0):.1e}, worst gradient {err:.1e} ({name})")
    assert rel_err(l1, l0) < 1e-12
    assert err < 1e-10, name
    mixers = {n.split(".")[2] for n in g1 if n.startswith("layers.") and ("attn" in n.split(".")[2])}
    assert mixers, "no token mixer parameter got a gradient"


@pytest.mark.parametrize("family", ["qwen3_moe", "kimi_linear", "qwen3_next"])
def test_the_documents_matter(family):
    """The documents change the step (so the test above checks that they are kept apart across segments)."""
    model = _model(FAMILIES[family])
    ids, labels = _batch(model)
    _, g0 = plain(model, ids, labels, DOCS)
    _, g1 = segmented(model, ids, labels, 9, None)
    assert worst(g1, g0)[0] > 1e-3


# ---- broken variants ---------------------------------------------------------------------------------------
def _broken_accumulate(monkeypatch, suffix: str) -> None:
    """The earlier segments' cached rows of keys ending in ``suffix`` never get their gradient."""
    orig = ms.SegmentContext._accumulate

    def broken(self, key, leaf):
        if key.endswith(suffix):
            leaf.grad = None
            return
        orig(self, key, leaf)

    monkeypatch.setattr(ms.SegmentContext, "_accumulate", broken)


@pytest.mark.parametrize("family,suffix,param", [
    ("qwen3_moe", ".self_attn.0", "k_proj"),  # the keys' gradient (k_proj gets only that)
    ("mixtral", ".self_attn.1", "v_proj"),  # the values'
    ("deepseek_v3", ".self_attn.0", "kv_a_proj_with_mqa"),  # the MLA latent's
    ("kimi_linear", ".self_attn.0", "kv_a_proj_with_mqa"),
])
def test_a_kv_gradient_not_accumulated_fails(monkeypatch, family, suffix, param):
    model = _model(FAMILIES[family])
    ids, labels = _batch(model)
    _, g0 = plain(model, ids, labels, DOCS)
    _broken_accumulate(monkeypatch, suffix)
    _, g1 = segmented(model, ids, labels, 9, DOCS)
    bad = [n for n in g0 if rel_err(g1[n], g0[n]) > 1e-6]
    assert any(param in n for n in bad), bad


@pytest.mark.parametrize("family,param", [("qwen3_next", "linear_attn"), ("kimi_linear", "forget_gate")])
def test_a_recurrent_state_not_carried_fails(monkeypatch, family, param):
    """A zeroed gated DeltaNet (or KDA) state at each segment start; then the conv halo dropped."""
    model = _model(FAMILIES[family])
    ids, labels = _batch(model)
    _, g0 = plain(model, ids, labels)
    orig = ms.SegmentContext.carried_in

    def zero_state(self, key, x, halo):
        x_in, h, state = orig(self, key, x, halo)
        return x_in, h, None if state is None else torch.zeros_like(state)

    monkeypatch.setattr(ms.SegmentContext, "carried_in", zero_state)
    _, g1 = segmented(model, ids, labels, 9)
    assert any(param in n for n in g0 if rel_err(g1[n], g0[n]) > 1e-3)

    def no_halo(self, key, x, halo):
        _, _, state = orig(self, key, x, halo)
        return x, 0, state

    monkeypatch.setattr(ms.SegmentContext, "carried_in", no_halo)
    _, g2 = segmented(model, ids, labels, 9)
    assert any(param in n for n in g0 if rel_err(g2[n], g0[n]) > 1e-6)


# ---- LoRA ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("preset", ["kimi-linear-tiny", "qwen3-moe-tiny"])
def test_segments_with_lora_equal_one_pass(preset):
    """LoRA on every projection (MLA's ``kv_b_proj`` merged into the keys and values it expands; the base frozen, so
    the first layer's keys carry no gradient): the adapters' gradients equal one pass's."""
    from lora_helpers import adapted_model, settings
    from megaseq.config import MemorySettings

    model, done = adapted_model(get_preset(preset), settings("all"), MemorySettings(model_segment_tokens=9))
    assert done.model_segmented == 9 and done.adapters
    ids, labels = _batch(model)
    l0, g0 = plain(model, ids, labels, DOCS)
    l1, g1 = segmented(model, ids, labels, 9, DOCS)
    assert g0 and all("lora_" in n for n in g0)
    err, name = worst(g1, g0)
    assert rel_err(l1, l0) < 1e-12 and err < 1e-10, name


# ---- the attention op with a segment's queries -----------------------------------------------------------------
@pytest.mark.parametrize("docs", [False, True])
def test_attention_op_with_fewer_queries_than_keys(docs):
    """Queries that are the last ``Sq`` of ``Sk`` keys (GQA, odd sizes): the reference equals the last rows of
    the full computation, and SDPA (float32, lower-right causal per document) equals the reference."""
    g = torch.Generator().manual_seed(0)
    Bq, Sk, Sq, Hq, Hkv, D = 2, 47, 13, 6, 2, 8
    q, k, v = (torch.randn(Bq, Sk, h, D, generator=g, dtype=F64) for h in (Hq, Hkv, Hkv))
    doc = torch.tensor([[0] * 20 + [1] * 25 + [2] * 2, [0] * 40 + [1] * 7]) if docs else None
    full = attn.attention_exact(q, k, v, doc, 0.3)
    part = attn.attention_exact(q[:, -Sq:], k, v, doc, 0.3)
    assert rel_err(part, full[:, -Sq:]) < 1e-14
    ref32 = attn.attention_reference(*(t.float() for t in (q[:, -Sq:], k, v)), doc, 0.3)
    sdpa = attn.attention_sdpa(*(t.float() for t in (q[:, -Sq:], k, v)), doc, 0.3)
    assert rel_err(sdpa, ref32) < 1e-5
    assert rel_err(ref32.double(), part) < 1e-5
    wrong = attn.attention_exact(q[:, -Sq:], k[:, -Sq:], v[:, -Sq:], None if doc is None else doc[:, -Sq:], 0.3)
    assert rel_err(wrong, part) > 1e-3  # the earlier keys matter


def test_check_names_the_setting():
    """Every family now runs sequence segments; what the check still refuses names the setting."""
    for family in FAMILIES:
        ms.check_model_segments(family if family != "glm5" else "glm5_next", 4096, cp=2)
    with pytest.raises(ValueError, match="memory.model_segment_tokens.*no_such_family"):
        ms.check_model_segments("no_such_family", 4096)


# ---- Ulysses CP + FSDP over gloo -------------------------------------------------------------------------------
def _rank(rank: int, preset: str, broken: str, ref) -> None:
    import test_fsdp_train_step as fsdp_test

    dispatch.configure(preferred={"attention": ["torch_exact"]})
    if broken:
        from megaseq.memory import model_segments

        orig = model_segments.SegmentContext._accumulate

        def no_grad(self, key, leaf):
            if key.endswith(broken):
                leaf.grad = None
                return
            orig(self, key, leaf)

        model_segments.SegmentContext._accumulate = no_grad  # a forked rank: nothing to restore
    fsdp_test._rank(rank, 1, 2, "dp_cp", 8, "", ref, preset)


@pytest.mark.parametrize("preset", ["qwen3-moe-tiny", "deepseek-v3-tiny"])
def test_segments_under_cp_match_one_process(preset):
    """Two trainer steps over 2 gloo ranks (cp 2, FSDP over both, segments of 8: each split in 4-token pieces)
    equal the one-process steps (loss, every gradient, the parameters); dropping the keys' (or latent's)
    gradient across segments fails."""
    from test_fsdp_train_step import reference

    from conftest import torch_threads
    from megaseq.parallel.launch import spawn_local

    with torch_threads(1), dispatch.configured(preferred={"attention": ["torch_exact"]}):
        ref = reference(preset)
    spawn_local(_rank, 2, args=(preset, "", ref))
    with pytest.raises(Exception, match="step 0 grad"):
        spawn_local(_rank, 2, args=(preset, ".self_attn.0", ref))


# ---- bf16 autocast (the CPU's): the rows kept in bf16, SDPA over a segment ---------------------------------------
@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_segments_under_autocast_keep_bf16_rows_and_match_one_pass(family):
    """Under bf16 autocast the segments keep their K/V (or MLA latent) rows in bf16, the bytes the planner counts
    (``plan.segments.segment_kv_rows`` in the compute dtype) and the dtype the attention reads them in, whatever
    dtype the projections and norms gave (Qwen3's q/k norms give float32 keys beside bf16 values); SDPA's
    lower-right causal call over a segment takes them, and the step is about as close to the float64 one as one
    pass (within 1.5x: the MLA keys expanded from the merged ``kv_b_proj`` weight sum in another order)."""
    model = _model(FAMILIES[family])
    ids, labels = _batch(model)
    _, truth = plain(model, ids, labels, DOCS)
    model.float()
    kept = []
    orig = ms.SegmentContext.collect

    def spy(self):
        kept.extend(t.dtype for t in self.store.cache.values())
        orig(self)

    def run(segmented: bool) -> float:
        model.zero_grad(set_to_none=True)
        with dispatch.configured(preferred={"attention": ["sdpa"]}), torch.autocast("cpu", dtype=torch.bfloat16):
            if segmented:
                ms.segmented_loss_backward(model, ids, labels, _loss_fn(model), 1 / S, 8, doc_ids=DOCS)
            else:
                (_loss_fn(model)(model(ids, doc_ids=DOCS), labels) / S).backward()
        errs = sorted(rel_err(p.grad.double(), truth[n]) for n, p in model.named_parameters() if n in truth)
        return errs[len(errs) // 2]

    ms.SegmentContext.collect = spy
    try:
        one, seg = run(False), run(True)
    finally:
        ms.SegmentContext.collect = orig
    print(f"\n{family} CPU bf16 vs float64, median relative gradient error: one pass {one:.3g}, segments {seg:.3g}")
    assert kept and set(kept) == {torch.bfloat16}, kept
    assert seg < 1.5 * one + 1e-3


# ---- on a GPU -------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("family", ["qwen3_moe", "kimi_linear", "qwen3_next", "deepseek_v3"])
def test_segments_on_gpu_are_as_close_to_fp64_as_one_pass(family):
    """bf16 autocast on a GPU (SDPA with lower-right causal masks per document, MLA's latent expanded per head
    group, fla's KDA / gated delta rule with carried per-document states): the segmented step is no further from
    the float64 step than one bf16 pass is. The SDPA math fallback (which would build a segment x keys mask) is
    off, so a kernel that cannot run a segment's shapes fails here instead of running slowly."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    model = _model(FAMILIES[family])
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(1, model.spec.vocab_size, (2, 300), generator=g)
    labels = torch.randint(1, model.spec.vocab_size, (2, 300), generator=g)
    doc_ids = torch.tensor([[0] * 100 + [1] * 130 + [2] * 70, [0] * 300])
    with dispatch.configured():  # the reference (HF's float32 softmax) is the truth here
        _, truth = plain(model, ids, labels, doc_ids)
    gpu = model.float().cuda()
    dev = [t.cuda() for t in (ids, labels, doc_ids)]

    def run(segmented: bool) -> float:
        gpu.zero_grad(set_to_none=True)
        with dispatch.configured(), torch.autocast("cuda", dtype=torch.bfloat16), \
                sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]):
            if segmented:
                ms.segmented_loss_backward(gpu, dev[0], dev[1], _loss_fn(gpu), 1 / S, 64, doc_ids=dev[2])
            else:
                (_loss_fn(gpu)(gpu(dev[0], doc_ids=dev[2]), dev[1]) / S).backward()
        grads = {n: p.grad.double().cpu() for n, p in gpu.named_parameters() if p.grad is not None}
        errs = sorted(rel_err(grads[n], truth[n]) for n in truth)
        return errs[len(errs) // 2]

    one, seg = run(False), run(True)
    print(f"\n{family} GPU bf16 vs float64, median relative gradient error: one pass {one:.3g}, segments {seg:.3g}")
    assert seg < 1.25 * one + 1e-3


# ---- the planner's store against the runtime's ------------------------------------------------------------------
@pytest.mark.parametrize("preset", ["qwen3-next-tiny", "deepseek-v3-tiny", "mixtral-tiny"])
def test_planned_store_bounds_the_runtime_store(preset):
    """``plan.segments.segment_store_bytes`` (K/V caches + fp32 gradients, MLA latents + gradients, GDN states and
    halos) against ``SegmentStore.nbytes`` over a float32 step, measured after each segment's backward: the
    plan holds the caches and gradients exactly, and the states of every segment start but the first (the
    measurement sees one start fewer: the first backward has spent the last one)."""
    from megaseq.config import MemorySettings
    from megaseq.plan import Mesh
    from megaseq.plan import components as C
    from megaseq.plan.run import Run
    from megaseq.plan.segments import segment_store_bytes

    model = build_model(get_preset(preset), dtype=torch.float32, seed=0)
    ids, labels = _batch(model)
    measured = []
    orig = ms.SegmentContext.collect

    def spy(self):
        orig(self)
        measured.append(self.store.nbytes())

    ms.SegmentContext.collect = spy
    try:
        model.zero_grad(set_to_none=True)
        ms.segmented_loss_backward(model, ids[:1], labels[:1], _loss_fn(model), 1 / S, 8)
    finally:
        ms.SegmentContext.collect = orig
    spec = model.spec
    run = Run(spec=spec, seq_len=S, batch=1, mesh=Mesh(), model_dtype="fp32",
              memory=MemorySettings(model_segment_tokens=8), counts=C.gpu_counts(C.count_params(spec), Mesh()))
    terms = segment_store_bytes(run)
    planned = sum(terms.values())
    one_start = terms.get("segment GDN states", 0) // 4  # 37 tokens in segments of 8: 4 starts carry state
    print(f"\n{preset}: store {max(measured)} B, planned {terms}")
    assert planned > 0 and max(measured) <= planned <= max(measured) + one_start
