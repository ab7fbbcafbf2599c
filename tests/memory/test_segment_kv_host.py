"""Sequence segments with the earlier segments' K/V (or MLA latents) and their fp32 gradients in host memory
(``memory.segment_kv_host``, ``memory/segment_host.py``) against the GPU-resident store: the same step bitwise
(float64, CPU: the "device" is the CPU, so every fetch, write-back and prefetch runs as plain copies), and against
one plain pass to 1e-10; softmax attention (qwen3-moe), dense MLA (deepseek-v3), hybrids (qwen3-next: gated
DeltaNet + gated attention; kimi-linear: KDA + MLA), with packed documents and LoRA; under Ulysses CP + FSDP over
2 gloo ranks; dense MLA with one head per expansion. Broken variants that must fail: an accumulator never written
back to the host, a stale layer's rows (the layer before's, or the rows of the previous segment) handed to a layer,
the prefetch one layer off, MLA's ``kv_b_proj`` weights without their gradient.
"""

from __future__ import annotations

import pytest
import torch
from test_family_segments import DOCS, FAMILIES, B, S, _batch, _grads, _loss_fn, _model, plain, worst

from family_parity import rel_err
from megaseq.memory import model_segments as ms
from megaseq.memory import segment_host as sh
from megaseq.ops import dispatch

pytestmark = pytest.mark.usefixtures("one_thread", "exact_attention")
HOSTED = ["qwen3_moe", "deepseek_v3", "qwen3_next", "kimi_linear"]


def segmented(model, ids, labels, T: int, doc_ids=None, kv_host: bool = False):
    model.zero_grad(set_to_none=True)
    loss = ms.segmented_loss_backward(model, ids, labels, _loss_fn(model), 1 / S, T, doc_ids=doc_ids,
                                      kv_host=kv_host)
    return loss, _grads(model)


def bitwise(got: dict, ref: dict) -> list[str]:
    assert got.keys() == ref.keys(), sorted(set(got) ^ set(ref))
    return [n for n in ref if not torch.equal(got[n], ref[n])]


@pytest.mark.parametrize("family", HOSTED)
@pytest.mark.parametrize("T,docs", [(9, True), (5, False)])
def test_host_store_equals_gpu_store(family, T, docs):
    """Loss and every gradient bitwise equal to the GPU-resident store's, and within 1e-10 of one pass."""
    model = _model(FAMILIES[family])
    ids, labels = _batch(model)
    doc_ids = DOCS if docs else None
    l0, g0 = plain(model, ids, labels, doc_ids)
    l1, g1 = segmented(model, ids, labels, T, doc_ids)
    l2, g2 = segmented(model, ids, labels, T, doc_ids, kv_host=True)
    assert torch.equal(l1, l2) and not bitwise(g2, g1), bitwise(g2, g1)
    err, name = worst(g2, g0)
    assert rel_err(l2, l0) < 1e-12 and err < 1e-10, name


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_the_store_is_on_the_host_and_two_layers_on_the_device(monkeypatch, family):
    """With the host store the segments keep no attention rows on the device (only DSA/recurrent state would
    stay there); the host holds every layer's rows and fp32 gradients, the planner's bytes
    (``plan.segments.segment_kv_host_bytes``); the fetched tensors on the device peak within the planner's
    in-flight bound (two layers: one in its backward, the next fetched ahead; softmax attention's rows'
    gradient beside them)."""
    from megaseq.config import MemorySettings
    from megaseq.plan import Mesh
    from megaseq.plan import components as C
    from megaseq.plan.run import Run
    from megaseq.plan.segments import segment_kv_host_bytes, segment_kv_rows, segment_store_bytes

    model = _model(FAMILIES[family])
    ids, labels = _batch(model)
    seen = []
    orig = sh.HostKV.release

    def spy(self):
        seen.append((self.host_bytes(), self.peak_device_bytes, list(self.order), dict(self.ahead)))
        orig(self)

    monkeypatch.setattr(sh.HostKV, "release", spy)
    cached = []
    orig_collect = ms.SegmentContext.collect
    monkeypatch.setattr(ms.SegmentContext, "collect",
                        lambda self: (cached.append(sorted(self.store.cache)), orig_collect(self))[1])
    segmented(model, ids, labels, 9, DOCS, kv_host=True)
    host_bytes, peak, order, left = seen[0]
    assert order == [f"layers.{i}.self_attn" for i in range(len(model.layers))]
    assert all(not keys for keys in cached) and not left  # nothing on the device store; every fetch consumed
    run = Run(spec=model.spec, seq_len=S, batch=B, mesh=Mesh(), model_dtype="fp64",
              memory=MemorySettings(model_segment_tokens=9, segment_kv_host=True),
              counts=C.gpu_counts(C.count_params(model.spec), Mesh()))
    assert host_bytes == segment_kv_host_bytes(run)
    in_flight = segment_store_bytes(run)["segment K/V in flight (host-kept store)"]
    one_layer = B * S * max(segment_kv_rows(run)) * 8 * 2  # rows + fp64 accumulator
    assert one_layer < peak <= in_flight, (peak, in_flight)


