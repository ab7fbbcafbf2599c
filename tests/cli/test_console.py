"""Only the CLI prints: library modules log (``logging.getLogger(__name__)``), and the handler the CLI installs
(``megaseq.console.show_logs``) shows their lines on stdout / stderr as they were printed, once each."""

from __future__ import annotations

import ast
import logging
from pathlib import Path

import pytest
import torch

from megaseq import console
from megaseq.cli.main import main
from megaseq.parallel.env import ParallelEnv

SRC = Path(__file__).parents[2] / "src" / "megaseq"


def printing_calls(source: str) -> list[int]:
    """Lines of ``source`` that call the builtin ``print``."""
    return [n.lineno for n in ast.walk(ast.parse(source))
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "print"]


def test_no_library_module_prints():
    found = {str(p.relative_to(SRC)): printing_calls(p.read_text()) for p in SRC.rglob("*.py")
             if "cli" not in p.relative_to(SRC).parts}
    assert len(found) > 100
    assert not {k: v for k, v in found.items() if v}


def test_a_printing_module_fails_the_scan():
    assert printing_calls("import sys\n\ndef f():\n    print('x', file=sys.stderr)\n") == [4]
    assert printing_calls("def f(console):\n    console.print('a table')\n") == []  # rich's console: not print


def test_library_lines_reach_the_users_streams(capsys):
    console.show_logs()
    ParallelEnv(torch.device("cpu")).log("resumed from somewhere")
    logging.getLogger("megaseq.train.metrics").info("step 1/2", extra=console.TO_STDOUT)
    out = capsys.readouterr()
    assert out.err == "resumed from somewhere\n" and out.out == "step 1/2\n"


def test_without_the_handler_the_lines_are_lost(capsys, monkeypatch):
    """The broken variant: a library that logs with nothing installed shows the user nothing."""
    logger = logging.getLogger("megaseq")
    monkeypatch.setattr(logger, "handlers", [])
    ParallelEnv(torch.device("cpu")).log("resumed from somewhere")
    with pytest.raises(AssertionError):
        assert "resumed from somewhere" in capsys.readouterr().err


def test_each_line_once_however_often_the_cli_runs(capsys):
    for _ in range(3):
        assert main(["--version"]) == 0
    ParallelEnv(torch.device("cpu")).log("once")
    assert capsys.readouterr().err == "once\n"
    assert sum(isinstance(h, console.UserLines) for h in logging.getLogger("megaseq").handlers) == 1
