"""How megaseq's log lines reach the user. Library modules log (``logging.getLogger(__name__)``) and never
print; the CLI, and each training process a launch starts, calls ``show_logs``, whose handler writes every line
of the ``megaseq`` loggers as a plain line: to stdout when the record carries ``extra=TO_STDOUT`` (a run's
step lines, ``verify``'s report), else to stderr. It writes to ``sys.stdout`` / ``sys.stderr`` as they are at
each line, so a redirection made later (a test's capture, a forked rank's log file) sees it.
"""

from __future__ import annotations

import logging
import sys

TO_STDOUT = {"stdout": True}  # logging's ``extra``: this line belongs on stdout


class UserLines(logging.Handler):
    """Each record's message alone, on stdout or stderr (``TO_STDOUT``), flushed."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            stream = sys.stdout if getattr(record, "stdout", False) else sys.stderr
            stream.write(self.format(record) + "\n")
            stream.flush()
        except Exception:  # noqa: BLE001  (logging's contract: a failing handler reports, never raises)
            self.handleError(record)


def show_logs(level: int = logging.INFO) -> None:
    """Show the ``megaseq`` loggers' lines from ``level`` up, once per process (calling again changes only the
    level); they do not propagate to the root logger, so a line is never shown twice."""
    logger = logging.getLogger("megaseq")
    if not any(isinstance(h, UserLines) for h in logger.handlers):
        logger.addHandler(UserLines())
    logger.setLevel(level)
    logger.propagate = False