# ---- broken variants ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("family,param", [("qwen3_moe", "k_proj"), ("deepseek_v3", "kv_a_proj_with_mqa")])
def test_an_accumulator_not_written_back_fails(monkeypatch, family, param):
    """The accumulated gradient of the earlier rows never reaches the host: the keys' projection (or the MLA
    latent's) gets another gradient than the GPU-resident store's."""
    model = _model(FAMILIES[family])
    ids, labels = _batch(model)
    _, g1 = segmented(model, ids, labels, 9, DOCS)
    monkeypatch.setattr(sh.HostKV, "write_grad", lambda self, name, acc, S: None)
    monkeypatch.setattr(sh.HostKV, "grad_rows", lambda self, name, s, e, dtype, device: torch.zeros(
        self.rows[name][:, s:e].shape, dtype=dtype))
    _, g2 = segmented(model, ids, labels, 9, DOCS, kv_host=True)
    bad = [n for n in g1 if rel_err(g2[n], g1[n]) > 1e-6]
    assert any(param in n for n in bad), bad


def _stale(monkeypatch, how: str) -> None:
    """Hand a layer stale rows: the layer before's (the prefetch one layer off), or rows the last segment wrote
    missing (a fetch that did not wait for the write-back before it)."""
    orig = sh.HostKV._fetch

    def fetch(self, key, r, grads, device):
        i = self.order.index(key) if key in self.order else 0
        if how == "layer" and i > 0:
            return orig(self, self.order[i - 1], r, grads, device)
        rows, accs, r_, event = orig(self, key, r, grads, device)
        if how == "segment":
            last = max(s for s, _ in self.bounds if s < r)
            for x in rows:
                x[:, last:r] = 0
        return rows, accs, r_, event

    monkeypatch.setattr(sh.HostKV, "_fetch", fetch)


@pytest.mark.parametrize("how", ["layer", "segment"])
@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_stale_rows_fail(monkeypatch, family, how):
    model = _model(FAMILIES[family])
    ids, labels = _batch(model)
    l1, g1 = segmented(model, ids, labels, 9, DOCS)
    _stale(monkeypatch, how)
    l2, g2 = segmented(model, ids, labels, 9, DOCS, kv_host=True)
    assert rel_err(l2, l1) > 1e-6 or worst(g2, g1)[0] > 1e-6


# ---- dense MLA: the latent expanded a group of heads at a time ---------------------------------------------------
@pytest.mark.parametrize("family", ["deepseek_v3", "kimi_linear"])
@pytest.mark.parametrize("kv_host", [False, True])
def test_mla_one_head_per_call(monkeypatch, family, kv_host):
    """Dense MLA under segments with one head per expansion (``ops.workspace.MLA_SEGMENT_GROUP_BYTES`` at 1 byte:
    every call's keys over budget): each head's call checkpointed, the same loss and gradients as one pass to
    1e-10."""
    from megaseq.models.common import mla
    from megaseq.ops import workspace

    model = _model(FAMILIES[family])
    ids, labels = _batch(model)
    l0, g0 = plain(model, ids, labels, DOCS)
    heads = []
    orig = mla.MultiLatentAttention._attend_heads
    monkeypatch.setattr(mla.MultiLatentAttention, "_attend_heads",
                        lambda self, q, *a: (heads.append(q.shape[2]), orig(self, q, *a))[1])
    monkeypatch.setattr(workspace, "MLA_SEGMENT_GROUP_BYTES", 1)
    l1, g1 = segmented(model, ids, labels, 9, DOCS, kv_host=kv_host)
    assert heads and set(heads) == {1} and model.spec.num_attention_heads > 1
    err, name = worst(g1, g0)
    assert rel_err(l1, l0) < 1e-12 and err < 1e-10, name


