"""Goodput by cause: the `goodput` view and `queries.goodput_causes`, on runs built here
whose every second is known.

Run "heal" (one rank, steps of 1 s, wall time 1000 -> 1014 s = 14 s):

    1000-1002  start-up                                  idle        2.0
    1002-1004  steps 1, 2 (a straggler's, 0.25 s/step)   productive 1.5 + slowdown 0.5
    1004-1004.5 the snapshot of step 2's checkpoint      checkpoint  0.5
    1004.5-1005.5 step 3                                 productive  1.0
    1005.5-1006.5 step 4, skipped (a NaN)                skipped     1.0
    1006.5-1008.5 steps 5, 6; a spike at 5, opened at 1008.0, rolled back:
                  step 5 ran before it opened             detection   1.0
                  step 6 after                            redone      1.0
    1008.5-1010.5 the rollback                           recovery    2.0
    1010.5-1012.5 steps 5, 6 again (attempt 1)           productive  2.0
    1012.5-1014 until run_finished                       idle        1.5

Run "restart" (no rollback: a rank exited and came back in the same attempt):
steps 1-3, a gap of 4 s with rank_exited and run_started in it, steps 4-5."""

from __future__ import annotations

import json

import duckdb
import pytest

from collector.read import queries, views
from collector.store.schema import migrate


def _step(con, run, attempt, step, end_ts, *, step_s=1.0, skipped=False):
    con.execute("INSERT INTO steps (run_id, attempt, step, rank, ts, loss, step_s, skipped, tokens) "
                "VALUES (?, ?, ?, 0, ?, 2.0, ?, ?, 10)", [run, attempt, step, end_ts, step_s, skipped])


def _event(con, run, ts, kind, *, step=None, attempt=None, **data):
    con.execute("INSERT INTO events (run_id, rank, ts, step, attempt, kind, data) VALUES (?, 0, ?, ?, ?, ?, ?)",
                [run, ts, step, attempt, kind, json.dumps(data)])


@pytest.fixture
def con(tmp_path):
    con = duckdb.connect(str(tmp_path / "g.duckdb"))
    migrate(con)
    for run in ("heal", "restart"):
        con.execute("INSERT INTO runs (run_id, created_ts, updated_ts, status, world_size, started_ts) "
                    "VALUES (?, 1000, 1000, 'completed', 1, 1000)", [run])
    _step(con, "heal", 0, 1, 1003.0)
    _step(con, "heal", 0, 2, 1004.0)
    _event(con, "heal", 1004.5, "checkpoint_queued", step=2, attempt=0, stall_s=0.5, num_shards=1)
    _step(con, "heal", 0, 3, 1005.5)
    _step(con, "heal", 0, 4, 1006.5, skipped=True)
    _step(con, "heal", 0, 5, 1007.5)
    _step(con, "heal", 0, 6, 1008.5)
    _event(con, "heal", 1009.0, "rollback_started", step=6, attempt=0)
    _step(con, "heal", 1, 5, 1011.5)
    _step(con, "heal", 1, 6, 1012.5)
    _event(con, "heal", 1014.0, "run_finished", step=6, attempt=1, status="completed")
    incidents = [(1, "straggler", 1, 2, 1003.5, {"cost_s_per_step": 0.25, "share_of_step": 0.25}),
                 (2, "loss_spike", 5, 5, 1008.0, {"z": 9.0})]
    for iid, kind, lo, hi, opened, evidence in incidents:
        con.execute("INSERT INTO incidents (id, run_id, kind, severity, step_from, step_to, opened_ts, updated_ts, "
                    "status, evidence) VALUES (?, 'heal', ?, 'warning', ?, ?, ?, ?, 'closed', ?)",
                    [iid, kind, lo, hi, opened, opened, json.dumps(evidence)])
    con.execute("INSERT INTO actions (id, run_id, incident_id, kind, status, requested_ts) "
                "VALUES (1, 'heal', 2, 'rollback', 'done', 1008.1)")
    for step, end in ((1, 1001.0), (2, 1002.0), (3, 1003.0), (4, 1008.0), (5, 1009.0)):
        _step(con, "restart", 0, step, end)
    _event(con, "restart", 1003.2, "rank_exited", exit_code=1)
    _event(con, "restart", 1006.0, "run_started", restart=1)
    yield con
    con.close()


