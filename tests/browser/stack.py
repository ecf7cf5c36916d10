"""The real processes the browser tests look at: a collector, a trainer run shipping to
it, and dashboards (live on the collector, then postmortem on its file).

    stack = LiveStack(tmp_dir).start()      # collector, dashboard, then the run (not awaited)
    stack.wait_finished()                   # the run ended and the collector says so
    stack.api("/incidents")                 # the collector's answer: the truth pages are held to

The collector has a token file per role (ingest for the ranks, read for the dashboard
and the tests, control unused) and the default policy (auto): the run's loss spike is
rolled back. The trainer is `trainer --telemetry --collector URL`: 4 ranks (dp2 x tp2,
ranks 0, 1 on node0 and 2, 3 on node1), a tiny fp16 model, 80 steps, eval every 20,
checkpoints every 10, and two injected faults: a loss spike at step 40 and rank 3
(node1) computing 3x slower from step 8.

Rules (written beside the DB): the tiny model's lone grad-norm excursions alert no one
(as in tests/e2e/test_healing.py), and a node is never isolated for real, only in
shadow: an isolation's restart would make the run's length depend on when the
straggler verdict lands, on a 2-core machine that a browser is loading too.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from tests.integration.trainer_run import ROOT, TINY
from tests.polling import wait_for
from tests.unit.collector.collector_server import CollectorProcess

RUN_ID = "browser"
NUM_STEPS = 80
SPIKE_STEP = 40
STRAGGLER = {"rank": 3, "node": "node1", "from_step": 8, "factor": 3}
RULES = """\
[grad_spike]
alone_z_threshold = 1000.0

[policy]
isolate_mode = "shadow"
"""
RUN_ARGS = (*TINY, "--precision", "fp16", "--dp", "2", "--tp", "2", "--nodes", "2", "--micro-batches", "2",
            "--steps", str(NUM_STEPS), "--eval-every", "20", "--ckpt-every", "10", "--ckpt-keep", "20",
            "--inject", f"spike@step={SPIKE_STEP}",
            "--inject", "straggler@rank={rank},from={from_step},factor={factor}".format(**STRAGGLER))
RUN_TIMEOUT_S = 150.0


def _env() -> dict[str, str]:
    """This environment without any llmwatch token: every process gets its token from a file."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLMWATCH_")}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    return env


def _stop(proc: subprocess.Popen | None, sig: int = signal.SIGTERM, timeout_s: float = 30.0) -> int | None:
    """Signal a process (its whole session: a trainer's ranks too) and wait; kill it past the timeout."""
    if proc is None:
        return None
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
    return proc.returncode


class Dashboard:
    """`python -m dashboard <source args> --port 0 --url-file F`; its URL once it answers."""

    def __init__(self, root: Path, name: str, *source_args: str) -> None:
        self.root, self.name, self.source_args = Path(root), name, source_args
        self.url_file = self.root / f"{name}.url"
        self.log_path = self.root / f"{name}.log"
        self.proc: subprocess.Popen | None = None
        self.url = ""

    def start(self, timeout_s: float = 60.0) -> "Dashboard":
        self.url_file.unlink(missing_ok=True)
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "dashboard", *self.source_args, "--port", "0",
                                          "--url-file", str(self.url_file)],
                                         cwd=ROOT, env=_env(), stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        self.url = wait_for(self._answers, timeout_s, f"the {self.name} dashboard to answer (log {self.log_path})")
        return self

    def _answers(self) -> str | None:
        if self.proc.poll() is not None:
            raise AssertionError(f"the {self.name} dashboard exited with {self.proc.returncode}:\n{self.log()}")
        text = self.url_file.read_text().strip() if self.url_file.is_file() else ""
        if not text:
            return None
        try:
            ok = httpx.get(text + "healthz", timeout=2.0).status_code == 200
        except httpx.HTTPError:
            return None
        return text.rstrip("/") if ok else None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:] if self.log_path.exists() else ""

    def stop(self) -> int | None:
        return _stop(self.proc)


