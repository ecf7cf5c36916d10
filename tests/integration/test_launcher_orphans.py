"""SIGKILL the launcher mid-run (the OOM killer, a scheduler): nothing of the run survives it.

Its ranks and its embedded collector get SIGTERM from the kernel (PDEATHSIG) and from
the lifeline pipe; the ranks flush, the collector drains and checkpoints, and the
DuckDB file opens afterwards (no process holds its lock) with the steps so far.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import duckdb
import pytest

from tests.integration.trainer_run import ROOT, TINY

pytestmark = [pytest.mark.integration, pytest.mark.slow]
GONE_WITHIN_S = 30.0


def pids_with(needles: list[str]) -> list[int]:
    """Processes whose command line holds one of `needles` (this run's config or db path)."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (entry / "stat").read_text().split(") ", 1)[1][0]
        except (OSError, IndexError):
            continue
        if state != "Z" and any(n in cmdline for n in needles):
            out.append(int(entry.name))
    return out


def metrics_steps(path: Path) -> int:
    try:
        return len([json.loads(x) for x in path.read_text().splitlines() if x.strip()])
    except (OSError, ValueError):
        return 0  # a line half written: the next poll reads it whole


@pytest.mark.skipif(not Path("/proc/self/cmdline").exists(), reason="finds the run's processes through /proc")
def test_sigkilled_launcher_leaves_no_rank_or_collector_behind(tmp_path):
    run_dir = tmp_path / "run"
    metrics = run_dir / "metrics.jsonl"
    needles = [str(run_dir / "config.json"), str(run_dir / "telemetry.duckdb")]
    argv = [sys.executable, "-m", "trainer", "--run-dir", str(run_dir), "--run-id", "orphans",
            "--metrics-jsonl", str(metrics), *TINY, "--layers", "2", "--telemetry", "--dp", "2", "--steps", "100000"]
    env = {k: v for k, v in os.environ.items() if k != "LLMWATCH_TOKEN"}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    with open(tmp_path / "launcher.out", "wb") as out:
        launcher = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 180.0
        while metrics_steps(metrics) < 3:  # training has really started: steps are logged
            assert launcher.poll() is None, (tmp_path / "launcher.out").read_text()[-3000:]
            assert time.monotonic() < deadline, "training did not start"
            time.sleep(0.1)
        children = pids_with(needles)
        assert len(children) == 3, children  # two ranks and the collector
        shipped = metrics_steps(metrics)  # these steps have had a second to be shipped by the agents
        time.sleep(1.0)
        launcher.kill()
        launcher.wait()
        killed_at = time.monotonic()
        while (left := pids_with(needles)) and time.monotonic() - killed_at < GONE_WITHIN_S:
            time.sleep(0.1)
        gone_s = time.monotonic() - killed_at
        assert not left, f"still running {gone_s:.1f} s after the launcher died: {left}"
        print(f"launcher SIGKILLed at step ~{metrics_steps(metrics)}; its 3 children gone in {gone_s:.2f} s")
    finally:
        if launcher.poll() is None:
            launcher.kill()
        for pid in pids_with(needles):  # this test's own processes, if the fix failed
            os.kill(pid, signal.SIGKILL)
    # the collector exited through its SIGTERM path: queue drained, WAL checkpointed into the file
    assert not (run_dir / "telemetry.duckdb.wal").exists()
    con = duckdb.connect(str(run_dir / "telemetry.duckdb"), read_only=True)  # raises if still locked
    try:
        per_rank = dict(con.execute("SELECT rank, list(DISTINCT step ORDER BY step) FROM steps GROUP BY rank")
                        .fetchall())
    finally:
        con.close()
    assert sorted(per_rank) == [0, 1]
    for rank, steps in per_rank.items():
        assert set(range(1, shipped + 1)) <= set(steps), (rank, shipped, steps[:5], steps[-5:])
    logged = metrics_steps(metrics)
    spooled = {p.parent.name: p.stat().st_size for p in (run_dir / "spool").glob("rank*/seg-*") if p.stat().st_size}
    print(f"steps stored per rank: {({r: len(s) for r, s in per_rank.items()})}, logged {logged}, spooled {spooled}")
    # What the collector did not take before it closed, the ranks' final flush spooled.
    # `logged` is rank 0's count, written after its record_step; the SIGTERM reaches every
    # rank at once, so another rank may be stopped inside step `logged` itself, before it
    # recorded it: one step in flight is not a lost row (it was never recorded).
    for rank, steps in per_rank.items():
        in_flight = 0 if rank == 0 else 1
        if len(steps) < logged - in_flight:
            assert f"rank{rank:05d}" in spooled, (rank, len(steps), logged, spooled)
