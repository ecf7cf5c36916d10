"""Bounded polling for tests: wait for a condition, never sleep a fixed time and hope."""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_until(predicate: Callable[[], object], timeout_s: float = 10.0, interval_s: float = 0.01) -> bool:
    """Poll `predicate` until it is truthy or `timeout_s` passed; its last answer, as a bool
    (so `assert wait_until(...)` fails with the condition still false, not a timeout error)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return bool(predicate())


def wait_for(predicate: Callable[[], object], timeout_s: float, what: str, interval_s: float = 0.05):
    """Poll `predicate` until it returns something truthy, and return that; after
    `timeout_s`, fail the test naming `what` was awaited."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(interval_s)
