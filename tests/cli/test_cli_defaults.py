"""The defaults ``--help`` prints are the defaults a run gets, for every setting: a recipe that leaves a key out gets
``[default: X]``; ``megaseq train`` without a recipe (the embedded default job) gets ``[default job: Y]`` where shown,
else X."""

from __future__ import annotations

import dataclasses
import re

import pytest

from megaseq.cli import help_text as cli
from megaseq.config import DATA_DEFAULT, FAMILY_DEFAULT, Config, default_recipe, load_config, parse_size


def _printed() -> dict[tuple[str, str], tuple[str, str | None]]:
    """{(section, key): (default, default job's or None)} as ``megaseq config`` prints them."""
    text = cli.config_help()
    out = {}
    for block in re.split(r"\n    (?=--)", text)[1:]:
        flat = " ".join(block.split())
        key = re.match(r"--(\w+)\.(\w+)", flat)
        default = re.search(r"\[default: (.*?)\](?: \[default job: (.*?)\])?(?: \S+:)?$", flat)
        assert key and default, flat
        out[(key.group(1), key.group(2))] = (default.group(1), default.group(2))
    return out


def _values(cfg: Config) -> dict[tuple[str, str], str]:
    return {(s.name, f.name): cli._shown(getattr(getattr(cfg, s.name), f.name))
            for s in dataclasses.fields(Config) for f in dataclasses.fields(getattr(cfg, s.name))}


def _same(value: str, printed: str) -> bool:
    """Equal as printed, or as sizes (a printed ``8K`` is 8192 tokens)."""
    if value == printed or value == "None" and printed in (FAMILY_DEFAULT, DATA_DEFAULT):  # unset: resolved later
        return True
    try:
        return parse_size(value) == parse_size(printed)
    except (ValueError, TypeError):
        return False


def test_printed_defaults_are_what_a_run_gets(tmp_path):
    printed = _printed()
    recipe = tmp_path / "r.yaml"
    recipe.write_text("model:\n  name: glm5-flash-tiny\n")
    with_recipe, without = _values(load_config(recipe)), _values(load_config(default_recipe()))
    assert set(printed) == set(with_recipe) and len(printed) > 80
    for key, (default, job) in printed.items():
        assert _same(with_recipe[key], default), (key, with_recipe[key], default)
        assert _same(without[key], job if job is not None else default), (key, without[key], default, job)


def test_a_help_that_hides_the_default_job_fails_the_check(tmp_path, monkeypatch):
    """The help as it was: the fields' defaults only, though the default job sets optim.lr 3e-3 and more."""
    monkeypatch.setattr(cli, "default_job_values", lambda: {})
    with pytest.raises(AssertionError, match="model|optim|eval|moe|train|data"):
        test_printed_defaults_are_what_a_run_gets(tmp_path)
