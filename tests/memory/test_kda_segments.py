"""Sequence-segmented KDA vs the plain layer: outputs, input and every parameter gradient (float64, CPU);
the state carry, the kda op's initial/final state, the saved memory, the errors."""

from __future__ import annotations

import copy

import pytest
import torch

from megaseq.memory import kda_segments as kda_seg
from megaseq.memory.kda_segments import segment, segment_bounds, segment_tokens_of, segmented_kda
from megaseq.models.common.context import SeqContext
from megaseq.models.common.kda import KimiDeltaAttention
from megaseq.models.glm5.spec import glm5_flash_tiny
from megaseq.ops.kda import fla as fla_kda
from megaseq.ops.kda.reference import kda_reference
from megaseq.plan import layers as LY
from megaseq.plan.mesh import precision_for

torch.set_num_threads(1)
F64 = torch.float64
B, S, HID, HH, D, K = 2, 37, 20, 3, 6, 4


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-300)).item()


def block_spec(lower_bound: float | None = -5.0, conv_kernel: int = K):
    return glm5_flash_tiny().replace(hidden_size=HID, linear_num_heads=HH, linear_head_dim=D,
                                     linear_conv_kernel=conv_kernel, linear_lower_bound=lower_bound)


def make_kda(lower_bound: float | None = -5.0, seed: int = 0, conv_kernel: int = K) -> KimiDeltaAttention:
    """A tiny GLM-5 KDA block in float64, every parameter random (slow decay: long memory is exercised)."""
    block = KimiDeltaAttention(block_spec(lower_bound, conv_kernel)).double()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in block.named_parameters():
            r = torch.randn(p.shape, generator=gen, dtype=F64)
            if name.endswith("conv1d.weight"):
                r = r * 0.5
            elif p.dim() >= 2:
                r = r * p.shape[-1] ** -0.5
            elif name.endswith("norm.weight"):
                r = 1.0 + 0.2 * r
            elif name.endswith("dt_bias"):
                r = -4.0 + 0.5 * r
            else:  # A_log
                r = 0.5 * r
            p.copy_(r)
    return block


def _inputs(seed: int = 1, seq: int = S) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(B, seq, HID, generator=gen, dtype=F64)
    w = torch.randn(B, seq, HID, generator=gen, dtype=F64)
    return x, w


def _run(block: KimiDeltaAttention, x: torch.Tensor, w: torch.Tensor, ctx: SeqContext | None = None):
    """Output, input gradient and every parameter gradient of ``sum(block(x) * w)``."""
    block.zero_grad(set_to_none=True)
    xg = x.clone().requires_grad_(True)
    out = block(xg, ctx or SeqContext())
    (out * w).sum().backward()
    return out.detach(), xg.grad, {n: p.grad.clone() for n, p in block.named_parameters()}


def _worst(a, b) -> float:
    (ya, gxa, gpa), (yb, gxb, gpb) = a, b
    assert set(gpa) == set(gpb)
    return max([_rel(ya, yb), _rel(gxa, gxb)] + [_rel(gpa[n], gpb[n]) for n in gpb])


# ---- the segmented layer equals the plain one -------------------------------------------------------
@pytest.mark.parametrize("lower_bound", [-5.0, None])
@pytest.mark.parametrize("T", [8, 5, 3, 1, 36, 37, 100])
def test_segmented_matches_plain(T, lower_bound):
    block = make_kda(lower_bound)
    x, w = _inputs()
    ref = _run(block, x, w)
    for n, g in ref[2].items():
        assert g.abs().max() > 0, f"{n}: zero gradient in the plain run, the test would not see it"
    segment(block, T)
    seg = _run(block, x, w)
    assert _worst(seg, ref) < 1e-12


@pytest.mark.parametrize("conv_kernel", [1, 2, 6])
def test_segmented_matches_plain_other_conv_kernels(conv_kernel):
    """Halo K - 1 from 0 (no halo) to more than a segment (T=3 < K - 1 = 5: the halo spans segments)."""
    block = make_kda(conv_kernel=conv_kernel, seed=3)
    x, w = _inputs(seed=4)
    ref = _run(block, x, w)
    segment(block, 3)
    assert _worst(_run(block, x, w), ref) < 1e-12


