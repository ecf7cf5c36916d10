"""A real `python -m collector serve` process for the integration tests."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[3]
TOKEN = "test-token"


class CollectorProcess:
    """Starts the collector on 127.0.0.1 (port 0 = a free one, read from its banner)."""

    def __init__(self, db_path: Path, *, port: int = 0, token: str | None = TOKEN, args: tuple[str, ...] = (),
                 env: dict[str, str] | None = None, scheme: str = "http") -> None:
        """`token`: one token with every role, passed as $LLMWATCH_TOKEN (None: none; give
        role tokens through `env` or `args`)."""
        self.db_path, self.port, self.token, self.args = db_path, port, token, args
        self.env, self.scheme = env or {}, scheme
        self.proc: subprocess.Popen | None = None
        self.output: list[str] = []

    @property
    def url(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 60.0) -> "CollectorProcess":
        env = {k: v for k, v in os.environ.items() if not k.startswith("LLMWATCH_")}
        env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", **self.env)
        if self.token is not None:
            env["LLMWATCH_TOKEN"] = self.token
        cmd = [sys.executable, "-m", "collector", "serve", "--db", str(self.db_path), "--port", str(self.port),
               *self.args]
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + timeout_s
        for line in self.proc.stdout:
            self.output.append(line)
            m = re.match(r"collector listening on https?://127\.0\.0\.1:(\d+) \(db (.+)\)", line)
            if m:
                self.port = int(m.group(1))
                break
            if time.monotonic() > deadline:
                break
        else:
            raise RuntimeError(f"collector exited: {''.join(self.output)}")
        if not self.port:
            raise RuntimeError(f"collector did not start: {''.join(self.output)}")
        threading.Thread(target=self._drain, daemon=True).start()
        return self

    def _drain(self) -> None:
        for line in self.proc.stdout:
            self.output.append(line)

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 60.0) -> int:
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else 0
        self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise

    def client(self, token: str | None = None) -> httpx.Client:
        token = self.token if token is None else token
        return httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {token}"}, timeout=30.0)

    def _select(self, query: str) -> dict:
        with self.client() as c:
            r = c.post("/v1/sql", json={"sql": query, "max_rows": 1_000_000})
            r.raise_for_status()
            return r.json()

    def sql(self, query: str) -> list[list]:
        return self._select(query)["rows"]

    def records(self, query: str) -> list[dict]:
        """The rows of `query` as {column: value}."""
        got = self._select(query)
        return [dict(zip(got["columns"], row)) for row in got["rows"]]
