"""Children die with their launcher.

When the `trainer` launcher is SIGKILLed (the OOM killer, a scheduler's hard
stop), none of its code runs: no `finally`, no `_stop()`. Its children would be
re-parented to init and keep going: the ranks until the process-group timeout
(minutes), the embedded collector for ever, holding the lock on the run's DuckDB
file. Two mechanisms stop that, and the launcher uses both:

- `die_with_parent()` (Linux): `PR_SET_PDEATHSIG(SIGTERM)`, set in the child
  between fork and exec. The kernel sends the signal however the parent dies and
  the child's code need not cooperate, so it also covers the collector, which
  is a program of its own. PDEATHSIG fires when the *thread* that forked the
  child ends: the launcher forks from its main thread, which ends only with it.
- `Lifeline` (everywhere; the only one off Linux): a pipe whose write end only
  the launcher holds and never writes. Each rank has the read end and a daemon
  thread blocked on it (`watch_lifeline`); the kernel closes the write end when
  the launcher dies, the read returns EOF, and the thread sends its own process
  SIGTERM. It also does what PDEATHSIG cannot: if the rank is still alive a grace
  period later (its main thread stuck in a C call, where a Python signal handler
  never gets to run), it exits the process hard. That escalation used to be the
  launcher's (`_stop`: SIGTERM, then SIGKILL), and it died with the launcher.

SIGTERM then does what it always does: a rank unwinds through its `finally`
blocks (the agent flushes, or spools what it cannot send), and the collector
drains its write queue and checkpoints the DuckDB file before it exits.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Mapping

LIFELINE_ENV = "LLMWATCH_LIFELINE_FD"
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
ORPHAN_EXIT_CODE = 143  # what SIGTERM's own exit would report (128 + 15)


def die_with_parent(sig: int = signal.SIGTERM) -> Callable[[], None] | None:
    """A `preexec_fn` that makes the child get `sig` when this process dies, or
    None where the platform has no PR_SET_PDEATHSIG (the lifeline still works).

    prctl is looked up here, in the parent: between fork and exec the child should
    do as little as it can. The child checks its parent afterwards because the
    launcher may have died before prctl ran: then no signal would ever come."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    launcher_pid = os.getpid()

    def preexec() -> None:
        prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
        if os.getppid() != launcher_pid:
            os._exit(ORPHAN_EXIT_CODE)

    return preexec


def sidecar_preexec(nice: int) -> Callable[[], None] | None:
    """`die_with_parent()`'s `preexec_fn` that also lowers the child's priority by `nice`
    (0: as the launcher's): for the embedded collector and dashboard, which share the
    ranks' cores. The scheduler then gives a rank that wakes up (a collective completed)
    the core at once, and what the sidecar needs (a few percent of a core) it still gets.

    A child started in a session of its own (`start_new_session`) is also in a scheduling
    autogroup of its own where the kernel has them (`/proc/sys/kernel/sched_autogroup_enabled`),
    and a process's nice then only ranks it within its group: the group's nice is what
    ranks it against the ranks', so it is lowered too (`/proc/self/autogroup`), only there:
    a child in the launcher's session shares the launcher's autogroup, the ranks' with it."""
    pdeath = die_with_parent()
    if nice <= 0:
        return pdeath

    def preexec() -> None:
        if pdeath is not None:
            pdeath()
        try:
            os.nice(nice)
        except OSError:  # not permitted here: run at the launcher's priority
            pass
        if os.getsid(0) != os.getpid():  # the launcher's autogroup: the ranks' too, never lowered
            return
        try:
            with open("/proc/self/autogroup", "w") as f:
                f.write(str(nice))
        except OSError:  # no autogroups (or not Linux): the process's nice is all there is
            pass

    return preexec


class Lifeline:
    """The launcher's side: a pipe the children watch for EOF.

    Both ends are close-on-exec (`os.pipe()`), and `Popen` passes only the read
    end (`pass_fds`), so no child holds the write end: the last writer is the
    launcher, and its death is the EOF."""

    def __init__(self) -> None:
        self.read_fd, self._write_fd = os.pipe()

    def env(self) -> dict[str, str]:
        return {LIFELINE_ENV: str(self.read_fd)}

    @property
    def pass_fds(self) -> tuple[int, ...]:
        return (self.read_fd,)

    def close(self) -> None:
        for fd in (self.read_fd, self._write_fd):
            try:
                os.close(fd)
            except OSError:
                pass
        self.read_fd = self._write_fd = -1


def watch_lifeline(environ: Mapping[str, str], *, grace_s: float,
                   kill: Callable[[int, int], None] = os.kill,
                   hard_exit: Callable[[int], None] = os._exit) -> threading.Thread | None:
    """Start the thread that ends this process when the launcher is gone: SIGTERM
    at once, a hard exit `grace_s` later if the SIGTERM did not end it. None when
    no lifeline was passed (under torchrun, which supervises its own workers)."""
    raw = environ.get(LIFELINE_ENV)
    if not raw:
        return None
    fd = int(raw)

    def watch() -> None:
        try:
            while os.read(fd, 64):  # the launcher never writes: only EOF (or an error) ends this
                pass
        except OSError:
            pass
        kill(os.getpid(), signal.SIGTERM)
        time.sleep(grace_s)
        hard_exit(ORPHAN_EXIT_CODE)

    t = threading.Thread(target=watch, name="llmwatch-lifeline", daemon=True)
    t.start()
    return t


def exit_now(code: int) -> None:
    """End a rank's process once its own cleanup ran (the agent closed, the process group
    destroyed, every thread of ours a daemon): the exit handlers run, stdout and stderr are
    flushed, and the interpreter's teardown of torch's modules (~0.6 s of CPU per rank, at
    every end of a job and every restart round) is skipped. Only for a normal return: an
    exception unwinds as usual, traceback and all."""
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)
