"""The command line: help from field docstrings, overrides, one clear message per user error."""

import subprocess
import sys

import pytest

from megaseq.cli.main import main
from megaseq.config import split_overrides


def test_split_overrides():
    assert split_overrides(["--train.steps", "5", "--data.seq_len=1K", "--memory.recompute"]) == [
        "train.steps=5", "data.seq_len=1K", "memory.recompute=true"]
    with pytest.raises(ValueError, match="section.key"):
        split_overrides(["steps"])


def test_help_lists_verbs_and_config_keys(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = capsys.readouterr().out
    assert "--memory.checkpoint_offload" in out and "SCO" in out
    assert "--data.seq_len" in out
    main(["--help"])
    out = capsys.readouterr().out
    for verb in ("train", "eval", "plan", "bench", "verify", "convert"):
        assert verb in out


def test_unknown_key_is_one_clear_message():
    r = subprocess.run([sys.executable, "-m", "megaseq", "train", "--train.stpes", "3"],
                       capture_output=True, text=True)
    assert r.returncode == 2
    assert "Did you mean 'steps'" in r.stderr
    assert "Traceback" not in r.stderr


def test_unknown_preset_is_one_clear_message(tmp_path):
    r = subprocess.run([sys.executable, "-m", "megaseq", "train", "--model.name", "glm6-huge",
                        "--train.run_dir", str(tmp_path / "r")], capture_output=True, text=True)
    assert r.returncode == 2
    assert "unknown model preset 'glm6-huge'" in r.stderr and "glm5-flash-tiny" in r.stderr
    assert "Traceback" not in r.stderr
