"""Kept attention under recompute (``memory.keep_attention_layers``, ``ops.kept_attention``) vs the plain model:
loss and every gradient (float64, CPU), with the rerun taking attention's output from the forward instead of
running the kernel again.

float64 runs the reference attention by default (HF's eager numerics); here the ops ``attention`` and
``sink_attention`` run their SDPA paths (``dispatch.override``), whose CPU kernel
(``_scaled_dot_product_flash_attention_for_cpu``) is the op kept. The plain model runs the same SDPA paths.
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.nn.functional as F

from megaseq.config import MemorySettings
from megaseq.memory.apply import loss_fn
from megaseq.memory.offload import KeptHostStore, _CheckpointedForward, checkpoint_layers, kept_host_store
from megaseq.models.build import build_model
from megaseq.models.common import attention as attn_mod
from megaseq.models.common import sink_attention as sink_mod
from megaseq.models.presets import get_preset
from megaseq.models.registry import parallelize
from megaseq.ops import dispatch, kept_attention

torch.set_num_threads(1)
S = 37
CPU_FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default


@contextlib.contextmanager
def _sdpa_in_float64():
    """The SDPA paths of both attention ops, in float64 on the CPU."""
    with dispatch.override("attention", "torch_reference", attn_mod.attention_sdpa), \
            dispatch.override("sink_attention", "torch_reference", sink_mod.sink_attention_sdpa):
        yield


def _batch(vocab: int, n: int = S, first_doc: int = 15):
    """Two rows of ``n`` tokens: the first two documents (``first_doc`` tokens, then the rest), the second one."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (2, n), generator=g)
    doc_ids = torch.tensor([[0] * first_doc + [1] * (n - first_doc), [0] * n])
    labels = torch.cat([ids[:, 1:], torch.full((2, 1), -100)], dim=1)
    labels[0, first_doc - 1] = -100
    return ids, doc_ids, labels


def _step(model):
    ids, doc_ids, labels = _batch(model.spec.vocab_size)
    model.zero_grad(set_to_none=True)
    loss = loss_fn(MemorySettings())(model(ids, doc_ids=doc_ids), model.lm_head.weight, labels)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


