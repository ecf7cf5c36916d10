"""Runs of jobs we did not write (tests/integration/loops/), watched by llmwatch, against a
real collector: `llmwatch-instrument -- torchrun ... loop.py` (zero code), the loop's own
`watch()` call ($LOOP_WATCH=1), or the framework callbacks. The harness injects the faults
($LOOP_FAULTS, loops/faults.py); the collector never sees them.

A run that ends by itself is read after its collector stopped (stopping drains the
detection of every committed row, so "no incident" is a fact, not a wait). A hang is
watched live: the job is stopped once the collector holds what the test needs (`stop_when`:
the incident, and the rows sent before the hang, which may still be on their way from a
spool), or at a bound. Each run spools under its own directory ($TMPDIR), and a stopped
run leaves no process behind (tests/procs.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import duckdb

from tests.procs import stop_tree
from tests.unit.collector.collector_server import CollectorProcess
from trainer.launch import free_port

ROOT = Path(__file__).resolve().parents[2]
LOOPS = Path(__file__).resolve().parent / "loops"
BIN = Path(sys.executable).parent
RUN_TIMEOUT_S = 240.0

# how each loop is watched: the instrumented ones under llmwatch-instrument, the others
# by their own code (LOOP_WATCH=1: one watch() call; the framework callbacks)
LOOP_SCRIPTS = {"ddp": "ddp_gpt.py", "ddp_watch": "ddp_gpt.py", "fsdp2": "fsdp2_gpt.py", "hf": "hf_gpt2.py",
                "lightning": "lightning_gpt.py"}
INSTRUMENTED = {"ddp", "fsdp2"}


def hang_seen(rank: int, last_step: int) -> str:
    """`stop_when` for a hang run: the hang incident is open, and `rank`'s `last_step` (the
    last it finished) is stored."""
    return ("SELECT (SELECT count(*) FROM incidents WHERE run_id = '{run_id}' AND kind = 'hang') > 0"
            f" AND (SELECT count(*) FROM steps WHERE run_id = '{{run_id}}' AND rank = {rank}"
            f" AND step = {last_step}) > 0")


@dataclass
class ForeignRun:
    loop: str
    run_id: str
    returncode: int | None
    output: str
    incidents: list[dict] = field(default_factory=list)
    actions: list[dict] = field(default_factory=list)
    steps: dict[int, float] = field(default_factory=dict)  # step -> when its last rank reported it
    num_steps_rows: int = 0
    num_collectives: int = 0
    config: dict = field(default_factory=dict)

    def of(self, kind: str) -> list[dict]:
        return [i for i in self.incidents if i["kind"] == kind]

    def summary(self) -> str:
        return "\n".join(f"{i['kind']} rank={i['rank']} steps={i['step_from']}-{i['step_to']} {i['root_cause']}"
                         for i in self.incidents) or "(no incidents)"


def _command(loop: str, nproc: int, run_id: str, col: CollectorProcess) -> tuple[list[str], dict[str, str]]:
    script = str(LOOPS / LOOP_SCRIPTS[loop])
    torchrun = [str(BIN / "torchrun"), "--nproc-per-node", str(nproc), "--master-addr", "127.0.0.1",
                "--master-port", str(free_port()), script]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LLMWATCH_", "LOOP_"))}
    env.update(OMP_NUM_THREADS="1", LLMWATCH_TOKEN=col.token)
    if loop in INSTRUMENTED:
        return [str(BIN / "llmwatch-instrument"), "--collector", col.url, "--run-id", run_id, "--", *torchrun], env
    env.update(LLMWATCH_URL=col.url, LLMWATCH_RUN_ID=run_id, PYTHONPATH=str(ROOT))
    if loop == "ddp_watch":
        env["LOOP_WATCH"] = "1"
    return torchrun, env


def run_loop(tmp: Path, loop: str, *, faults: str = "", steps: int = 60, nproc: int = 2,
             collector_args: tuple[str, ...] = ("--policy", "off"), stop_when: str | None = None) -> ForeignRun:
    """Run `loop` with `faults` to its end (or until the SQL `stop_when`, `{run_id}` in it
    filled in, answers true) and read what the collector stored."""
    tmp.mkdir(parents=True, exist_ok=True)
    run_id = f"{loop}-{tmp.name}"
    col = CollectorProcess(tmp / "tel.duckdb", args=collector_args).start()
    try:
        cmd, env = _command(loop, nproc, run_id, col)
        env.update(LOOP_FAULTS=faults, LOOP_STEPS=str(steps), LOOP_TRUTH=str(tmp / "truth"), LOOP_OUT=str(tmp / "out"),
                   TMPDIR=str(tmp))
        log = open(tmp / "job.log", "w+")
        proc = subprocess.Popen(cmd, cwd=tmp, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while proc.poll() is None and time.monotonic() < deadline:
            if stop_when and col.sql(stop_when.format(run_id=run_id))[0][0]:
                break
            time.sleep(0.2)
        stop_tree(proc)
        log.seek(0)
        output = log.read()
        log.close()
    finally:
        col.stop()
    return _read(tmp / "tel.duckdb", loop, run_id, proc.returncode, output)


def _read(db: Path, loop: str, run_id: str, returncode: int | None, output: str) -> ForeignRun:
    con = duckdb.connect(str(db), read_only=True)
    try:
        def rows(sql: str) -> list[dict]:
            cur = con.execute(sql, [run_id])
            names = [d[0] for d in cur.description]
            return [dict(zip(names, r)) for r in cur.fetchall()]

        incidents = rows("SELECT * FROM incidents WHERE run_id = ? ORDER BY id")
        actions = rows("SELECT * FROM actions WHERE run_id = ? ORDER BY id")
        ends = dict(con.execute("SELECT step, max(ts) FROM steps WHERE run_id = ? GROUP BY step", [run_id]).fetchall())
        n_steps = con.execute("SELECT count(*) FROM steps WHERE run_id = ?", [run_id]).fetchone()[0]
        n_coll = con.execute("SELECT count(*) FROM collectives WHERE run_id = ?", [run_id]).fetchone()[0]
        config = con.execute("SELECT config::VARCHAR FROM runs WHERE run_id = ?", [run_id]).fetchone()
    finally:
        con.close()
    for r in incidents + actions:
        for key in ("evidence", "detail"):
            if isinstance(r.get(key), str):
                r[key] = json.loads(r[key])
    return ForeignRun(loop=loop, run_id=run_id, returncode=returncode, output=output, incidents=incidents,
                      actions=actions, steps=ends, num_steps_rows=n_steps, num_collectives=n_coll,
                      config=json.loads(config[0]) if config and config[0] else {})