def test_routes_only_when_longer_and_off_is_plain(monkeypatch):
    block = make_kda()
    x, w = _inputs()
    calls = []
    monkeypatch.setattr(kda_seg, "segmented_kda", lambda *a: calls.append(1) or segmented_kda(*a))
    ref = _run(block, x, w)
    segment(block, S)  # not longer: the plain path
    same = _run(block, x, w)
    assert not calls
    assert torch.equal(same[0], ref[0]) and torch.equal(same[1], ref[1])
    segment(block, S - 1)
    _run(block, x, w)
    assert calls


def test_no_grad_forward_and_params_only():
    block = make_kda(seed=5)
    x, w = _inputs(seed=6)
    with torch.no_grad():
        ref = block(x, SeqContext())
        segment(block, 6)
        out = block(x, SeqContext())
    assert _rel(out, ref) < 1e-12
    # the input does not require grad: parameter gradients only
    segment(block, None)
    block.zero_grad(set_to_none=True)
    (block(x, SeqContext()) * w).sum().backward()
    ref_p = {n: p.grad.clone() for n, p in block.named_parameters()}
    segment(block, 6)
    block.zero_grad(set_to_none=True)
    (block(x, SeqContext()) * w).sum().backward()
    for n, p in block.named_parameters():
        assert _rel(p.grad, ref_p[n]) < 1e-12, n


def test_input_grad_only():
    block = make_kda(seed=7)
    for p in block.parameters():
        p.requires_grad_(False)
    x, w = _inputs(seed=8)
    xg = x.clone().requires_grad_(True)
    (block(xg, SeqContext()) * w).sum().backward()
    ref = xg.grad
    segment(block, 4)
    xg = x.clone().requires_grad_(True)
    (block(xg, SeqContext()) * w).sum().backward()
    assert _rel(xg.grad, ref) < 1e-12


def test_segment_installs_and_removes_on_each_kda_module():
    """``segment`` (what glm5's parallelize applies to every KDA mixer) installs, resizes and removes."""
    model = torch.nn.ModuleList([make_kda(), torch.nn.Linear(2, 2), make_kda(seed=2)])
    for m in (model[0], model[2]):
        segment(m, 7)
    assert [segment_tokens_of(m) for m in model] == [7, None, 7]
    segment(model[0], None)
    assert segment_tokens_of(model[0]) is None and "forward" not in model[0].__dict__
    with pytest.raises(ValueError, match="memory.kda_segment_tokens"):
        segment(model[2], 0)


