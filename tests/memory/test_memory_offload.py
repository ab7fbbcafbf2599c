"""Full recompute and SCO boundary offload vs the plain model: loss and every gradient (float64, CPU).

The toy decoder layers below have the features that make recompute hard: a 4-stream (mHC-shaped)
boundary, document-aware token mixing, a DSA-like ``full`` layer that writes its top-k selection to
``ctx.carry`` and ``shared`` layers that read it, and an MoE with per-forward side state.
"""

from __future__ import annotations

import copy
import gc

import pytest
import torch
from torch import nn

from megaseq.memory.offload import BoundaryOffloader, _forward_tracking_carry, checkpoint_layers
from megaseq.memory.tiling import enable_tiling
from megaseq.models.common.context import SeqContext
from megaseq.plan.activations import layer_input_bytes as boundary_bytes
from megaseq.plan.activations import sco_plan
from megaseq.plan.components import round_up

torch.set_num_threads(1)
B, S, HC, H, TOPK = 2, 19, 4, 15, 5


class ToyMoE(nn.Module):
    def __init__(self, g: torch.Generator, num_experts: int = 3) -> None:
        super().__init__()
        self.router = nn.Parameter(torch.randn(num_experts, H, generator=g, dtype=torch.float64))
        self.w = nn.Parameter(torch.randn(num_experts, H, H, generator=g, dtype=torch.float64) * 0.3)
        self.last_tokens_per_expert = torch.zeros(num_experts, dtype=torch.int64)
        self.register_buffer("tokens_seen", torch.zeros(num_experts, dtype=torch.int64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x_NH = x.reshape(-1, H)
        probs_NE = torch.softmax(x_NH @ self.router.T, dim=-1)
        top_N = probs_NE.argmax(dim=-1)
        self.last_tokens_per_expert = torch.bincount(top_N, minlength=self.w.shape[0])
        with torch.no_grad():  # a load counter over calls: recompute must not add to it again
            self.tokens_seen += self.last_tokens_per_expert
        y_NH = torch.tanh(torch.einsum("nh,noh->no", x_NH, self.w[top_N]))
        return (y_NH * probs_NE.gather(1, top_N[:, None])).view(x.shape)


class ToyLayer(nn.Module):
    """``layer(h [B,S,HC,H], ctx) -> h``; ``kind``: 'full' writes ctx.carry['topk'], 'shared' reads it,
    'mix' does document-causal running-mean mixing."""

    def __init__(self, kind: str, seed: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.kind = kind
        self.pre = nn.Parameter(torch.randn(HC, generator=g, dtype=torch.float64))
        self.post = nn.Parameter(torch.randn(HC, generator=g, dtype=torch.float64))
        self.proj = nn.Parameter(torch.randn(H, H, generator=g, dtype=torch.float64) * 0.3)
        self.score = nn.Parameter(torch.randn(H, H, generator=g, dtype=torch.float64))
        self.mlp = ToyMoE(g)

    def _mask(self, ctx: SeqContext) -> torch.Tensor:
        same_doc = ctx.doc_ids[:, :, None] == ctx.doc_ids[:, None, :]
        return same_doc & torch.ones(S, S, dtype=torch.bool, device=same_doc.device).tril()

    def forward(self, h: torch.Tensor, ctx: SeqContext) -> torch.Tensor:
        x = (h * torch.softmax(self.pre, 0)[:, None]).sum(2)
        mask = self._mask(ctx)
        if self.kind == "full":
            with torch.no_grad():  # like the DSA indexer: the selection carries no gradient
                s = (x @ self.score) @ x.transpose(1, 2)
                ctx.carry["topk"] = s.masked_fill(~mask, float("-inf")).topk(TOPK, dim=-1).indices
        if self.kind in ("full", "shared"):
            idx = ctx.carry["topk"]
            keep = mask.gather(2, idx).to(x.dtype)  # selected keys outside the document/causal window drop
            picked = torch.gather(x[:, None].expand(B, S, S, H), 2, idx[..., None].expand(-1, -1, -1, H))
            attn = (picked * keep[..., None]).sum(2) / keep.sum(2, keepdim=True).clamp(min=1)
        else:
            w = mask.to(x.dtype)
            attn = (w @ x) / w.sum(-1, keepdim=True)
        y = x + torch.tanh(attn @ self.proj)
        y = y + self.mlp(y)
        return h + y[:, :, None, :] * self.post[:, None]


def _model(kinds=("full", "mix", "shared", "full", "shared", "mix")) -> nn.ModuleList:
    return nn.ModuleList(ToyLayer(k, seed=10 + i) for i, k in enumerate(kinds))


def _inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    h0 = torch.randn(B, S, HC, H, generator=g, dtype=torch.float64)
    doc_ids = torch.tensor([[0] * 7 + [1] * 12, [0] * 19])
    target = torch.randn(B, S, HC, H, generator=g, dtype=torch.float64)
    return h0, doc_ids, target


def _step(layers: nn.ModuleList, seed: int = 0, micro_batches: int = 1):
    """Loss and every gradient (input and parameters), accumulated over ``micro_batches``."""
    layers.zero_grad(set_to_none=True)
    total, grads_in = 0.0, []
    for mb in range(micro_batches):
        h0, doc_ids, target = _inputs(seed + mb)
        h0.requires_grad_(True)
        ctx = SeqContext(doc_ids=doc_ids)
        h = h0
        for layer in layers:
            h = layer(h, ctx)
        loss = ((h - target) ** 2).mean()
        loss.backward()
        total += loss.item()
        grads_in.append(h0.grad)
    grads = {n: p.grad.clone() for n, p in layers.named_parameters() if p.grad is not None}
    counts = [t.clone() for layer in layers
              for t in (layer.mlp.last_tokens_per_expert, layer.mlp.tokens_seen)]
    return total, grads_in, grads, counts


def _assert_same(ref, got, exact: bool = True) -> None:
    tol = {"rtol": 0, "atol": 0} if exact else {"rtol": 1e-12, "atol": 1e-13}
    assert got[0] == pytest.approx(ref[0], rel=0 if exact else 1e-12)
    for a, b in zip(got[1], ref[1]):
        torch.testing.assert_close(a, b, **tol)
    assert got[2].keys() == ref[2].keys() and len(ref[2]) > 0
    for n in ref[2]:
        torch.testing.assert_close(got[2][n], ref[2][n], **tol, msg=lambda m, n=n: f"{n}: {m}")
    for a, b in zip(got[3], ref[3]):
        assert torch.equal(a, b)  # MoE load counts: the forward's, not the recompute's


def test_selection_differs_between_full_layers():
    """Guard for the tests below: the shared layers would see a different selection in a wrong scheme."""
    layers = _model()
    h0, doc_ids, _ = _inputs()
    ctx = SeqContext(doc_ids=doc_ids)
    h = layers[0](h0, ctx)
    first = ctx.carry["topk"]
    layers[3](layers[2](layers[1](h, ctx), ctx), ctx)
    assert not torch.equal(first, ctx.carry["topk"])


@pytest.mark.parametrize("budget_layers", [None, 0, 1, 4, 6])
def test_recompute_and_sco_match_plain_bitwise(budget_layers):
    plain = _model()
    layers = copy.deepcopy(plain)
    ref = _step(plain)
    nbytes = boundary_bytes(B * S, H, HC, 8)
    off = None if budget_layers is None else BoundaryOffloader(budget_layers * round_up(nbytes))
    checkpoint_layers(layers, off)
    got = _step(layers)
    _assert_same(ref, got)
    if off is not None:
        plan = sco_plan(len(layers), nbytes, off.host_budget)
        assert off.num_offloaded == plan.num_offloaded == budget_layers
        assert off.host_bytes == plan.host_pinned_bytes == budget_layers * round_up(nbytes)
        assert not off._live() and len(off.free) == budget_layers  # every slot back after backward


def test_sco_with_tiled_moe_and_grad_accumulation():
    plain = _model()
    layers = copy.deepcopy(plain)
    ref = _step(plain, seed=3, micro_batches=2)
    for layer in layers:
        enable_tiling(layer.mlp, 7)
    off = BoundaryOffloader(3 * round_up(boundary_bytes(B * S, H, HC, 8)))
    checkpoint_layers(layers, off)
    got = _step(layers, seed=3, micro_batches=2)
    _assert_same(ref, got, exact=False)
    assert off.num_offloaded == 6  # three per micro-batch


def test_pool_reused_across_steps_and_released():
    layers = _model()
    off = checkpoint_layers(layers, BoundaryOffloader(10**9))
    _step(layers)
    base = off.pool.base.data_ptr()
    _step(layers, seed=1)
    assert off.pool.base.data_ptr() == base and off.host_bytes == 6 * off.slot_bytes
    off.release()
    assert off.host_bytes == 0
    _step(layers, seed=2)  # plans a new pool on demand
    assert off.host_bytes == 6 * off.slot_bytes


def test_abandoned_graph_returns_its_slots():
    layers = _model()
    off = checkpoint_layers(layers, BoundaryOffloader(10**9))
    h0, doc_ids, _ = _inputs()
    h = h0.requires_grad_(True)
    ctx = SeqContext(doc_ids=doc_ids)
    for layer in layers:
        h = layer(h, ctx)
    assert len(off.free) == 0
    del h, h0
    gc.collect()
    assert len(off.free) == 6 and not off._live()


def test_eval_runs_without_recompute():
    layers = _model()
    ref = copy.deepcopy(layers)
    off = checkpoint_layers(layers, BoundaryOffloader(10**9))
    h0, doc_ids, _ = _inputs()
    with torch.no_grad():
        a, b = h0, h0
        c1, c2 = SeqContext(doc_ids=doc_ids), SeqContext(doc_ids=doc_ids)
        for lp, lr in zip(layers, ref):
            a, b = lp(a, c1), lr(b, c2)
    assert torch.equal(a, b) and off.num_offloaded == 0


def test_only_carry_entries_read_are_kept():
    big, small = torch.zeros(3), torch.ones(2)
    ctx = SeqContext(carry={"topk": big, "other": small})

    def fwd(h, c):
        c.carry["new"] = c.carry["other"] + 1
        del c.carry["topk"]
        return h

    _, kept = _forward_tracking_carry(fwd, torch.zeros(1), ctx)
    assert set(kept) == {"other"} and kept["other"] is small
    assert set(ctx.carry) == {"other", "new"}  # the layer's writes reach the caller's dict


def test_sco_plan_formula():
    bb = boundary_bytes(1 << 20, 4096, 4, 2)  # 1M tokens, mHC, bf16: 32 GiB per boundary
    assert bb == 32 << 30
    plan = sco_plan(45, bb, host_budget=180 << 30)
    assert plan.num_offloaded == 5 and plan.host_pinned_bytes == 5 * bb
    assert plan.gpu_boundary_bytes == (45 - 5 + 2) * bb
    assert sco_plan(45, bb, 0).gpu_boundary_bytes == 45 * bb


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_sco_on_gpu_pinned_and_exact():
    plain = _model().cuda()
    layers = copy.deepcopy(plain)
    ref = _step_cuda(plain)
    off = checkpoint_layers(layers, BoundaryOffloader(4 * round_up(boundary_bytes(B * S, H, HC, 8))))
    got = _step_cuda(layers)
    assert off.pool.pinned and off.host_bytes == 4 * off.slot_bytes
    _assert_same(ref, got)


def _step_cuda(layers):
    layers.zero_grad(set_to_none=True)
    h0, doc_ids, target = (t.cuda() for t in _inputs())
    h0.requires_grad_(True)
    ctx = SeqContext(doc_ids=doc_ids)
    h = h0
    for layer in layers:
        h = layer(h, ctx)
    loss = ((h - target) ** 2).mean()
    loss.backward()
    torch.cuda.synchronize()
    grads = {n: p.grad.cpu() for n, p in layers.named_parameters() if p.grad is not None}
    return loss.item(), [h0.grad.cpu()], grads, [m.mlp.tokens_seen.cpu() for m in layers]


class _AutocastProbe(nn.Module):
    """A layer that records, at every call, whether CPU autocast was on (recompute must re-enter it)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.seen: list[bool] = []

    def forward(self, h, ctx=None):
        self.seen.append(torch.is_autocast_enabled("cpu"))
        return h + self.lin(h).float()


def test_recompute_and_tiling_reenter_the_forwards_autocast():
    layers = nn.ModuleList([_AutocastProbe(), _AutocastProbe()])
    checkpoint_layers(layers, None)
    enable_tiling(layers[1].lin, 2)
    h = torch.randn(1, 5, 6, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = layers[1](layers[0](h, SeqContext()), SeqContext())
    out.sum().backward()  # outside autocast, as the trainer does
    for layer in layers:
        assert layer.seen == [True, True], layer.seen  # forward, then the recompute in backward
