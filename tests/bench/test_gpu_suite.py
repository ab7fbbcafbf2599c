"""``make test-gpu``'s script (benchmarks/gpu_suite.py) and the ``gpu`` mark it selects by: the record's counts
come from the per-test log a real pytest run writes as it goes (``gpu_suite_log.py``), a deadline stops the run
and the record says what did not run, and ``-m gpu`` selects every test that needs CUDA."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from bench_scripts import BENCHMARKS, load

suite = load("gpu_suite")
TESTS = Path(__file__).resolve().parents[1]
CUDA = torch.cuda.is_available()

SAMPLE = '''
import pytest, torch

def test_passes():
    assert True

def test_fails():
    assert 1 == 2

@pytest.fixture
def broken():
    raise RuntimeError("fixture fails")

def test_errors(broken):
    pass

@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_needs_cuda_without_the_mark():
    assert torch.cuda.is_available()

@pytest.mark.gpu
def test_gpu_marked_without_a_skipif():
    assert torch.cuda.is_available()
'''


def _run_sample(tmp_path: Path, *args: str, deadline: float | None = None) -> tuple[dict, str]:
    """The sample file beside a copy of the suite's conftest.py, run by pytest with ``args`` and the suite's
    plugin: the counts ``log_counts`` reads from the log it wrote, and pytest's output."""
    shutil.copy(TESTS / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "test_sample.py").write_text(SAMPLE)
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    gpu: needs CUDA\n")
    log = tmp_path / "out.jsonl"
    env = dict(os.environ, MEGASEQ_SUITE_LOG=str(log),
               PYTHONPATH=os.pathsep.join([str(BENCHMARKS)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    env.pop("MEGASEQ_SUITE_DEADLINE", None)
    if deadline is not None:
        env["MEGASEQ_SUITE_DEADLINE"] = str(deadline)
    proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "gpu_suite_log", *args],
                          cwd=tmp_path, capture_output=True, text=True, env=env)
    return suite.log_counts(log), proc.stdout


def test_counts_every_outcome_of_a_real_run(tmp_path):
    """Each outcome of the sample, and a test file skipped as it is collected (once, outside the collected)."""
    (tmp_path / "test_skipped_file.py").write_text("import pytest\npytest.skip('no', allow_module_level=True)\n")
    counts, out = _run_sample(tmp_path)
    gpu_passes = 2 if CUDA else 0
    expected = {"passed": 1 + gpu_passes, "failed": 1, "errors": 1, "skipped": 3 - gpu_passes, "total": 6,
                "collected": 5, "not_run": 0}
    assert {k: counts[k] for k in expected} == expected, out
    assert sorted(n.rsplit("::", 1)[1] for n in counts["failing"]) == ["test_errors", "test_fails"]
    assert suite.record(counts, 1, 1.0)["complete"]


def test_a_deadline_stops_the_run_and_the_record_says_what_did_not_run(tmp_path):
    """A deadline already past: the first test runs, then the session stops; the record is not complete."""
    counts, out = _run_sample(tmp_path, deadline=time.time() - 1)
    assert (counts["total"], counts["collected"], counts["not_run"]) == (1, 5, 4), out
    assert "time limit" in out
    assert not suite.record(counts, 2, 1.0)["complete"]


def test_under_xdist_workers_the_log_has_each_outcome_once(tmp_path):
    """``--workers 2``'s pytest arguments: the same counts as one process, each test's deciding phase written
    once (the controller writes the workers' reports; a worker writing too would double them), and a deadline
    still stops the run."""
    runs = {name: tmp_path / name for name in ("xdist", "one", "late")}
    for d in runs.values():
        d.mkdir()
    counts, out = _run_sample(runs["xdist"], *suite.worker_args(2))
    one, _ = _run_sample(runs["one"])
    keys = ("passed", "failed", "errors", "skipped", "total", "collected", "not_run")
    assert {k: counts[k] for k in keys} == {k: one[k] for k in keys}, out
    lines = [json.loads(x) for x in (runs["xdist"] / "out.jsonl").read_text().splitlines()]
    phases = [(x["nodeid"], x["when"]) for x in lines if "nodeid" in x]
    assert len(phases) == len(set(phases)) == 5, lines
    late, out = _run_sample(runs["late"], *suite.worker_args(2), deadline=time.time() - 1)
    assert late["total"] < late["collected"] == 5 and late["not_run"] > 0, out


def test_two_workers_by_default_where_xdist_is_installed(monkeypatch):
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object() if name == "xdist" else None)
    assert suite.default_workers() == "2"
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert suite.default_workers() == "1"


def test_workers_are_checked_before_anything_runs():
    assert suite.worker_args(1) == []
    assert suite.worker_args(3) == ["-n", "3", "--dist", "loadfile"]
    with pytest.raises(SystemExit, match="--workers 0"):
        suite.main(["--workers", "0"])


def test_a_failure_is_kept_over_a_later_phase(tmp_path):
    """A test whose call failed stays failed when its teardown reports after it; a teardown error after a
    passed call makes it an error; a run stopped from outside (no exit status) is not complete."""
    log = tmp_path / "log.jsonl"
    lines = [{"collected": 2}, {"nodeid": "t::a", "when": "call", "outcome": "failed"},
             {"nodeid": "t::a", "when": "teardown", "outcome": "failed"},
             {"nodeid": "t::b", "when": "call", "outcome": "passed"},
             {"nodeid": "t::b", "when": "teardown", "outcome": "failed"}]
    log.write_text("".join(json.dumps(x) + "\n" for x in lines))
    counts = suite.log_counts(log)
    assert (counts["failed"], counts["errors"], counts["passed"], counts["not_run"]) == (1, 1, 0, 0)
    assert not suite.record(counts, None, 1.0)["complete"]


def test_the_gpu_mark_selects_every_test_that_needs_cuda(tmp_path):
    """``-m gpu`` keeps the test skipped for want of CUDA though it lacks the mark, and the gpu-marked test
    that has no skipif of its own skips (not fails) without CUDA."""
    counts, out = _run_sample(tmp_path, "-m", "gpu")
    assert counts["total"] == 2, out
    assert (counts["passed"], counts["skipped"]) == ((2, 0) if CUDA else (0, 2)), out


def test_without_a_gpu_it_refuses_with_one_message(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(suite, "gpu_name", lambda: None)
    out = tmp_path / "latest.json"
    assert suite.main(["--out", str(out)]) == 2
    assert "no CUDA device" in capsys.readouterr().err and not out.exists()


def test_the_record_names_the_versions_gpu_date_and_commit(tmp_path):
    rec = suite.record({"passed": 3, "failed": 0, "errors": 0, "skipped": 1, "total": 4, "failing": [],
                        "collected": 4, "not_run": 0}, 0, 1.0)
    assert set(rec["versions"]) == {"torch", "triton", "transformers", "fla", "liger"}
    assert rec["versions"]["torch"] == torch.__version__.split("+")[0] or rec["versions"]["torch"] == torch.__version__
    assert rec["date"].endswith("Z") and rec["passed"] == 3
    assert rec["commit"] is None or len(rec["commit"].split("-")[0]) == 40
    json.dumps(rec)
