"""A degraded link on a real run: `--inject slowlink@...` makes one rank's data-parallel
communication really take 4x as long; the collector's `slow_link` detector names that rank
and its node, and no compute straggler is opened (its compute stayed normal)."""

import json

import duckdb
import pytest

from tests.integration.trainer_run import run_trainer

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.e2e]

RANK, NODE, AXIS, FROM, FACTOR = 3, "node1", "dp", 20, 4


def test_a_slow_link_is_named_for_what_it_is(tmp_path):
    r = run_trainer(tmp_path / "run", "--telemetry", "--dp", "2", "--tp", "2", "--nodes", "2", "--steps", "45",
                    "--micro-batches", "2", "--policy", "off",
                    "--inject", f"slowlink@rank={RANK},axis={AXIS},from={FROM},factor={FACTOR}")
    assert r.returncode == 0, r.stderr[-3000:]
    truth = [json.loads(x) for x in (r.run_dir / "injections.jsonl").read_text().splitlines()]
    assert [(t["kind"], t["rank"], t["step"], t["axis"], t["factor"]) for t in truth] == [
        ("slowlink", RANK, FROM, AXIS, FACTOR)]
    con = duckdb.connect(str(r.run_dir / "telemetry.duckdb"), read_only=True)
    try:
        rows = con.execute("SELECT kind, rank, node, step_from, evidence FROM incidents ORDER BY id").fetchall()
        stretched = con.execute("""SELECT rank, median(duration_s) FROM collectives
                                   WHERE axis = 'dp' AND bytes > 0 AND step >= ? GROUP BY rank""", [FROM]).fetchall()
    finally:
        con.close()
    assert [row[0] for row in rows] == ["slow_link"], rows  # no straggler, nothing else
    kind, rank, node, step_from, evidence = rows[0]
    assert (rank, node) == (RANK, NODE)
    assert step_from >= FROM
    ev = json.loads(evidence)
    assert ev["axis"] == AXIS and ev["cost_s_per_step"] > 0 and ev["link_ratio"] > 1.5
    assert len(stretched) == 4  # every dp member reported its ops with bytes and durations
