"""A bench result names the recipe it ran (``meta.recipe`` and its overrides), and the planner-error table re-plans
the row from that recipe: a LoRA bench of a published config is planned as the LoRA run it was."""

from __future__ import annotations

import json

from bench_scripts import load
from megaseq.cli.main import main

planner_error = load("memory/planner_error")


def test_bench_records_its_recipe_and_the_table_plans_from_it(tmp_path) -> None:
    out = tmp_path / "b"
    assert main(["bench", "recipes/qwen3-moe-tiny-dna.yaml", "--seq-lens", "64", "--steps", "0", "--out", str(out),
                 "--lora.rank", "4", "--data.kind", "random"]) == 0
    meta = json.loads(out.with_suffix(".json").read_text())["meta"]
    assert meta["recipe"] == "recipes/qwen3-moe-tiny-dna.yaml"
    assert "lora.rank=4" in meta["overrides"]
    recipe, over = planner_error.recipe_of(out.with_suffix(".json"), meta)
    assert recipe == str(planner_error.ROOT / "recipes/qwen3-moe-tiny-dna.yaml") and over["lora.rank"] == "4"


def test_without_a_recipe_the_table_falls_back_to_the_model(tmp_path) -> None:
    meta = {"model": "qwen3-moe-tiny", "dtype": "fp32"}
    recipe, over = planner_error.recipe_of(tmp_path / "x.json", meta)
    assert recipe is None and over == {"model.name": "qwen3-moe-tiny", "model.dtype": "fp32"}
