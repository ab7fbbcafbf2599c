"""A recipe naming files its own ``make_*.py`` writes (the agent-trace recipe's checkpoint and traces): before
the script has run, the error names the setting, the path looked for and the command that writes it, not an
unknown model preset; an override that replaces the setting, or the files once written, load as usual."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from megaseq.config import generated, load_config

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "agent-traces-tiny"


def _copy(tmp_path: Path) -> Path:
    """The recipe and its script in a fresh directory, the script not run."""
    folder = tmp_path / "agent-traces-tiny"
    folder.mkdir()
    for name in ("recipe.yaml", "make_checkpoint.py"):
        shutil.copy(RECIPE / name, folder / name)
    return folder


def test_the_message_names_the_path_and_the_command(tmp_path):
    folder = _copy(tmp_path)
    with pytest.raises(ValueError) as e:
        load_config(folder / "recipe.yaml")
    msg = str(e.value)
    assert msg.startswith("model.name 'checkpoint' of ")
    assert f"{folder / 'checkpoint'} does not exist" in msg
    assert f"run `python {folder / 'make_checkpoint.py'}` first" in msg
    assert "unknown model preset" not in msg


def test_the_cli_says_it_before_anything_runs(tmp_path, capsys, monkeypatch):
    from megaseq.cli.main import main

    folder = _copy(tmp_path)
    monkeypatch.chdir(tmp_path)
    assert main(["plan", "agent-traces-tiny/recipe.yaml"]) != 0
    err = capsys.readouterr().err
    assert "agent-traces-tiny/checkpoint does not exist" in err and str(folder / "checkpoint") in err
    assert "run `python agent-traces-tiny/make_checkpoint.py` first" in err


def test_each_setting_is_named_and_an_override_replaces_it(tmp_path):
    folder = _copy(tmp_path)
    with pytest.raises(ValueError, match="^data.tokenizer 'checkpoint' of "):
        load_config(folder / "recipe.yaml", ["model.name=qwen3-moe-tiny"])
    with pytest.raises(ValueError, match=r"^data.train of .*recipe.yaml: .*/traces.jsonl does not exist"):
        load_config(folder / "recipe.yaml", ["model.name=qwen3-moe-tiny", "data.tokenizer=dna"])
    (folder / "traces.jsonl").write_text("")
    (folder / "heldout_traces.jsonl").write_text("")
    (folder / "checkpoint").mkdir()
    cfg = load_config(folder / "recipe.yaml")  # written: no error, the paths resolved at the recipe
    assert cfg.model.name == str(folder / "checkpoint") and cfg.data.train == [str(folder / "traces.jsonl")]


def test_names_no_script_writes_are_left_alone(tmp_path):
    """A preset name, a built-in tokenizer, and a recipe without a script are not this check's business."""
    folder = _copy(tmp_path)
    (folder / "recipe.yaml").write_text("model:\n  name: qwen3-moe-tiny\ndata:\n  tokenizer: dna\n")
    assert load_config(folder / "recipe.yaml").model.name == "qwen3-moe-tiny"
    (folder / "make_checkpoint.py").unlink()
    (folder / "recipe.yaml").write_text("model:\n  name: checkpoint\n")
    assert load_config(folder / "recipe.yaml").model.name == "checkpoint"  # the preset error comes later


def test_without_the_check_the_message_is_the_unhelpful_one(tmp_path, monkeypatch, capsys):
    """The broken variant: no script found to name; the run then fails as an unknown preset, which the tests
    above would refuse."""
    from megaseq.cli.main import main

    folder = _copy(tmp_path)
    monkeypatch.setattr(generated, "_writer", lambda scripts, name: None)
    load_config(folder / "recipe.yaml")  # no error at load
    assert main(["plan", str(folder / "recipe.yaml")]) != 0
    err = capsys.readouterr().err
    assert "unknown model preset 'checkpoint'" in err and "make_checkpoint.py" not in err
