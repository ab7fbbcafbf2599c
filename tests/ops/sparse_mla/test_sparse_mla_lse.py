"""Op ``sparse_attention``'s per-head log-sum-exp (``return_lse``): every implementation against the float64
log-sum-exp of the masked scores, in base 2, and its output and gradients unchanged by asking for it.

Shapes: B batch, Q queries, S keys, Hh heads, R latent width (Dr: DeepSeek's shared RoPE part), W slots.

The contract (``ops.sparse_mla.reference``): ``lse2 [B, Q, Hh]`` is ``log2 sum_w 2^(LOG2E * scale * q . k_w)`` over
the query's valid slots (``0 <= idx < S``), ``+inf`` for a query without one, in the compute dtype, no gradient.
``torch_masked`` and ``absorbed`` run in float64 on the CPU; ``triton`` under Triton's interpreter in fp32 and
fp16 (the ``device`` fixture). The selections have pools with their tails (``causal_pool_selection``), a query
with no valid slot, slots past S and more slots than keys; a key listed twice counts once in ``torch_masked`` (its
mask) and per slot in the others (the indexer's selection lists each key once). A log-sum-exp in the natural
base, or with its heads permuted, fails the same check.
"""

from __future__ import annotations

import math

import pytest
import torch

from megaseq.ops.sparse_mla import absorbed, fused
from megaseq.ops.sparse_mla.reference import sparse_mla_reference

torch.set_num_threads(1)
TOL = {torch.float64: 1e-12, torch.float32: 1e-4, torch.float16: 2e-2}  # max |lse2 - lse2_64|, logits of a few units
FLOAT64_IMPLS = {"torch_masked": sparse_mla_reference, "absorbed": absorbed.sparse_mla}


