"""The embedded collector: a child process the launcher starts for one run.

The trainer does not import the collector (DESIGN.md: the trainer knows the
agent and nothing else); it starts `python -m collector serve` as a separate
process on a loopback port, waits for `/healthz`, and stops it with SIGTERM,
which drains the collector's write queue and closes the DuckDB file cleanly.
If the launcher dies first, the child gets that SIGTERM from the kernel
(`trainer.lifeline.die_with_parent`). `LLMWATCH_SIDECAR_NICE` runs it, and the
embedded dashboard, that much lower than the ranks (by default at their priority):
both share the ranks' cores.

Tokens: the collector accepts tokens by role (ingest for the ranks, read for
dashboards and SQL, control for commands). By default this makes one of each,
writes them to `<run dir>/tokens/{ingest,read,control}` (the directory 0700,
the files 0600) and hands the collector only the paths: no token is in its
command line (readable by any user in /proc) or its environment. The ranks get
the ingest token alone, so a rank (or whoever reads its environment) cannot
read the run's data or stop it. When the user gave one token, it is written to
`<run dir>/tokens/token` and serves every role, as a single-user quick start.

Alerts: `--rules`, `--webhook` and `--alertmanager` are handed on as flags; the
webhook secret (from the launcher's $LLMWATCH_WEBHOOK_SECRET, where `trainer`
put it) is written to `<run dir>/tokens/webhook-secret` (0600) and the collector
gets its path, never the secret (the variable is kept out of its environment and
out of every rank's).
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from trainer.launch import free_port
from trainer.lifeline import sidecar_preexec
from trainer.private import COLLECTOR_TOKEN_ENVS, WEBHOOK_SECRET_ENV, private_dir, write_secret

START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 30.0
ROLES = ("ingest", "read", "control")
ALL_ROLES_FILE = "token"  # the user's one token, every role
WEBHOOK_SECRET_FILE = "webhook-secret"
# the collector and dashboard beside the ranks: at their priority unless asked (see `sidecar_preexec`). Below
# them (10), telemetry costs less in steady state on CPU-bound ranks (1.005 against 0.945 on/off), but detection
# then trails those ranks by more steps (a 1.5x straggler named at 13 steps against a 10-step bound, CI)
SIDECAR_NICE = 0


def write_tokens(tokens_dir: Path, *, token: str | None) -> tuple[str, dict[str, Path]]:
    """Write the collector's token files; returns (the ranks' token, {role: path}),
    with role "all" for the user's one token. Files of the other scheme, left by an
    earlier run in the same directory, are removed: a secret nothing reads."""
    tokens_dir = private_dir(tokens_dir)
    if token:
        paths = {"all": write_secret(tokens_dir / ALL_ROLES_FILE, token)}
        stale = ROLES
        rank_token = token
    else:
        generated = {role: secrets.token_urlsafe(32) for role in ROLES}
        paths = {role: write_secret(tokens_dir / role, t) for role, t in generated.items()}
        stale = (ALL_ROLES_FILE,)
        rank_token = generated["ingest"]
    for name in stale:
        (tokens_dir / name).unlink(missing_ok=True)
    return rank_token, paths


def write_webhook_secret(tokens_dir: Path, secret: str | None) -> Path | None:
    """The webhook secret's 0600 file (None, and an old file removed, without one)."""
    path = private_dir(tokens_dir) / WEBHOOK_SECRET_FILE
    if not secret:
        path.unlink(missing_ok=True)
        return None
    return write_secret(path, secret)


def collector_argv(*, db_path: Path, host: str, port: int, token_paths: Mapping[str, Path],
                   rules: str | None = None, webhooks: Sequence[str] = (), alertmanagers: Sequence[str] = (),
                   webhook_secret_path: Path | None = None, policy: str | None = None,
                   min_nodes: int | None = None, archive: str | None = None) -> list[str]:
    """`python -m collector serve ...` with token and secret *files* only."""
    argv = [sys.executable, "-m", "collector", "serve", "--db", str(db_path), "--host", host, "--port", str(port),
            "--duckdb-threads", "1"]  # it shares the trainer's CPUs: one DuckDB thread is plenty for one run
    for role, path in token_paths.items():
        argv += ["--token-file" if role == "all" else f"--{role}-token-file", str(path)]
    if rules:
        argv += ["--rules", str(Path(rules).resolve())]
    for url in webhooks:
        argv += ["--webhook", url]
    for url in alertmanagers:
        argv += ["--alertmanager", url]
    if webhook_secret_path is not None:
        argv += ["--webhook-secret-file", str(webhook_secret_path)]
    if policy:
        argv += ["--policy", policy]
    if min_nodes is not None:
        argv += ["--min-nodes", str(min_nodes)]
    if archive:
        argv += ["--archive", str(Path(archive).resolve())]
    return argv


