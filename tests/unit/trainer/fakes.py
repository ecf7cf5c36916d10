"""Stand-ins for the supervisor's rank processes and its clock (trainer/supervisor.py)."""

from __future__ import annotations

import signal


class FakeProc:
    """A rank: exits with `code` after `polls` polls (never, with None), or when
    signalled (143, as the worker does)."""

    def __init__(self, code: int | None, polls: int = 1) -> None:
        self.code, self.polls, self.returncode, self.signals = code, polls, None, []

    def poll(self):
        if self.returncode is None and self.code is not None:
            self.polls -= 1
            if self.polls <= 0:
                self.returncode = self.code
        return self.returncode

    def send_signal(self, sig) -> None:
        self.signals.append(sig)
        self.returncode = 143

    def wait(self, timeout=None):
        return self.returncode

    def kill(self) -> None:
        self.returncode = -signal.SIGKILL


class FakeClock:
    """Stands in for the `time` module in trainer.supervisor: sleep() advances monotonic()
    and time(), so the watch loop's waits cost no real time."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.slept = 0.0

    def monotonic(self) -> float:
        return self.now

    def time(self) -> float:
        return 1.7e9 + self.now

    def sleep(self, s: float) -> None:
        self.now += s
        self.slept += s
