"""Op ``linear_cross_entropy``: Liger's fused linear cross-entropy against megaseq's plain loss.

On the CPU only the ``supports`` reasons and the dispatcher's fallback are checked (Liger's kernels need
cuda); the ``gpu`` tests compare every reduction, ``ignore_index``, ``num_items`` and an all-ignored batch.
Tolerances: fp32 1e-5 (another order of summation); bf16 2e-2 relative to the largest gradient (Liger
writes ``softmax - onehot`` in bf16 and, with ``WEIGHT_GRAD_DTYPE=None``, accumulates the weight gradient
in bf16 across its token chunks).
"""

from __future__ import annotations

import pytest
import torch

from devices import GPU
from megaseq.ops import dispatch
from megaseq.ops.vocab_loss import liger as liger_loss
from megaseq.ops.vocab_loss.reference import plain_linear_cross_entropy
from numerics import rel_err


def _inputs(N=37, H=24, V=301, dtype=torch.float32, device="cpu", seed=0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, H, generator=gen).to(dtype).to(device).requires_grad_()
    weight = (torch.randn(V, H, generator=gen) * H**-0.5).to(dtype).to(device).requires_grad_()
    labels = torch.randint(0, V, (N,), generator=gen).to(device)
    labels[::5] = -100
    return hidden, weight, labels


def test_liger_declines_cpu_and_falls_back():
    hidden, weight, labels = _inputs()
    why = liger_loss.liger_loss_supports(hidden, weight, labels)
    assert why is not None and ("cuda" in why or "not installed" in why)
    assert "reduction" in liger_loss.liger_loss_supports(hidden, weight, labels, reduction="max")
    impl = dispatch.select("linear_cross_entropy", "test", hidden, weight, labels)
    assert impl.name == "torch"
    loss = impl.fn(hidden, weight, labels)
    assert torch.isfinite(loss)


@pytest.mark.parametrize("n", [1, 100, 1031, 8192, 32768, 1 << 20, 3 << 21])
@pytest.mark.parametrize("h,v", [(2048, 154880), (256, 5003), (4096, 151936), (24, 301)])
@pytest.mark.parametrize("rows", [1, 128, 512, 4096])
def test_chunk_mem_const_gives_the_largest_chunks_within_rows(n, h, v, rows):
    c = liger_loss.chunk_mem_const(n, h, v, rows)
    got = liger_loss.liger_chunk_rows(n, h, v, c)
    floor = liger_loss.liger_chunk_rows(n, h, v, 1)  # Liger's smallest chunks (its default)
    assert c >= 1 and got <= max(rows, floor)
    # one more unit of C would give chunks past the limit, or none larger
    assert liger_loss.liger_chunk_rows(n, h, v, c + 1) > max(rows, floor) or got == min(n, max(rows, floor)) \
        or liger_loss.liger_chunk_rows(n, h, v, c + 1) == got
    if n <= rows:
        assert got == n  # one chunk


def test_chunk_rows_are_a_power_of_two():
    with pytest.raises(ValueError, match="power of two"):
        liger_loss.chunk_mem_const(100, 8, 50, 96)


@pytest.mark.gpu
@GPU
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("reduction,num_items", [("mean", None), ("mean", 123.0), ("sum", None), ("none", None)])
@pytest.mark.parametrize("chunk_rows", [None, 128, 4096])  # Liger's rule (64-row chunks here), 9 chunks, one
def test_liger_matches_plain(dtype, tol, reduction, num_items, chunk_rows):
    pytest.importorskip("liger_kernel")
    hidden, weight, labels = _inputs(N=1031, H=256, V=5003, dtype=dtype, device="cuda")
    assert liger_loss.liger_loss_supports(hidden, weight, labels, -100, reduction, num_items) is None
    ref = plain_linear_cross_entropy(hidden, weight, labels, -100, reduction, num_items)
    out = liger_loss.linear_cross_entropy_liger(hidden, weight, labels, -100, reduction, num_items, chunk_rows)
    assert out.dtype == ref.dtype and out.shape == ref.shape
    assert rel_err(out, ref) < tol
    w = torch.randn_like(ref)
    g_ref = torch.autograd.grad((ref * w).sum(), (hidden, weight))
    g_out = torch.autograd.grad((out * w).sum(), (hidden, weight))
    for a, b in zip(g_out, g_ref):
        assert rel_err(a, b) < tol


