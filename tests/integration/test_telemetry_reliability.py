"""A dead or missing collector costs no training and loses no data.

Each test changes the collector's state at a given training step. Starting a
collector takes from half a second to several on a loaded machine, and training
would run on meanwhile: whether the collector was back before the run ended
used to depend on that race. So the run (launcher and ranks, one process group)
is paused with SIGSTOP while the collector (re)starts, and resumed once it
listens. Every wait polls for its condition with a bound; none sleeps a fixed
time to let something happen.
"""

import os
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import duckdb
import pytest

from tests.integration.trainer_run import ROOT, TINY, run_trainer
from tests.unit.collector.collector_server import CollectorProcess
from trainer.launch import free_port

pytestmark = [pytest.mark.integration, pytest.mark.slow]
STEPS = 40
SLOW = ["--layers", "2", "--inject", "straggler@rank=0,from=1,factor=6"]  # ~0.1 s per step on 2 cores
RUN_TIMEOUT_S = 240.0


def count_steps(db, run_id):
    con = duckdb.connect(str(db), read_only=True)
    try:
        return con.execute("""SELECT count(*), count(DISTINCT (attempt, step, rank)),
                              (SELECT count(*) FROM steps_effective WHERE run_id = $1)
                              FROM steps WHERE run_id = $1""", [run_id]).fetchone()
    finally:
        con.close()


def _start_trainer(run_dir: Path, *args: str) -> subprocess.Popen:
    """What `run_trainer` runs, started in a process group of its own so that one
    signal pauses or resumes the launcher and every rank together."""
    argv = [sys.executable, "-m", "trainer", "--run-dir", str(run_dir), "--run-id", run_dir.name,
            "--metrics-jsonl", str(run_dir / "metrics.jsonl"), *TINY, *args]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    return subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def _finish(proc: subprocess.Popen) -> tuple[int, str]:
    try:
        _, err = proc.communicate(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        _signal_group(proc, signal.SIGKILL)
        _, err = proc.communicate()
    return proc.returncode, err


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass  # the run has ended


@contextmanager
def _paused(proc: subprocess.Popen):
    """The run is stopped (SIGSTOP to its process group) while the body runs."""
    _signal_group(proc, signal.SIGSTOP)
    try:
        yield
    finally:
        _signal_group(proc, signal.SIGCONT)


def _logged_steps(metrics: Path) -> int:
    return len(metrics.read_text().splitlines()) if metrics.exists() else 0


def _at_step(proc: subprocess.Popen, metrics: Path, step: int, action, seen: dict, key: str) -> threading.Thread:
    """Once the trainer has logged `step` (it trained on without a collector), run
    `action()` and note in `seen[key]` the step count it ran at. Gives up if the run
    ends first or after RUN_TIMEOUT_S; an exception lands in `seen[key + "_error"]`."""
    def wait():
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while time.monotonic() < deadline and proc.poll() is None:
            if _logged_steps(metrics) >= step:
                try:
                    action()
                    seen[key] = _logged_steps(metrics)
                except Exception as e:  # noqa: BLE001 - reported by the test
                    seen[key + "_error"] = repr(e)
                return
            time.sleep(0.02)
    t = threading.Thread(target=wait, daemon=True)
    t.start()
    return t


def _join(*threads: threading.Thread) -> None:
    for t in threads:
        t.join(RUN_TIMEOUT_S)
        assert not t.is_alive()


def _spool_left(run_dir: Path) -> list[Path]:
    return sorted((run_dir / "spool").glob("rank*/seg-*"))


def test_collector_sigkill_and_restart_loses_nothing(tmp_path):
    db = tmp_path / "tel.duckdb"
    run_dir = tmp_path / "run"
    metrics = run_dir / "metrics.jsonl"
    col = CollectorProcess(db).start()
    seen: dict = {}

    def restart():
        with _paused(proc):
            col.start()

    proc = _start_trainer(run_dir, "--telemetry", "--collector", col.url, "--token", col.token,
                          "--steps", str(STEPS), "--dp", "2", *SLOW)
    killer = _at_step(proc, metrics, 8, lambda: col.stop(signal.SIGKILL), seen, "killed_at")
    restarter = _at_step(proc, metrics, 20, restart, seen, "restarted_at")
    try:
        code, err = _finish(proc)
        _join(killer, restarter)
        assert code == 0, err[-3000:]
    finally:
        _signal_group(proc, signal.SIGCONT)
        col.stop()
    assert "killed_at" in seen and "restarted_at" in seen, seen
    assert seen["killed_at"] < seen["restarted_at"] < STEPS  # the collector really was down in the middle
    assert count_steps(db, "run") == (STEPS * 2, STEPS * 2, STEPS * 2)
    assert _spool_left(run_dir) == []  # close() delivered what the outage had spooled


def test_collector_never_started_then_appears(tmp_path):
    db = tmp_path / "tel.duckdb"
    run_dir = tmp_path / "run"
    col = CollectorProcess(db, port=free_port())
    seen: dict = {}

    def appear():
        with _paused(proc):
            col.start()

    proc = _start_trainer(run_dir, "--telemetry", "--collector", col.url, "--token", col.token,
                          "--steps", str(STEPS), "--dp", "2", *SLOW)
    starter = _at_step(proc, run_dir / "metrics.jsonl", 10, appear, seen, "started_at")
    try:
        code, err = _finish(proc)
        _join(starter)
        assert code == 0, err[-3000:]
        assert "collector unavailable" in err  # the agents noticed, spooled, and carried on
    finally:
        _signal_group(proc, signal.SIGCONT)
        col.stop()
    assert seen.get("started_at", STEPS) < STEPS, seen  # it appeared while the run went on
    assert count_steps(db, "run") == (STEPS * 2, STEPS * 2, STEPS * 2)
    # close() delivered the spool and the last batch; nothing was left for agent.replay
    assert _spool_left(run_dir) == [] and "left in the spool" not in err, err[-3000:]


def test_spool_of_a_finished_run_replays_later(tmp_path):
    db = tmp_path / "tel.duckdb"
    col = CollectorProcess(db, port=free_port())  # not started: the whole run goes to the spool
    r = run_trainer(tmp_path / "run", "--telemetry", "--collector", col.url, "--token", col.token,
                    "--steps", "6", "--dp", "2")
    assert r.returncode == 0, r.stderr[-3000:]
    spool = tmp_path / "run" / "spool"
    assert any(spool.glob("rank*/seg-*"))
    assert "undelivered batches left in the spool" in r.stderr  # close() said what it left, and where
    col.start()
    try:
        # the token from the environment, not the command line (where ps shows it)
        argv = [sys.executable, "-m", "agent.replay", str(spool), "--url", col.url]
        env = dict(os.environ, PYTHONPATH=str(ROOT), LLMWATCH_TOKEN=col.token)
        out = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=120, env=env)
        assert out.returncode == 0, out.stderr
        again = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=120, env=env)
        assert "replayed 0 batches" in again.stdout  # a replayed spool is empty
    finally:
        col.stop()
    assert count_steps(db, "run") == (12, 12, 12)
