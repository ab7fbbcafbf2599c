"""The protocol's recipes (recipes/long-context/genome-*.yaml): they load, hold out whole genomes of the species
they train on, keep the control's tokens per step equal to the long fine-tune's, and plan within one H200."""

import dataclasses
from pathlib import Path

import pytest
import yaml

from megaseq.config import ModelConfig, load_config
from megaseq.data.related import species_of
from megaseq.plan.planner import plan_from_config

RECIPES = Path(__file__).resolve().parents[2] / "recipes" / "long-context"
NAMES = ("genome-start", "genome-long", "genome-control")
INDEXER_KEYS = ("train_indexer", "dsa_warmup_steps", "indexer_loss_coef")


def load(name: str, tmp_path: Path):
    """The recipe as written, less the indexer's settings where this checkout's config lacks them."""
    raw = yaml.safe_load((RECIPES / f"{name}.yaml").read_text())
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    assert set(INDEXER_KEYS) <= set(raw["model"]), f"{name} must train the indexer"
    raw["model"] = {k: v for k, v in raw["model"].items() if k in known}
    path = RECIPES / f".{name}.test.yaml"  # beside the originals, so recipe-relative paths resolve the same
    path.write_text(yaml.safe_dump(raw))
    try:
        return raw, load_config(path, [f"train.run_dir={tmp_path / name}"])
    finally:
        path.unlink()


@pytest.mark.parametrize("name", NAMES)
def test_recipe_loads_and_plans_on_one_h200(name, tmp_path):
    raw, cfg = load(name, tmp_path)
    assert cfg.model.name.endswith("glm5-dna.json")
    train = {Path(p).name for p in cfg.data.train}
    held = {Path(p).name for p in cfg.data.heldout}
    assert not train & held and {species_of(p) for p in held} == {species_of(p) for p in train}
    assert all(p.endswith(".fa.gz") and "/.data/" in p for p in cfg.data.train + cfg.data.heldout)
    plan = plan_from_config(cfg, world_size=1)
    assert plan.fits, f"{name}: {plan.peak_gpu / 2**30:.1f} GiB does not fit one H200"


def test_control_matches_the_long_fine_tune(tmp_path):
    _, start = load("genome-start", tmp_path)
    _, long_ = load("genome-long", tmp_path)
    _, control = load("genome-control", tmp_path)
    tokens = lambda c: c.data.seq_len * c.train.batch_size * c.train.grad_accum  # noqa: E731
    assert tokens(long_) == tokens(control) and control.data.seq_len == start.data.seq_len
    assert long_.data.seq_len >= 256 * 1024 and long_.eval.by_position == 32 * 1024
    assert long_.data.heldout == control.data.heldout == start.data.heldout
    assert long_.data.train == control.data.train == start.data.train
