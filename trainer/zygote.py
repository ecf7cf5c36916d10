"""Ranks forked from a warm interpreter: a rank's imports are paid once per job.

A rank's first seconds are imports, not training: torch (2.2 s of CPU on this
project's 2-core CI machine), then torch._dynamo with sympy and inductor, which
`torch.optim.Optimizer.__init__` imports (1.4 s more). Every rank paid them, and
paid them again at every restart: 4 ranks on 2 cores spent 8 s of wall before
the first step, on a job that restarts to heal.

So the embedded launcher starts one zygote (`python -m trainer.zygote`) as it
starts, beside the collector. The zygote imports what a rank imports, makes a
one-parameter optimizer (which pulls in the rest), and waits. Each rank is then
`fork()`ed from it, copy on write, and runs `python -m trainer.worker` as it
would have: its own environment (set in full, the zygote's own dropped), its own
argv, the launcher's stdout and stderr, the lifeline fd the zygote was given.

Why not `multiprocessing`'s forkserver: its children take the server's
environment and only the fds it passes itself, and what the launcher's
supervisor needs is Popen's surface (poll, wait, send_signal, an exit code that
is -N for signal N). `Zygote.spawn` returns that surface (`ForkedRank`).

The parts that make fork safe here:
- the zygote has one thread of ours; it forks from it, before any OpenMP
  parallel region ran, and refuses (falls back) if CUDA was initialized;
- with a GPU build of torch it refuses by default: a CUDA driver initialized in
  the zygote (by anything in torch's imports) would be unusable in every rank.
  `LLMWATCH_ZYGOTE=1` forks there too; `LLMWATCH_ZYGOTE=0` never forks;
- a child drops the zygote's pipes and signal settings before anything else, and
  gets PR_SET_PDEATHSIG from the zygote, which gets it from the launcher: a
  SIGKILLed launcher still takes its ranks with it, as does the lifeline;
- a child never returns into the zygote's loop: it leaves through `exit_now`.

The zygote reaps its children and reports each exit to the launcher (a JSON line
on a pipe), so `ForkedRank.poll()` is what `Popen.poll()` would have said. When
the zygote cannot start (no fork on the platform, a failed import) `spawn` is
Popen, as before, and the job runs the same, only slower to start.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence

from trainer.lifeline import die_with_parent, exit_now

READY_TIMEOUT_S = 120.0  # a zygote still importing after this is given up on: ranks are Popen'd
SPAWN_TIMEOUT_S = 30.0  # one fork's answer
REAP_INTERVAL_S = 0.05  # how often the zygote reaps, between requests
LOST_CODE = -signal.SIGTERM  # a rank's code when its zygote died before reporting it: PDEATHSIG's
MODE_ENV = "LLMWATCH_ZYGOTE"  # "0": every rank a process of its own; "1": a zygote with a GPU build of torch too
PRELOAD = ("trainer.worker",)  # what a rank imports; the optimizer warm-up pulls in torch._dynamo


class ForkedRank:
    """A rank forked by the zygote, with the part of `subprocess.Popen`'s surface the
    supervisor uses. Its exit code comes from the zygote, which reaps it."""

    def __init__(self, zygote: Zygote, pid: int, args: Sequence[str]) -> None:
        self._zygote = zygote
        self.pid = pid
        self.args = list(args)
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._zygote.exit_code(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        code = self._zygote.wait_exit(self.pid, timeout)
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        self.returncode = code
        return code

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # an exit not yet reported: its pid is not reaped, so not reused
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Zygote:
    """The launcher's side: starts the zygote process, asks it for ranks, learns their exits.

    `env`: the zygote's own environment (what the ranks share: no token in it; a rank's
    own environment is set in full at its fork); `pass_fds`: fds the ranks inherit (the
    lifeline's read end); `stderr`: the ranks' (default: the launcher's). Starting is
    asynchronous: the first `spawn` waits for the imports, bounded by READY_TIMEOUT_S."""

    def __init__(self, env: Mapping[str, str], *, pass_fds: Sequence[int] = (),
                 preload: Sequence[str] = PRELOAD, warm_optimizer: bool = True, gpu_build_ok: bool = False,
                 stderr=None) -> None:
        self._cond = threading.Condition()
        self._ready: bool | None = None  # None: importing; False: failed (Popen from now on)
        self._why = ""
        self._spawned: list[int] = []  # pids answered to spawn requests, in order
        self._exits: dict[int, int] = {}
        self._gone = False
        self._lock = threading.Lock()  # one spawn request in flight
        self._proc: subprocess.Popen | None = None
        self._cmd_w = -1
        cmd_r, self._cmd_w = os.pipe()
        rep_r, rep_w = os.pipe()
        argv = [sys.executable, "-m", "trainer.zygote", str(cmd_r), str(rep_w), ",".join(preload),
                "1" if warm_optimizer else "0", "1" if gpu_build_ok else "0"]
        try:
            self._proc = subprocess.Popen(argv, env=dict(env), stdin=subprocess.DEVNULL, stderr=stderr,
                                          pass_fds=(cmd_r, rep_w, *pass_fds), preexec_fn=die_with_parent())
        except OSError as e:
            os.close(rep_r)
            self._fail(f"could not start: {e}")
        finally:
            os.close(cmd_r)
            os.close(rep_w)
        if self._proc is not None:
            self._reader = threading.Thread(target=self._read, args=(rep_r,), name="llmwatch-zygote", daemon=True)
            self._reader.start()

    @property
    def failed(self) -> str:
        """Why ranks are Popen'd instead ("" while the zygote serves)."""
        return self._why

    def _fail(self, why: str) -> None:
        with self._cond:
            if self._ready is not False:
                self._ready, self._why = False, why
            self._cond.notify_all()

    def _read(self, fd: int) -> None:
        with os.fdopen(fd, "r", encoding="utf-8") as f:
            for line in f:
                msg = json.loads(line)
                with self._cond:
                    if "ready" in msg:
                        self._ready = True
                    elif "error" in msg:
                        self._ready, self._why = False, msg["error"]
                    elif "spawned" in msg:
                        self._spawned.append(msg["spawned"])
                    elif "exited" in msg:
                        self._exits[msg["exited"]] = msg["code"]
                    self._cond.notify_all()
        with self._cond:
            self._gone = True
            if self._ready is None:
                self._ready, self._why = False, "exited while importing"
            self._cond.notify_all()

    def wait_ready(self, timeout_s: float = READY_TIMEOUT_S) -> bool:
        with self._cond:
            if not self._cond.wait_for(lambda: self._ready is not None, timeout_s):
                self._ready, self._why = False, f"not ready after {timeout_s:.0f} s"
            return bool(self._ready) and not self._gone

    def spawn(self, argv: Sequence[str], env: Mapping[str, str], *,
              popen_kwargs: Mapping | None = None) -> ForkedRank | subprocess.Popen:
        """A rank running `argv` (`[python, "-m", module, *args]`) with exactly `env`:
        forked from the zygote, or Popen'd (with `popen_kwargs`) when it cannot serve."""
        with self._lock:
            if self.wait_ready():
                pid = self._request(argv, env)
                if pid is not None:
                    return ForkedRank(self, pid, argv)
        return subprocess.Popen(list(argv), env=dict(env), **dict(popen_kwargs or {}))

    def _request(self, argv: Sequence[str], env: Mapping[str, str]) -> int | None:
        if list(argv[:2]) != [sys.executable, "-m"] or len(argv) < 3:
            raise ValueError(f"the zygote runs `python -m MODULE ...`, not {list(argv)!r}")
        msg = json.dumps({"module": argv[2], "argv": list(argv[2:]), "env": dict(env)}) + "\n"
        with self._cond:
            before = len(self._spawned)
        try:
            data = msg.encode()  # an environment can pass the pipe's atomic size: write until all went
            while data:
                data = data[os.write(self._cmd_w, data):]
        except OSError as e:
            self._fail(f"request failed: {e}")
            return None
        with self._cond:
            if not self._cond.wait_for(lambda: len(self._spawned) > before or self._gone, SPAWN_TIMEOUT_S):
                self._ready, self._why = False, f"no answer to a fork in {SPAWN_TIMEOUT_S:.0f} s"
                return None
            return self._spawned[before] if len(self._spawned) > before else None

    def exit_code(self, pid: int) -> int | None:
        with self._cond:
            if pid in self._exits:
                return self._exits[pid]
            if self._gone and not _alive(pid):  # the zygote died and took its report with it
                return LOST_CODE
            return None

    def wait_exit(self, pid: int, timeout: float | None) -> int | None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            code = self.exit_code(pid)
            if code is not None:
                return code
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return None
            with self._cond:
                self._cond.wait(0.1 if left is None else min(left, 0.1))

    def close(self, timeout_s: float = 5.0) -> None:
        """Ends the zygote (its ranks are the supervisor's to have stopped first). Idempotent."""
        if self._cmd_w >= 0:
            try:
                os.close(self._cmd_w)  # EOF: the zygote leaves its loop
            except OSError:
                pass
            self._cmd_w = -1
        if self._proc is not None:
            try:
                self._proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# -- the zygote process ----------------------------------------------------------------------------


def _warm(preload: Sequence[str], warm_optimizer: bool, gpu_build_ok: bool) -> None:
    import importlib

    for name in preload:
        importlib.import_module(name)
    torch_mod = sys.modules.get("torch")
    if torch_mod is not None and not gpu_build_ok and (torch_mod.version.cuda or torch_mod.version.hip):
        # A CUDA driver initialized before a fork cannot be used after it, and what in torch
        # initializes it (an availability check on import) is not ours to audit: a GPU build
        # gets plain processes unless LLMWATCH_ZYGOTE=1 asks otherwise.
        raise RuntimeError("a GPU build of torch: LLMWATCH_ZYGOTE=1 forks its ranks too")
    if warm_optimizer:
        import torch

        # torch.optim's constructor imports torch._dynamo (sympy, inductor) and loads its
        # trace rules on first use: a one-element CPU tensor, no parallel region, no thread pool
        torch.optim.AdamW([torch.zeros(1, requires_grad=True)])
    if torch_mod is not None and torch_mod.cuda.is_initialized():
        raise RuntimeError("CUDA was initialized while preloading: forking from here is unsafe")


def _child(request: dict, fds: Sequence[int], pdeath) -> None:
    """In the forked child: become the rank, then leave. Never returns."""
    code = 1
    try:
        for fd in fds:
            os.close(fd)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        if pdeath is not None:
            pdeath()  # PDEATHSIG from the zygote, which has it from the launcher
        import setproctitle

        # ps, top and /proc/PID/cmdline show what the rank runs, not the zygote it came from
        # (first: it finds the room for the title next to the environment it inherited)
        setproctitle.setproctitle(" ".join([sys.executable, "-m", request["module"], *request["argv"][1:]]))
        os.environ.clear()
        os.environ.update(request["env"])
        import runpy
        import warnings

        sys.argv = list(request["argv"])
        with warnings.catch_warnings():
            # the module is preloaded, by design: `python -m` of it runs its code again as __main__
            warnings.filterwarnings("ignore", message=".*found in sys.modules", category=RuntimeWarning)
            runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, int) and e.code is not None:
            print(e.code, file=sys.stderr)
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        exit_now(code)


def serve(cmd_fd: int, report_fd: int, preload: Sequence[str], warm_optimizer: bool, gpu_build_ok: bool) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is for the launcher and the ranks

    def report(msg: dict) -> None:
        os.write(report_fd, (json.dumps(msg) + "\n").encode())

    try:
        _warm(preload, warm_optimizer, gpu_build_ok)
    except BaseException as e:  # noqa: BLE001 - any failure here means: Popen the ranks
        report({"error": f"preload failed: {type(e).__name__}: {e}"})
        return 1
    report({"ready": True})
    pdeath = die_with_parent()  # made here: it checks that the child's parent is this process
    pending = b""
    children: set[int] = set()
    while True:
        readable, _, _ = select.select([cmd_fd], [], [], REAP_INTERVAL_S)
        _reap(children, report)
        if not readable:
            continue
        chunk = os.read(cmd_fd, 1 << 16)
        if not chunk:  # the launcher closed its end, or died
            break
        pending += chunk
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            request = json.loads(line)
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                _child(request, (cmd_fd, report_fd), pdeath)
            children.add(pid)
            report({"spawned": pid})
    deadline = time.monotonic() + 10.0  # the launcher stopped its ranks before closing: report them
    while children and time.monotonic() < deadline:
        _reap(children, report)
        time.sleep(REAP_INTERVAL_S)
    return 0


def _reap(children: set[int], report) -> None:
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            children.clear()
            return
        if pid == 0:
            return
        children.discard(pid)
        report({"exited": pid, "code": os.waitstatus_to_exitcode(status)})


def main(argv: Sequence[str]) -> int:
    cmd_fd, report_fd, preload = int(argv[0]), int(argv[1]), [m for m in argv[2].split(",") if m]
    try:
        return serve(cmd_fd, report_fd, preload, argv[3] == "1", argv[4] == "1")
    except BrokenPipeError:  # the launcher is gone
        return 0


if __name__ == "__main__":
    exit_now(main(sys.argv[1:]))  # torch's teardown skipped, as in a rank
