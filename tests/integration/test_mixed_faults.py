"""Two faults in one real run, each named for what it is: a compute straggler on one node and a
slow data-parallel link on the other. The straggler's partners wait for it (transfers are timed
from the last member's entry, so its group's links are not slow); the slow link's rank computes
normally. The incidents are exactly one `straggler` (its rank and node) and one `slow_link`."""

import json

import duckdb
import pytest

from analysis.scoring import WINDOWS
from tests.integration.trainer_run import run_trainer

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.e2e]

# dp2 x tp2, tp innermost: node0 = ranks 0, 1; node1 = ranks 2, 3. The straggler's dp group {0, 2}
# and tp group {0, 1} are not the slow link's dp group {1, 3}.
# The straggler from step 16, not 12: its onset is the change point of the rank's ratios since the run
# began, and more clean steps before it leave the change point more to go on
STRAGGLER = {"rank": 0, "node": "node0", "from": 16, "factor": 3}
LINK = {"rank": 3, "node": "node1", "from": 20, "axis": "dp", "factor": 4}


def test_a_straggler_and_a_slow_link_are_each_named_for_what_they_are(tmp_path):
    s, k = STRAGGLER, LINK
    r = run_trainer(tmp_path / "mixed", "--telemetry", "--dp", "2", "--tp", "2", "--nodes", "2", "--steps", "40",
                    "--micro-batches", "2", "--policy", "off",
                    "--inject", f"straggler@rank={s['rank']},from={s['from']},factor={s['factor']}",
                    "--inject", f"slowlink@rank={k['rank']},axis={k['axis']},from={k['from']},factor={k['factor']}")
    assert r.returncode == 0, r.stderr[-3000:]
    assert sorted((t["kind"], t["rank"], t["step"]) for t in r.injections()) == [
        ("slowlink", k["rank"], k["from"]), ("straggler", s["rank"], s["from"])]
    con = duckdb.connect(str(r.run_dir / "telemetry.duckdb"), read_only=True)
    try:
        rows = con.execute("SELECT kind, rank, node, step_from, evidence FROM incidents ORDER BY id").fetchall()
    finally:
        con.close()
    assert sorted(row[0] for row in rows) == ["slow_link", "straggler"], rows  # one each, nothing else
    by_kind = {row[0]: row for row in rows}
    _, rank, node, step_from, evidence = by_kind["straggler"]
    # the onset within the scoring's window, and up to 3 steps early: locally it is dated 16 run after run
    # (fired at 22), but CI dated it 14 (and, when it began at 12, 9): on a loaded host the steps just
    # before the fault can be as slow as the fault's first ones, and the change point of the rank's
    # ratios then lies among them. This test is about naming each fault for what it is
    _, hi = WINDOWS["straggler"]
    assert (rank, node) == (s["rank"], s["node"]) and s["from"] - 3 <= step_from <= s["from"] + hi, rows
    assert json.loads(evidence)["cost_s_per_step"] > 0
    _, rank, node, step_from, evidence = by_kind["slow_link"]
    lo, hi = WINDOWS["slowlink"]
    assert (rank, node) == (k["rank"], k["node"]) and k["from"] + lo <= step_from <= k["from"] + hi, rows
    ev = json.loads(evidence)
    assert ev["axis"] == k["axis"] and ev["link_ratio"] > 1.5 and ev["cost_s_per_step"] > 0
