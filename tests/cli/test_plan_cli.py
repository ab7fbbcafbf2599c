"""``megaseq plan`` as a user reads it: its first lines say whether the settings as given fit and what to run, its exit
code says whether they fit (0 fits as given, 1 does not: the first lines name what fits instead, or the nearest when
nothing does), and on / off / yes / no on the command line or in a recipe stay words for a setting that takes words."""

from __future__ import annotations

import dataclasses
import json
import typing
from pathlib import Path

import pytest
import yaml

from megaseq import config
from megaseq.cli.main import main
from megaseq.config import SECTIONS, build_config, load_config

ROOT = Path(__file__).resolve().parents[2]
YAML11_BOOL_WORDS = {"on", "off", "yes", "no", "y", "n"}


def _word_settings() -> list[tuple[str, str, str]]:
    """(section, key, choice) of every string setting whose choices include a word YAML 1.1 reads as a bool."""
    out = []
    for section, cls in SECTIONS.items():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if hints[f.name] is str:
                out += [(section, f.name, c) for c in f.metadata.get("choices", ()) if c.lower() in YAML11_BOOL_WORDS]
    return out


def test_on_off_yes_no_stay_words_for_word_settings(tmp_path):
    cases = _word_settings() + [("parallel", "fsdp", "off")]  # fsdp checks its words itself (no choices metadata)
    for section, key, word in cases:
        assert getattr(getattr(build_config(overrides=[f"{section}.{key}={word}"]), section), key) == word
        recipe = tmp_path / "r.yaml"
        recipe.write_text(f"{section}:\n  {key}: {word}\n")
        assert getattr(getattr(load_config(recipe), section), key) == word


def test_bool_settings_still_take_the_words():
    cfg = build_config(overrides=["train.resume=on", "train.overwrite=yes", "log.progress=off", "log.tensorboard=no"])
    assert cfg.train.resume and cfg.train.overwrite and not cfg.log.progress and not cfg.log.tensorboard
    assert build_config({"train": {"resume": "on"}}).train.resume is True


def test_yaml_11_booleans_fail_the_check(monkeypatch, tmp_path):
    """The parser as it was (YAML 1.1: off is False): --parallel.fsdp off is refused."""
    monkeypatch.setattr(config.loading, "_UniqueKeyLoader", yaml.SafeLoader)
    with pytest.raises(ValueError, match="parallel.fsdp must be one of off, dp, dp_cp, got 'False'"):
        test_on_off_yes_no_stay_words_for_word_settings(tmp_path)


def _plan(capsys, *argv: str) -> tuple[int, list[str]]:
    rc = main(["plan", *argv])
    return rc, capsys.readouterr().out.splitlines()


def test_fits_as_given_says_so_first_with_the_command(capsys):
    rc, lines = _plan(capsys, "--parallel.fsdp", "off")
    assert rc == 0 and lines[0].startswith("FITS as given (")
    assert lines[1].strip() == "megaseq train --parallel.fsdp off"


def test_a_setting_that_does_not_fit_names_what_to_run_first(capsys):
    rc, lines = _plan(capsys, str(ROOT / "recipes/qwen3-30b-a3b/config.json"), "--seq-len", "1M", "--gpus", "8")
    assert rc == 1 and lines[0].startswith("DOES NOT FIT as given (") and "binding:" in lines[0]
    assert lines[1].startswith("fits instead (") and lines[1].endswith("; run:")
    assert lines[2].strip().startswith("torchrun --nproc-per-node 8 -m megaseq train --model.name ")
    assert "--data.seq_len 1M" in lines[2]


def test_nothing_fits_names_the_nearest(capsys):
    rc, lines = _plan(capsys, "--gpu-mem", "2G", "--seq-len", "4M")
    assert rc == 1 and lines[0].startswith("DOES NOT FIT as given (")
    assert lines[1].startswith("nothing megaseq supports fits") and lines[2].startswith("  - ")


def test_as_given_and_json_keep_their_exit_code(capsys):
    assert main(["plan", "--as-given"]) == 0 and main(["plan", "--json", "--gpu-mem", "1G", "--seq-len", "4M"]) == 1


def test_memory_sizes_take_fractions_of_a_unit(capsys):
    """``--gpu-mem 79.6G`` (an H100's usable memory, the spelling of the help's default 139.8G) is 79.6 GiB; a size
    that is no number is refused naming the flag."""
    from megaseq.config import parse_bytes

    assert parse_bytes("79.6G") == int(79.6 * 2**30) and parse_bytes("85000000000") == 85_000_000_000
    assert parse_bytes(2**30) == 2**30
    for bad in ("lots", "0", "-1G", "nanG", True):
        with pytest.raises(ValueError, match="--gpu-mem expects a memory size"):
            parse_bytes(bad, "--gpu-mem")
    budgets = []
    for mem in ("139.8G", str(int(139.8 * 2**30))):
        assert main(["plan", "--json", "--gpu-mem", mem, "--seq-len", "8K"]) == 0
        budgets.append(json.loads(capsys.readouterr().out)["gpu_budget"])
    assert budgets[0] == budgets[1]
