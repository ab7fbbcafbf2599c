"""The planner's dense-MLA segment attention (``plan.layers.mla_segment_temp``) against what
``MultiLatentAttention._attend_groups`` allocates in a forward and ``_attend_groups_vjp`` in a backward, as both
segment stores call it (``joined_vjp``): Kimi-Linear's latent and head shapes (8 heads), bf16, 8K earlier keys
and a 64-token segment, head groups of 2, 4 and all 8 heads, the attention by a stand-in with the memory of the
GPU's flash kernel (``flash_standin``). Measured is every tensor the forward or the backward creates
(``bench.live``); the plan must hold it (no more than 5% under) without being loose (no more than 10% over). The
queries' own gradients and the joined output (64 rows) are planned with the layer's other terms, ``kv_b_proj``'s
gradient with its weight gradients (both added here). A forward or backward that keeps every group's keys and
values fails it."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

import flash_standin
from megaseq.bench.live import CreatedStorages
from megaseq.memory.segment_host import joined_vjp
from megaseq.models.common import mla as M
from megaseq.models.spec import from_hf_config
from megaseq.ops import workspace
from megaseq.plan import Mesh
from megaseq.plan.layers import mla_segment_temp
from megaseq.plan.mesh import precision_for

S, T, H = 8192, 64, 8
CONFIG = Path(__file__).parents[2] / "recipes/kimi-linear-48b-a3b-instruct/config.json"


def _measure(monkeypatch, heads_per_group: int) -> tuple[int, int]:
    """(measured, planned) bytes of the backward of one segment attention over ``S`` keys."""
    flash_standin.install(monkeypatch)
    spec = dataclasses.replace(from_hf_config(str(CONFIG)), num_attention_heads=H)
    D = max(spec.qk_head_dim, spec.v_head_dim)
    monkeypatch.setattr(workspace, "MLA_SEGMENT_GROUP_BYTES", heads_per_group * 4 * D * 2 * S)
    torch.manual_seed(0)
    layer = M.MultiLatentAttention(spec, layer="layers.3.self_attn").to(torch.bfloat16)
    R, Dr, Dn, Dv = spec.kv_lora_rank, spec.qk_rope_head_dim, spec.qk_nope_head_dim, spec.v_head_dim
    bf = torch.bfloat16
    q = torch.randn(1, T, H, Dn + Dr, dtype=bf)
    rows, kv = torch.randn(1, S - T, R + Dr, dtype=bf), torch.randn(1, T, R + Dr, dtype=bf)
    w_uk, w_uv = layer.kv_b_proj.weight.detach().view(H, Dn + Dv, R).split([Dn, Dv], dim=1)
    g = torch.randn(1, T, H, Dv, dtype=bf)
    assert layer._heads_per_call(q, torch.cat([rows, kv], dim=1)) == heads_per_group

    def vjp(q_, latent, wk, wv, g_, needs):
        return layer._attend_groups_vjp(q_, latent, wk, wv, None, g_, needs)

    with CreatedStorages() as live, torch.no_grad():  # as a backward runs it
        d = joined_vjp(vjp, q, [rows], [kv], [w_uk, w_uv], g, (True, True, True, True, True))
    assert all(t is not None for t in (d[0], *d[1], *d[2], *d[3]))
    w_grad = H * (Dn + Dv) * R * 2  # kv_b_proj's gradient: planned with the layer's weight gradients
    return live.peak, mla_segment_temp(spec, S, precision_for("bf16"), Mesh(), backward=True) + w_grad


def _measure_forward(monkeypatch, heads_per_group: int) -> tuple[int, int]:
    """(measured, planned) bytes of the forward of one segment attention (the forward pass and the rerun)."""
    flash_standin.install(monkeypatch)
    spec = dataclasses.replace(from_hf_config(str(CONFIG)), num_attention_heads=H)
    D = max(spec.qk_head_dim, spec.v_head_dim)
    monkeypatch.setattr(workspace, "MLA_SEGMENT_GROUP_BYTES", heads_per_group * 4 * D * 2 * S)
    layer = M.MultiLatentAttention(spec, layer="layers.3.self_attn").to(torch.bfloat16)
    R, Dv = spec.kv_lora_rank, spec.v_head_dim
    q = torch.randn(1, T, H, spec.qk_head_dim, dtype=torch.bfloat16)
    latent = torch.randn(1, S, R + spec.qk_rope_head_dim, dtype=torch.bfloat16)
    w_uk, w_uv = layer.kv_b_proj.weight.detach().view(H, spec.qk_nope_head_dim + Dv, R).split(
        [spec.qk_nope_head_dim, Dv], dim=1)
    with CreatedStorages() as live, torch.no_grad():
        out = layer._attend_groups(q, latent, w_uk, w_uv, None)
    assert out.shape == (1, T, H, Dv)
    planned = mla_segment_temp(spec, S, precision_for("bf16"), Mesh(), backward=False)
    return live.peak, planned + T * H * Dv * 2  # the joined output: planned with the layer's per-query terms


@pytest.mark.parametrize("heads_per_group", [2, 4, 8])
def test_the_plan_holds_the_segment_attention_forward(monkeypatch, heads_per_group):
    """The forward: one group's keys and padded values at a time."""
    measured, planned = _measure_forward(monkeypatch, heads_per_group)
    assert 0.95 * measured <= planned <= 1.10 * measured, (measured / 2**20, planned / 2**20)


@pytest.mark.parametrize("heads_per_group", [2, 4, 8])
def test_the_plan_holds_the_segment_attention_backward(monkeypatch, heads_per_group):
    measured, planned = _measure(monkeypatch, heads_per_group)
    assert 0.95 * measured <= planned <= 1.10 * measured, (measured / 2**20, planned / 2**20)


def test_keeping_every_groups_keys_fails(monkeypatch):
    kept = []
    keys_values = M.MultiLatentAttention._keys_values

    def keep(self, *args, **kwargs):
        out = keys_values(self, *args, **kwargs)
        kept.append(out)
        return out

    monkeypatch.setattr(M.MultiLatentAttention, "_keys_values", keep)
    for measure in (_measure, _measure_forward):
        kept.clear()
        measured, planned = measure(monkeypatch, 2)
        assert planned < 0.95 * measured, measure.__name__