def test_mla_weights_without_their_gradient_fail(monkeypatch):
    """The host store's backward drops the gradient of ``attend``'s ``params`` (MLA's ``kv_b_proj`` weights, read
    inside the rerun attention): ``kv_b_proj`` gets another gradient than the GPU-resident store's."""
    model = _model(FAMILIES["deepseek_v3"])
    ids, labels = _batch(model)
    _, g1 = segmented(model, ids, labels, 9, DOCS)
    orig = sh._HostAttend.backward

    def dropped(ctx, g_out):
        got = list(orig(ctx, g_out))
        for i in range(5, 5 + ctx.n_params):
            got[i] = None
        return tuple(got)

    monkeypatch.setattr(sh._HostAttend, "backward", staticmethod(dropped))
    _, g2 = segmented(model, ids, labels, 9, DOCS, kv_host=True)
    bad = [n for n in g1 if n not in g2 or rel_err(g2[n], g1[n]) > 1e-6]
    assert bad and all("kv_b_proj" in n for n in bad), bad


# ---- LoRA ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("preset", ["qwen3-moe-tiny", "kimi-linear-tiny"])
def test_host_store_with_lora(preset):
    """LoRA on every projection (the base frozen: the first layer's keys carry no gradient, so its rows reach the
    attention as the forward pass's): bitwise the GPU-resident store's step."""
    from lora_helpers import adapted_model, settings
    from megaseq.config import MemorySettings
    from megaseq.models.presets import get_preset

    model, done = adapted_model(get_preset(preset), settings("all"),
                                MemorySettings(model_segment_tokens=9, segment_kv_host=True))
    assert done.model_segmented == 9 and done.adapters
    ids, labels = _batch(model)
    l1, g1 = segmented(model, ids, labels, 9, DOCS)
    l2, g2 = segmented(model, ids, labels, 9, DOCS, kv_host=True)
    assert g1 and all("lora_" in n for n in g1)
    assert torch.equal(l1, l2) and not bitwise(g2, g1), bitwise(g2, g1)


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_frozen_keys_read_the_forward_rows(family):
    """Every key-side projection frozen (no K/V gradient anywhere: the layers read the rows ``[0, e)`` the forward
    pass wrote): bitwise the GPU-resident store's step."""
    model = _model(FAMILIES[family])
    for n, p in model.named_parameters():
        if any(k in n for k in ("k_proj", "v_proj", "kv_a_proj", "kv_a_layernorm", "k_norm", "embed", "layers.0.")):
            p.requires_grad_(False)
    ids, labels = _batch(model)
    l1, g1 = segmented(model, ids, labels, 9, DOCS)
    l2, g2 = segmented(model, ids, labels, 9, DOCS, kv_host=True)
    assert torch.equal(l1, l2) and not bitwise(g2, g1), bitwise(g2, g1)


# ---- Ulysses CP + FSDP over gloo -------------------------------------------------------------------------------
def _rank(rank: int, preset: str, broken: bool, ref) -> None:
    """One rank of the trainer's steps with ``memory.segment_kv_host`` on (the trainer passes it to the segments)."""
    import test_fsdp_train_step as fsdp_test

    from megaseq.config import MemorySettings

    dispatch.configure(preferred={"attention": ["torch_exact"]})
    fsdp_test.MemorySettings = lambda **kw: MemorySettings(segment_kv_host=True, **kw)  # a forked rank
    made = []
    orig_init = sh.HostKV.__init__

    def counted(self, bounds):
        made.append(len(bounds))
        orig_init(self, bounds)

    sh.HostKV.__init__ = counted
    if broken:
        sh.HostKV.write_grad = lambda self, name, acc, S: None
        sh.HostKV.grad_rows = lambda self, name, s, e, dtype, device: torch.zeros(
            self.rows[name][:, s:e].shape, dtype=dtype)
    fsdp_test._rank(rank, 1, 2, "dp_cp", 8, "", ref, preset)
    assert made, "the host store did not run"


@pytest.mark.parametrize("preset", ["qwen3-moe-tiny", pytest.param("deepseek-v3-tiny", marks=pytest.mark.slow)])
def test_host_store_under_cp_matches_one_process(preset):
    """Two trainer steps over 2 gloo ranks (cp 2, FSDP over both, segments of 8) with the host store equal the
    one-process steps (loss, every gradient, the parameters); the accumulators not written back fail."""
    from test_fsdp_train_step import reference

    from conftest import torch_threads
    from megaseq.parallel.launch import spawn_local

    with torch_threads(1), dispatch.configured(preferred={"attention": ["torch_exact"]}):
        ref = reference(preset)
    spawn_local(_rank, 2, args=(preset, False, ref))
    with pytest.raises(Exception, match="step 0 grad"):
        spawn_local(_rank, 2, args=(preset, True, ref))