def sidecar_nice(environ: Mapping[str, str] = os.environ) -> int:
    """How much lower than the ranks the embedded collector and dashboard run:
    `LLMWATCH_SIDECAR_NICE` (0 to 19), by default `SIDECAR_NICE`."""
    text = environ.get("LLMWATCH_SIDECAR_NICE", "").strip()
    if not text:
        return SIDECAR_NICE
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"LLMWATCH_SIDECAR_NICE must be an integer from 0 to 19, not {text!r}") from None
    if not 0 <= value <= 19:
        raise ValueError(f"LLMWATCH_SIDECAR_NICE must be from 0 to 19, not {value}")
    return value


def collector_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The launcher's environment without any token variable: the collector would
    add those to the tokens it accepts. One thread for OpenMP and (unless the user
    set it) for polars: the embedded collector and dashboard share the ranks' cores,
    and a detection pass of a small job costs 20% less CPU without polars' pool
    (12.1 against 15.2 ms, `bench/bench_detection_cost.py --dp 4 --tp 2 --pp 1`)."""
    env = {k: v for k, v in environ.items() if k not in COLLECTOR_TOKEN_ENVS}
    env["OMP_NUM_THREADS"] = "1"
    env.setdefault("POLARS_MAX_THREADS", "1")
    return env


class EmbeddedCollector:
    def __init__(self, *, db_path: Path, tokens_dir: Path, log_path: Path, token: str | None = None,
                 host: str = "127.0.0.1", rules: str | None = None, alerts: Any = None,
                 policy: str | None = None, min_nodes: int | None = None, archive: str | None = None,
                 environ: Mapping[str, str] = os.environ) -> None:
        """`token`: the user's one token (every role); None: one generated per role.
        `rules`: a detection rules file; `alerts`: the receivers (`config.AlertReceivers`);
        the webhook secret comes from `environ[LLMWATCH_WEBHOOK_SECRET]`."""
        self.rules = rules
        self.policy = policy
        self.min_nodes = min_nodes
        self.archive = archive
        self.webhooks = tuple(getattr(alerts, "webhooks", ()))
        self.alertmanagers = tuple(getattr(alerts, "alertmanagers", ()))
        self._environ = environ
        self.db_path = Path(db_path)
        self.tokens_dir = Path(tokens_dir)
        self.log_path = Path(log_path)
        self.host = host
        self.port = 0
        self.proc: subprocess.Popen | None = None
        self._user_token = token
        self.rank_token: str | None = None  # what the ranks send: the ingest token (or the user's)
        self.token_paths: dict[str, Path] = {}

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> None:
        nice = sidecar_nice(self._environ)  # a bad value is refused before anything is written
        self.port = free_port(self.host)
        self.rank_token, self.token_paths = write_tokens(self.tokens_dir, token=self._user_token)
        secret_path = write_webhook_secret(self.tokens_dir, self._environ.get(WEBHOOK_SECRET_ENV)
                                           if self.webhooks else None)
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            collector_argv(db_path=self.db_path, host=self.host, port=self.port, token_paths=self.token_paths,
                           rules=self.rules, webhooks=self.webhooks, alertmanagers=self.alertmanagers,
                           webhook_secret_path=secret_path, policy=self.policy, min_nodes=self.min_nodes,
                           archive=self.archive),
            stdout=log, stderr=subprocess.STDOUT, env=collector_env(os.environ),
            # its own session: a Ctrl-C in the terminal reaches the ranks, and the launcher
            # stops the collector after they flushed; PDEATHSIG: it dies with the launcher
            start_new_session=True, preexec_fn=sidecar_preexec(nice),
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

    def describe_tokens(self) -> list[str]:
        """Where the tokens are, for the user (paths only, never a token)."""
        if "all" in self.token_paths:
            return [f"your token (every role) in {self.token_paths['all']}"]
        uses = {"read": "dashboard, SQL, /metrics", "control": "commands", "ingest": "the ranks"}
        return [f"{role} token in {self.token_paths[role]}  ({uses[role]})" for role in ("read", "control", "ingest")]

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
        stop_process(proc, STOP_TIMEOUT_S)


def stop_process(proc: subprocess.Popen | None, timeout_s: float) -> None:
    """SIGTERM a child that is still running (it drains and closes its files), and
    SIGKILL it past `timeout_s`."""
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
