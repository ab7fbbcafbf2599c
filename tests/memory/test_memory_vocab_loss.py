"""Chunked linear cross-entropy and the online log-sum-exp vs the plain loss (float64, CPU)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megaseq.memory.vocab_loss import chunked_linear_cross_entropy, linear_cross_entropy
from megaseq.ops.vocab_loss.reference import (
    lse_finalize,
    lse_init,
    lse_logsumexp,
    lse_update,
    plain_linear_cross_entropy,
)
from megaseq.plan.activations import vocab_loss_bytes

torch.set_num_threads(1)
N, H, V = 47, 31, 123
TOL = {"rtol": 1e-12, "atol": 1e-13}


def _inputs(seed: int = 0, n: int = N, ignore_frac: float = 0.2, dtype: torch.dtype = torch.float64):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, H, generator=g, dtype=dtype)
    weight = torch.randn(V, H, generator=g, dtype=dtype) * 0.3
    labels = torch.randint(0, V, (n,), generator=g)
    labels[torch.rand(n, generator=g) < ignore_frac] = -100
    labels[0], labels[-1] = 0, V - 1  # the first and last vocabulary ids are both targets
    return hidden, weight, labels


def _loss_and_grads(fn, hidden, weight, labels, reduction="mean", **kw):
    h = hidden.clone().requires_grad_(True)
    w = weight.clone().requires_grad_(True)
    loss = fn(h, w, labels, reduction=reduction, **kw)
    if reduction == "none":  # reduced with uneven per-token weights so every token's gradient is checked
        loss_w = loss * torch.linspace(0.5, 1.5, loss.numel(), dtype=loss.dtype)
        loss_w.sum().backward()
    else:
        loss.backward()
    return loss.detach(), h.grad, w.grad


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("chunk_tokens,vocab_chunk",
                         [(5, None), (16, 17), (47, 123), (100, 40), (1, 61), (13, 1)])
def test_chunked_matches_plain(reduction, chunk_tokens, vocab_chunk):
    hidden, weight, labels = _inputs()
    ref = _loss_and_grads(plain_linear_cross_entropy, hidden, weight, labels, reduction)
    got = _loss_and_grads(chunked_linear_cross_entropy, hidden, weight, labels, reduction,
                          chunk_tokens=chunk_tokens, vocab_chunk=vocab_chunk)
    for r, o, name in zip(ref, got, ("loss", "grad_hidden", "grad_weight")):
        torch.testing.assert_close(o, r, **TOL, msg=lambda m, name=name: f"{name}: {m}")


def test_weight_gradient_row_blocks(monkeypatch):
    """The weight gradient is accumulated in row blocks (bounding a temporary); blocks that split a strip."""
    import megaseq.memory.vocab_loss as vl

    monkeypatch.setattr(vl, "WEIGHT_GRAD_ROWS", 7)
    hidden, weight, labels = _inputs(9)
    ref = _loss_and_grads(plain_linear_cross_entropy, hidden, weight, labels)
    got = _loss_and_grads(chunked_linear_cross_entropy, hidden, weight, labels, chunk_tokens=11, vocab_chunk=30)
    for r, o in zip(ref, got):
        torch.testing.assert_close(o, r, **TOL)


def test_plain_matches_torch_cross_entropy():
    hidden, weight, labels = _inputs(1)
    expected = F.cross_entropy(hidden @ weight.T, labels, ignore_index=-100)
    torch.testing.assert_close(plain_linear_cross_entropy(hidden, weight, labels), expected, **TOL)


def test_num_items_accumulates_across_micro_batches():
    """Two micro-batches, each divided by the total count, give the whole batch's mean loss and grads."""
    hidden, weight, labels = _inputs(2)
    total = int((labels != -100).sum())
    ref = _loss_and_grads(plain_linear_cross_entropy, hidden, weight, labels)
    h = hidden.clone().requires_grad_(True)
    w = weight.clone().requires_grad_(True)
    loss = 0
    for sl in (slice(0, 20), slice(20, N)):
        part = chunked_linear_cross_entropy(h[sl], w, labels[sl], chunk_tokens=7, vocab_chunk=50,
                                            num_items=total)
        part.backward()
        loss = loss + part.detach()
    torch.testing.assert_close(loss, ref[0], **TOL)
    torch.testing.assert_close(h.grad, ref[1], **TOL)
    torch.testing.assert_close(w.grad, ref[2], **TOL)


def test_all_ignored_gives_zero_not_nan():
    hidden, weight, _ = _inputs(3)
    labels = torch.full((N,), -100)
    for fn, kw in ((plain_linear_cross_entropy, {}), (chunked_linear_cross_entropy, {"chunk_tokens": 8})):
        loss, gh, gw = _loss_and_grads(fn, hidden, weight, labels, **kw)
        assert loss.item() == 0.0
        assert torch.count_nonzero(gh) == 0 and torch.count_nonzero(gw) == 0


