"""KDA's causal conv run once per part (q, k, v apart, each with its third of the conv weight) vs the
concatenated path it replaced (one conv over ``[q | k | v]``, then a split), written out here: outputs and
every gradient in float64 on CPU, with a halo, packed documents and both; and the tensors the ``kda`` op
gets are contiguous (nothing for fla's ``chunk_kda`` to copy)."""

from __future__ import annotations

import pytest
import torch

from megaseq.models.common import kda as kda_mod
from megaseq.models.common.context import SeqContext
from megaseq.models.common.kda import KimiDeltaAttention, cu_seqlens_from_doc_ids
from megaseq.models.glm5.spec import glm5_flash_tiny
from megaseq.ops.kda.reference import causal_conv_reference, kda_reference

torch.set_num_threads(1)
F64 = torch.float64
B, L, HID, HH, D, K = 2, 19, 16, 3, 4, 4
DOCS = torch.tensor([[0] * 6 + [1] * 9 + [2] * 4, [3] * 19])  # [B, L]: packed documents


def make_kda(seed: int = 0) -> KimiDeltaAttention:
    spec = glm5_flash_tiny().replace(hidden_size=HID, linear_num_heads=HH, linear_head_dim=D, linear_conv_kernel=K,
                                     linear_lower_bound=-5.0)
    block = KimiDeltaAttention(spec).double()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in block.named_parameters():
            r = torch.randn(p.shape, generator=gen, dtype=F64)  # the conv's taps too: no symmetry across q/k/v
            if p.dim() >= 2 and not name.endswith("conv1d.weight"):
                r = r * p.shape[-1] ** -0.5
            elif name.endswith("norm.weight"):
                r = 1.0 + 0.2 * r
            elif name.endswith("dt_bias"):
                r = -4.0 + 0.5 * r
            elif name.endswith("A_log"):
                r = 0.5 * r
            p.copy_(r)
    return block


def concat_path(m: KimiDeltaAttention, x_BLH: torch.Tensor, doc_ids: torch.Tensor | None, halo: int) -> torch.Tensor:
    """The layer as it was: ``cat([q, k, v])``, one conv with the whole weight, ``split`` (one rank, zero state)."""
    Bx, Lx, _ = x_BLH.shape
    x_BTH = x_BLH[:, halo:]
    q, k, v = (p(x_BLH).view(Bx, Lx, HH, D) for p in (m.q_proj, m.k_proj, m.v_proj))
    g = m.forget_gate(x_BTH)
    beta = torch.sigmoid(m.b_proj(x_BTH)).unsqueeze(-1)
    C = 3 * HH * D
    mixed = torch.cat([t.reshape(Bx, Lx, HH * D) for t in (q, k, v)], dim=-1)
    cu = None if doc_ids is None else cu_seqlens_from_doc_ids(doc_ids)
    rows = 1 if cu is not None else Bx
    mixed = causal_conv_reference(mixed.reshape(rows, -1, C), m.conv1d.weight.squeeze(1), "silu", cu)
    if rows == Bx:
        mixed = mixed[:, halo:]
    elif halo:
        mixed = mixed.reshape(Bx, -1, C)[:, halo:].reshape(rows, -1, C)
    q, k, v = (t.reshape(rows, -1, HH, D) for t in mixed.split(HH * D, dim=-1))
    if cu is not None and halo:
        cu = cu_seqlens_from_doc_ids(doc_ids[:, halo:])
    o = kda_reference(q, k, v, g.reshape(rows, -1, HH, D), beta.reshape(rows, -1, HH), cu)
    T = Lx - halo
    gate = m.g_b_proj(m.g_a_proj(x_BTH)).view(Bx, T, HH, D)
    return m.o_proj(m.o_norm(o.reshape(Bx, T, HH, D), gate).reshape(Bx, T, HH * D))


def _grads(m: KimiDeltaAttention, fn, x: torch.Tensor, w: torch.Tensor):
    m.zero_grad(set_to_none=True)
    xg = x.clone().requires_grad_(True)
    y = fn(xg)
    (y * w).sum().backward()
    return y.detach(), xg.grad, {n: p.grad.clone() for n, p in m.named_parameters()}


CASES = [("plain", None, 0), ("halo", None, 3), ("documents", DOCS, 0), ("documents+halo", DOCS, 2)]


@pytest.mark.parametrize("name, doc_ids, halo", CASES, ids=[c[0] for c in CASES])
def test_split_conv_matches_concatenated_conv(name, doc_ids, halo):
    m = make_kda()
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(B, L, HID, generator=gen, dtype=F64)
    w = torch.randn(B, L - halo, HID, generator=gen, dtype=F64)
    ours = _grads(m, lambda t: m._mix(t, SeqContext(doc_ids=doc_ids), halo)[0], x, w)
    ref = _grads(m, lambda t: concat_path(m, t, doc_ids, halo), x, w)
    (y, gx, gp), (y_ref, gx_ref, gp_ref) = ours, ref
    torch.testing.assert_close(y, y_ref, rtol=1e-12, atol=1e-13)
    torch.testing.assert_close(gx, gx_ref, rtol=1e-12, atol=1e-13)
    assert set(gp) == set(gp_ref)
    for n in gp_ref:  # conv1d.weight among them: each third's gradient in its place
        torch.testing.assert_close(gp[n], gp_ref[n], rtol=1e-12, atol=1e-13, msg=lambda s, n=n: f"{n}: {s}")


def test_forward_is_the_plain_layer():
    m = make_kda(seed=3)
    x = torch.randn(B, L, HID, generator=torch.Generator().manual_seed(4), dtype=F64)
    for doc_ids in (None, DOCS):
        torch.testing.assert_close(m(x, SeqContext(doc_ids=doc_ids)), concat_path(m, x, doc_ids, 0),
                                   rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("batch, doc_ids, halo", [(2, None, 0), (1, None, 3), (2, DOCS, 0), (2, DOCS, 2),
                                                  (1, DOCS[:1], 2)])
def test_kda_op_gets_contiguous_qkv(monkeypatch, batch, doc_ids, halo):
    """No copy downstream: the conv inputs and the q, k, v that reach the ``kda`` op are contiguous (fla's
    ``input_guard`` would copy them otherwise). The conv returns a contiguous ``[rows, L, C]`` here, as fla's
    ``causal_conv1d`` does (``empty_like`` of its input); the torch reference returns a transposed view. (With
    several rows, a halo and no documents the rows are sliced along the sequence: not contiguous, not tested.)"""
    seen = []
    call = kda_mod.dispatch.call

    def spy(op, *args, **kwargs):
        if op == "causal_conv":
            seen.append(("conv in", args[0].is_contiguous(), args[1].is_contiguous()))
            return call(op, *args, **kwargs).contiguous()
        if op == "kda":
            seen.append(("kda", *(t.is_contiguous() for t in args[:3])))
        return call(op, *args, **kwargs)

    monkeypatch.setattr(kda_mod.dispatch, "call", spy)
    m = make_kda()
    x = torch.randn(batch, L, HID, dtype=F64)
    m._mix(x, SeqContext(doc_ids=doc_ids), halo)
    assert seen == [("conv in", True, True)] * 3 + [("kda", True, True, True)], seen