def test_backward_reenters_autocast(monkeypatch):
    """The recompute runs under the forward's autocast state (as tiling and full recompute do)."""
    block = make_kda().float()
    seen = []
    real = KimiDeltaAttention.segment_step

    def spy(self, x, halo, state=None):
        seen.append((torch.is_grad_enabled(), torch.is_autocast_enabled("cpu")))
        return real(self, x, halo, state)

    monkeypatch.setattr(KimiDeltaAttention, "segment_step", spy)
    segment(block, 16)
    x = torch.randn(1, 40, HID, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = block(x, SeqContext())
    assert out.dtype == torch.bfloat16
    out.float().sum().backward()
    assert seen == [(False, True)] * 3 + [(True, True)] * 3
    assert x.grad is not None and x.grad.dtype == torch.float32


# ---- the state carry is what makes it exact ---------------------------------------------------------
def test_state_carry_is_exercised(monkeypatch):
    block = make_kda()
    x, w = _inputs()
    ref = _run(block, x, w)
    real = KimiDeltaAttention.segment_step
    monkeypatch.setattr(KimiDeltaAttention, "segment_step",
                        lambda self, x, halo, state=None: real(self, x, halo, None))  # zero state per segment
    segment(block, 8)
    broken = _run(block, x, w)
    assert _rel(broken[0][:, :8], ref[0][:, :8]) < 1e-12  # the first segment does not need a carry
    assert _rel(broken[0][:, 8:], ref[0][:, 8:]) > 1e-3
    assert _rel(broken[1], ref[1]) > 1e-3


def test_conv_halo_is_exercised(monkeypatch):
    block = make_kda()
    x, w = _inputs()
    ref = _run(block, x, w)
    real = KimiDeltaAttention.segment_step

    def no_halo(self, x, halo, state=None):  # the conv restarts (zero padded) at every segment
        return real(self, x[:, halo:], 0, state)

    monkeypatch.setattr(KimiDeltaAttention, "segment_step", no_halo)
    segment(block, 8)
    broken = _run(block, x, w)
    assert _rel(broken[0][:, 8:], ref[0][:, 8:]) > 1e-3


# ---- the kda op with initial / final state --------------------------------------------------------
def _kda_inputs(gen, Bn=2, Sn=45, H=3, Dk=5, Dv=4):
    q, k = (torch.randn(Bn, Sn, H, Dk, generator=gen, dtype=F64) for _ in range(2))
    v = torch.randn(Bn, Sn, H, Dv, generator=gen, dtype=F64)
    g = -0.5 * torch.sigmoid(torch.randn(Bn, Sn, H, Dk, generator=gen, dtype=F64))  # slow decay
    beta = torch.sigmoid(torch.randn(Bn, Sn, H, generator=gen, dtype=F64))
    return [t.requires_grad_() for t in (q, k, v, g, beta)]


@pytest.mark.parametrize("split", [1, 16, 23, 44])
def test_kda_reference_state_carry_equals_concatenated(split):
    gen = torch.Generator().manual_seed(11)
    q, k, v, g, beta = inputs = _kda_inputs(gen)
    full, final = kda_reference(*inputs, chunk_size=16, return_state=True)
    assert torch.equal(full, kda_reference(*inputs, chunk_size=16))  # unchanged for existing callers
    assert final.shape == (2, 3, 5, 4) and final.dtype == F64
    a = [t[:, :split] for t in inputs]
    b = [t[:, split:] for t in inputs]
    out_a, mid = kda_reference(*a, chunk_size=16, return_state=True)
    out_b, end = kda_reference(*b, chunk_size=16, initial_state=mid, return_state=True)
    out = torch.cat([out_a, out_b], dim=1)
    assert _rel(out, full) < 1e-12 and _rel(end, final) < 1e-12
    # gradients through the carried state equal the whole sequence's
    wo = torch.randn(full.shape, generator=gen, dtype=F64)
    ws = torch.randn(final.shape, generator=gen, dtype=F64)
    g_full = torch.autograd.grad((full * wo).sum() + (final * ws).sum(), inputs)
    g_split = torch.autograd.grad((out * wo).sum() + (end * ws).sum(), inputs)
    for x, y in zip(g_split, g_full):
        assert _rel(x, y) < 1e-12


def test_kda_reference_initial_state_matches_naive_recurrence():
    gen = torch.Generator().manual_seed(12)
    q, k, v, g, beta = (t.detach() for t in _kda_inputs(gen, Sn=19))
    h0 = torch.randn(2, 3, 5, 4, generator=gen, dtype=F64)
    out, ht = kda_reference(q, k, v, g, beta, chunk_size=8, initial_state=h0, return_state=True)
    qn, kn = (t / torch.sqrt((t * t).sum(-1, keepdim=True) + 1e-6) for t in (q, k))
    state, outs = h0.clone(), []
    for t in range(q.shape[1]):  # S_t = diag(exp g_t) S_{t-1} + beta_t k_t (v_t - k_t^T diag(exp g_t) S_{t-1})
        state = state * g[:, t].exp().unsqueeze(-1)
        delta = beta[:, t].unsqueeze(-1) * (v[:, t] - torch.einsum("bhk,bhkv->bhv", kn[:, t], state))
        state = state + torch.einsum("bhk,bhv->bhkv", kn[:, t], delta)
        outs.append(torch.einsum("bhk,bhkv->bhv", qn[:, t] * 5 ** -0.5, state))
    assert _rel(out, torch.stack(outs, dim=1)) < 1e-12 and _rel(ht, state) < 1e-12


def test_kda_reference_state_per_document():
    gen = torch.Generator().manual_seed(13)
    q, k, v, g, beta = (t.detach().reshape(1, 44, *t.shape[2:]) for t in _kda_inputs(gen, Sn=22))
    cu = torch.tensor([0, 7, 30, 44])
    h0 = torch.randn(3, 3, 5, 4, generator=gen, dtype=F64)
    out, ht = kda_reference(q, k, v, g, beta, cu, chunk_size=8, initial_state=h0, return_state=True)
    assert ht.shape == (3, 3, 5, 4)
    for i, (s, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        one, st = kda_reference(q[:, s:e], k[:, s:e], v[:, s:e], g[:, s:e], beta[:, s:e], chunk_size=8,
                                initial_state=h0[i:i + 1], return_state=True)
        assert _rel(out[:, s:e], one) < 1e-13 and _rel(ht[i:i + 1], st) < 1e-13


def test_fla_supports_accepts_the_state_keywords():
    x = torch.zeros(2, 5, 3, 4, dtype=F64)
    h0 = torch.zeros(2, 3, 4, 4)
    why = fla_kda.kda_fla_supports(x, x, x, x, x[..., 0], None, initial_state=h0, return_state=True)
    assert why is not None and "device" in why  # CPU: declined for the device, not for the keywords
    bad = fla_kda.kda_fla_supports(x, x, x, x, x[..., 0], None, initial_state=h0[:1], return_state=True)
    assert bad is not None and "initial_state" in bad


# ---- memory: the input and one state per segment ----------------------------------------------------
def test_saves_only_input_and_states():
    block = make_kda()
    T = 8
    segment(block, T)
    x = torch.randn(B, S, HID, dtype=F64, requires_grad=True)
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = block(x, SeqContext())
    n = len(segment_bounds(S, T))
    assert out.grad_fn is not None and "_ReplayFn" in type(out.grad_fn).__name__  # the replay engine's Function
    assert len(saved) == 2
    assert saved[0] is x  # the tensor passed in, not a copy
    assert saved[1].shape == (n, B, HH, D, D) and saved[1].dtype == F64
    nbytes = sum(t.numel() * t.element_size() for t in saved)
    assert nbytes == x.numel() * 8 + n * B * HH * D * D * 8
    spec = block_spec()  # the planner's one formula (plan/layers.kda_segmented) for what was saved
    assert nbytes == sum(LY.kda_segmented(spec, B * S, B, T, 8, precision_for("fp64"))[0].values())
    assert torch.count_nonzero(saved[1][0]) == 0 and torch.count_nonzero(saved[1][1:]) > 0
    # vs the plain layer, which saves many sequence-sized tensors
    segment(block, None)
    plain = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: plain.append(t) or t, lambda t: t):
        block(x, SeqContext())
    assert sum(t.numel() * t.element_size() for t in plain) > 10 * nbytes


@pytest.mark.parametrize("T", [10, S, 100])
def test_function_directly(T):
    """Also one segment (T >= S) through the Function: the plain computation with a zero initial state."""
    block = make_kda(seed=9)
    x, w = _inputs(seed=10)
    ref = _run(block, x, w)
    xg = x.clone().requires_grad_(True)
    out = segmented_kda(block, xg, SeqContext(), T)
    assert _rel(out, ref[0]) < 1e-12
    gx = torch.autograd.grad((out * w).sum(), xg)[0]
    assert _rel(gx, ref[1]) < 1e-12


# ---- errors -----------------------------------------------------------------------------------------
def test_errors_name_the_setting():
    block = make_kda()
    x = torch.randn(B, S, HID, dtype=F64)
    segment(block, 8)
    docs = torch.tensor([[0] * 20 + [1] * (S - 20)] * B)
    with pytest.raises(ValueError, match="memory.kda_segment_tokens.*document"):
        block(x, SeqContext(doc_ids=docs))
    with pytest.raises(ValueError, match="memory.kda_segment_tokens.*cp=3"):
        block(x, SeqContext(cp_size=3))
    with pytest.raises(ValueError, match="memory.kda_segment_tokens.*cp=2"):
        segmented_kda(block, x, SeqContext(cp_size=2), 8)
    for bad in (0, -3):  # refused when applied, before any forward
        with pytest.raises(ValueError, match="memory.kda_segment_tokens must be >= 1"):
            segment(block, bad)
    segment(block, 40)  # not segmented: documents run the plain path
    assert block(x, SeqContext(doc_ids=docs)).shape == (B, S, HID)


def test_dataclass_copy_keeps_attribute():
    block = make_kda()
    segment(block, 5)
    assert segment_tokens_of(copy.deepcopy(block)) == 5
    assert not any("segment" in k for k in block.state_dict())