# ---- on a GPU -------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_host_store_on_gpu_equals_gpu_store_with_a_lower_peak(family):
    """bf16 autocast on a GPU (SDPA, MLA's latent expanded per head group, the copies on the side stream into pinned
    host memory): the host store's step equals the GPU-resident store's bitwise (one sequence, so the GPU store's
    ``[:, :e]`` views are contiguous as the joined rows are; where a kernel's backward is not deterministic, no
    further from it than the GPU store is from itself), and its peak ``max_memory_allocated`` is lower by about
    the store less two layers' worth."""
    model = _model(FAMILIES[family]).float().cuda()
    g = torch.Generator().manual_seed(4)
    Sg, T = 16384, 512  # the store (4 layers x 16K rows) well above one segment's working set
    ids, labels = (torch.randint(1, model.spec.vocab_size, (1, Sg), generator=g).cuda() for _ in range(2))
    doc_ids = torch.tensor([[0] * 5000 + [1] * 9000 + [2] * 2384]).cuda()

    def run(kv_host: bool):
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        with dispatch.configured(), torch.autocast("cuda", dtype=torch.bfloat16):
            loss = ms.segmented_loss_backward(model, ids, labels, _loss_fn(model), 1 / Sg, T, doc_ids=doc_ids,
                                              kv_host=kv_host)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        return loss, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, peak

    l1, g1, peak_gpu = run(False)
    l2, g2, peak_host = run(True)
    print(f"\n{family} GPU bf16, {Sg} tokens in segments of {T}: peak above the model {peak_gpu / 2**20:.1f} MiB "
          f"(GPU store) vs {peak_host / 2**20:.1f} MiB (host store)")
    assert peak_host < peak_gpu
    if torch.equal(l1, l2) and not bitwise(g2, g1):
        return
    # not bitwise: only as far as the GPU store differs from itself (a kernel's backward summing in any order)
    l3, g3, _ = run(False)
    noise, diff = worst(g3, g1)[0], worst(g2, g1)
    print(f"not bitwise: GPU store against itself {noise:.2e}, host against GPU store {diff[0]:.2e} ({diff[1]})")
    assert noise > 0 and diff[0] <= 2 * noise, diff[1]


# ---- through megaseq train ---------------------------------------------------------------------------------------
def test_megaseq_train_with_the_host_store(tmp_path, monkeypatch):
    """``memory.segment_kv_host`` forced through ``megaseq train`` (qwen3-moe-tiny, float64, a 96-base window in
    segments of 40): every step runs the host store, the losses are the plain step's, the plan records it. The
    first loss to 1e-10; the second after one AdamW update, whose first step divides each gradient entry by its
    own magnitude, so an entry near 0 turns float64 rounding into a difference of up to about 1e-9 (seen under
    xdist): to 1e-8. The gradients themselves are compared to float64 rounding above."""
    import json

    import numpy as np
    from test_train import _cfg, _fasta

    from megaseq.train.trainer import run_training

    _fasta(tmp_path / "g.fa", 3000, seed=2)
    common = dict(data={"train": [str(tmp_path / "g.fa")], "seq_len": 96},
                  model={"name": "qwen3-moe-tiny", "dtype": "fp64"}, train={"steps": 2})
    plain = run_training(_cfg(tmp_path, "plain", **common))
    made = []
    orig = sh.HostKV.__init__
    monkeypatch.setattr(sh.HostKV, "__init__", lambda self, bounds: (made.append(len(bounds)), orig(self, bounds))[1])
    host = run_training(_cfg(tmp_path, "host", **common, memory={"auto": False, "model_segment_tokens": 40,
                                                                "segment_kv_host": True}))
    assert made == [3, 3]
    np.testing.assert_allclose(host.losses[0], plain.losses[0], rtol=1e-10)
    np.testing.assert_allclose(host.losses[1], plain.losses[1], rtol=1e-8)
    plan = json.loads((tmp_path / "host" / "plan.json").read_text())
    assert plan["memory"]["segment_kv_host"]
    assert any(c[0].startswith("host: segment K/V") for c in plan["components"])
