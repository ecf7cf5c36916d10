"""Stopping a job the tests started, with every process it started: torchrun puts each
worker in a session of its own, so a signal to the launcher's process group never reaches
them, and a SIGKILL to the launcher leaves them running (holding their spools, heartbeating
at a dead collector, taking the next test's cores)."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path


def _started(pid: int) -> str | None:
    """When `pid` started (its /proc stat field 22): a pid and this name one process, not
    a later one that reused the pid."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def descendants(pid: int) -> list[tuple[int, str]]:
    """Every live descendant of `pid`, as (pid, start time) (Linux /proc; none where it
    cannot be read)."""
    out, todo = [], [pid]
    while todo:
        parent = todo.pop()
        for task in Path(f"/proc/{parent}/task").glob("*"):
            try:
                children = [int(c) for c in (task / "children").read_text().split()]
            except (OSError, ValueError):
                continue
            out.extend((c, s) for c in children if (s := _started(c)) is not None)
            todo.extend(children)
    return out


def _kill(procs: list[tuple[int, str]]) -> None:
    for pid, started in procs:
        if _started(pid) == started:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


def stop_tree(proc: subprocess.Popen, timeout_s: float = 30.0) -> int:
    """SIGTERM the job (torchrun then stops its workers itself); past `timeout_s`, SIGKILL it
    and every descendant it still has. The descendants are listed before any signal, so a
    worker orphaned by its launcher's death is still found. Returns the job's exit code."""
    if proc.poll() is not None:
        return proc.returncode
    tree = descendants(proc.pid)
    proc.terminate()
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        tree += descendants(proc.pid)
        proc.kill()
        proc.wait()
    _kill(tree)  # whatever outlived its launcher
    return proc.returncode