def make_inputs(seed: int, B: int, Q: int, S: int, Hh: int, R: int, kp: int = 4, pools: int = 3, Dr: int = 0,
                D: int = 16, dtype=torch.float64, device: str = "cpu"):
    """``q [B, Q, Hh, D + Dr]``, latents ``[B, S, R + Dr]``, ``kv_b`` weight, ``idx [B, Q, pools * kp + kp - 1]``
    (the indexer's layout): query 1 of row 0 selects nothing, query 2 of the last row has a slot past S."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Q, Hh, D + Dr, generator=gen)
    c = torch.randn(B, S, R + Dr, generator=gen)
    w = torch.randn(Hh * 2 * D, R, generator=gen) * R**-0.5
    idx = fused.causal_pool_selection(B, Q, S, kpool=kp, pools=pools, generator=gen)
    idx[0, 1] = -1
    idx[-1, 2, 0] = S + 3
    return [t.to(device, dtype) for t in (q, c, w)], idx.to(device)


def lse2_64(q, c, w, idx, scale: float, distinct: bool = False) -> torch.Tensor:
    """The float64 base-2 log-sum-exp of the masked scores ``[B, Q, Hh]`` (``distinct``: a key listed twice once)."""
    q, c, w = (t.double() for t in (q, c, w))
    B, Q, Hh, Dq = q.shape
    S, R = c.shape[1], w.shape[1]
    Dr = c.shape[-1] - R
    w_uk = w.view(Hh, -1, R)[:, :Dq - Dr]
    q_abs = torch.cat([torch.einsum("bqhd,hdr->bqhr", q[..., :Dq - Dr], w_uk), q[..., Dq - Dr:]], dim=-1)
    ok = (idx >= 0) & (idx < S)
    if distinct:  # the slots that repeat an earlier slot's key
        same = (idx[..., :, None] == idx[..., None, :]) & ok[..., None, :]
        ok &= ~(same & torch.ones_like(same).tril(-1)).any(-1)
    keys = torch.stack([c[b][idx[b].long().clamp(0, S - 1)] for b in range(B)])  # [B, Q, W, C]
    s = torch.einsum("bqhc,bqwc->bqhw", q_abs, keys) * scale
    lse = s.masked_fill(~ok[:, :, None], float("-inf")).logsumexp(-1) / math.log(2.0)
    return lse.masked_fill(~ok.any(-1)[..., None], float("inf"))


def check_lse(lse: torch.Tensor, want: torch.Tensor, tol: float) -> None:
    assert lse.shape == want.shape and not lse.requires_grad, (tuple(lse.shape), lse.requires_grad)
    empty = torch.isinf(want)
    assert torch.equal(torch.isinf(lse), empty) and (lse[empty] > 0).all(), "rows without a valid slot: +inf"
    err = (lse[~empty].double() - want[~empty]).abs().max().item()
    assert err <= tol, f"max |lse2 - lse2_64| {err:.3e}"


def outputs_and_grads(fn, leaves, idx, scale: float, **kw):
    leaves = [t.detach().requires_grad_() for t in leaves]
    res = fn(*leaves, idx, scale, **kw)
    out, lse = res if isinstance(res, tuple) else (res, None)
    g = torch.linspace(-1, 1, out.numel(), dtype=out.dtype, device=out.device).view_as(out)
    return out, lse, torch.autograd.grad((out * g).sum(), leaves)


def check_unchanged(fn, leaves, idx, scale: float, atomics: bool = False) -> torch.Tensor:
    """``return_lse`` changes neither the output (bitwise) nor the gradients (bitwise; with ``atomics``, the fused
    backward's fp32 atomic adds on a GPU sum in a run-dependent order: to the dtype's default tolerance); returns
    the lse."""
    out, _, grads = outputs_and_grads(fn, leaves, idx, scale)
    out2, lse, grads2 = outputs_and_grads(fn, leaves, idx, scale, return_lse=True)
    assert torch.equal(out, out2)
    for a, b in zip(grads, grads2, strict=True):
        if atomics:
            torch.testing.assert_close(b, a)
        else:
            assert torch.equal(a, b)
    return lse


# ---- float64: the reference and absorbed ----------------------------------------------------------------
@pytest.mark.parametrize("impl", list(FLOAT64_IMPLS))
@pytest.mark.parametrize("B,Q,S,Hh,R,kp,pools", [
    (2, 13, 29, 3, 16, 4, 3),   # pools of 4 and their tails, an empty query, a slot past S
    (1, 9, 7, 5, 8, 2, 6),      # more slots (13) than keys (7)
])
def test_float64_lse_is_the_masked_scores_logsumexp(impl, B, Q, S, Hh, R, kp, pools):
    leaves, idx = make_inputs(0, B, Q, S, Hh, R, kp, pools)
    lse = check_unchanged(FLOAT64_IMPLS[impl], leaves, idx, 0.37)
    assert lse.dtype == torch.float64
    check_lse(lse, lse2_64(*leaves, idx, 0.37), TOL[torch.float64])


def test_reference_lse_with_deepseeks_rope_part():
    """DeepSeek-V3.2's latent carries the shared rotated key part (``torch_masked`` alone runs it)."""
    leaves, idx = make_inputs(1, 1, 11, 17, 4, 16, kp=1, pools=6, Dr=8)
    assert absorbed.sparse_mla_supports(*leaves, idx, 0.3) is not None
    lse = check_unchanged(sparse_mla_reference, leaves, idx, 0.3)
    check_lse(lse, lse2_64(*leaves, idx, 0.3), TOL[torch.float64])


def test_reference_lse_over_several_query_blocks(monkeypatch):
    """Queries in blocks (each recomputed in backward): the lse of every block, in order."""
    from megaseq.ops.sparse_mla import reference

    leaves, idx = make_inputs(2, 1, 21, 30, 3, 16)
    monkeypatch.setattr(reference, "ATTENTION_BLOCK_ELEMS", 3 * 30 * 4)  # blocks of 4 queries
    lse = check_unchanged(sparse_mla_reference, leaves, idx, 0.37)
    check_lse(lse, lse2_64(*leaves, idx, 0.37), TOL[torch.float64])


