"""Sequence-tiled MLP / MoE vs the untiled module: outputs, every gradient, side state (float64, CPU)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from megaseq.memory.tiling import TiledModule, disable_tiling, enable_tiling, tiled_forward
from megaseq.models.common.mlp import MLP
from megaseq.models.common.moe import MoE
from megaseq.models.glm5.spec import glm5_flash_tiny

torch.set_num_threads(1)
TOL = {"rtol": 1e-12, "atol": 1e-12}
H = 31


class CountingMoE(nn.Module):
    """A small top-k MoE in float64 throughout, with the side state real MoEs keep: the per-forward
    ``last_tokens_per_expert`` and a buffer that counts tokens over calls (torchtitan-style)."""

    def __init__(self, hidden: int = H, num_experts: int = 5, top_k: int = 2, inter: int = 13) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(1)
        self.router = nn.Parameter(torch.randn(num_experts, hidden, generator=g, dtype=torch.float64) * 0.3)
        self.register_buffer("bias", torch.zeros(num_experts, dtype=torch.float64))
        self.register_buffer("tokens_seen", torch.zeros(num_experts, dtype=torch.int64))
        f64 = torch.float64
        self.w_in = nn.Parameter(torch.randn(num_experts, 2 * inter, hidden, generator=g, dtype=f64) * 0.2)
        self.w_out = nn.Parameter(torch.randn(num_experts, hidden, inter, generator=g, dtype=f64) * 0.2)
        self.top_k = top_k
        self.last_tokens_per_expert = torch.zeros(num_experts, dtype=torch.int64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x_NH = x.reshape(-1, x.shape[-1])
        scores_NE = torch.sigmoid(x_NH @ self.router.T)
        experts_NK = torch.topk(scores_NE + self.bias, self.top_k, dim=-1).indices
        weights_NK = scores_NE.gather(1, experts_NK)
        out_NH = torch.zeros_like(x_NH)
        for e in range(self.router.shape[0]):
            tok, slot = (experts_NK == e).nonzero(as_tuple=True)
            gate, up = (x_NH[tok] @ self.w_in[e].T).chunk(2, dim=-1)
            y = (torch.nn.functional.silu(gate) * up) @ self.w_out[e].T
            out_NH = out_NH.index_add(0, tok, y * weights_NK[tok, slot, None])
        counts = torch.bincount(experts_NK.reshape(-1), minlength=self.router.shape[0])
        self.last_tokens_per_expert = counts
        with torch.no_grad():
            self.tokens_seen += counts
        return out_NH.view(x.shape)


def _run(module: nn.Module, x: torch.Tensor, calls: int = 1):
    """Forward (``calls`` times, summed), backward of a fixed random projection; output and grads."""
    xg = x.clone().requires_grad_(True)
    out = sum(module(xg * (i + 1)) for i in range(calls))
    proj = torch.randn(out.shape, generator=torch.Generator().manual_seed(9), dtype=out.dtype)
    (out * proj).sum().backward()
    grads = {n.removeprefix("module."): p.grad.clone() for n, p in module.named_parameters()
             if p.grad is not None}
    return out.detach(), xg.grad, grads


def _compare(plain: nn.Module, tiled: nn.Module, x: torch.Tensor, calls: int = 1,
             tol_by_name: dict | None = None) -> None:
    ref, got = _run(plain, x, calls), _run(tiled, x, calls)
    torch.testing.assert_close(got[0], ref[0], **TOL)
    torch.testing.assert_close(got[1], ref[1], **TOL)
    assert got[2].keys() == ref[2].keys() and ref[2]
    for name in ref[2]:
        tol = (tol_by_name or {}).get(name, TOL)
        torch.testing.assert_close(got[2][name], ref[2][name], **tol, msg=lambda m, n=name: f"{n}: {m}")


def _x(shape, seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


@pytest.mark.parametrize("tile", [1, 10, 46, 47, 200])
def test_dense_mlp_tiled_matches_plain(tile):
    torch.manual_seed(0)
    plain = MLP(H, 19, swiglu_limit=1.5).double()
    tiled = enable_tiling(copy.deepcopy(plain), tile)
    _compare(plain, tiled, _x((1, 47, H)))


def test_mlp_2d_input_and_wrapper():
    torch.manual_seed(1)
    plain = MLP(H, 19).double()
    _compare(plain, TiledModule(copy.deepcopy(plain), 8), _x((37, H)))


@pytest.mark.parametrize("skew", [False, True])
def test_moe_tiled_matches_plain_and_counts_once(skew):
    plain = CountingMoE()
    if skew:  # expert 0 takes every token
        plain.bias[0] = 100.0
    tiled = enable_tiling(copy.deepcopy(plain), 9)
    x = _x((2, 23, H), seed=2)
    _compare(plain, tiled, x)
    counts = plain.last_tokens_per_expert
    if skew:
        assert counts[0] == 46
    assert torch.equal(tiled.last_tokens_per_expert, counts)
    # one forward's tokens counted once, though the backward recomputed every tile
    assert torch.equal(tiled.tokens_seen, plain.tokens_seen) and plain.tokens_seen.sum() == 46 * 2


def test_moe_called_twice_per_step():
    plain = CountingMoE()
    tiled = enable_tiling(copy.deepcopy(plain), 7)
    _compare(plain, tiled, _x((29, H), seed=3), calls=2)
    assert torch.equal(tiled.tokens_seen, plain.tokens_seen)
    assert torch.equal(tiled.last_tokens_per_expert, plain.last_tokens_per_expert)  # the last call's


def test_real_moe_with_skewed_routing():
    """megaseq's MoE (sigmoid router with correction bias, shared expert), bias pushing all tokens to
    expert 3. In a float64 model the router computes in float64, so tiling is exact for it too."""
    spec = glm5_flash_tiny().replace(hidden_size=H, moe_intermediate_size=11, num_experts=6)
    torch.manual_seed(4)
    plain = MoE(spec).double()
    plain.gate.e_score_correction_bias[3] = 50.0
    tiled = enable_tiling(copy.deepcopy(plain), 10)
    _compare(plain, tiled, _x((1, 47, H), seed=4) * 0.5)
    assert plain.last_tokens_per_expert[3] == 47
    assert torch.equal(tiled.last_tokens_per_expert, plain.last_tokens_per_expert)


def test_no_grad_and_autograd_grad():
    plain = CountingMoE()
    tiled = enable_tiling(copy.deepcopy(plain), 6)
    x = _x((31, H), seed=5)
    with torch.no_grad():
        torch.testing.assert_close(tiled(x), plain(x), **TOL)
    # torch.autograd.grad (no .grad accumulation) sees the same parameter gradients
    xr, xt = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    ref = torch.autograd.grad(plain(xr).square().sum(), [xr, plain.w_in, plain.router])
    got = torch.autograd.grad(tiled(xt).square().sum(), [xt, tiled.w_in, tiled.router])
    for r, g in zip(ref, got):
        torch.testing.assert_close(g, r, **TOL)


def test_enable_keeps_state_dict_names_and_can_be_undone():
    m = MLP(H, 19).double()
    keys = list(m.state_dict())
    enable_tiling(m, 5)
    enable_tiling(m, 3)  # again: changes the tile size, does not stack wrappers
    assert list(m.state_dict()) == keys
    assert m.forward.tile_tokens == 3
    disable_tiling(m)
    assert "forward" not in m.__dict__
    with pytest.raises(ValueError, match="mlp_tile_tokens"):
        tiled_forward(m, _x((4, H)), 0)


def test_frozen_module_gives_input_gradient_only():
    torch.manual_seed(2)
    plain = MLP(H, 19).double().requires_grad_(False)
    tiled = enable_tiling(copy.deepcopy(plain), 4)
    x = _x((13, H), seed=6)
    xr, xt = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    plain(xr).sum().backward()
    tiled(xt).sum().backward()
    torch.testing.assert_close(xt.grad, xr.grad, **TOL)