def test_saved_gradients_scale_in_place():
    a, b = torch.full((3, 2), 2.0, dtype=torch.bfloat16), torch.ones(4)
    out = liger_loss.scale_saved_gradients(torch.tensor(0.25), a, None, b)
    assert out[0] is a and out[1] is None and (a == 0.5).all() and (b == 0.25).all() and a.dtype == torch.bfloat16


@pytest.mark.gpu
@GPU
def test_liger_backward_reads_nothing_back(monkeypatch):
    """The backward scales the forward's gradients without Liger's ``torch.equal(grad_output, 1)`` (a host sync):
    with ``torch.equal`` made to fail, the gradients still come, and are the plain loss's."""
    pytest.importorskip("liger_kernel")
    hidden, weight, labels = _inputs(N=1031, H=256, V=5003, dtype=torch.float32, device="cuda")
    out = liger_loss.linear_cross_entropy_liger(hidden, weight, labels, -100, "sum")

    def no_equal(*a, **k):
        raise AssertionError("torch.equal in the loss's backward: a host sync")

    monkeypatch.setattr(torch, "equal", no_equal)
    grads = torch.autograd.grad(out * 0.37, (hidden, weight))
    monkeypatch.undo()
    ref = plain_linear_cross_entropy(hidden, weight, labels, -100, "sum")
    for a, b in zip(grads, torch.autograd.grad(ref * 0.37, (hidden, weight))):
        assert rel_err(a, b) < 1e-5


@pytest.mark.gpu
@GPU
def test_liger_all_ignored_gives_zero():
    pytest.importorskip("liger_kernel")
    hidden, weight, labels = _inputs(device="cuda")
    labels[:] = -100
    loss = liger_loss.linear_cross_entropy_liger(hidden, weight, labels)
    assert loss.item() == 0.0
    g_h, g_w = torch.autograd.grad(loss, (hidden, weight))
    assert g_h.abs().max().item() == 0.0 and g_w.abs().max().item() == 0.0


# ---- op chunked_linear_cross_entropy: the loss where the memory plan bounds it -------------------------------
def test_the_planned_chunked_loss_runs_through_its_op():
    """``memory.vocab_loss.linear_cross_entropy`` with ``chunk_tokens`` calls op ``chunked_linear_cross_entropy``:
    megaseq's chunked loss by default; Liger when preferred (``model.kernels fast``) and it can run, else the
    chunked loss again with the reason (here: the CPU)."""
    from megaseq.memory import vocab_loss

    hidden, weight, labels = _inputs()
    want = vocab_loss.chunked_linear_cross_entropy(hidden, weight, labels, 8)
    for prefer, expect in (({}, "torch_chunked"), ({"chunked_linear_cross_entropy": ["liger"]}, "torch_chunked")):
        dispatch.reset_records()
        with dispatch.configured(prefer, {}, False):
            got = vocab_loss.linear_cross_entropy(hidden, weight, labels, chunk_tokens=8)
        recs = {r.op: r for _, r in dispatch.records()}
        assert recs["chunked_linear_cross_entropy"].impl == expect
        assert torch.equal(got, want)
    assert "liger" in recs["chunked_linear_cross_entropy"].reason  # why Liger did not run


@pytest.mark.gpu
@GPU
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_liger_as_the_chunked_loss_matches_it(reduction):
    from megaseq.memory import vocab_loss

    hidden, weight, labels = _inputs(N=4096, H=256, V=8191, dtype=torch.bfloat16, device="cuda")
    runs = []
    for fn in (liger_loss.chunked_linear_cross_entropy_liger, vocab_loss.chunked_linear_cross_entropy):
        loss = fn(hidden, weight, labels, 1024, None, -100, reduction)
        runs.append((loss, *torch.autograd.grad(loss, [hidden, weight])))
    for name, a, b in zip(("loss", "grad hidden", "grad weight"), *runs):
        assert rel_err(a, b) <= 2e-2, (name, rel_err(a, b))
