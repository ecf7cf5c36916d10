"""docs/postmortem.md's queries, each run on a real faulted run, each answer checked
against what was injected (tests/integration/faulted_run.py): a straggler on rank 3
(node1) from step 10, a transient NaN on rank 1 (node0) at step 25 under fp16.

Every query runs through `run_select`, the guard the HTTP route (`POST /v1/sql`, via
Storage.sql) and `collector sql --db` run: it passes the allow-list as written."""

from __future__ import annotations

import json
import math

import pytest

from collector import cli
from collector.sql.guard import run_select
from collector.storage import connect
from tests.docs_sql import sql_blocks
from tests.integration.faulted_run import CHECKPOINT_EVERY, NAN, NUM_STEPS, STRAGGLER, WORLD_SIZE, faulted_run

pytestmark = [pytest.mark.integration, pytest.mark.slow]

QUERIES = sql_blocks()


@pytest.fixture(scope="module")
def answers():
    """name -> rows as dicts, every cookbook query once."""
    run = faulted_run()
    con = connect(run.db, read_only=True)
    try:
        out = {}
        for name, sql in QUERIES.items():
            r = run_select(con, sql, max_rows=10_000, timeout_s=30)
            assert not r.truncated, name
            out[name] = [dict(zip(r.columns, row)) for row in r.rows]
        out["_has_local_flags"] = con.execute(
            "SELECT count(finite_fwd) > 0 FROM steps WHERE run_id = 'demo'").fetchall()[0][0]
        return out
    finally:
        con.close()


def test_the_cookbook_is_big_enough():
    assert len(QUERIES) >= 10
    assert {"slowest_rank_per_step", "comm_by_axis", "who_waited_for_whom", "incidents_by_node",
            "time_lost_per_incident", "first_nonfinite_step"} <= set(QUERIES)


def test_the_straggler_node_had_a_fault_in_the_run_and_the_other_none(answers):
    rows = {r["node"]: r for r in answers["node_fault_runs"]}
    assert set(rows) == {f"node{n}" for n in range(2)}, rows
    assert (rows[STRAGGLER["node"]]["runs"], rows[STRAGGLER["node"]]["fault_runs"]) == (1, 1), rows
    assert rows[STRAGGLER["node"]]["faults"] >= 1 and answers["node_fault_runs"][0]["node"] == STRAGGLER["node"]
    assert all(r["fault_runs"] == 0 for n, r in rows.items() if n != STRAGGLER["node"]), rows  # a NaN is the data's


