"""Compiling Triton kernels for an H200 (sm_90) without a GPU, for the CPU tests: Triton's interpreter
accepts code the compiler refuses, so each kernel module's test compiles its kernels in a child process
with ``TRITON_INTERPRET`` unset (it must be unset before Triton is imported, and the test process has it).
``interpreter_device`` picks where a kernel test runs: the GPU, or the CPU under that interpreter."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"


def compile_in_child(script: str, timeout: int = 600) -> str:
    """Run ``script`` in a fresh Python without the interpreter; its stdout. Skips where Triton has no ptxas."""
    import triton

    if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists():
        pytest.skip("triton without its bundled ptxas")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(SRC), env.get("PYTHONPATH", "")])
    run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=timeout)
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stdout


def interpreter_device(monkeypatch, module) -> str:
    """cuda when present, else the cpu under Triton's interpreter with ``module.CPU_INTERPRETER`` set for the test
    (skipped if triton was imported without ``TRITON_INTERPRET=1``)."""
    import torch
    import triton

    if torch.cuda.is_available():
        return "cuda"
    if os.environ.get("TRITON_INTERPRET") != "1" or not triton.knobs.runtime.interpret:
        pytest.skip("triton was imported before TRITON_INTERPRET=1 was set")
    monkeypatch.setattr(module, "CPU_INTERPRETER", True)
    return "cpu"


def broken_helper_fails(monkeypatch, kernels, broken: tuple[str, object], check) -> None:
    """``check()`` passes with the kernel module ``kernels`` as it is and raises AssertionError with one of its
    ``@triton.jit`` helpers replaced (``broken``: the helper's name and a broken variant). Under the interpreter
    only, which reads the helpers at run time."""
    check()
    monkeypatch.setattr(kernels, *broken)
    with pytest.raises(AssertionError):
        check()
