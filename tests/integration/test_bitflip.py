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


# past the steep start of the loss curve: the replay after the rollback is not a loss spike
# against the level the detector learnt later in attempt 0 (a rollback into the first ~40
# steps replays losses well above it: loss_spike, and a rollback of its own)
DP2_FLIP = {"rank": 0, "step": 57}
DP2_CKPT_EVERY = 5


def test_dp2_names_both_replicas_and_rolls_back_to_before_the_last_agreeing_step(tmp_path):
    """dp = 2: no majority to say which replica is corrupted, so no repair: both are named,
    the run rolls back to a checkpoint older than the last agreeing checksum, goes on as
    attempt 1 with agreeing replicas, and the fault counts against both nodes."""
    run_dir = tmp_path / "bitflip_dp2"
    # the same run length and flush as above: the rollback lands long before the run ends;
    # every checkpoint kept (--ckpt-keep 0): the default 3 would have pruned the one before
    # the last agreeing step by the time the divergence is seen
    r = run_trainer(run_dir, "--telemetry", "--no-dashboard", "--dp", "2", "--nodes", "2", "--steps", "300",
                    "--telemetry-flush-s", "0.25", "--checksum-every", str(EVERY),
                    "--inject", f"bitflip@rank={DP2_FLIP['rank']},step={DP2_FLIP['step']}",
                    "--ckpt-dir", str(run_dir / "ckpt"), "--ckpt-every", str(DP2_CKPT_EVERY), "--ckpt-keep", "0",
                    timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    (truth,) = [t for t in r.injections() if t["kind"] == "bitflip"]
    assert (truth["rank"], truth["step"], truth["attempt"]) == (DP2_FLIP["rank"], DP2_FLIP["step"], 0)
    con = duckdb.connect(str(run_dir / "telemetry.duckdb"), read_only=True)
    inc = con.execute("SELECT id, rank, node, step_from, step_to, status, evidence FROM incidents "
                      "WHERE kind = 'replica_divergence'").fetchall()
    assert len(inc) == 1, inc
    iid, rank, node, step_from, step_to, status, evidence = inc[0]
    ev = json.loads(evidence)
    last_agree, first_bad = 50, 60  # the checksums around the flip after step 57's update
    assert (rank, node, step_from, step_to) == (None, None, last_agree, first_bad)
    assert ev["majority"] is False and ev["src_dp"] is None
    assert ev["divergent_ranks"] == [0, 1] and ev["suspect_nodes"] == ["node0", "node1"]
    assert "dp = 2" in ev["why"] and "no majority" in ev["why"]
    assert status == "closed" and ev["agreeing_again_attempt"] == 1  # the new lineage agrees

    actions = con.execute("SELECT kind, status, attempt, detail FROM actions WHERE incident_id = ? ORDER BY id",
                          [iid]).fetchall()
    assert [(k, s, a) for k, s, a, _ in actions] == [("rollback", "done", 1)], actions
    detail = json.loads(actions[0][3])
    assert detail["args"]["step"] == last_agree and detail["args"]["diagnose"] is False
    assert detail["faults"] == {"node0": 1, "node1": 1}  # counted against both; under transient_limit
    assert con.execute("SELECT node, status FROM nodes ORDER BY node").fetchall() == [
        ("node0", "healthy"), ("node1", "healthy")]
    assert con.execute("SELECT count(*) FROM actions WHERE kind = 'isolate'").fetchone() == (0,)

    (data,) = con.execute("SELECT data FROM events WHERE kind = 'rollback_started' AND rank = 0").fetchone()
    rb = json.loads(data)
    # the newest checkpoint strictly before the last agreeing step (a checkpoint of step k holds
    # the bits the checksum of step k + 1 reads)
    assert rb["to_step"] == last_agree - DP2_CKPT_EVERY and rb["attempt"] == 1 and rb["diagnose"] is False
    lineage = dict(con.execute("SELECT attempt, min(step) FROM steps GROUP BY attempt").fetchall())
    assert lineage == {0: 1, 1: rb["to_step"] + 1}
    assert con.execute("SELECT max(step) FROM steps WHERE attempt = 1").fetchone() == (300,)

    rows = con.execute("SELECT attempt, step, count(DISTINCT value), count(*) FROM scalars "
                       "WHERE name LIKE 'checksum/%' GROUP BY attempt, step ORDER BY attempt, step").fetchall()
    by = {(a, s): (distinct, n) for a, s, distinct, n in rows}
    assert by[(0, last_agree)] == (1, 2) and by[(0, first_bad)] == (2, 2)
    after = sorted(s for a, s in by if a == 1)
    assert after[0] == last_agree and after[-1] == 300  # the replay checks from the first due step on
    assert all(by[(1, s)] == (1, 2) for s in after), by
