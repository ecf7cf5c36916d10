"""SIGKILL (or SIGTERM) the collector while the load generator posts, restart it on
the same port and file: the file opens, and every acknowledged batch is there
exactly once (the generator resends unacknowledged batches, as the agent's spool
does)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.unit.collector.collector_server import ROOT, CollectorProcess

pytestmark = [pytest.mark.integration, pytest.mark.slow]

STEPS_PER_BATCH = 10
COLLECTIVES_PER_STEP = 4


@pytest.mark.parametrize("sig, exit_code", [(signal.SIGKILL, -signal.SIGKILL), (signal.SIGTERM, 0)])
def test_stop_mid_load_loses_and_duplicates_nothing(tmp_path, sig, exit_code):
    db = tmp_path / "crash.duckdb"
    acks = tmp_path / "acks.txt"
    server = CollectorProcess(db, args=("--group-linger-s", "0.01", "--group-min-interval-s", "0")).start()
    loadgen = subprocess.Popen(
        [sys.executable, str(ROOT / "bench" / "loadgen.py"), "--url", server.url, "--token", server.token,
         "--run-id", "crash", "--ranks", "6", "--connections", "4", "--collectives", str(COLLECTIVES_PER_STEP),
         "--duration", "6", "--retry", "--ack-log", str(acks), "--json",
         "throughput", "--steps-per-batch", str(STEPS_PER_BATCH)],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True)
    try:
        deadline = time.monotonic() + 30
        while (not acks.exists() or len(acks.read_text().splitlines()) < 50) and time.monotonic() < deadline:
            time.sleep(0.05)
        acked_before_kill = len(acks.read_text().splitlines())
        assert acked_before_kill >= 50
        assert server.stop(sig) == exit_code
        time.sleep(0.5)  # the generator now sees refused connections and retries
        server = CollectorProcess(db, port=server.port, args=("--group-min-interval-s", "0")).start()  # same port, file
        out, err = loadgen.communicate(timeout=120)
    finally:
        if loadgen.poll() is None:
            loadgen.kill()
    assert loadgen.returncode == 0, err
    summary = json.loads(out)
    assert summary["errors"] > 0  # the kill was felt mid-load

    lines = [tuple(map(int, line.split())) for line in acks.read_text().splitlines()]
    acked = {(rank, seq) for rank, seq, _, _ in lines}
    assert len(lines) > acked_before_kill  # acknowledged after the restart too
    stored = server.sql("SELECT rank, batch_seq, count(*) FROM batches WHERE run_id = 'crash' GROUP BY ALL")
    assert all(n == 1 for _, _, n in stored)
    assert {(r, s) for r, s, _ in stored} == acked  # every ack stored once; every stored batch was acked
    (n_steps, n_distinct), = server.sql(
        "SELECT count(*), count(DISTINCT (rank, step)) FROM steps WHERE run_id = 'crash'")
    assert n_steps == n_distinct == len(acked) * STEPS_PER_BATCH
    (n_coll,), = server.sql("SELECT count(*) FROM collectives WHERE run_id = 'crash'")
    assert n_coll == len(acked) * STEPS_PER_BATCH * COLLECTIVES_PER_STEP
    assert server.stop() == 0
