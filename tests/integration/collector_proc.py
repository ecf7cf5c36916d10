"""Start and stop a real collector process on a loopback port for a test."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from trainer.launch import free_port

ROOT = Path(__file__).resolve().parents[2]


class CollectorProc:
    def __init__(self, db: Path, *, token: str = "test-token", port: int | None = None) -> None:
        self.db = Path(db)
        self.token = token
        self.port = port or free_port()
        self.proc: subprocess.Popen | None = None
        self.log = self.db.with_suffix(".log")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 60.0) -> "CollectorProc":
        env = dict(os.environ, LLMWATCH_TOKEN=self.token, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "collector", "serve", "--db", str(self.db), "--host", "127.0.0.1",
                 "--port", str(self.port)], stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.log.read_text()[-3000:]
            try:
                with urllib.request.urlopen(self.url + "/healthz", timeout=1) as r:
                    if r.status == 200:
                        return self
            except OSError:
                time.sleep(0.1)
        raise TimeoutError(f"collector did not start: {self.log.read_text()[-3000:]}")

    def kill(self) -> None:
        """SIGKILL: no chance to flush or close anything."""
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self) -> "CollectorProc":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
