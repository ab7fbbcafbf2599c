"""``make test-gpu``'s script (benchmarks/gpu_suite.py) and the ``gpu`` mark it selects by: the record's counts
come from the junit XML of a real pytest run, and ``-m gpu`` selects every test that needs CUDA."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import torch

from bench_scripts import load

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


def _run_sample(tmp_path: Path, *args: str) -> tuple[dict, str]:
    """The sample file beside a copy of the suite's conftest.py, run by pytest with ``args``: the counts
    ``junit_counts`` reads from its XML, and pytest's output."""
    shutil.copy(TESTS / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "test_sample.py").write_text(SAMPLE)
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    gpu: needs CUDA\n")
    xml = tmp_path / "out.xml"
    proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", f"--junitxml={xml}", *args],
                          cwd=tmp_path, capture_output=True, text=True)
    return suite.junit_counts(xml), proc.stdout


def test_counts_every_outcome_of_a_real_run(tmp_path):
    counts, out = _run_sample(tmp_path)
    gpu_passes = 2 if CUDA else 0
    expected = {"passed": 1 + gpu_passes, "failed": 1, "errors": 1, "skipped": 2 - gpu_passes, "total": 5}
    assert {k: counts[k] for k in expected} == expected, out
    assert sorted(n.rsplit("::", 1)[1] for n in counts["failing"]) == ["test_errors", "test_fails"]


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
    rec = suite.record({"passed": 3, "failed": 0, "errors": 0, "skipped": 1, "total": 4, "failing": []}, 0, 1.0)
    assert set(rec["versions"]) == {"torch", "triton", "transformers", "fla", "liger"}
    assert rec["versions"]["torch"] == torch.__version__.split("+")[0] or rec["versions"]["torch"] == torch.__version__
    assert rec["date"].endswith("Z") and rec["passed"] == 3
    assert rec["commit"] is None or len(rec["commit"].split("-")[0]) == 40
    json.dumps(rec)
