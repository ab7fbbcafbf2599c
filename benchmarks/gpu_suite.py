"""The whole GPU test suite in one run, and its record: ``make test-gpu``.

Runs ``pytest -m "gpu or triton" tests`` once (every gpu-marked test of every file, and every test of a Triton
kernel, which runs on the GPU where there is one: a failure anywhere is seen), reads the outcome of each test
as the run wrote it (``gpu_suite_log.py``, a line as each test finishes), and records in
``benchmarks/results/gpu_suite/latest.json``: the passed, failed, errored and skipped counts, the failing test
ids, how many were collected and how many did not run, the GPU, the versions of torch, Triton, transformers,
fla and Liger, the date and the git commit. Exits with pytest's status, so a red suite fails the make target.

``--workers N`` (default ``MEGASEQ_SUITE_WORKERS``, else 2 where pytest-xdist is installed, else 1): N
pytest-xdist processes share the GPU, a test file to each in turn (``--dist loadfile``): the compiles, which take
most of a cold suite's time, run on N cores at once. Each process has its own CUDA context and peak statistics;
two ran the whole suite on one 80 GB H100 in 204 s (benchmarks/results/gpu_suite/latest.md).

``--time-limit S``: no test starts after S seconds and pytest is stopped at S + 60; the record says
``complete: false`` and counts what ran. Set it below a job's own limit: a job killed from outside writes
no record (the per-test log, ``--log``, still holds what ran).

Autotuned Triton kernels (fla's and megaseq's) run on one config each (``MEGASEQ_FLA_AUTOTUNE=one``, unless
set otherwise): the suite checks numerics, not speed, and stays within minutes on a warm cache.

    python benchmarks/gpu_suite.py [--out benchmarks/results/gpu_suite/latest.json] [--time-limit S] [--workers N]
        [-- pytest args]
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "gpu_suite" / "latest.json"
# distribution names whose versions the record carries (first installed name of each tuple)
PACKAGES = {"torch": ("torch",), "triton": ("triton",), "transformers": ("transformers",),
            "fla": ("fla-core", "flash-linear-attention"), "liger": ("liger-kernel", "liger-kernel-nightly")}


GRACE_S = 60  # past --time-limit, the running test's time to end before pytest is stopped


def log_counts(log_path: Path) -> dict:
    """Passed, failed, errors, skipped and total counts, the failing test ids, the collected count and the
    tests not run, from the lines ``gpu_suite_log.py`` wrote. A test is failed where its call failed, an error
    where its setup or teardown failed, skipped where any phase skipped, passed otherwise; a test file skipped
    (or failing) as it is collected counts once as skipped (or an error), outside the collected tests."""
    collected, outcome, files = None, {}, set()
    lines = log_path.read_text().splitlines() if log_path.exists() else []
    for line in lines:
        rec = json.loads(line)
        if "collected" in rec:
            collected = rec["collected"]
            continue
        nodeid, when, result = rec["nodeid"], rec["when"], rec["outcome"]
        if when == "collect":
            files.add(nodeid)
        if result == "failed":
            kind = "failed" if when == "call" else "errors"
        else:
            kind = "skipped" if result == "skipped" else "passed"
        if outcome.get(nodeid) not in ("failed", "errors"):  # a failure is kept over a later phase's outcome
            outcome[nodeid] = kind
    counts = {k: sum(v == k for v in outcome.values()) for k in ("passed", "failed", "errors", "skipped")}
    failing = [n for n, v in outcome.items() if v in ("failed", "errors")]
    ran = sum(1 for n in outcome if n not in files)
    return {**counts, "total": sum(counts.values()), "failing": failing, "collected": collected,
            "not_run": None if collected is None else max(collected - ran, 0)}


def versions() -> dict[str, str | None]:
    """Installed version of each package of ``PACKAGES`` (None where absent)."""
    out: dict[str, str | None] = {}
    for key, dists in PACKAGES.items():
        out[key] = None
        for dist in dists:
            try:
                out[key] = importlib.metadata.version(dist)
                break
            except importlib.metadata.PackageNotFoundError:
                continue
    return out


def gpu_name() -> str | None:
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None


def git_commit() -> str | None:
    """``MEGASEQ_TREE`` where set (a copied tree whose git metadata is another checkout's names its commit so), else
    HEAD's hash, with ``-dirty`` when tracked files differ from it (None outside a git checkout)."""
    if os.environ.get("MEGASEQ_TREE"):
        return os.environ["MEGASEQ_TREE"]
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True)
        dirty = subprocess.run(["git", "diff", "--quiet", "HEAD"], cwd=ROOT, capture_output=True).returncode != 0
    except (OSError, subprocess.CalledProcessError):
        return None
    return head.stdout.strip() + ("-dirty" if dirty else "")


