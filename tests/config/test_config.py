"""Configuration: typed sections, YAML recipes, dotted overrides, clear errors."""

from pathlib import Path

import pytest
import yaml

from megaseq.config import Config, build_config, field_help, format_size, load_config, parse_size
from megaseq.models.presets import PRESETS, get_preset, resolve_spec

ROOT = Path(__file__).resolve().parents[2]


def test_sizes():
    assert parse_size("32K") == 32768
    assert parse_size("1M") == 1048576
    assert parse_size("1.5K") == 1536
    assert parse_size(7) == 7
    assert parse_size("64G") == 64 * 2**30


@pytest.mark.parametrize("n, text", [(32768, "32K"), (1 << 20, "1M"), (3 << 20, "3M"), (1536, "1536"), (1000, "1000"),
                                     (0, "0")])
def test_format_size_spells_what_parse_size_reads(n, text):
    assert format_size(n) == text
    assert parse_size(text) == n


def test_overrides_and_types():
    cfg = build_config({"data": {"seq_len": "4K"}}, ["train.steps=5", "memory.chunked_loss=true",
                                                      "optim.betas=[0.8, 0.9]", "data.train=a.fa,b.fa"])
    assert cfg.data.seq_len == 4096
    assert cfg.train.steps == 5
    assert cfg.memory.chunked_loss is True
    assert cfg.optim.betas == [0.8, 0.9]
    assert cfg.data.train == ["a.fa", "b.fa"]


@pytest.mark.parametrize(
    "overrides, words",
    [
        (["train.stesp=3"], ["train.stesp", "Did you mean 'steps'"]),
        (["trian.steps=3"], ["trian.steps", "Did you mean 'train'"]),
        (["train.steps=abc"], ["train.steps", "integer"]),
        (["memory.recompute=maybe"], ["memory.recompute", "true or false"]),
        (["train.steps=0"], ["train.steps", ">= 1"]),
        (["model.dtype=fp8"], ["model.dtype", "bf16"]),
    ],
)
def test_bad_settings_name_the_setting(overrides, words):
    with pytest.raises(ValueError) as e:
        build_config(None, overrides)
    for w in words:
        assert w in str(e.value)


def test_unknown_section_in_yaml(tmp_path):
    p = tmp_path / "r.yaml"
    p.write_text("modle:\n  name: glm5-flash-tiny\n")
    with pytest.raises(ValueError, match="Did you mean 'model'"):
        load_config(p)
    with pytest.raises(ValueError, match="not found"):
        load_config(tmp_path / "missing.yaml")


def test_resolved_config_round_trips():
    cfg = build_config(None, ["data.seq_len=1M", "memory.recompute=true"])
    again = build_config(yaml.safe_load(cfg.to_yaml()))
    assert again == cfg


def test_every_field_has_help():
    for section, rows in field_help().items():
        for key, help_text, _ in rows:
            assert help_text, f"{section}.{key} has no help text"


@pytest.mark.parametrize("recipe", sorted((ROOT / "recipes").glob("*.yaml")))
def test_recipes_load_and_name_known_models(recipe):
    cfg = load_config(recipe)
    assert isinstance(cfg, Config)
    resolve_spec(cfg.model.name)


def test_presets_and_unknown_preset():
    for name in PRESETS:
        spec = get_preset(name)
        assert spec.num_layers == len(spec.layer_types)
    with pytest.raises(ValueError, match="Did you mean 'glm5-flash-tiny'"):
        get_preset("glm5-flash-tyni")


def test_1gpu_preset_meets_its_brief():
    s = get_preset("glm5-flash-1gpu")
    assert s.hidden_size >= 2048 and s.num_layers >= 8 and s.count("dsa") >= 2
    assert s.num_experts >= 32 and s.num_experts_per_tok == 8 and s.vocab_size == 154880 and s.hc_mult == 4
    sl = get_preset("glm5-flash-slice")
    full = get_preset("glm5-flash")
    assert (sl.num_layers, sl.count("kda"), sl.count("dsa")) == (4, 3, 1)
    for f in ("hidden_size", "num_attention_heads", "linear_num_heads", "moe_intermediate_size", "q_lora_rank",
              "kv_lora_rank", "index_n_heads", "num_experts_per_tok"):
        assert getattr(sl, f) == getattr(full, f)
