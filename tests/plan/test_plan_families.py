"""Planner terms of dense MLA (DeepSeek-V3, Kimi-Linear), gated DeltaNet and gated attention (Qwen3-Next)
against what autograd really saves in the megaseq blocks on the CPU, and ``megaseq plan`` on every published
config.json under recipes/ (plan_from_config / the CLI)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_plan_layers import kda_uncounted, saved_bytes, uncounted  # noqa: F401  (kda_uncounted: a fixture)

from megaseq.plan import layers as LY
from megaseq.plan.mesh import Calibration, Mesh, Precision

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = sorted(p.parent.name for p in (ROOT / "recipes").glob("*/config.json"))
CPU = Calibration(kda_conv_copies=2)  # the torch reference conv keeps its output too (fla's does not)
CHUNK_STATES = ("kda chunk state (q,k,v,g,A)", "gdn chunk state (q,k,v,beta,g,A)")  # fla's own saved sets


@pytest.fixture
def gdn_uncounted():
    """Op ``gdn`` without fla's chunk_gated_delta_rule saved set, as ``kda_uncounted`` for KDA."""
    yield from uncounted("gdn", "megaseq.models.common.gdn")


def _run(spec, seq: int, autocast: bool):
    from megaseq.plan import components as C
    from megaseq.plan.choice import base_settings
    from megaseq.plan.run import Run

    return Run(spec=spec, seq_len=seq, batch=1, mesh=Mesh(), model_dtype="bf16" if autocast else "fp32",
               memory=base_settings(None, seq).to_dict(), counts=C.count_params(spec), cal=CPU)


def _mixer_params(spec, kind: str) -> int:
    from megaseq.plan import components as C

    return {"mla": C.mla_params, "gdn": C.gdn_params, "kda": C.kda_params}.get(kind, C.attention_params)(spec)


@pytest.mark.parametrize("name,seq,autocast", [
    ("deepseek-v3-tiny", 777, False), ("deepseek-v3-tiny", 333, True),
    ("kimi-linear-tiny", 777, False), ("kimi-linear-tiny", 333, True),
    ("qwen3-next-tiny", 777, False), ("qwen3-next-tiny", 333, True),
])
def test_mixer_saved_matches_blocks(name, seq, autocast, kda_uncounted, gdn_uncounted):  # noqa: F811
    """Each token mixer alone (its input a leaf: the normed layer input, fp32) keeps what the planner's terms
    say, within 3% (fp32 and CPU bf16 autocast): dense MLA (RoPE with interleaved pairs, and NoPE without a
    q LoRA rank), gated DeltaNet (grouped value heads) and Qwen3-Next's gated attention (zero-centered q/k
    norms, partial rotation)."""
    import torch

    from megaseq.models.build import build_model
    from megaseq.models.presets import get_preset
    from megaseq.plan import components as C
    from megaseq.plan.layer_terms import _mixer

    torch.manual_seed(0)
    spec = get_preset(name)
    model = build_model(spec, dtype=torch.float32, seed=0)
    run = _run(spec, seq, autocast)
    seen = set()
    for i, layer in enumerate(model.layers):
        kind = spec.layer_types[i]
        if kind in seen or kind == "kda":
            continue
        seen.add(kind)
        x = torch.randn(1, seq, spec.hidden_size, requires_grad=True)
        saved = _mixer(run, i, 4)[0]
        predicted = sum(v for k, v in saved.items() if k not in CHUNK_STATES)
        predicted += C.weight_copy_bytes(_mixer_params(spec, kind), run.prec, run.mesh)

        # a non-leaf input, as a norm's output (autocast caches a leaf's casts)
        measured = saved_bytes(layer.mixer, x * 1.0, autocast, skip_params=True)
        assert abs(predicted / measured - 1) < 0.03, (i, kind, predicted / seq, measured / seq, saved)
    assert seen >= set(spec.layer_types) - {"kda"}


@pytest.mark.parametrize("name,seq,autocast", [
    ("deepseek-v3-tiny", 777, False), ("kimi-linear-tiny", 333, True), ("qwen3-next-tiny", 777, False),
    ("qwen3-next-tiny", 333, True),
])
def test_layer_saved_matches_blocks(name, seq, autocast, kda_uncounted, gdn_uncounted):  # noqa: F811
    """Whole layers (norms, mixer, MoE with the shared expert, Qwen3-Next's gated one) within 5%."""
    import torch

    from megaseq.models.build import build_model
    from megaseq.models.presets import get_preset
    from megaseq.plan import components as C
    from megaseq.plan.layer_terms import layer_terms

    torch.manual_seed(0)
    spec = get_preset(name)
    model = build_model(spec, dtype=torch.float32, seed=0)
    run = _run(spec, seq, autocast)
    h = torch.randn(1, seq, spec.hidden_size, requires_grad=True)
    for i, layer in enumerate(model.layers):
        terms = layer_terms(run, i)
        dense, experts, _ = run.counts.layers[i]
        predicted = terms.saved - sum(terms.attn.get(k, 0) for k in CHUNK_STATES)
        predicted += C.weight_copy_bytes(dense + experts, run.prec, run.mesh)
        measured = saved_bytes(layer, h * 1.0, autocast, skip_params=True)  # a non-leaf input
        assert abs(predicted / measured - 1) < 0.05, (i, spec.layer_types[i], predicted / seq, measured / seq)


