"""Real runs for the end-to-end scenarios: `trainer --telemetry` (embedded collector), then
what it left behind: the incidents table of `<run dir>/telemetry.duckdb` and the
ground truth in `<run dir>/injections.jsonl`.

Timing facts are asserted in steps (deterministic); seconds are measured by
bench/bench_detection.py, not asserted here (a loaded 2-core box makes them flaky).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import duckdb

from tests.integration.trainer_run import ROOT, TINY, Run, run_trainer

# The detection scenarios watch what is detected and named: the policy is off, so the
# faults stay as injected (no rollback, restart or isolation changes the run under them).
DETECT_ONLY = ("--policy", "off")
E2E_TIMEOUT_S = 150  # one run; the suite's budget is 4 minutes on 2 cores


@dataclass
class Outcome:
    run: Run
    incidents: list[dict] = field(default_factory=list)  # incidents rows, in id order, evidence parsed
    step_end_ts: dict[int, float] = field(default_factory=dict)  # step -> when its last rank reported it
    last_ts: float | None = None  # the newest step row's ts: the run's end as the ranks saw it

    def of(self, kind: str) -> list[dict]:
        return [i for i in self.incidents if i["kind"] == kind]

    def only(self, kind: str) -> dict:
        """The one incident of `kind`; an assertion that prints what the run did otherwise (a
        bare unpacking would say only how many there were)."""
        found = self.of(kind)
        assert len(found) == 1, f"{len(found)} {kind} incident(s), one expected\n{self.report()}"
        return found[0]

    def truths(self, kind: str) -> list[dict]:
        return [t for t in self.run.injections() if t["kind"] == kind]

    def summary(self) -> str:
        return "\n".join(f"{i['kind']} rank={i['rank']} node={i['node']} steps={i['step_from']}-{i['step_to']} "
                         f"status={i['status']} {i['root_cause']}" for i in self.incidents) or "(no incidents)"

    def report(self) -> str:
        """What a failed assertion prints: the incidents and the run's output tails."""
        return (f"rc={self.run.returncode}\nincidents:\n{self.summary()}\n"
                f"stdout tail:\n{self.run.stdout[-2500:]}\nstderr tail:\n{self.run.stderr[-2500:]}")


def read_outcome(run: Run) -> Outcome:
    con = duckdb.connect(str(run.run_dir / "telemetry.duckdb"), read_only=True)
    try:
        cur = con.execute("SELECT * FROM incidents ORDER BY id")
        names = [d[0] for d in cur.description]
        rows = [dict(zip(names, r)) for r in cur.fetchall()]
        ends = dict(con.execute("SELECT step, max(ts) FROM steps GROUP BY step").fetchall())
        last = con.execute("SELECT max(ts) FROM steps").fetchone()[0]
    finally:
        con.close()
    for r in rows:
        if isinstance(r.get("evidence"), str):
            r["evidence"] = json.loads(r["evidence"])
    return Outcome(run=run, incidents=rows, step_end_ts=ends, last_ts=last)


def run_scenario(run_dir: Path, *args: str, env: dict | None = None) -> Outcome:
    """A run that ends by itself (cleanly, or through a crash the launcher handles)."""
    run = run_trainer(run_dir, "--telemetry", *DETECT_ONLY, *args, timeout=E2E_TIMEOUT_S, env=env)
    return read_outcome(run)


def run_until_incident(run_dir: Path, kind: str, *args: str, timeout_s: float = E2E_TIMEOUT_S) -> Outcome:
    """A run that never ends by itself (a hang): start it, watch the launcher's incident
    lines (trainer/incident_feed.py), interrupt it once an incident of `kind` opened, and
    read what it stored. Fails on the timeout rather than waiting forever."""
    run_dir = Path(run_dir)
    argv = [sys.executable, "-m", "trainer", "--run-dir", str(run_dir), "--run-id", run_dir.name,
            "--metrics-jsonl", str(run_dir / "metrics.jsonl"), "--telemetry", *DETECT_ONLY, *TINY, *args]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    seen = threading.Event()
    lines: list[str] = []

    def watch() -> None:
        for line in proc.stdout:
            lines.append(line)
            if line.startswith(f"incident: {kind} "):
                seen.set()

    reader = threading.Thread(target=watch, daemon=True)
    reader.start()
    found = seen.wait(timeout_s)
    proc.send_signal(signal.SIGINT)  # the launcher stops its ranks and the collector, which closes the file
    try:
        _, stderr = proc.communicate(timeout=60)  # past the launcher's own bounds (collector stop: 30 s)
    except subprocess.TimeoutExpired:  # a launcher too slow to stop (a starved host): its whole group goes
        os.killpg(proc.pid, signal.SIGKILL)
        _, stderr = proc.communicate()
        wait_released(run_dir / "telemetry.duckdb")  # the killed collector's lock goes with its process
    reader.join(timeout=5)
    run = Run(proc.returncode, "".join(lines), stderr, run_dir)
    assert found, f"no {kind} incident within {timeout_s} s:\n{run.stdout[-3000:]}\n{stderr[-3000:]}"
    return read_outcome(run)


