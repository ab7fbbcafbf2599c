"""A pytest plugin for ``benchmarks/gpu_suite.py``: each test's outcome written as it finishes, and a deadline.

Loaded with ``-p gpu_suite_log`` (this directory on ``PYTHONPATH``). ``MEGASEQ_SUITE_LOG`` names a file that
gets one JSON line when collection ends (``{"collected": n}``) and one per test phase that decides the test's
outcome (``{"nodeid", "when", "outcome"}``: the call, and a setup or teardown that failed or skipped; a test
file skipped or failed as it is collected has ``when`` ``collect``), each flushed at once: a run cut off from
outside (a killed job, a machine taken back) still says what ran. ``MEGASEQ_SUITE_DEADLINE`` (Unix seconds): no
test starts after it; the session stops as ``-x`` stops it and says why.

Under pytest-xdist (``gpu_suite.py --workers N``) each worker collects, so each writes the collected count (the
same n), and the controller, which receives every worker's reports, writes the outcomes: one line per phase as
in a single process. A worker past the deadline stops after its running test; the controller then stops the rest.
"""

from __future__ import annotations

import json
import os
import time

import pytest

_session: pytest.Session | None = None


_worker = False  # this process is a pytest-xdist worker (its reports reach the controller, which writes them)


def pytest_configure(config: pytest.Config) -> None:
    global _worker
    _worker = hasattr(config, "workerinput")  # xdist's mark of a worker's config (not the environment: a
    # pytest that a worker's test starts inherits the worker's variables)


def _write(line: dict) -> None:
    path = os.environ.get("MEGASEQ_SUITE_LOG")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(line) + "\n")


def pytest_sessionstart(session: pytest.Session) -> None:
    global _session
    _session = session


def pytest_collection_finish(session: pytest.Session) -> None:
    _write({"collected": len(session.items)})


def pytest_collectreport(report: pytest.CollectReport) -> None:
    if report.outcome != "passed" and not _worker:
        _write({"nodeid": report.nodeid, "when": "collect", "outcome": report.outcome})


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if (report.when == "call" or report.outcome != "passed") and not _worker:
        _write({"nodeid": report.nodeid, "when": report.when, "outcome": report.outcome})
    deadline = os.environ.get("MEGASEQ_SUITE_DEADLINE")
    if report.when == "teardown" and deadline and time.time() > float(deadline) and _session is not None:
        _session.shouldstop = "gpu_suite: the time limit was reached; the tests not run are counted as not run"
