"""Native names for the collector's threads.

Python 3.11 names a thread inside Python only: `top -H`, `ps -L -o tid,comm,pcpu` and
`/proc/<pid>/task/<tid>/comm` show every one of them as `python`. Each long-lived
thread of the collector names itself when it starts, so an operator (or
bench/bench_trainer.py, which splits the embedded collector's CPU by thread) sees
which one spends it:

    lw-writer      the one writer (collector/store/writer.py)
    lw-detection   the detectors' passes (collector/live/detection.py)
    lw-policy      the healing policy (collector/live/policy.py)
    lw-sql         the read-only SQL slots (collector/sql/slots.py)
    lw-alerts      alert delivery, one per receiver (collector/alerts/delivery.py)
    lw-rollup      retention's rollup (collector/offline/retention.py)

The main thread (the HTTP server's event loop) keeps the process's name; the
ASGI thread pool's workers (read routes) stay `python`.
"""

from __future__ import annotations

import ctypes
import sys

_PR_SET_NAME = 15  # linux/prctl.h
_NAME_MAX = 15  # bytes the kernel keeps, less the terminating NUL
_prctl = None


def name_native(name: str) -> None:
    """Give the calling OS thread `name` (cut to 15 bytes). Not Linux, or no libc: nothing."""
    global _prctl
    if not sys.platform.startswith("linux"):
        return
    try:
        if _prctl is None:
            _prctl = ctypes.CDLL(None, use_errno=True).prctl
        _prctl(_PR_SET_NAME, ctypes.c_char_p(name.encode()[:_NAME_MAX]), 0, 0, 0)
    except (OSError, AttributeError):  # a libc without prctl: names are a convenience
        return