def test_slowest_rank_is_the_straggler(answers):
    rows = answers["slowest_rank_per_step"]
    assert [r["step"] for r in rows] == list(range(1, NUM_STEPS + 1))
    after = [r for r in rows if r["step"] >= STRAGGLER["from_step"] + 2]
    slow = [r for r in after if r["slowest_rank"] == STRAGGLER["rank"]]
    assert len(slow) >= 0.8 * len(after), [(r["step"], r["slowest_rank"]) for r in after]
    assert all(r["node"] == STRAGGLER["node"] for r in slow)
    assert sorted(r["slowdown"] for r in slow)[len(slow) // 2] > 1.5  # factor 3 on its compute


def test_the_straggler_computes_most_and_waits_least(answers):
    rows = answers["compute_and_exposed_comm_per_rank"]
    assert rows[0]["rank"] == STRAGGLER["rank"] and len(rows) == WORLD_SIZE
    assert min(rows, key=lambda r: r["exposed_share"])["rank"] == STRAGGLER["rank"]


def test_comm_by_axis_splits_exposed_and_overlapped(answers):
    rows = answers["comm_by_axis"]
    assert {("tp", "all_reduce"), ("dp", "all_reduce")} <= {(r["axis"], r["op"]) for r in rows}
    for r in rows:
        assert 0 <= r["exposed_share"] <= 1.01, r
        assert r["exposed_s"] + r["overlapped_s"] >= r["total_s"] - 0.002, r
    assert [r["exposed_s"] for r in rows] == sorted((r["exposed_s"] for r in rows), reverse=True)


def test_everyone_waited_for_the_straggler(answers):
    rows = answers["who_waited_for_whom"]
    top = rows[0]
    assert (top["waited_for_rank"], top["node"]) == (STRAGGLER["rank"], STRAGGLER["node"]), rows
    # the culprit of most steps since the slowdown began, not of a stall or two
    assert top["num_steps_culprit"] >= 0.6 * (NUM_STEPS - STRAGGLER["from_step"]), rows
    assert all(top["num_steps_culprit"] > 2 * r["num_steps_culprit"] for r in rows[1:]), rows


def test_incidents_by_node(answers):
    rows = {(r["node"], r["kind"]): r for r in answers["incidents_by_node"]}
    straggler = rows[(STRAGGLER["node"], "straggler")]
    # rank 3, or node1 as a whole when the detector names rank 3's TP partner with it (no rank
    # column then: the incident's evidence lists its ranks, and rank 3 must be among them)
    if straggler["ranks"] is None:
        con = connect(faulted_run().db, read_only=True)
        try:
            named = [json.loads(e)["ranks"] for (e,) in con.execute(
                "SELECT evidence FROM incidents WHERE run_id = 'demo' AND kind = 'straggler' AND node = ?",
                [STRAGGLER["node"]]).fetchall()]
        finally:
            con.close()
        assert named and all(STRAGGLER["rank"] in r for r in named), named
    else:
        assert STRAGGLER["rank"] in straggler["ranks"], rows
    # open at the end, the slowdown lasted; (its range may start a few steps early: first_step
    # is not asserted)
    assert straggler["still_open"] >= 1 and straggler["last_step"] >= NUM_STEPS - 5, rows
    # a healthy rank that looked slow for a few steps on two loaded cores: closed again
    assert all(r["still_open"] == 0 for (node, kind), r in rows.items()
               if kind == "straggler" and node != STRAGGLER["node"]), rows
    nan_node = NAN["node"] if answers["_has_local_flags"] else "(run-wide)"
    nan = rows[(nan_node, "nan")]
    assert nan["first_step"] == NAN["step"] and nan["still_open"] == 0  # transient: it closed


def test_time_lost_per_incident(answers):
    rows = answers["time_lost_per_incident"]
    straggler = max((r for r in rows if r["kind"] == "straggler" and r["node"] == STRAGGLER["node"]),
                    key=lambda r: r["lost_s"])
    assert straggler["rank"] in (STRAGGLER["rank"], None), rows
    assert straggler["lost_s"] == pytest.approx(straggler["cost_s_per_step"] * straggler["num_steps"], rel=1e-3)
    assert straggler["lost_s"] > 0.2
    (nan,) = [r for r in rows if r["kind"] == "nan"]
    assert nan["num_skipped"] == 1 and nan["lost_s"] > 0  # the one skipped step, what it took
    assert rows[0]["kind"] == "straggler"  # 27 slow steps cost more than one skipped one


def test_goodput_by_cause_adds_up_and_names_the_straggler_and_the_skip(answers):
    rows = answers["goodput_by_cause"]
    assert sum(r["pct"] for r in rows) == pytest.approx(100.0, abs=0.5)
    by = {(r["cause"], r["incident_id"]): r for r in rows}
    assert by[("productive", None)]["pct"] > 50, rows
    assert by[("skipped", None)]["num_steps"] == 1  # the NaN's step
    slow = [r for r in rows if r["cause"] == "slowdown"]
    assert slow and all(r["incident_id"] is not None and r["seconds"] > 0 for r in slow), rows
    straggler_ids = {r["id"] for r in answers["time_lost_per_incident"] if r["kind"] == "straggler"}
    assert {r["incident_id"] for r in slow} <= straggler_ids | {
        r["id"] for r in answers["time_lost_per_incident"] if r["kind"] in ("slow_link", "data_stall")}


def test_first_nonfinite_step_and_origin(answers):
    (row,) = answers["first_nonfinite_step"]
    assert (row["attempt"], row["step"]) == (0, NAN["step"])
    assert NAN["rank"] in row["nonfinite_ranks"]
    if answers["_has_local_flags"]:
        assert (row["signal"], row["origin_rank"]) == ("forward", NAN["rank"])
    else:  # agents without finite_fwd/finite_bwd/local_loss: every rank's reduced loss, origin unknown
        assert (row["signal"], row["origin_rank"]) == ("reduced loss/grad-norm", None)
        assert row["nonfinite_ranks"] == list(range(WORLD_SIZE))


def test_one_loss_scale_backoff_at_the_nan(answers):
    (row,) = answers["loss_scale_backoffs"]
    assert row["step"] == NAN["step"] and row["skipped"] is True
    assert row["scale_before"] == 2 * row["scale_after"]


def test_tokens_per_s_counts_the_global_batch_once(answers):
    rows = answers["tokens_per_s_over_time"]
    metrics = {m["step"]: m for m in faulted_run().run.metrics()}
    assert [r["step"] for r in rows] == list(range(1, NUM_STEPS + 1))
    for r in rows:
        assert r["tokens_per_s"] == pytest.approx(r["tokens"] / r["step_s"], rel=0.01, abs=1)
        # rank 0's own tokens/s: the step took at least as long as rank 0's part of it
        assert r["tokens_per_s"] <= metrics[r["step"]]["tokens_per_s"] * 1.01 + 1


def test_checkpoint_write_times(answers):
    rows = answers["checkpoint_write_times"]
    assert [r["step"] for r in rows] == list(range(CHECKPOINT_EVERY, NUM_STEPS + 1, CHECKPOINT_EVERY))
    assert all(r["num_ranks"] == r["world_size"] == WORLD_SIZE and r["verified"] for r in rows)
    assert all(r["write_s"] > 0 and r["bytes"] > 0 for r in rows)


def test_heartbeats_had_no_long_gap(answers):
    rows = answers["heartbeat_gaps_per_rank"]
    assert sorted(r["rank"] for r in rows) == list(range(WORLD_SIZE))
    for r in rows:  # about one a second, nobody hung or crashed
        assert 0.5 <= r["median_gap_s"] <= 2.0 and r["max_gap_s"] < 5.0, r


def test_loss_curve_has_one_attempt_and_the_nan(answers):
    rows = answers["loss_curve_attempts"]
    assert len(rows) == NUM_STEPS and all(r["attempt"] == 0 and r["effective"] for r in rows)
    assert [r["step"] for r in rows if not math.isfinite(r["loss"])] == [NAN["step"]]


def test_checkpoint_timeline_ends_with_the_finish(answers):
    rows = answers["checkpoint_timeline"]
    assert [r["step"] for r in rows if r["what"] == "checkpoint"] == list(range(CHECKPOINT_EVERY, NUM_STEPS + 1, CHECKPOINT_EVERY))
    assert rows[-1]["what"] == "run_finished"


def test_no_telemetry_was_dropped(answers):
    rows = answers["telemetry_drops"]
    assert len(rows) == WORLD_SIZE and all(r["agent_drops"] == 0 and r["batches"] > 0 for r in rows)


def test_a_query_as_the_docs_say_to_run_it(capsys):
    """`collector sql --db FILE --format json "..."`, verbatim from the page."""
    assert cli.main(["sql", "--db", str(faulted_run().db), "--format", "json",
                     QUERIES["who_waited_for_whom"]]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["rows"][0][out["columns"].index("waited_for_rank")] == STRAGGLER["rank"]
