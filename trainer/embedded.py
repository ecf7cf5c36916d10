"""The embedded collector: a child process the launcher starts for one run.

The trainer does not import the collector (DESIGN.md: the trainer knows the
agent and nothing else); it starts `python -m collector serve` as a separate
process on a loopback port, waits for `/healthz`, and stops it with SIGTERM,
which drains the collector's write queue and closes the DuckDB file cleanly.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from trainer.launch import free_port

START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 30.0


class EmbeddedCollector:
    def __init__(self, *, db_path: Path, token: str, log_path: Path, host: str = "127.0.0.1") -> None:
        self.db_path = Path(db_path)
        self.token = token
        self.log_path = Path(log_path)
        self.host = host
        self.port = 0
        self.proc: subprocess.Popen | None = None
        self.token_path = self.db_path.with_name("collector.token")

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> None:
        self.port = free_port(self.host)
        fd = os.open(self.token_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(self.token + "\n")
        env = dict(os.environ, LLMWATCH_TOKEN=self.token, OMP_NUM_THREADS="1")
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            # it shares the trainer's CPUs: one DuckDB thread is plenty for one run
            [sys.executable, "-m", "collector", "serve", "--db", str(self.db_path), "--host", self.host,
             "--port", str(self.port), "--duckdb-threads", "1"],
            stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
        )
        log.close()
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"embedded collector exited with {self.proc.returncode}; see {self.log_path}:\n"
                                   + self._log_tail())
            try:
                with urllib.request.urlopen(f"{self.url}/healthz", timeout=1.0) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"embedded collector did not answer within {START_TIMEOUT_S:.0f} s; see {self.log_path}")

    def _log_tail(self, num_bytes: int = 2000) -> str:
        try:
            return self.log_path.read_bytes()[-num_bytes:].decode(errors="replace")
        except OSError:
            return ""

    def wait_interrupted(self) -> None:
        try:
            while self.proc is not None and self.proc.poll() is None:
                time.sleep(0.5)
        except KeyboardInterrupt:
            pass

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
