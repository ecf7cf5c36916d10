"""`python -m trainer.preflight` under torchrun, for any job: four simulated nodes; a clean fleet
passes in one round of link pairs; a node whose link is slowed is found in two rounds (its first
partner cleared), the check exits 3, and a collector given by LLMWATCH_URL opens a `preflight`
incident naming the node; a rank that never answers has its node named `no_answer` within the
timeout, not the job's. `trainer --preflight` is in tests/e2e/test_healing.py."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import duckdb
import pytest

from tests.polling import wait_until
from tests.unit.collector.collector_server import ROOT, TOKEN, CollectorProcess

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def _preflight(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable))
    assert torchrun, "torchrun is installed with torch"
    clean = {k: v for k, v in os.environ.items() if not k.startswith("LLMWATCH_")}
    return subprocess.run([torchrun, "--standalone", "--nproc-per-node", "4", "-m", "trainer.preflight", "--nodes",
                           "4", "--json", *args], capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env={**clean, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **(env or {})})


def _report(out: str) -> dict:
    return json.loads(next(line for line in out.splitlines() if line.startswith("{")))


def test_a_clean_fleet_passes_in_one_round():
    run = _preflight()
    assert run.returncode == 0, run.stderr[-3000:]
    report = _report(run.stdout)
    assert {n: r["verdict"] for n, r in report["nodes"].items()} == {f"node{i}": "ok" for i in range(4)}
    assert report["rounds"] == 1 and report["shared_host"] is True
    assert report["elapsed_s"] < 30 and all(len(r["link_s"]) == 1 for r in report["nodes"].values())


def test_a_slow_link_is_found_in_two_rounds_and_recorded_as_an_incident(tmp_path):
    proc = CollectorProcess(tmp_path / "c.duckdb").start()
    try:
        run = _preflight("--inject", "slowlink@rank=3,axis=dp,from=0,factor=8",
                         env={"LLMWATCH_URL": proc.url, "LLMWATCH_TOKEN": TOKEN, "LLMWATCH_RUN_ID": "preflight-1"})
        assert run.returncode != 0, run.stdout  # 3: a node failed
        report = _report(run.stdout)
        verdicts = {n: r["verdict"] for n, r in report["nodes"].items()}
        assert verdicts == {"node0": "ok", "node1": "ok", "node2": "ok", "node3": "slow_link"}, report
        assert report["rounds"] == 2 and report["nodes"]["node2"]["suspect"]  # its first partner, cleared

        def flagged():
            from agent.api import ApiClient

            rows = ApiClient(proc.url, TOKEN).get_json("/v1/runs/preflight-1/incidents")
            return [r for r in rows if r["kind"] == "preflight"]

        assert wait_until(flagged, timeout_s=30)
        (inc,) = flagged()
    finally:
        proc.stop()
    assert (inc["node"], inc["rank"], inc["step_from"], inc["severity"]) == ("node3", 3, 0, "critical")
    ev = inc["evidence"] if isinstance(inc["evidence"], dict) else json.loads(inc["evidence"])
    assert ev["verdict"] == "slow_link" and ev["rounds"] == 2 and ev["link_ratio"] >= 2.0
    con = duckdb.connect(str(tmp_path / "c.duckdb"), read_only=True)
    try:
        assert con.execute("SELECT count(*) FROM events WHERE kind = 'preflight'").fetchone()[0] == 1
    finally:
        con.close()


def test_a_peer_that_never_answers_is_named_within_the_timeout():
    """Rank 2 stops answering after its matmuls: node3, its partner, waits 2 s for it and is re-paired
    with node0; rank 0 prints node2 as no_answer and every rank that answered exits 3, so torchrun
    stops the silent one and the job never starts on it."""
    t = time.monotonic()
    run = _preflight("--inject", "hang@rank=2,step=0", "--timeout-s", "2")
    took = time.monotonic() - t
    assert run.returncode != 0, run.stdout
    report = _report(run.stdout)
    verdicts = {n: r["verdict"] for n, r in report["nodes"].items()}
    assert verdicts == {"node0": "ok", "node1": "ok", "node2": "no_answer", "node3": "ok"}, report
    assert report["nodes"]["node2"]["silent_ranks"] == [2] and report["unanswered"] == [[1, "node2", "node3", "node2"]]
    assert report["rounds"] == 2 and len(report["nodes"]["node3"]["link_s"]) == 1  # re-paired, judged
    assert report["elapsed_s"] < 20 and took < 90, (report["elapsed_s"], took)  # not the store's minutes