def _by_cause(rows):
    out = {}
    for r in rows:
        key = r["cause"] if r["incident_id"] is None else (r["cause"], r["incident_id"])
        out[key] = round(r["seconds"], 6)
    return out


def test_every_second_of_a_healed_run_has_its_cause(con):
    rows = queries.goodput_causes(con, "heal")
    assert _by_cause(rows) == {"idle": 3.5, "productive": 4.5, ("slowdown", 1): 0.5, "checkpoint": 0.5,
                               "skipped": 1.0, "detection": 1.0, "redone": 1.0, "recovery": 2.0}
    assert sum(r["seconds"] for r in rows) == pytest.approx(14.0)  # the wall time, all of it
    assert sum(r["share"] for r in rows) == pytest.approx(1.0)
    steps = {r["cause"]: r["num_steps"] for r in rows}
    assert steps == {"idle": None, "productive": 5, "slowdown": 2, "checkpoint": None, "skipped": 1,
                     "detection": 1, "redone": 1, "recovery": None}
    assert rows[0]["cause"] == "productive"  # largest first


def test_a_restart_in_the_same_attempt_is_recovery(con):
    # steps 1-3 (1000-1003), the gap 1003-1007 with the exit and the restart in it, steps 4-5
    assert _by_cause(queries.goodput_causes(con, "restart")) == {"productive": 5.0, "recovery": 4.0}


def test_the_first_start_and_the_clean_exits_at_the_end_are_idle_not_recovery(con):
    """The launcher reports the first round's `run_started` and every rank's exit: at the start and
    at the end of a run that ends well (its last seconds: the wait for the verdict on its last steps)
    neither is a recovery. A rank that exits with an error, or is stopped, is."""
    con.execute("INSERT INTO runs (run_id, created_ts, updated_ts, status, world_size, started_ts) "
                "VALUES ('ends', 1000, 1000, 'completed', 1, 1000)")
    _event(con, "ends", 1000.5, "run_started", restart=0)
    for step, end in ((1, 1002.0), (2, 1003.0), (3, 1004.0)):
        _step(con, "ends", 0, step, end)
    _event(con, "ends", 1005.5, "rank_exited", rank=0, exit_code=0, signal=None, cause="exited")
    assert _by_cause(queries.goodput_causes(con, "ends")) == {"idle": 2.5, "productive": 3.0}
    _event(con, "ends", 1005.6, "rank_exited", rank=1, exit_code=0, signal=None, cause="stopped")
    assert _by_cause(queries.goodput_causes(con, "ends")) == {"idle": 1.0, "productive": 3.0, "recovery": 1.6}


def test_the_view_holds_every_run_and_the_read_one_run(con):
    everything = con.execute("SELECT run_id, cause, incident_id, seconds FROM goodput").fetchall()
    assert {r for r, *_ in everything} == {"heal", "restart"}
    for run in ("heal", "restart"):
        mine = sorted((c, i, round(s, 6)) for r, c, i, s in everything if r == run)
        assert mine == sorted((r["cause"], r["incident_id"], round(r["seconds"], 6))
                              for r in queries.goodput_causes(con, run))
    assert queries.goodput_causes(con, "nope") == []


