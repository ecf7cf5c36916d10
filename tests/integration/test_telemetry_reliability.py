"""A dead or missing collector costs no training and loses no data."""

import threading
import time

import duckdb
import pytest

from tests.integration.collector_proc import CollectorProc
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
    col = CollectorProc(db).start()

    def chaos():
        time.sleep(6)
        col.kill()
        time.sleep(3)
        col.start()

    t = threading.Thread(target=chaos)
    t.start()
    try:
        r = run_trainer(tmp_path / "run", "--telemetry", "--collector", col.url, "--token", col.token,
                        "--steps", str(STEPS), "--dp", "2", *SLOW)
        t.join()
        assert r.returncode == 0, r.stderr[-3000:]
    finally:
        t.join()
        col.stop()
    assert count_steps(db, "run") == (STEPS * 2, STEPS * 2, STEPS * 2)


def test_collector_never_started_then_appears(tmp_path):
    db = tmp_path / "tel.duckdb"
    port = free_port()
    col = CollectorProc(db, port=port)
    starter = threading.Timer(8.0, col.start)
    starter.start()
    try:
        r = run_trainer(tmp_path / "run", "--telemetry", "--collector", col.url, "--token", col.token,
                        "--steps", str(STEPS), "--dp", "2", *SLOW)
        starter.join()
        assert r.returncode == 0, r.stderr[-3000:]
    finally:
        starter.join()
        col.stop()
    assert count_steps(db, "run") == (STEPS * 2, STEPS * 2, STEPS * 2)
