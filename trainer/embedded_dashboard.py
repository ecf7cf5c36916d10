"""The embedded dashboard: the child process `trainer --telemetry` starts next to
its embedded collector, so the run is something to watch in a browser.

Like the embedded collector (trainer/embedded.py), it is a separate process
(`python -m dashboard --collector URL`): the trainer imports neither Dash nor the
collector. It reads the collector with the read token, by the token file's path
(never the token on its command line), binds loopback only, and takes the
configured port, or any free one when that one is taken. It starts beside the
ranks and never holds training up: `wait_ready` runs on a thread of the launcher,
which prints the URL once the dashboard answers. A dashboard that fails is
reported with its log and training goes on.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from trainer.embedded import collector_env, sidecar_nice, stop_process
from trainer.lifeline import sidecar_preexec

HOST = "127.0.0.1"
START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 10.0


def port_free(port: int, host: str = HOST) -> bool:
    if port <= 0:
        return True
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


class EmbeddedDashboard:
    def __init__(self, *, collector_url: str, token_path: Path | None, run_dir: Path, port: int = 8050,
                 refresh_s: float = 2.0) -> None:
        self.collector_url = collector_url
        self.token_path = token_path
        self.url_file = Path(run_dir) / "dashboard.url"
        self.log_path = Path(run_dir) / "dashboard.log"
        self.port = port if port_free(port) else 0
        self.refresh_s = refresh_s
        self.proc: subprocess.Popen | None = None
        self.url: str | None = None

    def argv(self) -> list[str]:
        argv = [sys.executable, "-m", "dashboard", "--collector", self.collector_url, "--host", HOST,
                "--port", str(self.port), "--url-file", str(self.url_file), "--refresh-s", str(self.refresh_s)]
        if self.token_path is not None:
            argv += ["--token-file", str(self.token_path)]
        return argv

    def start(self) -> None:
        self.url_file.unlink(missing_ok=True)
        log = open(self.log_path, "ab")
        try:
            self.proc = subprocess.Popen(self.argv(), stdout=log, stderr=subprocess.STDOUT,
                                         env=self.env(), start_new_session=True,
                                         preexec_fn=sidecar_preexec(sidecar_nice()))
        finally:
            log.close()

    def wait_ready(self, timeout_s: float = START_TIMEOUT_S) -> bool:
        """True once the dashboard answers /healthz at the URL it wrote; False when it
        exited or did not answer in time."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            proc = self.proc
            if proc is None or proc.poll() is not None:
                return False
            if self.url is None and self.url_file.is_file():
                text = self.url_file.read_text().strip()
                self.url = text or None
            if self.url is not None:
                try:
                    with urllib.request.urlopen(self.url + "healthz", timeout=1.0) as r:
                        if r.status == 200:
                            return True
                except (urllib.error.URLError, OSError):
                    pass
            time.sleep(0.1)
        return False

    def announce(self, out=sys.stdout) -> threading.Thread:
        """Print the URL (or why there is none) once known, from a daemon thread."""
        def run() -> None:
            if self.wait_ready():
                print(f"dashboard: {self.url}  (live; open it in a browser)", file=out, flush=True)
            elif self.proc is not None:
                print(f"telemetry: the dashboard did not start; see {self.log_path}", file=out, flush=True)
        t = threading.Thread(target=run, name="dashboard-announce", daemon=True)
        t.start()
        return t

    @staticmethod
    def env() -> dict[str, str]:
        """The launcher's environment without any token variable (the dashboard reads its
        token from the file it is given), as the embedded collector's."""
        return collector_env(os.environ)

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        stop_process(proc, STOP_TIMEOUT_S)