class _Calls(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the CPU flash kernel's runs."""

    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += func is CPU_FLASH
        return func(*args, **(kwargs or {}))


def _kept_run(spec, keep: int, host: int = 0, steps: int = 1, before=None):
    """(plain step, last kept step, kept stats of the kept steps, what parallelize applied); ``before(done)`` runs
    after parallelize."""
    model = build_model(spec, dtype=torch.float64, seed=0)
    plain = copy.deepcopy(model)
    with _sdpa_in_float64():
        ref = _step(plain)
        done = parallelize(model, MemorySettings(recompute=True, keep_attention_layers=keep,
                                                 keep_attention_host_layers=host))
        if before is not None:
            before(done)
        kept_attention.STATS.reset()
        for _ in range(steps):
            got = _step(model)
    return ref, got, kept_attention.STATS, done


def _assert_same(ref, got):
    torch.testing.assert_close(got[0], ref[0], rtol=1e-12, atol=1e-12)
    assert got[1].keys() == ref[1].keys()
    for n in ref[1]:
        torch.testing.assert_close(got[1][n], ref[1][n], rtol=1e-10, atol=1e-12, msg=n)


@pytest.mark.parametrize("preset", ["qwen3-moe-tiny", "gpt-oss-tiny", "kimi-linear-tiny"])
def test_kept_attention_matches_plain(preset):
    """Softmax attention (GQA, two documents), attention with sinks and a sliding window, MLA (v padded): every
    layer keeps, the rerun takes every attention call from the forward, and loss and gradients are the plain
    model's."""
    spec = get_preset(preset)
    ref, got, stats, _ = _kept_run(spec, keep=spec.num_layers)
    assert stats.kept > 0 and stats.hits == stats.kept and stats.misses == 0, stats
    _assert_same(ref, got)


def test_the_rerun_runs_no_attention_kernel():
    """Recompute runs the attention kernel twice per layer (forward, rerun); kept attention once."""
    spec = get_preset("qwen3-moe-tiny")
    counts = {}
    for keep in (0, spec.num_layers):
        model = build_model(spec, dtype=torch.float64, seed=0)
        parallelize(model, MemorySettings(recompute=True, keep_attention_layers=keep))
        calls = _Calls()
        with _sdpa_in_float64(), calls:
            _step(model)
        counts[keep] = calls.n
    assert counts[0] == 2 * counts[spec.num_layers] > 0, counts


def test_only_the_last_layers_keep():
    spec = get_preset("qwen3-moe-tiny")
    L = spec.num_layers
    model = build_model(spec, dtype=torch.float64, seed=0)
    checkpoint_layers(model.layers, keep_attention=2)
    assert [layer.forward.keep_attention for layer in model.layers] == [False] * (L - 2) + [True, True]
    assert all(isinstance(layer.forward, _CheckpointedForward) for layer in model.layers)
    _, _, every, _ = _kept_run(spec, keep=L)
    per_layer = every.kept // L
    ref, got, stats, _ = _kept_run(spec, keep=1)
    assert stats.hits == stats.kept == per_layer > 0 and stats.misses == 0, stats
    _assert_same(ref, got)


def test_a_wrong_kept_output_fails(monkeypatch):
    """The comparison can fail: a rerun given a kept log-sum-exp off by a constant changes the gradients."""
    spec = get_preset("qwen3-moe-tiny")
    original = kept_attention.Keeper.handle

    def shifted(self, func, args, kwargs):
        out = original(self, func, args, kwargs)
        if self.phase == "reuse":
            return (out[0], out[1] + 0.5) + tuple(out[2:])
        return out

    monkeypatch.setattr(kept_attention.Keeper, "handle", shifted)
    ref, got, _, _ = _kept_run(spec, keep=spec.num_layers)
    torch.testing.assert_close(got[0], ref[0], rtol=1e-12, atol=1e-12)  # the forward is untouched
    with pytest.raises(AssertionError):
        _assert_same(ref, got)


def test_a_rerun_that_differs_runs_the_kernel():
    """A rerun call of other shapes than the kept one runs the kernel and drops what was kept."""
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 9, 4, dtype=torch.float64, generator=g) for _ in range(3))
    keeper = kept_attention.Keeper()
    kept_attention.STATS.reset()
    with keeper.keeping(), kept_attention.wrap("attention"):
        F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert len(keeper.calls) == 1
    q2 = q[:, :, :5].clone().requires_grad_()
    with keeper.reusing(), kept_attention.wrap("attention"):
        o = F.scaled_dot_product_attention(q2, k[:, :, :5], v[:, :, :5], is_causal=True)
    assert kept_attention.STATS.misses == 1 and kept_attention.STATS.hits == 0 and not keeper.calls
    torch.testing.assert_close(o, F.scaled_dot_product_attention(q2, k[:, :, :5], v[:, :, :5], is_causal=True))


def _large_outputs(stats_per_layer_calls: int) -> int:
    return 2 * stats_per_layer_calls  # each kept CPU flash call: its output and its log-sum-exp


def test_host_kept_matches_plain():
    """The first L - 1 of L kept layers keep in host memory: every kept tensor goes out after its layer's forward and
    comes back for its rerun (two steps: the pool, planned in the first, is reused in the second), and loss and
    gradients are the plain model's."""
    spec = get_preset("qwen3-moe-tiny")
    L = spec.num_layers
    ref, got, stats, done = _kept_run(spec, keep=L, host=L - 1, steps=2)
    assert stats.kept > 0 and stats.hits == stats.kept and stats.misses == 0, stats
    _assert_same(ref, got)
    store = done.kept_host
    assert done.kept_attention == L and done.kept_attention_host == L - 1 and isinstance(store, KeptHostStore)
    per_layer = stats.kept // (2 * L)  # calls per layer and step
    assert store.copies_out == store.copies_in == 2 * (L - 1) * _large_outputs(per_layer), vars(store)
    assert store.bytes_out == 2 * stats.bytes_kept * (L - 1) // (2 * L)  # the host layers' share, both steps
    assert store.spilled == 0 and store.host_bytes == store.need > 0
    assert not store._live()  # every layer's tensors came back
    done.release()
    assert store.host_bytes == 0