class LiveStack:
    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.db = self.root / "telemetry.duckdb"
        self.run_dir = self.root / RUN_ID
        self.tokens = {}
        for role in ("ingest", "read", "control"):
            path = self.root / f"{role}.token"
            path.write_text(secrets.token_urlsafe(32) + "\n")
            path.chmod(0o600)
            self.tokens[role] = path
        (self.root / "rules.toml").write_text(RULES)
        self.collector: CollectorProcess | None = None
        self.dashboard: Dashboard | None = None
        self.trainer: subprocess.Popen | None = None
        self.trainer_log = self.root / "trainer.log"
        self._http: httpx.Client | None = None

    # -- start and stop -------------------------------------------------------------------------------
    def start(self) -> "LiveStack":
        args = [a for role, path in self.tokens.items() for a in (f"--{role}-token-file", str(path))]
        self.collector = CollectorProcess(self.db, token=None, args=(
            *args, "--rules", str(self.root / "rules.toml"), "--policy", "auto")).start()
        self._http = httpx.Client(base_url=self.collector.url, timeout=30.0,
                                  headers={"Authorization": f"Bearer {self.tokens['read'].read_text().strip()}"})
        self.dashboard = Dashboard(self.root, "live", "--collector", self.collector.url,
                                   "--token-file", str(self.tokens["read"])).start()
        argv = [sys.executable, "-m", "trainer", "--run-dir", str(self.run_dir), "--run-id", RUN_ID,
                "--metrics-jsonl", str(self.run_dir / "metrics.jsonl"), "--ckpt-dir", str(self.run_dir / "ckpt"),
                *RUN_ARGS, "--telemetry", "--collector", self.collector.url,
                "--token-file", str(self.tokens["ingest"])]
        with open(self.trainer_log, "wb") as log:
            self.trainer = subprocess.Popen(argv, cwd=ROOT, env=_env(), stdout=log, stderr=subprocess.STDOUT,
                                            start_new_session=True)
        return self

    def stop_collector(self) -> int | None:
        """SIGTERM and wait: the collector closes its file, for a postmortem dashboard to open."""
        if self.dashboard is not None:
            self.dashboard.stop()
        if self._http is not None:
            self._http.close()
            self._http = None
        return self.collector.stop() if self.collector is not None else None

    def close(self) -> None:
        _stop(self.trainer, signal.SIGINT)  # the launcher stops its ranks
        self.stop_collector()

    # -- what the collector says ------------------------------------------------------------------------
    def api(self, path: str = "", **params):
        """GET /v1/runs/<run><path> with the read token; None for a 404."""
        r = self._http.get(f"/v1/runs/{RUN_ID}{path}", params=params)
        if r.status_code == 404:
            return None
        r.raise_for_status()
        return r.json()

    def sql(self, query: str) -> list[list]:
        r = self._http.post("/v1/sql", json={"sql": query})
        r.raise_for_status()
        return r.json()["rows"]

    def running(self) -> bool:
        return self.trainer is not None and self.trainer.poll() is None

    def trainer_output(self) -> str:
        return self.trainer_log.read_text(errors="replace")[-4000:] if self.trainer_log.exists() else ""

    def wait_finished(self, timeout_s: float = RUN_TIMEOUT_S) -> dict:
        """The run ended by itself (rc 0) and the collector no longer calls it running."""
        deadline = time.monotonic() + timeout_s
        try:
            rc = self.trainer.wait(max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the run did not end within {timeout_s:.0f} s:\n{self.trainer_output()}") from None
        assert rc == 0, f"trainer exited with {rc}:\n{self.trainer_output()}"

        def finished():
            run = self.api()
            return run if run and run.get("status") != "running" else None
        return wait_for(finished, max(5.0, deadline - time.monotonic()), "the collector to mark the run finished")