def test_a_key_listed_twice():
    """``torch_masked`` attends a repeated key once (its mask), ``absorbed`` once per slot; each lse is its own
    softmax's normaliser."""
    leaves, idx = make_inputs(3, 1, 9, 20, 3, 16)
    idx[0, 4, :3] = 7
    idx[0, 6, 1] = idx[0, 6, 0]
    ref = sparse_mla_reference(*leaves, idx, 0.4, return_lse=True)[1]
    check_lse(ref, lse2_64(*leaves, idx, 0.4, distinct=True), TOL[torch.float64])
    got = absorbed.sparse_mla(*leaves, idx, 0.4, return_lse=True)[1]
    check_lse(got, lse2_64(*leaves, idx, 0.4), TOL[torch.float64])


BROKEN = {"natural_base": lambda lse: lse / math.log2(math.e), "heads_permuted": lambda lse: lse.roll(1, dims=-1)}


@pytest.mark.parametrize("name", list(BROKEN))
def test_a_broken_lse_fails(name):
    leaves, idx = make_inputs(0, 2, 13, 29, 3, 16)
    lse = absorbed.sparse_mla(*leaves, idx, 0.37, return_lse=True)[1]
    want = lse2_64(*leaves, idx, 0.37)
    check_lse(lse, want, TOL[torch.float64])
    with pytest.raises(AssertionError):
        check_lse(BROKEN[name](lse), want, TOL[torch.float64])


# ---- triton under the interpreter (or the GPU) -------------------------------------------------------------
@pytest.fixture
def device(monkeypatch) -> str:
    pytest.importorskip("triton")
    from triton_compile import interpreter_device

    return interpreter_device(monkeypatch, fused)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_lse_is_its_saved_tensor(device, dtype):
    """The fused forward's saved ``[Hh, N]`` log-sum-exp, handed out as a ``[B, Q, Hh]`` view (no copy)."""
    leaves, idx = make_inputs(4, 2, 13, 29, 5, 32, dtype=dtype, device=device)
    idx[0, 1, 0] = 12  # no batch row with an empty query: the kernels run every row
    assert fused.empty_batch_rows(idx, 29) == [False, False]
    lse = check_unchanged(fused.triton_sparse_mla, leaves, idx, 0.37, atomics=True)
    assert lse.dtype == torch.float32 and lse.stride() == (13, 1, 26)  # a view of [Hh, B * Q]
    check_lse(lse, lse2_64(*leaves, idx, 0.37), TOL[dtype])


def test_triton_rows_with_an_empty_query_take_absorbed_with_their_lse(device):
    """A batch row with a query that selects nothing runs ``absorbed``; its lse joins the kernels' rows."""
    leaves, idx = make_inputs(5, 2, 13, 29, 3, 32, dtype=torch.float32, device=device)
    assert fused.empty_batch_rows(idx, 29) == [True, False]
    lse = check_unchanged(fused.triton_sparse_mla, leaves, idx, 0.37, atomics=True)
    check_lse(lse, lse2_64(*leaves, idx, 0.37), TOL[torch.float32])


def test_dispatcher_passes_return_lse(device):
    """``dispatch.call`` hands ``return_lse`` to each implementation's ``supports`` and to the one that runs."""
    from megaseq.ops import dispatch

    leaves, idx = make_inputs(6, 1, 9, 20, 3, 16, dtype=torch.float32, device=device)
    for impl in ("triton", "torch_masked"):
        with dispatch.configured(preferred={"sparse_attention": [impl]}):
            dispatch.reset_records()
            out, lse = dispatch.call("sparse_attention", *leaves, idx, 0.4, layer="l", return_lse=True)
            assert [r.impl for _, r in dispatch.records()] == [impl]
        check_lse(lse, lse2_64(*leaves, idx, 0.4), TOL[torch.float32])
