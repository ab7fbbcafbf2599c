"""Attention with sinks and a sliding window (gpt-oss): the reference and the SDPA path against the dense
definition, values and gradients (q, k, v and the sinks), with documents, GQA and windows shorter and longer
than the SDPA path's query blocks; broken variants (the sink key's score off by a constant, the band one key
too wide, the padding before a document scored 0) must fail."""

from __future__ import annotations

import pytest
import torch

from conftest import cuda_backward_peak
from megaseq.models.common import sink_attention
from megaseq.models.common.sink_attention import sink_attention_reference, sink_attention_sdpa

torch.set_num_threads(2)
DOCS = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3], [5, 5, 5, 5, 5, 5, 5, 5, 5, 6, 6, 6, 6, 6]])


def dense_sink_attention(q, k, v, doc_ids, scale, sinks_H, window):
    """The S x S definition in float64: masked scores, the sink's exp in the denominator."""
    q, k, v, sinks_H = (t.double() for t in (q, k, v, sinks_H))
    g = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(g, 2), v.repeat_interleave(g, 2)
    S = q.shape[1]
    i, j = torch.arange(S, device=q.device)[:, None], torch.arange(S, device=q.device)[None, :]
    allowed = ((j <= i) & ((j > i - window) if window else True))[None]
    if doc_ids is not None:
        allowed = allowed & (doc_ids[:, :, None] == doc_ids[:, None, :])
    scores = torch.einsum("bshd,bthd->bhst", q, k) * scale
    e = torch.exp(scores - scores.amax(-1, keepdim=True).clamp_min(sinks_H.max())).masked_fill(~allowed[:, None], 0)
    sink = torch.exp(sinks_H.view(1, -1, 1, 1) - scores.amax(-1, keepdim=True).clamp_min(sinks_H.max()))
    return torch.einsum("bhst,bthd->bshd", e / (e.sum(-1, keepdim=True) + sink), v)


def _inputs(B=2, S=14, Hq=6, Hkv=2, D=10, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, S, h, D, generator=gen, dtype=torch.float64).requires_grad_() for h in (Hq, Hkv, Hkv))
    sinks = torch.randn(Hq, generator=gen, dtype=torch.float64).requires_grad_()
    return q, k, v, sinks


def _check(op, doc_ids, window: int, rtol: float = 1e-10) -> None:
    q, k, v, sinks = _inputs()
    scale = 10**-0.5
    want = dense_sink_attention(q, k, v, doc_ids, scale, sinks, window)
    got = op(q, k, v, doc_ids, scale, sinks, window)
    g = torch.randn(want.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    grads_want = torch.autograd.grad((want * g).sum(), (q, k, v, sinks))
    grads_got = torch.autograd.grad((got * g).sum(), (q, k, v, sinks))
    torch.testing.assert_close(got, want, rtol=rtol, atol=rtol)
    for name, a, b in zip("q k v sinks".split(), grads_got, grads_want):
        torch.testing.assert_close(a, b, rtol=rtol, atol=rtol, msg=lambda m, n=name: f"grad {n}: {m}")


@pytest.mark.parametrize("doc_ids", [None, DOCS])
@pytest.mark.parametrize("window", [0, 1, 3, 20])
def test_reference_matches_definition(doc_ids, window: int) -> None:
    _check(sink_attention_reference, doc_ids, window)


@pytest.mark.parametrize("doc_ids", [None, DOCS])
@pytest.mark.parametrize("window", [0, 1, 3, 6, 20])
def test_sdpa_path_matches_definition(monkeypatch: pytest.MonkeyPatch, doc_ids, window: int) -> None:
    """The SDPA path on the CPU in float64 (the math kernel), with blocks of 4 queries: several per document."""
    monkeypatch.setattr(sink_attention, "SLIDE_BLOCK", 4)
    _check(sink_attention_sdpa, doc_ids, window)


def test_broken_sdpa_variants_fail(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sink_attention, "SLIDE_BLOCK", 4)
    real = sink_attention.with_sink_dims

    def sink_off_by_one(q, k, v, sinks_H, scale):
        return real(q, k, v, sinks_H + 1.0, scale)

    monkeypatch.setattr(sink_attention, "with_sink_dims", sink_off_by_one)
    with pytest.raises(AssertionError):
        _check(sink_attention_sdpa, DOCS, 3)
    monkeypatch.setattr(sink_attention, "with_sink_dims", real)
    with pytest.raises(AssertionError):  # the band one key wider than the window
        _check(lambda *a: sink_attention_sdpa(*a[:-1], a[-1] + 1), DOCS, 3)
    monkeypatch.setattr(sink_attention, "PAD_SCORE", 0.0)
    with pytest.raises(AssertionError):  # the keys before a document not suppressed
        _check(sink_attention_sdpa, DOCS, 3)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("window", [0, 128])
def test_sdpa_path_matches_reference_on_gpu_bf16(window: int) -> None:
    """bf16 SDPA (flash for full layers, the masked kernel for sliding ones) against the float64 definition,
    values and gradients, over 3 documents of a 4100-token row (several 1024-query blocks)."""
    doc_ids = torch.repeat_interleave(torch.arange(3), torch.tensor([2700, 1, 1399]))[None].cuda()
    gen = torch.Generator(device="cuda").manual_seed(3)
    q, k, v = (torch.randn(1, 4100, h, 64, generator=gen, device="cuda").bfloat16().requires_grad_()
               for h in (16, 2, 2))
    sinks = torch.randn(16, generator=gen, device="cuda").bfloat16().requires_grad_()
    got = sink_attention_sdpa(q, k, v, doc_ids, 0.125, sinks, window)
    want = dense_sink_attention(q, k, v, doc_ids, 0.125, sinks, window)
    torch.testing.assert_close(got.double(), want, rtol=2e-2, atol=2e-2)
    g = torch.randn_like(want)
    grads_got = torch.autograd.grad((got.double() * g).sum(), (q, k, v, sinks))
    q64, k64, v64, s64 = (t.detach().double().requires_grad_() for t in (q, k, v, sinks))
    grads_want = torch.autograd.grad((dense_sink_attention(q64, k64, v64, doc_ids, 0.125, s64, window) * g).sum(),
                                     (q64, k64, v64, s64))
    for a, b in zip(grads_got, grads_want):
        torch.testing.assert_close(a.double(), b, rtol=3e-2, atol=3e-2 * float(b.abs().max()))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("window", [0, 128])
def test_sdpa_path_at_64k_holds_no_score_matrix(window: int) -> None:
    """gpt-oss-20b's attention shapes (64 query heads on 8 KV heads of 64) at 64K in bf16: the forward and the
    backward stay within a few GiB (the scores alone would be 512 GiB), so no kernel fell back to the math one."""
    gen = torch.Generator(device="cuda").manual_seed(4)
    q, k, v = (torch.randn(1, 65536, h, 64, generator=gen, device="cuda").bfloat16().requires_grad_()
               for h in (64, 8, 8))
    sinks = torch.randn(64, generator=gen, device="cuda").bfloat16().requires_grad_()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = sink_attention_sdpa(q, k, v, None, 0.125, sinks, window)
    assert torch.cuda.max_memory_allocated() - base < 6 * 2**30
    assert cuda_backward_peak(out, torch.randn_like(out)) < 8 * 2**30
