"""Runs of jobs we did not write (tests/integration/loops/), watched by llmwatch, against a
real collector: `llmwatch-instrument -- torchrun ... loop.py` (zero code), the loop's own
`watch()` call ($LOOP_WATCH=1), or the framework callbacks. The harness injects the faults
($LOOP_FAULTS, loops/faults.py); the collector never sees them.

Runs share a collector (`Collectors`: one per policy, started on first use), each
under its own run id. A run that ended by itself is read once detection has judged
every row acknowledged before the read (`GET /v1/runs/{run}/incidents?settle_s=`, the
launcher's end-of-run list): its agents flushed before they exited, so "no incident" is
a fact, not a wait. A hang is watched live: the job is stopped once the collector holds
what the test needs (`stop_when`: the incident, and the rows sent before the hang, which
may still be on their way from a spool), or at a bound. Each run spools under its own
directory ($TMPDIR), and a stopped run leaves no process behind (tests/procs.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import quote

from tests.procs import stop_tree
from tests.unit.collector.collector_server import CollectorProcess
from trainer.launch import free_port

ROOT = Path(__file__).resolve().parents[2]
LOOPS = Path(__file__).resolve().parent / "loops"
BIN = Path(sys.executable).parent
RUN_TIMEOUT_S = 240.0
SETTLE_S = 10.0  # the route's bound: detection of a finished run's last rows takes tens of ms

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
    num_summarized_ops: int = 0  # ops a summarizing agent sent as summary rows (agent/summary.py)
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


# Every job of a module runs on this one host, into a shared collector: the faults injected into the
# earlier ones would flag the host for the later ones (fleet memory: a node with faults in two runs
# this week, docs/rules.md [node_history]; tested in tests/unit/*/test_fleet.py). Here each job is
# judged on its own.
SHARED_RULES = "[node_history]\nenabled = false\n"


class Collectors:
    """One collector per set of arguments (a policy), started on first use, shared by the
    runs of a module (a start and a stop cost ~2 s of a ~13 s run), with SHARED_RULES;
    `close()` stops them."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._started: dict[tuple[str, ...], CollectorProcess] = {}

    def get(self, args: tuple[str, ...]) -> CollectorProcess:
        if args not in self._started:
            db = self.root / f"tel-{len(self._started)}.duckdb"
            rules = self.root / "shared-rules.toml"
            rules.write_text(SHARED_RULES)
            self._started[args] = CollectorProcess(db, args=(*args, "--rules", str(rules))).start()
        return self._started[args]

    def close(self) -> None:
        for col in self._started.values():
            col.stop()
        self._started.clear()


def run_loop(tmp: Path, loop: str, *, faults: str = "", steps: int = 60, nproc: int = 2,
             collector_args: tuple[str, ...] = ("--policy", "off"), stop_when: str | None = None,
             collectors: Collectors | None = None, env: dict[str, str] | None = None) -> ForeignRun:
    """Run `loop` with `faults` to its end (or until the SQL `stop_when`, `{run_id}` in it
    filled in, answers true) and read what the collector stored: a collector of
    `collectors` for `collector_args`, or one of its own started for the run. `env`: more of the
    job's environment (the harness passes none of the caller's LLMWATCH_ variables)."""
    tmp.mkdir(parents=True, exist_ok=True)
    run_id = f"{loop}-{tmp.name}"
    own = collectors is None
    col = CollectorProcess(tmp / "tel.duckdb", args=collector_args).start() if own \
        else collectors.get(collector_args)
    # a shared collector: the run id is the loop and the directory's name, and a second run under
    # the same one would add its rows to the first's (a test whose counts then fail for no reason)
    assert own or not col.sql(f"SELECT count(*) FROM runs WHERE run_id = '{run_id}'")[0][0], \
        f"run id {run_id} is taken on this collector: give the run a directory name of its own"
    try:
        cmd, job_env = _command(loop, nproc, run_id, col)
        job_env.update(LOOP_FAULTS=faults, LOOP_STEPS=str(steps), LOOP_TRUTH=str(tmp / "truth"), LOOP_OUT=str(tmp / "out"),
                   TMPDIR=str(tmp), **(env or {}))
        with open(tmp / "job.log", "w+") as log:
            proc = subprocess.Popen(cmd, cwd=tmp, env=job_env, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)
            deadline = time.monotonic() + RUN_TIMEOUT_S
            while proc.poll() is None and time.monotonic() < deadline:
                if stop_when and col.sql(stop_when.format(run_id=run_id))[0][0]:
                    break
                time.sleep(0.2)
            stop_tree(proc)
            log.seek(0)
            output = log.read()
        _settle(col, run_id)
        return _read(col, loop, run_id, proc.returncode, output)
    finally:
        if own:
            col.stop()


def _settle(col: CollectorProcess, run_id: str) -> None:
    """Wait until detection judged every row the collector acknowledged (and stored what it found)."""
    with col.client() as c:
        r = c.get(f"/v1/runs/{quote(run_id, safe='')}/incidents", params={"settle_s": SETTLE_S},
                  timeout=SETTLE_S + 30)
        r.raise_for_status()
        assert r.headers.get("X-Llmwatch-Settled") == "true", f"detection not caught up in {SETTLE_S} s"


def _read(col: CollectorProcess, loop: str, run_id: str, returncode: int | None, output: str) -> ForeignRun:
    def rows(sql: str) -> list[dict]:
        return col.records(sql.replace("?", f"'{run_id}'"))  # run ids: letters, digits and '-'

    incidents = rows("SELECT * FROM incidents WHERE run_id = ? ORDER BY id")
    actions = rows("SELECT * FROM actions WHERE run_id = ? ORDER BY id")
    ends = {r["step"]: r["ts"] for r in rows("SELECT step, max(ts) AS ts FROM steps WHERE run_id = ? GROUP BY step")}
    (n_steps,) = rows("SELECT count(*) AS n FROM steps WHERE run_id = ?")
    (n_coll,) = rows("SELECT count(*) AS n FROM collectives WHERE run_id = ?")
    (n_summ,) = rows("SELECT coalesce(sum(num_ops), 0) AS n FROM collectives_rollup WHERE run_id = ?")
    config = rows("SELECT config::VARCHAR AS config FROM runs WHERE run_id = ?")
    for r in incidents + actions:
        for key in ("evidence", "detail"):
            if isinstance(r.get(key), str):
                r[key] = json.loads(r[key])
    return ForeignRun(loop=loop, run_id=run_id, returncode=returncode, output=output, incidents=incidents,
                      actions=actions, steps=ends, num_steps_rows=n_steps["n"], num_collectives=n_coll["n"], num_summarized_ops=int(n_summ["n"]),
                      config=json.loads(config[0]["config"]) if config and config[0]["config"] else {})
