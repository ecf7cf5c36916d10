"""A dead or missing collector costs no training and loses no data."""

import signal
import threading
import time

import duckdb
import pytest

from tests.unit.collector.collector_server import CollectorProcess
from tests.integration.trainer_run import run_trainer
from trainer.launch import free_port

pytestmark = [pytest.mark.integration, pytest.mark.slow]
STEPS = 40
SLOW = ["--layers", "2", "--inject", "straggler@rank=0,from=1,factor=6"]  # ~0.1 s per step on 2 cores


def count_steps(db, run_id):
    con = duckdb.connect(str(db), read_only=True)
    try:
        return con.execute("""SELECT count(*), count(DISTINCT (attempt, step, rank)),
                              (SELECT count(*) FROM steps_effective WHERE run_id = $1)
                              FROM steps WHERE run_id = $1""", [run_id]).fetchone()
    finally:
        con.close()


def test_collector_sigkill_and_restart_loses_nothing(tmp_path):
    db = tmp_path / "tel.duckdb"
    metrics = tmp_path / "run" / "metrics.jsonl"
    col = CollectorProcess(db).start()
    seen = {}

    def restart():
        seen["restart_at"] = len(metrics.read_text().splitlines())
        col.start()

    killer = _when_step(metrics, 8, lambda: col.stop(signal.SIGKILL))
    restarter = _when_step(metrics, 20, restart)
    try:
        r = run_trainer(tmp_path / "run", "--telemetry", "--collector", col.url, "--token", col.token,
                        "--steps", str(STEPS), "--dp", "2", *SLOW)
        assert r.returncode == 0, r.stderr[-3000:]
    finally:
        killer.join()
        restarter.join()
        col.stop()
    assert seen["restart_at"] < STEPS  # the collector really was down in the middle of the run
    assert count_steps(db, "run") == (STEPS * 2, STEPS * 2, STEPS * 2)


def _when_step(metrics, step, action, timeout_s=120.0):
    """Run `action` once the trainer has logged `step` (training went on without a collector)."""
    def wait():
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if metrics.exists() and len(metrics.read_text().splitlines()) >= step:
                break
            time.sleep(0.05)
        action()
    t = threading.Thread(target=wait)
    t.start()
    return t


def test_collector_never_started_then_appears(tmp_path):
    db = tmp_path / "tel.duckdb"
    col = CollectorProcess(db, port=free_port())
    starter = _when_step(tmp_path / "run" / "metrics.jsonl", 10, col.start)
    try:
        r = run_trainer(tmp_path / "run", "--telemetry", "--collector", col.url, "--token", col.token,
                        "--steps", str(STEPS), "--dp", "2", *SLOW)
        starter.join()
        assert r.returncode == 0, r.stderr[-3000:]
        assert "collector unavailable" in r.stderr  # the agents noticed, spooled, and carried on
    finally:
        starter.join()
        col.stop()
    assert count_steps(db, "run") == (STEPS * 2, STEPS * 2, STEPS * 2)


def test_spool_of_a_finished_run_replays_later(tmp_path):
    import subprocess
    import sys

    from tests.integration.trainer_run import ROOT

    db = tmp_path / "tel.duckdb"
    col = CollectorProcess(db, port=free_port())  # not started: the whole run goes to the spool
    r = run_trainer(tmp_path / "run", "--telemetry", "--collector", col.url, "--token", col.token,
                    "--steps", "6", "--dp", "2")
    assert r.returncode == 0, r.stderr[-3000:]
    spool = tmp_path / "run" / "spool"
    assert any(spool.glob("rank*/seg-*"))
    col.start()
    try:
        argv = [sys.executable, "-m", "agent.replay", str(spool), "--url", col.url, "--token", col.token]
        out = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        again = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert "replayed 0 batches" in again.stdout  # a replayed spool is empty
    finally:
        col.stop()
    assert count_steps(db, "run") == (12, 12, 12)