def test_a_step_that_needs_more_replans_the_pool():
    """A pool planned too small (one layer's bytes for three host-kept layers) spills the rest to buffers of their
    own in that step, and the next step carves a pool of the whole need: no spill, the same results."""
    spec = get_preset("qwen3-moe-tiny")
    L = spec.num_layers

    def small(done):
        done.kept_host.layers = 1

    ref, got, stats, done = _kept_run(spec, keep=L, host=L - 1, steps=1, before=small)
    store = done.kept_host
    assert store.spilled > 0 and store.host_bytes < store.need
    _assert_same(ref, got)
    spilled, need = store.spilled, store.need
    ref2, got2, stats2, done2 = _kept_run(spec, keep=L, host=L - 1, steps=2, before=small)
    assert done2.kept_host.spilled == spilled and done2.kept_host.host_bytes == need  # none in the second step
    assert stats2.hits == stats2.kept and stats2.misses == 0
    _assert_same(ref2, got2)


@pytest.mark.parametrize("broken", ["zeros", "stale"])
def test_a_wrong_host_fetch_fails(monkeypatch, broken):
    """The comparison can fail: a fetch that returns zeros, or the first fetched layer's tensors again for every
    layer (a stale buffer), changes the gradients."""
    spec = get_preset("qwen3-moe-tiny")
    original = KeptHostStore._start_fetch
    first: list = []

    def wrong(self, rec):
        original(self, rec)
        if broken == "zeros":
            rec.gpu = [torch.zeros_like(g) for g in rec.gpu]
        elif first:
            rec.gpu = [f if f.shape == g.shape else g for f, g in zip(first[0], rec.gpu)]
        else:
            first.append(rec.gpu)

    monkeypatch.setattr(KeptHostStore, "_start_fetch", wrong)
    L = spec.num_layers
    ref, got, stats, _ = _kept_run(spec, keep=L, host=L - 1)
    assert stats.hits == stats.kept > 0
    torch.testing.assert_close(got[0], ref[0], rtol=1e-12, atol=1e-12)  # the forward is untouched
    with pytest.raises(AssertionError):
        _assert_same(ref, got)


def test_only_the_first_kept_layers_keep_on_host():
    spec = get_preset("qwen3-moe-tiny")
    L = spec.num_layers
    model = build_model(spec, dtype=torch.float64, seed=0)
    checkpoint_layers(model.layers, keep_attention=3, keep_attention_host=2)
    assert [layer.forward.keep_on_host for layer in model.layers] == [False] * (L - 3) + [True, True, False]
    assert kept_host_store(model.layers).layers == 2
    checkpoint_layers(model.layers, keep_attention=3)
    assert kept_host_store(model.layers) is None
    with pytest.raises(ValueError, match="keep_attention_host_layers=4 exceeds"):
        checkpoint_layers(model.layers, keep_attention=3, keep_attention_host=4)


def test_host_layers_need_kept_layers():
    with pytest.raises(ValueError, match=r"memory.keep_attention_host_layers=5 exceeds memory.keep_attention_layers=4"
                                         r".*--memory.keep_attention_layers 5.*--memory.keep_attention_host_layers 4"):
        MemorySettings(recompute=True, keep_attention_layers=4, keep_attention_host_layers=5).check_combination()
    MemorySettings(recompute=True, keep_attention_layers=4, keep_attention_host_layers=4).check_combination()


def test_the_setting_needs_recompute():
    with pytest.raises(ValueError, match="memory.keep_attention_layers=4 .*--memory.recompute true"):
        MemorySettings(keep_attention_layers=4).check_combination()
    MemorySettings(keep_attention_layers=4, recompute=True).check_combination()


