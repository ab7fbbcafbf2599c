"""benchmarks/lora/truncated_config.py: a published config cut to its first N layers keeps each kept layer's
kind (Kimi-Linear's 1-based layer lists cut with it), and a Kimi-Linear config naming a layer beyond
``num_hidden_layers`` is refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import bench_scripts
from megaseq.models.spec import from_hf_config

truncate = bench_scripts.load("lora/truncated_config", "truncated_config").truncated_config
RECIPES = Path(__file__).parents[2] / "recipes"


@pytest.mark.parametrize("name,layers", [("kimi-linear-48b-a3b-instruct", 4), ("qwen3-30b-a3b", 3),
                                         ("qwen3-next-80b-a3b-instruct", 4)])
def test_the_kept_layers_keep_their_kinds(tmp_path, name, layers):
    src = RECIPES / name / "config.json"
    path, full = truncate(src, layers, tmp_path)
    whole, cut = from_hf_config(str(src)), from_hf_config(str(path))
    assert full == whole.num_layers > layers == cut.num_layers
    assert cut.layer_types == whole.layer_types[:layers]
    assert cut.mlp_types == whole.mlp_types[:layers]


def test_a_kimi_layer_list_beyond_the_layers_is_refused(tmp_path):
    hf = json.loads((RECIPES / "kimi-linear-48b-a3b-instruct" / "config.json").read_text())
    hf["num_hidden_layers"] = 4
    (tmp_path / "config.json").write_text(json.dumps(hf))
    with pytest.raises(ValueError, match=r"full_attn_layers names layer 8 .* num_hidden_layers is 4"):
        from_hf_config(str(tmp_path / "config.json"))
