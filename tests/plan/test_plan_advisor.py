"""``megaseq plan``'s advisor (plan/advisor.py): the fastest configuration that fits, accepted by the runtime's config
validation, with the memory of the plain plan of the same settings; "does not fit" only when nothing does."""

from __future__ import annotations

from pathlib import Path

import pytest

from megaseq.config import load_config
from megaseq.plan import advisor
from megaseq.plan.advisor import Hardware, Source, advise, candidates, model_kernels
from megaseq.plan.mesh import GIB
from megaseq.plan.planner import plan_from_config
from megaseq.plan.report import format_advice

ROOT = Path(__file__).resolve().parents[2]
QWEN3_30B = str(ROOT / "recipes" / "qwen3-30b-a3b" / "config.json")


def _check_runtime_accepts(src: Source, a: advisor.Advice) -> None:
    """The choice's settings load through the runtime's validation, and their plain plan is the choice's plan."""
    c = a.choice
    assert c is not None, format_advice(a)
    cfg = load_config(src.recipe, [*src.base, *c.overrides])  # raises on any combination the trainer refuses
    assert cfg.parallel.dp * cfg.parallel.cp * cfg.parallel.ep == a.hardware.gpus
    plain = plan_from_config(cfg, world_size=a.hardware.gpus, gpus_per_host=min(a.hardware.gpus, 8))
    assert plain.fits and plain.peak_gpu == c.plan.peak_gpu and plain.memory == c.plan.memory
    assert plain.peak_gpu <= 139.8 * GIB


def test_qwen3_30b_at_1m_on_8_h200():
    src = Source(QWEN3_30B, [])
    a = advise(src, Hardware(8), 1 << 20, allow_lora=True)
    _check_runtime_accepts(src, a)
    assert a.command.startswith("torchrun --nproc-per-node 8 -m megaseq train --model.name ")
    assert "--data.seq_len 1M" in a.command
    # a Qwen3 model runs none of GLM-5's kernels
    assert not {"hc_merge", "hc_mix", "indexer_topk", "sparse_attention"} & set(a.kernels)
    assert "rms_norm" in a.kernels


@pytest.mark.slow
def test_glm5_flash_at_1m_on_64_h200_without_flags():
    src = Source(str(ROOT / "recipes" / "glm5-flash.yaml"), [])
    a = advise(src, Hardware(64), 1 << 20)
    _check_runtime_accepts(src, a)
    assert a.choice.settings["weights"] == "bf16" and a.choice.settings["fsdp"] != "off"
    assert "--nnodes 8" in a.command and "--model.weights bf16" in a.command


def test_refused_combinations_are_never_advised(monkeypatch):
    """A broken grid that offers only LoRA with bf16 weights (the trainer refuses a frozen base with
    model.weights bf16): nothing is advised."""
    def broken_grid(spec, hw, allow_lora, lora_in_recipe):
        yield {"lora": True, "weights": "bf16", "fsdp": "dp_cp", "ep": 8}

    monkeypatch.setattr(advisor, "_grid", broken_grid)
    src = Source(QWEN3_30B, [])
    assert candidates(src.recipe, src.base, src.spec, Hardware(8), 32768) == []


def test_a_setting_the_user_gives_is_kept():
    src = Source(QWEN3_30B, ["parallel.cp=4"])
    a = advise(src, Hardware(8), 1 << 17)
    assert a.choice is not None and a.choice.settings["cp"] == 4 and "--parallel.cp 4" in a.command


def test_does_not_fit_names_the_nearest_that_fits():
    src = Source(None, [])  # the embedded default job's tiny model
    a = advise(src, Hardware(1, gpu_bytes=3 * GIB), 1 << 22)
    assert a.choice is None
    text = format_advice(a)
    assert "does not fit" in text and any(x.startswith(("a shorter length", "more GPUs")) for x in a.nearest), text


def test_only_the_kernels_a_model_runs():
    qwen, glm = Source(QWEN3_30B, []).spec, Source(str(ROOT / "recipes" / "glm5-flash.yaml"), []).spec
    every = ["rms_norm", "hc_mix", "sparse_attention", "gated_rms_norm", "moe_permute"]
    assert model_kernels(qwen, every) == ["moe_permute", "rms_norm"]
    assert model_kernels(glm, every) == sorted(every)


def test_more_gpus_never_fit_less():
    """OLMoE LoRA at 1M fits 8 H200s, so it fits 64: the cp search starts from the largest cp the heads allow
    (64 is refused by the mesh check for OLMoE's 16 heads), not from the GPU count."""
    lora = ["lora.rank=16", "lora.alpha=32", "lora.targets=all"]
    src = Source(str(ROOT / "recipes" / "olmoe-1b-7b-0924" / "config.json"), lora)
    on8, on64 = (advise(src, Hardware(g), 1 << 20, explain=False).choice for g in (8, 64))
    assert on8 is not None and on64 is not None and on64.settings["cp"] <= 16


def _published() -> list[str]:
    """Every published model and recipe: the recipes (YAML) and the checkpoints' config.json files under recipes/
    (the agent-traces recipe reads a checkpoint its script writes first: not published as a model)."""
    found = sorted(ROOT.glob("recipes/**/*.yaml")) + sorted(ROOT.glob("recipes/**/config.json")) + sorted(
        ROOT.glob("recipes/long-context/*.json"))
    return [str(p.relative_to(ROOT)) for p in found if "agent-traces" not in str(p)]


@pytest.mark.slow
@pytest.mark.parametrize("published", _published())
def test_every_published_config_gets_a_fitting_command_or_the_nearest(published):
    """On 1, 8 and 64 H200s at the recipe's length: a configuration the runtime accepts with its command, or (only
    when nothing fits) the nearest configuration that does."""
    src = Source(str(ROOT / published), [])
    for gpus in (64, 8, 1):  # the larger meshes first: the nearest-fit search on fewer GPUs reuses their plans
        a = advise(src, Hardware(gpus))
        if a.choice is None:
            assert a.nearest, f"{published} on {gpus} GPUs: nothing fits and nothing nearest is named"
            continue
        _check_runtime_accepts(src, a)
        launcher = "megaseq train" if gpus == 1 else f"torchrun --nproc-per-node {min(gpus, 8)}"
        assert a.command.startswith(launcher), a.command
        if src.cfg.lora.enabled:  # a recipe's own adapters are kept as it gives them
            assert "--lora." not in a.command, a.command


def test_the_published_set_is_found():
    names = _published()
    assert len(names) >= 25 and "recipes/glm5-flash.yaml" in names and "recipes/qwen3-30b-a3b/config.json" in names


def test_the_command_names_each_setting_once():
    """A setting the user gave and the choice keeps appears once, as the user gave it; one the choice changes
    appears once, with the choice's value (the suggested command was ``--data.seq_len 1M --data.seq_len 1M``)."""
    src = Source("recipes/kimi-linear-48b-a3b-lora.yaml", ["data.seq_len=1M", "train.steps=3"])
    choice = advisor.Choice({}, ["data.seq_len=1048576", "train.steps=5", "memory.stream_base=true"], None, 1.0, 1.0)
    cmd = advisor.command(src, choice, Hardware(1)).split()
    flags = [w for w in cmd if w.startswith("--")]
    assert sorted(flags) == sorted(set(flags)), cmd
    assert cmd[cmd.index("--data.seq_len") + 1] == "1M" and cmd[cmd.index("--train.steps") + 1] == "5", cmd
    assert "--memory.stream_base" in cmd, cmd
