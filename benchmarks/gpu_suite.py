"""The whole GPU test suite in one run, and its record: ``make test-gpu``.

Runs ``pytest -m "gpu or triton" tests`` once (every gpu-marked test of every file, and every test of a Triton
kernel, which runs on the GPU where there is one: a failure anywhere is seen), reads
the junit XML pytest writes, and records in ``benchmarks/results/gpu_suite/latest.json``: the passed, failed,
errored and skipped counts, the failing test ids, the GPU, the versions of torch, Triton, transformers, fla
and Liger, the date and the git commit. Exits with pytest's status, so a red suite fails the make target.

Autotuned Triton kernels (fla's and megaseq's) run on one config each (``MEGASEQ_FLA_AUTOTUNE=one``, unless
set otherwise): the suite checks numerics, not speed, and stays within minutes on a warm cache.

    python benchmarks/gpu_suite.py [--out benchmarks/results/gpu_suite/latest.json] [-- extra pytest args]
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.metadata
import json
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "gpu_suite" / "latest.json"
# distribution names whose versions the record carries (first installed name of each tuple)
PACKAGES = {"torch": ("torch",), "triton": ("triton",), "transformers": ("transformers",),
            "fla": ("fla-core", "flash-linear-attention"), "liger": ("liger-kernel", "liger-kernel-nightly")}


def junit_counts(xml_path: Path) -> dict:
    """Passed, failed, errors, skipped and total counts and the failing test ids of a pytest junit XML."""
    root = ET.parse(xml_path).getroot()
    cases = root.iter("testcase")
    counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    failing: list[str] = []
    for case in cases:
        kinds = {child.tag for child in case}
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        if "failure" in kinds:
            counts["failed"] += 1
            failing.append(name)
        elif "error" in kinds:
            counts["errors"] += 1
            failing.append(name)
        elif "skipped" in kinds:
            counts["skipped"] += 1
        else:
            counts["passed"] += 1
    return {**counts, "total": sum(counts.values()), "failing": failing}


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


def run_suite(pytest_args: list[str], xml_path: Path) -> tuple[int, float]:
    """pytest over the gpu-marked tests, writing ``xml_path``; its exit status and wall seconds."""
    env = dict(os.environ)
    env.setdefault("MEGASEQ_FLA_AUTOTUNE", "one")
    src = str(ROOT / "src")
    env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu or triton", "tests", "-p", "no:cacheprovider", "-rfE",
           "--durations=15", f"--junitxml={xml_path}", *pytest_args]
    start = dt.datetime.now(dt.timezone.utc)
    rc = subprocess.run(cmd, cwd=ROOT, env=env).returncode
    return rc, (dt.datetime.now(dt.timezone.utc) - start).total_seconds()


def record(counts: dict, rc: int, wall_s: float) -> dict:
    return {"command": "make test-gpu", "pytest_exit_status": rc, **counts, "wall_s": round(wall_s, 1),
            "gpu": gpu_name(), "versions": versions(),
            "fla_autotune": os.environ.get("MEGASEQ_FLA_AUTOTUNE", "one"),
            "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"), "commit": git_commit()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="where the JSON record goes")
    parser.add_argument("--allow-no-gpu", action="store_true",
                        help="run even without CUDA (every test skips; for checking the script itself)")
    args, pytest_args = parser.parse_known_args(argv)
    pytest_args = [a for a in pytest_args if a != "--"]
    if gpu_name() is None and not args.allow_no_gpu:
        print("gpu_suite: no CUDA device is visible; run `make test-gpu` on a GPU machine "
              "(or pass --allow-no-gpu to check the script, every test then skips)", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        xml_path = Path(tmp) / "gpu_suite.xml"
        rc, wall_s = run_suite(pytest_args, xml_path)
        if not xml_path.exists():
            print(f"gpu_suite: pytest wrote no junit XML (exit status {rc})", file=sys.stderr)
            return rc or 1
        out = record(junit_counts(xml_path), rc, wall_s)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(f"gpu_suite: {out['passed']} passed, {out['failed']} failed, {out['errors']} errors, "
          f"{out['skipped']} skipped in {out['wall_s']} s on {out['gpu']}; wrote {args.out}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
