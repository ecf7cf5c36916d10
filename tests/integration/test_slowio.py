"""Slow storage end to end: `slowio` really stretches a rank's data fetch or its checkpoint shard writes,
and the collector's detectors name the rank and its node for what it is (a data stall is not a straggler)."""

import json

import duckdb
import pytest

from tests.integration.trainer_run import run_trainer

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.e2e]

LAYOUT = ["--telemetry", "--dp", "2", "--tp", "2", "--nodes", "2", "--micro-batches", "2", "--policy", "off"]


def _incidents(run_dir):
    con = duckdb.connect(str(run_dir / "telemetry.duckdb"), read_only=True)
    try:
        return con.execute("SELECT kind, rank, node, step_from, status, evidence FROM incidents ORDER BY id").fetchall()
    finally:
        con.close()


def test_a_data_stall_is_named_and_is_not_a_straggler(tmp_path):
    r = run_trainer(tmp_path / "slowdata", *LAYOUT, "--steps", "40",
                    "--inject", "slowio@rank=2,from=12,factor=4,what=data")
    assert r.returncode == 0, r.stderr[-3000:]
    (truth,) = r.injections()
    assert (truth["kind"], truth["rank"], truth["what"], truth["factor"], truth["step"]) == ("slowio", 2, "data", 4.0, 12)
    rows = _incidents(r.run_dir)
    assert [row[0] for row in rows] == ["data_stall"], rows  # one data stall: no straggler, nothing else
    assert [(row[1], row[2]) for row in rows] == [(2, "node1")], rows
    assert rows[0][3] >= 11 and json.loads(rows[0][5])["data_share"] > 0.3


def test_slow_checkpoint_writes_are_named(tmp_path):
    r = run_trainer(tmp_path / "slowckpt", *LAYOUT, "--steps", "24", "--ckpt-dir", str(tmp_path / "ckpt"),
                    "--ckpt-every", "4", "--inject", "slowio@rank=1,from=10,factor=50,what=ckpt")
    assert r.returncode == 0, r.stderr[-3000:]
    rows = _incidents(r.run_dir)
    assert rows and {row[0] for row in rows} == {"checkpoint_slow"}, rows  # nothing else opened
    assert {(row[1], row[2]) for row in rows} == {(1, "node0")}, rows
    assert rows[0][3] >= 12 and json.loads(rows[0][5])["ratio_vs_peers"] >= 3