def test_no_keeper_outside_a_kept_layer():
    """Without recompute's keeper the attention ops run under no mode (nothing intercepted)."""
    assert kept_attention.active() is None
    assert isinstance(kept_attention.wrap("attention"), contextlib.nullcontext)
    keeper = kept_attention.Keeper()
    with keeper.keeping():
        assert kept_attention.active() is keeper
        assert isinstance(kept_attention.wrap("rms_norm"), contextlib.nullcontext)
    assert kept_attention.active() is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_kept_attention_on_gpu(dtype):
    """On CUDA SDPA runs flash / cuDNN (bf16) or the memory-efficient kernel (float32): every call of the rerun
    is taken from the forward (none runs again), and loss and gradients are those of recompute without it (the
    same kernels; the backward kernels' accumulation order may differ between runs)."""
    spec = get_preset("qwen3-moe-tiny").replace(head_dim=64)
    results = {}
    for keep in (0, spec.num_layers):
        model = build_model(spec, dtype=dtype, seed=0).cuda()
        parallelize(model, MemorySettings(recompute=True, keep_attention_layers=keep))
        ids, doc_ids, labels = (t.cuda() for t in _batch(spec.vocab_size, n=296, first_doc=100))
        kept_attention.STATS.reset()
        loss = loss_fn(MemorySettings())(model(ids, doc_ids=doc_ids), model.lm_head.weight, labels)
        loss.backward()
        torch.cuda.synchronize()
        stats = copy.copy(kept_attention.STATS)
        results[keep] = (loss.detach().float().cpu(), {n: p.grad.float().cpu() for n, p in model.named_parameters()
                                                       if p.grad is not None}, stats)
    stats = results[spec.num_layers][2]
    assert stats.kept > 0 and stats.hits == stats.kept and stats.misses == 0, stats
    ref, got = results[0], results[spec.num_layers]
    assert got[0].item() == ref[0].item()
    tol = dict(rtol=2e-2, atol=2e-3) if dtype == torch.bfloat16 else dict(rtol=1e-4, atol=1e-6)
    for n in ref[1]:
        torch.testing.assert_close(got[1][n], ref[1][n], msg=n, **tol)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_host_kept_attention_on_gpu(dtype):
    """On CUDA the first L - 1 kept layers keep in a pinned host pool (copied on the side stream, back a layer
    ahead): two steps, every call of the reruns taken from the forward, every kept tensor out and back, and loss
    and gradients those of recompute without keeping."""
    spec = get_preset("qwen3-moe-tiny").replace(head_dim=64)
    L = spec.num_layers
    results = {}
    for keep, host in ((0, 0), (L, L - 1)):
        model = build_model(spec, dtype=dtype, seed=0).cuda()
        done = parallelize(model, MemorySettings(recompute=True, keep_attention_layers=keep,
                                                 keep_attention_host_layers=host))
        ids, doc_ids, labels = (t.cuda() for t in _batch(spec.vocab_size, n=296, first_doc=100))
        kept_attention.STATS.reset()
        for _ in range(2):
            model.zero_grad(set_to_none=True)
            loss = loss_fn(MemorySettings())(model(ids, doc_ids=doc_ids), model.lm_head.weight, labels)
            loss.backward()
        torch.cuda.synchronize()
        stats = copy.copy(kept_attention.STATS)
        results[keep] = (loss.detach().float().cpu(), {n: p.grad.float().cpu() for n, p in model.named_parameters()
                                                       if p.grad is not None}, stats, done)
    stats, done = results[L][2], results[L][3]
    assert stats.kept > 0 and stats.hits == stats.kept and stats.misses == 0, stats
    store = done.kept_host
    assert store.pool is not None and store.pool.pinned and store.spilled == 0 and store.host_bytes == store.need
    assert store.copies_out == store.copies_in > 0 and not store._live()
    ref, got = results[0], results[L]
    assert got[0].item() == ref[0].item()
    tol = dict(rtol=2e-2, atol=2e-3) if dtype == torch.bfloat16 else dict(rtol=1e-4, atol=1e-6)
    for n in ref[1]:
        torch.testing.assert_close(got[1][n], ref[1][n], msg=n, **tol)
    done.release()
    assert store.host_bytes == 0
