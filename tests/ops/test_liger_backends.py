"""Liger Kernel's warnings for optional backends it cannot import are moved to megaseq's debug log
(``ops.liger_backends``); every other record of its registry's logger passes."""

from __future__ import annotations

import logging

import pytest

from megaseq.ops import liger_backends

FORMAT = "Backend impl '%s' for op '%s' could not be imported: %s: %s"  # liger_kernel/backends/registry.py


@pytest.fixture
def registry():
    """Liger's registry logger, without megaseq's filter before and after the test."""
    lg = logging.getLogger(liger_backends.REGISTRY_LOGGER)
    saved = list(lg.filters)
    for f in saved:
        lg.removeFilter(f)
    yield lg
    for f in list(lg.filters):
        lg.removeFilter(f)
    for f in saved:
        lg.addFilter(f)


def _probe_failure(lg: logging.Logger) -> None:
    lg.warning(FORMAT, "liger_kernel.ops.backends._cutedsl.rope", "rope", "ImportError",
               "cutedsl backend requires the NVIDIA CUTLASS Python DSL (CuTe DSL)")


def test_probe_warnings_go_to_the_debug_log_and_others_pass(registry, caplog) -> None:
    caplog.set_level(logging.DEBUG)
    caplog.set_level(logging.DEBUG, logger=liger_backends.logger.name)
    _probe_failure(registry)  # without the filter: the user sees it (what the filter is for)
    assert [r.levelno for r in caplog.records if r.name == registry.name] == [logging.WARNING]
    caplog.clear()
    liger_backends.quiet_backend_probes()
    liger_backends.quiet_backend_probes()
    assert sum(isinstance(f, liger_backends._ProbeFilter) for f in registry.filters) == 1
    _probe_failure(registry)
    registry.warning("No backend for op '%s' on device '%s'", "rope", "cuda")
    registry.error(FORMAT, "p", "rope", "ImportError", "x")  # an error is never dropped
    kept = [(r.name, r.levelno, r.getMessage()) for r in caplog.records]
    assert (registry.name, logging.WARNING, "No backend for op 'rope' on device 'cuda'") in kept
    assert [lv for n, lv, _ in kept if n == registry.name] == [logging.WARNING, logging.ERROR]
    debug = [m for n, lv, m in kept if n == liger_backends.logger.name]
    assert len(debug) == 1 and "_cutedsl.rope" in debug[0] and "could not be imported" in debug[0]


INSTALLED = """
import logging
import megaseq.ops.rope.liger  # noqa: F401
from megaseq.ops import liger_backends
registry = logging.getLogger(liger_backends.REGISTRY_LOGGER)
print(sum(isinstance(f, liger_backends._ProbeFilter) for f in registry.filters))
"""


def test_the_rope_op_and_the_peer_install_it(registry) -> None:
    import subprocess
    import sys

    # the rope op's module installs it on import (in a new process: this one imported it long ago)
    out = subprocess.run([sys.executable, "-c", INSTALLED], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "1", out.stderr[-2000:]
    import torch

    from megaseq.bench.peer import apply_liger

    apply_liger(torch.nn.Linear(2, 2))  # off CUDA it applies nothing, and still quiets the probes
    assert any(isinstance(f, liger_backends._ProbeFilter) for f in registry.filters)


REAL = """
import logging, sys
logging.basicConfig(level=logging.WARNING, stream=sys.stdout, format="%(levelname)s %(name)s: %(message)s")
if sys.argv[1] == "quiet":
    import megaseq.ops.rope.liger  # noqa: F401  (its import installs the filter)
from liger_kernel.backends import registry
registry._discover("rope")
print("failed probes:", len(registry.get_discovery_failures()))
"""


def test_with_liger_installed_its_real_probes_are_quiet() -> None:
    """Where liger-kernel is installed (the GPU machine): its registry's own probes of RoPE's backends, in a new
    process, print their warnings without the filter and none with it."""
    import subprocess
    import sys

    registry = pytest.importorskip("liger_kernel.backends.registry")
    if not hasattr(registry, "_discover") or not hasattr(registry, "get_discovery_failures"):
        pytest.skip("this liger-kernel's registry has another shape")
    runs = {how: subprocess.run([sys.executable, "-c", REAL, how], capture_output=True, text=True, timeout=300)
            for how in ("loud", "quiet")}
    for how, out in runs.items():
        assert out.returncode == 0, (how, out.stderr[-2000:])
    failed = int(runs["loud"].stdout.rsplit("failed probes:", 1)[1])
    if failed == 0:
        pytest.skip("every backend of RoPE imports here: nothing to quiet")
    assert runs["loud"].stdout.count("could not be imported") == failed
    assert "could not be imported" not in runs["quiet"].stdout + runs["quiet"].stderr
