"""Liger Kernel's optional backends, probed quietly.

Liger Kernel (0.8.5) dispatches some of its ops (its RoPE, which op ``rope``'s fast set and the bench's peer run)
through a backend registry. On an op's first call in a process, the registry imports every backend it knows (CuTe
DSL, Ascend), and logs a warning, with advice to install packages, for each one that cannot load. Its Triton
kernels, the ones megaseq runs on NVIDIA GPUs, need none of them, so those warnings ask nothing of a megaseq user.
``quiet_backend_probes`` moves them to megaseq's debug log. An op with no implementation left still raises from
Liger, as before.
"""

from __future__ import annotations

import logging

REGISTRY_LOGGER = "liger_kernel.backends.registry"  # the logger of liger_kernel/backends/registry.py
logger = logging.getLogger(__name__)


class _ProbeFilter(logging.Filter):
    """Drops the registry's "Backend impl '...' for op '...' could not be imported" warnings (logged again at
    debug level here); passes every other record."""

    def filter(self, record: logging.LogRecord) -> bool:
        msg = str(record.msg)
        if record.levelno == logging.WARNING and msg.startswith("Backend impl ") and "could not be imported" in msg:
            logger.debug("Liger Kernel: %s", record.getMessage())
            return False
        return True


def quiet_backend_probes() -> None:
    """Install the filter on Liger's registry logger, once per process (idempotent; Liger need not be installed)."""
    registry = logging.getLogger(REGISTRY_LOGGER)
    if not any(isinstance(f, _ProbeFilter) for f in registry.filters):
        registry.addFilter(_ProbeFilter())
