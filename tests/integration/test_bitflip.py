"""A real run with a memory bit flip on one replica: detected by the replicas' checksums,
named, repaired in place, and the replicas agree again."""

from __future__ import annotations

import json

import duckdb
import pytest

from tests.integration.trainer_run import run_trainer

pytestmark = [pytest.mark.slow, pytest.mark.integration, pytest.mark.e2e]

FLIP = {"rank": 2, "step": 22, "node": "node2"}
EVERY = 10


def test_bitflip_is_detected_named_and_repaired_in_place(tmp_path):
    run_dir = tmp_path / "bitflip"
    # 300 steps (~10 s here) with a 0.25 s flush: the repair lands long before the run ends
    # (60 steps finished in 2 s, before the detector had seen step 30's checksums)
    r = run_trainer(run_dir, "--telemetry", "--no-dashboard", "--dp", "3", "--nodes", "3", "--steps", "300",
                    "--telemetry-flush-s", "0.25", "--checksum-every", str(EVERY), "--inject", f"bitflip@rank={FLIP['rank']},step={FLIP['step']}",
                    "--ckpt-dir", str(run_dir / "ckpt"), "--ckpt-every", "50", timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    (truth,) = [t for t in r.injections() if t["kind"] == "bitflip"]
    assert (truth["rank"], truth["step"]) == (FLIP["rank"], FLIP["step"])
    con = duckdb.connect(str(run_dir / "telemetry.duckdb"), read_only=True)
    inc = con.execute("SELECT id, rank, node, step_from, step_to, status, evidence FROM incidents "
                      "WHERE kind = 'replica_divergence'").fetchall()
    assert len(inc) == 1, inc
    iid, rank, node, step_from, step_to, status, evidence = inc[0]
    ev = json.loads(evidence)
    assert (rank, node, step_from, step_to) == (FLIP["rank"], FLIP["node"], 20, 30)
    assert ev["majority"] is True and ev["divergent_ranks"] == [FLIP["rank"]]
    assert status == "closed"  # the replicas agreed again after the repair
    actions = con.execute("SELECT kind, status FROM actions WHERE incident_id = ? ORDER BY id", [iid]).fetchall()
    assert actions == [("repair", "done")], actions
    (repaired_at,) = con.execute("SELECT min(step) FROM events WHERE kind = 'replica_repaired'").fetchone()
    assert repaired_at is not None and repaired_at >= 30
    # no rollback: one lineage
    assert con.execute("SELECT DISTINCT attempt FROM steps").fetchall() == [(0,)]
    rows = con.execute("SELECT step, count(DISTINCT value), count(*) FROM scalars WHERE name LIKE 'checksum/%' "
                       "GROUP BY step ORDER BY step").fetchall()
    by_step = {s: (distinct, n) for s, distinct, n in rows}
    assert by_step[20] == (1, 3) and by_step[30] == (2, 3)
    after = [s for s in by_step if s > repaired_at]
    assert after and after[0] == repaired_at + 1  # the repair's own check, at the next step
    assert all(by_step[s] == (1, 3) for s in after), by_step