def test_slowdowns_that_overlap_are_not_counted_past_the_productive_time(con):
    con.execute("UPDATE incidents SET evidence = '{\"cost_s_per_step\": 5.0}' WHERE id = 1")  # 10 s on 2 s steps
    con.execute("INSERT INTO incidents (id, run_id, kind, severity, step_from, step_to, opened_ts, updated_ts, status, "
                "evidence) VALUES (3, 'heal', 'slow_link', 'warning', 1, 3, 1004, 1004, 'open', "
                "'{\"cost_s_per_step\": 2.0}')")  # 6 s more: 16 s of slow-downs on 5 s of productive steps
    got = _by_cause(queries.goodput_causes(con, "heal"))
    assert got["productive"] == pytest.approx(0.0)
    assert got[("slowdown", 1)] == pytest.approx(5.0 * 10 / 16) and got[("slowdown", 3)] == pytest.approx(5.0 * 6 / 16)
    assert sum(got.values()) == pytest.approx(14.0)


def test_run_goodput_carries_the_causes_and_metrics_sum_them(con):
    good = views.run_goodput(con, "heal")
    assert good["wall_s"] == pytest.approx(14.0)
    assert {c["cause"] for c in good["causes"]} >= {"productive", "recovery", "detection"}
    assert all("run_id" not in c for c in good["causes"])
    assert queries.goodput_seconds(con, "heal") == pytest.approx(
        {"idle": 3.5, "productive": 4.5, "slowdown": 0.5, "checkpoint": 0.5, "skipped": 1.0, "detection": 1.0,
         "redone": 1.0, "recovery": 2.0})


def test_the_cost_models_inputs_from_the_tables(con):
    """queries.cost_inputs: the run's last step (its config), start-up, checkpoints, measured
    restarts (decision to first new step, auto and done only), nodes, and a rebalance's replicas
    (the world size now over tp x pp: a restart left 2 of the 4 ranks of a pp2 job) and micro-batches
    (the global batch's: dp x micro_batches of the config)."""
    from analysis.policy import RunPolicy, apply_cost_inputs

    con.execute("""UPDATE runs SET world_size = 2, config = '{"steps": 500, "parallel": {"dp": 2, "tp": 1, "pp": 2,
                   "micro_batches": 3}}' WHERE run_id = 'heal'""")
    for step in (2, 4, 6):
        con.execute("INSERT INTO checkpoints (run_id, step, attempt, ts) VALUES ('heal', ?, 0, 1000)", [step])
    con.execute("INSERT INTO actions (id, run_id, kind, status, mode, requested_ts, finished_ts) VALUES "
                "(2, 'heal', 'isolate', 'done', 'auto', 1020, 1024.5), (3, 'heal', 'restart', 'done', 'shadow', 1, 9),"
                " (4, 'heal', 'restart', 'failed', 'auto', 1, 9)")
    con.execute("INSERT INTO nodes (run_id, node, status, updated_ts) VALUES ('heal', 'node1', 'isolated', 1000), "
                "('heal', 'node2', 'spare', 1000)")  # a spare is no node of the job, one to take a place
    con.execute("INSERT INTO ranks (run_id, rank, node, first_seen_ts, last_seen_ts) VALUES "
                "('heal', 0, 'node0', 1000, 1000)")
    got = queries.cost_inputs(con, "heal")
    assert got == {"steps_total": 500, "startup_s": 3.0 - 0.0, "ckpt_steps": [2, 4, 6], "restart_costs": [4.5],
                   "nodes": ["node0", "node1"], "spares": ["node2"], "dp": 1,
                   "micro_batches": 6}  # the first step ended at 1003, started 1000
    st = RunPolicy(run_id="heal")
    apply_cost_inputs(st, got, reached=5)
    assert (st.reached, st.ckpt_step, st.steps_total, st.nodes, st.spares) == (5, 4, 500, ["node0", "node1"], 1)
    assert (st.dp, st.micro_batches) == (1, 6)
    open_ended = queries.cost_inputs(con, "restart")
    assert open_ended["steps_total"] is None  # no steps in its config: open-ended
    assert (open_ended["dp"], open_ended["micro_batches"]) == (None, None)  # not our trainer: no rebalance