def test_mla_and_gdn_by_hand():
    """The terms on small shapes, written out: DeepSeek-V3-like MLA under autocast, GDN with Hv = 2 Hk."""
    from megaseq.models.presets import get_preset

    spec = get_preset("deepseek-v3-tiny")  # H 64, 4 heads, q_lora 32, kv_lora 32, Dn 16, Dr 8, Dv 16
    got = LY.mla_saved(spec, 10, 4, Precision())
    assert got["mla projections' inputs"] == 10 * 2 * 2 * 64  # q_a, kv_a: a bf16 cast each
    assert got["mla q/kv norms + q_b input"] == 10 * ((4 + 2) * 32 + (4 + 2) * 32 + 2 * 32)
    assert got["mla rope cos/sin"] == 10 * 2 * 4 * 8
    assert got["mla kv_b input"] == 10 * 2 * 32
    assert got["mla q,k,v,o (SDPA, v padded) + lse"] == 10 * (2 * 4 * 4 * 24 + 4 * 4)  # v, o padded to Dq 24
    assert got["mla o_proj input"] == 10 * 2 * 4 * 16
    nope = LY.mla_saved(get_preset("kimi-linear-tiny"), 10, 4, Precision())  # q_proj, no RoPE
    assert nope["mla rope cos/sin"] == 0 and nope["mla q/kv norms + q_b input"] == 10 * (4 + 2) * 32
    g = get_preset("qwen3-next-tiny")  # H 64, Hk 2 x 16, Hv 4 x 16, conv 4
    got = LY.gdn_saved(g, 10, 4, Precision())
    assert got["gdn projections' inputs"] == 10 * 2 * 2 * 64
    assert got["gdn conv"] == 10 * 2 * (2 * 32 + 64)  # fla: the bf16 conv input, C = 2 Hk Dk + Hv Dv
    assert got["gdn chunk state (q,k,v,beta,g,A)"] == 10 * (2 * 4 * (32 + 16 + 1 + 64) + 3 * 4 * 4)
    assert got["gdn gated norm + o_proj input"] == 10 * ((3 * 4 + 2) * 64 + 4 * 64 + 2 * 64)
    assert LY.gdn_temp(g, 64, Precision(), False) == int(64 * (7 * 2 * 64 + 2 * 4 * 16 * 16 / 64 + 2 * 2 * 32))


def test_families_plan_and_cp_checks():
    """The three families plan (no refusal by layer kind); context parallelism is checked against their
    heads (Ulysses); at 1M these tiny models need no sequence segments."""
    from megaseq.models.presets import get_preset
    from megaseq.plan import Mesh as M
    from megaseq.plan import plan

    for name in ("deepseek-v3-tiny", "kimi-linear-tiny", "qwen3-next-tiny"):
        p = plan(get_preset(name), 1 << 20, M(cp=2))
        assert p.memory["model_segment_tokens"] == 0 and "model_segments" not in [f[0] for f in p.fixes]
    with pytest.raises(ValueError, match="MLA layers: num_attention_heads = 4"):
        plan(get_preset("deepseek-v3-tiny"), 3 * 1024, M(cp=3))
    with pytest.raises(ValueError, match="gated DeltaNet layers: linear_num_key_heads = 2"):
        plan(get_preset("qwen3-next-tiny"), 4 * 1024, M(cp=4))


# DeepSeek-V3.2's plan takes about 9 s on two cores: `make test-all` (DeepSeek-V3, the same MLA, runs in `make test`)
@pytest.mark.parametrize("model", [pytest.param(m, marks=pytest.mark.slow) if m == "deepseek-v3.2-exp" else m
                                   for m in FIXTURES])
def test_published_config_plans(model, capsys):
    """Every recipes/<model>/config.json loads through megaseq's loader and ``megaseq plan`` plans it (one H200,
    32K tokens) and prints a plan."""
    from megaseq.cli.main import main
    from megaseq.models.spec import from_hf_config

    path = ROOT / "recipes" / model / "config.json"
    spec = from_hf_config(json.loads(path.read_text()))
    assert spec.num_layers > 1
    assert main(["plan", str(path), "--seq-len", "32K"]) in (0, 1)  # 1: planned, does not fit one GPU
    assert "peak GPU" in capsys.readouterr().out


def test_fsdp_buffers_of_a_frozen_base():
    """FSDP with LoRA: FSDP shards only the frozen base (what trains stays whole on every rank,
    ``parallel.fsdp``), so its blocks are gathered in the bf16 they are stored in under autocast and get no
    unsharded gradient nor reduce-scatter; the DeepSeek-V3 LoRA plan on 64 GPUs counts the experts' gathered
    bytes once, not with gradients."""
    from megaseq.plan import components as C

    mesh, prec = Mesh(dp=64, fsdp="dp_cp"), Precision()  # fp32 parameters under autocast
    full = C.fsdp_buffers(1000, 1000, 10, mesh, prec, 4, True)
    assert full == (2000 + 10) * 4 + 1000 * (4 + 4) + 1000 * 4 // 64 + 10 * 4
    assert C.fsdp_buffers(1000, 1000, 10, mesh, prec, 4, True, frozen=True) == 2010 * 2
    assert C.fsdp_buffers(1000, 1000, 10, mesh, prec, 4, False, frozen=True) == 2010 * 2


def test_lora_fsdp_plan_fits_deepseek_v3_on_64():
    import warnings

    from megaseq.config import AdapterSettings, LoraConfig
    from megaseq.models.spec import from_hf_config
    from megaseq.plan import plan

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        spec = from_hf_config(ROOT / "recipes" / "deepseek-v3" / "config.json")
    lora = AdapterSettings(LoraConfig(rank=16, alpha=32.0, targets=["all"]), frozen_dtype="bf16")
    p = plan(spec, 32768, Mesh(cp=64, gpus_per_host=8, fsdp="dp_cp"), adapters=lora)
    assert p.fits, p.advice