def test_custom_ignore_index_and_frozen_weight():
    hidden, weight, labels = _inputs(4, ignore_frac=0.0)
    labels[::3] = 7  # id 7 is the ignored one here
    h1 = hidden.clone().requires_grad_(True)
    h2 = hidden.clone().requires_grad_(True)
    ref = plain_linear_cross_entropy(h1, weight, labels, ignore_index=7)
    got = chunked_linear_cross_entropy(h2, weight, labels, chunk_tokens=9, vocab_chunk=31, ignore_index=7)
    ref.backward()
    got.backward()
    torch.testing.assert_close(got, ref, **TOL)
    torch.testing.assert_close(h2.grad, h1.grad, **TOL)
    assert torch.count_nonzero(h2.grad[::3]) == 0


def test_entry_point_flattens_batch_and_sequence():
    hidden, weight, labels = _inputs(5, n=2 * 23)
    h_BSH, l_BS = hidden.reshape(2, 23, H), labels.reshape(2, 23)
    ref = plain_linear_cross_entropy(hidden, weight, labels, reduction="none").reshape(2, 23)
    got = linear_cross_entropy(h_BSH, weight, l_BS, chunk_tokens=10, reduction="none")
    assert got.shape == (2, 23)
    torch.testing.assert_close(got, ref, **TOL)
    torch.testing.assert_close(linear_cross_entropy(h_BSH, weight, l_BS), ref.sum() / (labels != -100).sum(),
                               **TOL)


def test_online_lse_in_any_strip_order():
    """Ring-DTP folds strips starting at its own shard: the result must not depend on the order."""
    hidden, weight, labels = _inputs(6)
    logits = hidden @ weight.T
    bounds = [0, 19, 40, 77, 101, V]
    strips = list(zip(bounds[:-1], bounds[1:]))
    expected_lse = torch.logsumexp(logits, dim=1)
    expected_loss = F.cross_entropy(logits, labels, reduction="none")
    valid = labels != -100
    for rotation in range(len(strips)):
        state = lse_init(N, "cpu", torch.float64)
        for v0, v1 in strips[rotation:] + strips[:rotation]:
            state = lse_update(state, logits[:, v0:v1], labels, v0)
        torch.testing.assert_close(lse_logsumexp(state), expected_lse, **TOL)
        torch.testing.assert_close(lse_finalize(state)[valid], expected_loss[valid], **TOL)


def test_rejects_bad_settings():
    hidden, weight, labels = _inputs(7)
    with pytest.raises(ValueError, match="loss_chunk_tokens"):
        chunked_linear_cross_entropy(hidden, weight, labels, chunk_tokens=0)
    with pytest.raises(ValueError, match="reduction"):
        chunked_linear_cross_entropy(hidden, weight, labels, chunk_tokens=4, reduction="avg")
    with pytest.raises(ValueError, match="flatten"):
        plain_linear_cross_entropy(hidden[None], weight, labels[None])


def test_memory_formula_scaling():
    """Chunked bytes grow only linearly in N (per-token state and grad_hidden), never as N x V."""
    H_, V_, C, d = 4096, 154880, 4096, 2
    small, big = (vocab_loss_bytes(n, H_, V_, C, d) for n in (32768, 65536))
    per_token = (big["chunked"] - small["chunked"]) / 32768
    assert per_token == 2 * 4 + H_ * d  # lse + loss, and grad_hidden
    assert big["plain"] - small["plain"] >= 32768 * V_ * d  # the full logits, at least once
    # at 32K tokens the chunked loss needs under a fifth of the plain loss's bytes
    assert small["chunked"] * 5 < small["plain"]
    # vocabulary strips bound the chunk term further, down to the weight-gradient floor
    assert vocab_loss_bytes(32768, H_, V_, C, d, vocab_chunk=8192)["chunked"] < small["chunked"]
    floor = 2 * 32768 * 4 + 32768 * H_ * d + V_ * H_ * (4 + d)
    assert vocab_loss_bytes(32768, H_, V_, 64, d)["chunked"] == floor


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_bf16_on_gpu_close_to_fp32_reference():
    hidden, weight, labels = _inputs(8, n=4099, dtype=torch.float32)
    hidden, weight, labels = hidden.cuda(), weight.cuda(), labels.cuda()
    ref = _loss_and_grads(plain_linear_cross_entropy, hidden, weight, labels)
    got = _loss_and_grads(chunked_linear_cross_entropy, hidden.bfloat16(), weight.bfloat16(), labels,
                          chunk_tokens=1000, vocab_chunk=50)
    plain16 = _loss_and_grads(plain_linear_cross_entropy, hidden.bfloat16(), weight.bfloat16(), labels)
    for r, o, p in zip(ref, got, plain16):
        err_chunked = (o.float() - r).abs().max().item()
        err_plain = (p.float() - r).abs().max().item()
        # the chunked bf16 path is no worse than the plain bf16 path (it accumulates in fp32)
        assert err_chunked <= 1.5 * err_plain + 1e-6, (err_chunked, err_plain)