def wait_released(db: Path, bound_s: float = 30.0) -> None:
    """Polls until no process holds `db`'s lock (a SIGKILLed collector's exit is not
    synchronous with its launcher's), for at most `bound_s`."""
    deadline = time.monotonic() + bound_s
    while True:
        try:
            duckdb.connect(str(db), read_only=True).close()
            return
        except duckdb.IOException:
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.1)



# -- healing scenarios: what the policy did, read from the closed file --------------------------------------


@dataclass
class Healed(Outcome):
    """A healing run: its incidents (as Outcome) and the policy's tables. `query` opens the
    closed file read-only again for anything else."""

    actions: list[dict] = field(default_factory=list)  # actions rows, in id order, detail parsed
    nodes: dict[str, dict] = field(default_factory=dict)  # node -> nodes row
    bad_batches: list[dict] = field(default_factory=list)  # bad_batches rows, in (epoch, sample_from) order

    def query(self, sql: str, *params) -> list[dict]:
        return query_db(self.run.run_dir, sql, *params)

    def actions_of(self, kind: str) -> list[dict]:
        return [a for a in self.actions if a["kind"] == kind]

    def events(self, kind: str) -> list[dict]:
        """The run's events of `kind` in time order, data parsed."""
        rows = self.query("SELECT * FROM events WHERE kind = ? ORDER BY ts", kind)
        for r in rows:
            r["data"] = json.loads(r["data"]) if isinstance(r.get("data"), str) else r.get("data")
        return rows

    def report(self) -> str:
        """What a failed assertion prints: enough to tell from a CI log what happened."""
        acts = "\n".join(f"  #{a['id']} {a['kind']} {a['status']} mode={a['mode']} incident={a['incident_id']} "
                         f"node={a['node']} attempt={a['attempt']} recovery_s={a['recovery_s']} {a['detail']}"
                         for a in self.actions) or "  (none)"
        nodes = ", ".join(f"{n}={r['status']} ({r['reason']})" for n, r in sorted(self.nodes.items()))
        lineage = self.query("SELECT attempt, min(step) AS lo, max(step) AS hi, list(DISTINCT rank ORDER BY rank) AS "
                             "ranks FROM steps GROUP BY attempt ORDER BY attempt")
        return (f"rc={self.run.returncode}\nincidents:\n{self.summary()}\nactions:\n{acts}\nnodes: {nodes}\n"
                f"bad_batches: {self.bad_batches}\nattempts: {lineage}\n"
                f"stdout tail:\n{self.run.stdout[-2500:]}\nstderr tail:\n{self.run.stderr[-2500:]}")


def query_db(run_dir: Path, sql: str, *params) -> list[dict]:
    con = duckdb.connect(str(Path(run_dir) / "telemetry.duckdb"), read_only=True)
    try:
        cur = con.execute(sql, list(params))
        names = [d[0] for d in cur.description]
        return [dict(zip(names, r)) for r in cur.fetchall()]
    finally:
        con.close()


def read_healed(run: Run) -> Healed:
    o = read_outcome(run)
    h = Healed(run=o.run, incidents=o.incidents, step_end_ts=o.step_end_ts, last_ts=o.last_ts)
    h.actions = h.query("SELECT * FROM actions ORDER BY id")
    for a in h.actions:
        if isinstance(a.get("detail"), str):
            a["detail"] = json.loads(a["detail"])
    h.nodes = {r["node"]: r for r in h.query("SELECT * FROM nodes")}
    h.bad_batches = h.query("SELECT * FROM bad_batches ORDER BY epoch, sample_from")
    return h


def run_healing(run_dir: Path, *args: str) -> Healed:
    """A healing scenario: a run that ends by itself (the policy's actions included), then its tables."""
    run = run_trainer(run_dir, "--telemetry", *args, timeout=E2E_TIMEOUT_S)
    return read_healed(run)
