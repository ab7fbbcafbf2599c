"""The planner's gpt-oss terms: the sliding layers' attention FLOPs over the window, the sinks' and biases'
parameters (against the built model), the sink attention's SDPA saved set (wider heads, a sliding layer's
key blocks), and the published configs' totals (OpenAI's model card: 20.9B and 116.8B parameters)."""

from __future__ import annotations

from pathlib import Path

import pytest

from megaseq.models.gpt_oss.spec import gpt_oss_tiny
from megaseq.models.spec import from_hf_config
from megaseq.ops.workspace import sink_attention_dims, sliding_key_rows
from megaseq.plan import components as C
from megaseq.plan import flops as F
from megaseq.plan import layers
from megaseq.plan.mesh import Mesh, Precision

ROOT = Path(__file__).resolve().parents[2]


def test_sliding_layers_attend_the_window_only() -> None:
    spec = gpt_oss_tiny()
    S, W = 4096, spec.sliding_window
    sliding, full = F.layer_flops(spec, S, 0).mixer, F.layer_flops(spec, S, 1).mixer
    D, Hq = spec.head_dim, spec.num_attention_heads
    assert full - sliding == pytest.approx(4 * Hq * D * (F.causal_keys(S, S) - F.causal_keys(S, W)))
    assert F.causal_keys(S, W) == W * (W + 1) / 2 + (S - W) * W
    no_window = spec.replace(sliding_layers=(), sliding_window=0)
    assert F.layer_flops(no_window, S, 0).mixer == full  # a broken window (ignored) would count as full


def test_published_totals() -> None:
    for name, total in (("gpt-oss-20b", 20_914_757_184), ("gpt-oss-120b", 116_829_156_672)):
        spec = from_hf_config(ROOT / "recipes" / name / "config.json")
        assert C.count_params(spec).total == total
        assert spec.sliding_layers == tuple(range(0, spec.num_layers, 2)) and spec.sliding_window == 128


def test_sink_attention_saved_set() -> None:
    """q, k, v, o at the SDPA path's head width; a sliding layer's keys and values as its blocks copy them."""
    spec = from_hf_config(ROOT / "recipes" / "gpt-oss-20b" / "config.json")
    prec, n, S = Precision(), 1 << 17, 1 << 17
    Dp = sink_attention_dims(64)
    assert Dp == 72 and sliding_key_rows(128, S) == pytest.approx(1152 / 1024)
    full = layers.attention_saved(spec, n, 2, prec, Mesh(), None, 0, S)["attention q,k,v,o + lse"]
    slide = layers.attention_saved(spec, n, 2, prec, Mesh(), None, 128, S)["attention q,k,v,o + lse"]
    plain = layers.attention_saved(spec.replace(attention_sinks=False), n, 2, prec, Mesh())["attention q,k,v,o + lse"]
    assert full == n * (2 * (2 * 64 + 2 * 8) * Dp + 4 * 64)
    assert slide == pytest.approx(n * (2 * (2 * 64 + 2 * 8 * 1152 / 1024) * Dp + 4 * 64))
    assert plain < full < slide
    for backward in (False, True):
        assert layers.attention_temp(spec, n, prec, backward, Mesh(), 128, S) > layers.attention_temp(
            spec.replace(attention_sinks=False), n, prec, backward, Mesh())


@pytest.mark.parametrize("preset", ["gpt-oss-tiny", "qwen3-moe-tiny", "kimi-linear-tiny", "glm5-flash-tiny"])
def test_each_layers_terms_are_its_own(preset):
    """``all_layer_terms`` computes each distinct layer once: a sliding-window layer and a full one of the same
    kind (gpt-oss alternates them) are distinct, so every layer's terms are what ``layer_terms`` gives it."""
    from megaseq.models.presets import get_preset
    from megaseq.plan.given import run_for
    from megaseq.plan.layer_terms import all_layer_terms, layer_terms

    spec = get_preset(preset)
    run = run_for(spec, 4096, {"recompute": True})
    assert all_layer_terms(run) == [layer_terms(run, i) for i in range(spec.num_layers)]
