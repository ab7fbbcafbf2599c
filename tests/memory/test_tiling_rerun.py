"""A tiled MLP/MoE under recompute: the layer's rerun in the backward builds the tiles' graph node without running
them (``tiling.enable_tiling(..., residual_only=True)``, ``replay.in_layer_rerun``), since a pre-norm layer only
adds the MLP's output to its residual; the tiles replay from their input in the backward either way.

float64 on the CPU against the plain step (loss, every gradient, the MoE load counts), with the routed experts run
twice a tile and step (the forward and the replay) instead of three times. The broken variant, the same skip on a
layer whose MLP output is read by its backward, must fail the same check.
"""

from __future__ import annotations

import copy

import pytest
import torch

from megaseq.config import MemorySettings
from megaseq.memory import tiling
from megaseq.memory.apply import loss_fn
from megaseq.models.build import build_model
from megaseq.models.common import moe as moe_module
from megaseq.models.common.prenorm import PreNormDecoderLayer
from megaseq.models.kimi_linear.spec import kimi_linear_tiny
from megaseq.models.qwen3_moe.spec import qwen3_moe_tiny
from megaseq.models.registry import parallelize

torch.set_num_threads(1)
S, TILE = 48, 16
TOL = {"rtol": 1e-10, "atol": 1e-12}


EXPERTS_FORWARD = moe_module.Experts.forward


def _count_expert_runs(monkeypatch) -> list[int]:
    """A list that gets one entry each time the routed experts run (from now on, in this test)."""
    calls: list[int] = []

    def counted(self, *args, **kw):
        calls.append(1)
        return EXPERTS_FORWARD(self, *args, **kw)

    monkeypatch.setattr(moe_module.Experts, "forward", counted)
    return calls


def _step(model, plan: MemorySettings | None, device: str = "cpu", autocast: torch.dtype | None = None) -> tuple:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.spec.vocab_size, (2, S), generator=g).to(device)
    labels = torch.cat([ids[:, 1:], torch.full((2, 1), -100, device=device)], dim=1)
    model.zero_grad(set_to_none=True)
    with torch.autocast(device, dtype=autocast or torch.bfloat16, enabled=autocast is not None):
        loss = loss_fn(plan or MemorySettings())(model(ids), model.lm_head.weight, labels)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    counts = {n: m.last_tokens_per_expert.clone() for n, m in model.named_modules()
              if hasattr(m, "last_tokens_per_expert")}
    return loss.detach(), grads, counts


def _check(make_spec, monkeypatch, residual_only: bool | None = None, layer_cls: type | None = None) -> int:
    """The tiled, recomputed step against the plain one; returns how many times the routed experts ran.
    ``residual_only``: forced on every layer (None: as ``parallelize`` sets it); ``layer_cls``: the layers'
    class in both models."""
    spec = make_spec()
    plain = build_model(spec, dtype=torch.float64, seed=0)
    if layer_cls is not None:
        for layer in plain.layers:
            layer.__class__ = layer_cls
    model = copy.deepcopy(plain)
    ref = _step(plain, None)
    plan = MemorySettings(tiled_mlp=True, mlp_tile_tokens=TILE, recompute=True)
    parallelize(model, plan)
    if residual_only is not None:
        for layer in model.layers:
            tiling.enable_tiling(layer.mlp, TILE, residual_only=residual_only)
    calls = _count_expert_runs(monkeypatch)
    got = _step(model, plan)
    torch.testing.assert_close(got[0], ref[0], **TOL)
    assert got[1].keys() == ref[1].keys()
    for name in ref[1]:
        torch.testing.assert_close(got[1][name], ref[1][name], **TOL, msg=lambda m, n=name: f"{n}: {m}")
    for name in ref[2]:  # the forward's load counts, not those of a rerun
        assert torch.equal(got[2][name], ref[2][name]), name
    return len(calls)


@pytest.mark.parametrize("make_spec", [qwen3_moe_tiny, kimi_linear_tiny], ids=["qwen3_moe", "kimi_linear"])
def test_the_rerun_skips_the_tiles_and_the_step_is_exact(make_spec, monkeypatch):
    spec = make_spec()
    moe_layers = sum(t == "moe" for t in spec.mlp_types)
    tiles = -(-2 * S // TILE)
    assert _check(make_spec, monkeypatch) == 2 * tiles * moe_layers  # the forward and the replay, no rerun
    assert _check(make_spec, monkeypatch, residual_only=False) == 3 * tiles * moe_layers


class _ReadsItsMLP(PreNormDecoderLayer):
    """A layer whose backward reads its MLP's output (``h * mlp(...)``): its rerun must run the tiles."""

    def forward(self, h_BSH, ctx):
        h_BSH = h_BSH + self.mixer(self.input_layernorm(h_BSH), ctx)
        return h_BSH + h_BSH * self.mlp(self.post_attention_layernorm(h_BSH))


def test_the_skip_on_a_layer_that_reads_its_mlp_fails(monkeypatch):
    """The broken variant: ``residual_only`` on layers whose backward reads the MLP's output gives the wrong
    gradients; ``parallelize`` leaves it off there (the layer is not a plain pre-norm layer)."""
    with pytest.raises(AssertionError):
        _check(qwen3_moe_tiny, monkeypatch, residual_only=True, layer_cls=_ReadsItsMLP)
    _check(qwen3_moe_tiny, monkeypatch, layer_cls=_ReadsItsMLP)  # as parallelize sets it: off here, and exact


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_rerun_skip_on_gpu_under_bf16_autocast(monkeypatch):
    """On a GPU under bf16 autocast (the grouped GEMM's fast path): the step with the rerun's skip equals the step
    without it (the same kernels on the same values, to the MoE's atomics), and the experts run twice a tile."""
    spec = qwen3_moe_tiny()
    runs = []
    for residual_only in (True, False):
        model = build_model(spec, dtype=torch.float32, seed=0, device="cuda")
        plan = MemorySettings(tiled_mlp=True, mlp_tile_tokens=TILE, recompute=True)
        parallelize(model, plan)
        for layer in model.layers:
            tiling.enable_tiling(layer.mlp, TILE, residual_only=residual_only)
        calls = _count_expert_runs(monkeypatch)
        loss, grads, _ = _step(model, plan, "cuda", torch.bfloat16)
        runs.append((loss, grads, len(calls)))
    (l0, g0, c0), (l1, g1, c1) = runs
    tiles = -(-2 * S // TILE)
    moe_layers = sum(t == "moe" for t in spec.mlp_types)
    assert (c0, c1) == (2 * tiles * moe_layers, 3 * tiles * moe_layers)
    torch.testing.assert_close(l0, l1, rtol=1e-5, atol=1e-6)
    for name in g1:
        torch.testing.assert_close(g0[name], g1[name], rtol=1e-3, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