def has_xdist() -> bool:
    return importlib.util.find_spec("xdist") is not None


def default_workers() -> str:
    """Two processes where pytest-xdist is installed (the dev extra holds it), else one."""
    return "2" if has_xdist() else "1"


def worker_args(workers: int) -> list[str]:
    """pytest's arguments for ``workers`` xdist processes (none for one); a clear error without pytest-xdist."""
    if workers < 1:
        raise SystemExit(f"gpu_suite: --workers {workers}: give 1 or more processes")
    if workers == 1:
        return []
    if not has_xdist():
        raise SystemExit(f"gpu_suite: --workers {workers} needs pytest-xdist: pip install pytest-xdist "
                         "(or --workers 1)")
    return ["-n", str(workers), "--dist", "loadfile"]


def run_suite(pytest_args: list[str], log_path: Path, time_limit: float | None = None) -> tuple[int | None, float]:
    """pytest over the gpu-marked tests, each outcome written to ``log_path`` as it finishes; its
    exit status (None where it was stopped at ``time_limit`` + ``GRACE_S``) and wall seconds."""
    env = dict(os.environ)
    env.setdefault("MEGASEQ_FLA_AUTOTUNE", "one")
    paths = [str(ROOT / "src"), str(Path(__file__).resolve().parent)]  # megaseq, and the plugin gpu_suite_log
    env["PYTHONPATH"] = os.pathsep.join(paths + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env["MEGASEQ_SUITE_LOG"] = str(log_path)
    start = time.time()
    if time_limit is not None:
        env["MEGASEQ_SUITE_DEADLINE"] = str(start + time_limit)
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu or triton", "tests", "-p", "no:cacheprovider",
           "-p", "gpu_suite_log", "-rfE", "--durations=15", *pytest_args]
    try:
        rc = subprocess.run(cmd, cwd=ROOT, env=env,
                            timeout=None if time_limit is None else time_limit + GRACE_S).returncode
    except subprocess.TimeoutExpired:
        print(f"gpu_suite: pytest stopped {GRACE_S} s past the time limit ({time_limit:.0f} s)", file=sys.stderr)
        rc = None
    return rc, time.time() - start


def record(counts: dict, rc: int | None, wall_s: float, workers: int = 1) -> dict:
    complete = rc is not None and counts.get("not_run") == 0
    return {"command": "make test-gpu", "pytest_exit_status": rc, "complete": complete, **counts,
            "wall_s": round(wall_s, 1), "workers": workers,
            "gpu": gpu_name(), "versions": versions(),
            "fla_autotune": os.environ.get("MEGASEQ_FLA_AUTOTUNE", "one"),
            "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"), "commit": git_commit()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="where the JSON record goes")
    parser.add_argument("--time-limit", type=float, default=None,
                        help="seconds: no test starts after them; the record counts what ran (complete: false)")
    parser.add_argument("--log", type=Path, default=None,
                        help="keep the per-test log here (a JSON line as each test finishes; default: a temp file)")
    parser.add_argument("--workers", type=int, default=os.environ.get("MEGASEQ_SUITE_WORKERS", default_workers()),
                        help="pytest-xdist processes sharing the GPU (default MEGASEQ_SUITE_WORKERS, else 2 where "
                             "pytest-xdist is installed, else 1)")
    parser.add_argument("--allow-no-gpu", action="store_true",
                        help="run even without CUDA (every test skips; for checking the script itself)")
    args, pytest_args = parser.parse_known_args(argv)
    # xdist's arguments first: a bad --workers is said before anything runs
    pytest_args = worker_args(args.workers) + [a for a in pytest_args if a != "--"]
    if gpu_name() is None and not args.allow_no_gpu:
        print("gpu_suite: no CUDA device is visible; run `make test-gpu` on a GPU machine "
              "(or pass --allow-no-gpu to check the script, every test then skips)", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        log_path = args.log or Path(tmp) / "gpu_suite.jsonl"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        log_path.unlink(missing_ok=True)
        rc, wall_s = run_suite(pytest_args, log_path, args.time_limit)
        counts = log_counts(log_path)
    if counts["collected"] is None:
        print(f"gpu_suite: pytest collected nothing it could run (exit status {rc})", file=sys.stderr)
        return rc or 1
    out = record(counts, rc, wall_s, args.workers)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    cut = "" if out["complete"] else f", {out['not_run']} not run (time limit)"
    print(f"gpu_suite: {out['passed']} passed, {out['failed']} failed, {out['errors']} errors, "
          f"{out['skipped']} skipped{cut} in {out['wall_s']} s on {out['gpu']}; wrote {args.out}")
    return 1 if rc is None else (rc or (0 if out["complete"] else 1))


if __name__ == "__main__":
    sys.exit(main())
