"""Children die with their launcher: PDEATHSIG and the lifeline pipe, each on its own."""

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from trainer.lifeline import LIFELINE_ENV, Lifeline, die_with_parent, watch_lifeline

ROOT = Path(__file__).resolve().parents[3]


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except FileNotFoundError:
        return False


def wait_gone(pid: int, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not alive(pid):
            return True
        time.sleep(0.05)
    return False


def launcher(tmp_path, child_code: str, *, pdeathsig: bool, lifeline: bool) -> tuple[subprocess.Popen, int]:
    """A stand-in launcher that starts one child the given way, prints its pid, and sleeps."""
    code = textwrap.dedent(f"""
        import os, subprocess, sys, time
        from trainer.lifeline import Lifeline, die_with_parent
        line = Lifeline()
        env = dict(os.environ, **(line.env() if {lifeline!r} else {{}}))
        child = subprocess.Popen([sys.executable, "-c", {child_code!r}], env=env,
                                 pass_fds=line.pass_fds if {lifeline!r} else (),
                                 preexec_fn=die_with_parent() if {pdeathsig!r} else None)
        print(child.pid, flush=True)
        time.sleep(600)
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONPATH=str(ROOT)))
    return proc, int(proc.stdout.readline())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux")
def test_pdeathsig_alone_ends_a_child_that_ignores_its_parent(tmp_path):
    proc, child = launcher(tmp_path, "import time; time.sleep(600)", pdeathsig=True, lifeline=False)
    try:
        proc.kill()
        proc.wait()
        assert wait_gone(child), "the child outlived its SIGKILLed parent"
    finally:
        if alive(child):
            os.kill(child, signal.SIGKILL)


def test_lifeline_alone_sends_sigterm_and_the_child_unwinds(tmp_path):
    marker = tmp_path / "unwound"
    code = textwrap.dedent(f"""
        import os, sys, time
        from trainer.lifeline import watch_lifeline
        watch_lifeline(os.environ, grace_s=30)
        try:
            time.sleep(600)
        finally:
            open({str(marker)!r}, "w").write("finally ran")
    """)
    code = "import signal, sys; signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))\n" + code
    proc, child = launcher(tmp_path, code, pdeathsig=False, lifeline=True)
    try:
        time.sleep(1.0)  # let the child install its handler and its watcher
        proc.kill()
        proc.wait()
        assert wait_gone(child), "the child outlived its SIGKILLed parent"
        assert marker.read_text() == "finally ran"
    finally:
        if alive(child):
            os.kill(child, signal.SIGKILL)


def test_lifeline_escalates_when_sigterm_does_not_end_the_process():
    line = Lifeline()
    calls = []
    done = threading.Event()

    def hard_exit(code):
        calls.append(("exit", code))
        done.set()

    t = watch_lifeline({LIFELINE_ENV: str(line.read_fd)}, grace_s=0.05,
                       kill=lambda pid, sig: calls.append(("kill", sig)), hard_exit=hard_exit)
    time.sleep(0.1)
    assert calls == []  # the launcher is alive: nothing happens
    os.close(line._write_fd)  # what the kernel does when the launcher dies
    assert done.wait(5)
    assert calls == [("kill", signal.SIGTERM), ("exit", 143)]
    t.join(1)
    os.close(line.read_fd)


def test_no_lifeline_no_thread():
    assert watch_lifeline({}, grace_s=1) is None


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux")
def test_pdeathsig_preexec_is_a_callable_on_linux():
    assert callable(die_with_parent())
