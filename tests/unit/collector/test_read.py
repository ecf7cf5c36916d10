"""The read side: the same function answers the same on the live collector and
on its file once closed (opened read-only), which is what an offline replay and
the dashboard's file mode read."""

from __future__ import annotations

import numpy as np
import pytest

from agent import wire
from analysis.findings import Finding
from collector.ingest.decode import decode
from collector.read import queries
from collector.settings import Settings, WriterSettings
from collector.storage import Storage, connect
from tests.unit.collector.collector_batches import columns, make_batch, steps_section

RUN = {"run_id": "run1", "config": {"lr": 0.001}, "mesh": {"dp": 2, "tp": 1, "pp": 1}, "world_size": 2,
       "node_map": {"0": "n0", "1": "n1"}, "code_version": "abc", "data_version": "v1", "started_ts": 1.0}

# every read function, with the arguments to call it with
QUERIES = [
    (queries.runs, (), {}),
    (queries.run, ("run1",), {}),
    (queries.run, ("missing",), {}),
    (queries.open_incidents, (), {}),
    (queries.steps, ("run1", "loss"), {"max_points": 7}),
    (queries.steps, ("run1", "step_s"), {"rank": 1, "step_from": 3, "step_to": 30}),
    (queries.steps, ("run1", "eval_loss"), {}),
    (queries.step_summary, ("run1",), {"limit": 5}),
    (queries.ranks, ("run1",), {}),
    (queries.collectives, ("run1",), {"last_steps": 3}),
    (queries.incidents, ("run1",), {}),
    (queries.incidents, ("run1",), {"status": "open"}),
    (queries.actions, ("run1",), {}),
    (queries.checkpoints, ("run1",), {}),
    (queries.nodes, ("run1",), {}),
    (queries.events, ("run1",), {"limit": 10}),
    (queries.events, ("run1",), {"kind": "checkpoint_saved"}),
    (queries.heartbeats_latest, ("run1",), {}),
    (queries.commands, ("run1",), {}),
]


def populate(storage: Storage) -> None:
    events = [{"ts": 5.0, "step": 10, "attempt": 0, "kind": "checkpoint_saved",
               "data": {"step": 10, "path": "/ck/10", "num_shards": 1, "bytes": 10, "checksums": ["a"],
                        "write_s": 0.5, "verified": True}}]
    for rank in (0, 1):
        coll = columns(wire.COLLECTIVE, 20, step=np.arange(20), attempt=0, op=0, axis=0, bytes=100,
                       duration_s=0.5 + rank, wait_s=0.25 * rank)
        hb = columns(wire.HEARTBEAT, 2, ts=[10.0 + rank, 11.0 + rank], step=[18, 19], phase=1, last_seq=[5, 6])
        scal = columns(wire.SCALAR, 3, step=[5, 10, 15], attempt=0, ts=1.0, name=0, value=[2.0, 1.5, 1.2])
        storage.ingest_blocking(decode(make_batch(
            rank=rank, run=RUN if rank == 0 else None, events=events if rank == 0 else [],
            sections={wire.STEP: steps_section(range(20), loss=np.linspace(3, 1, 20) + rank, step_s=1.0 + rank),
                      wire.COLLECTIVE: (20, coll), wire.HEARTBEAT: (2, hb), wire.SCALAR: (3, scal)})))
        storage.ingest_blocking(decode(make_batch(  # a rollback re-ran steps 15-19
            rank=rank, batch_seq=1, sections={wire.STEP: steps_section(range(15, 20), attempt=1, loss=0.5)})))
    storage.issue_command("run1", "checkpoint", {}, None).result(10)
    storage.record_findings("run1", [Finding(kind="straggler", key="straggler:n1#1", run_id="run1", rank=1, node="n1",
                                             step_from=4, evidence={"ratio": 2.0})]).result(10)
    iid = storage.open_incident("run1", "hang", "critical", rank=0).result(10)
    storage.update_incident(iid, status="closed").result(10)
    storage.record_action("run1", "isolate", "done", incident_id=iid, detail={"node": "n1"}).result(10)
    storage.set_node_status("run1", "n1", "suspect", "straggler").result(10)


def test_the_same_answers_live_and_on_the_closed_file(tmp_path):
    path = tmp_path / "r.duckdb"
    storage = Storage(Settings(db_path=path, writer=WriterSettings(linger_s=0.0, min_interval_s=0.0)))
    try:
        populate(storage)
        live = [storage.read(fn, *args, **kwargs) for fn, args, kwargs in QUERIES]
    finally:
        storage.close()
    con = connect(path, read_only=True)
    try:
        closed = [fn(con, *args, **kwargs) for fn, args, kwargs in QUERIES]
    finally:
        con.close()
    for (fn, args, kwargs), a, b in zip(QUERIES, live, closed):
        assert a == b, (fn.__name__, args, kwargs)
    # and they are answers, not empty lists
    by_name = {(fn.__name__, args, tuple(kwargs.items())): r for (fn, args, kwargs), r in zip(QUERIES, closed)}
    assert by_name[("run", ("run1",), ())]["world_size"] == 2
    assert by_name[("run", ("missing",), ())] is None
    assert by_name[("open_incidents", (), ())] == {"run1": 1}
    assert len(by_name[("steps", ("run1", "loss"), (("max_points", 7),))]) == 7
    assert [r["num_points"] for r in by_name[("steps", ("run1", "eval_loss"), ())]] == [2, 2, 2]
    assert [r["step"] for r in by_name[("step_summary", ("run1",), (("limit", 5),))]] == [15, 16, 17, 18, 19]
    assert [r["rank"] for r in by_name[("ranks", ("run1",), ())]] == [0, 1]
    assert {r["step"] for r in by_name[("collectives", ("run1",), (("last_steps", 3),))]} == {17, 18, 19}
    assert [(i["kind"], i["status"]) for i in by_name[("incidents", ("run1",), ())]] == [
        ("straggler", "open"), ("hang", "closed")]
    assert by_name[("actions", ("run1",), ())][0]["detail"] == {"node": "n1"}
    assert by_name[("checkpoints", ("run1",), ())][0]["path"] == "/ck/10"
    assert [(n["node"], n["status"]) for n in by_name[("nodes", ("run1",), ())]] == [("n0", "healthy"),
                                                                                    ("n1", "suspect")]
    assert [h["last_seq"] for h in by_name[("heartbeats_latest", ("run1",), ())]] == [6, 6]
    assert by_name[("commands", ("run1",), ())][0]["ranks"] == [0, 1]


def test_a_job_with_only_local_losses_has_their_mean_as_its_loss_curve(tmp_path):
    """agent.watch records each rank's own loss (`local_loss`) and no global one: the curves
    the dashboard draws are the mean over the ranks, what data parallelism averages."""
    from collector.read import views

    storage = Storage(Settings(db_path=tmp_path / "w.duckdb", writer=WriterSettings(linger_s=0.0, min_interval_s=0.0)))
    try:
        for rank in (0, 1):
            storage.ingest_blocking(decode(make_batch(
                rank=rank, run=RUN if rank == 0 else None,
                sections={wire.STEP: steps_section(range(1, 4), loss=wire.NULL_F64, local_loss=1.0 + 2 * rank,
                                                      local_loss_valid=1)})))
        overview = storage.read(views.overview, "run1")
        window = storage.read(queries.step_window, "run1", step_from=1, step_to=3)
        curve = storage.read(queries.steps, "run1", "loss")
    finally:
        storage.close()
    assert [r["loss"] for r in overview] == [2.0, 2.0, 2.0]
    assert [r["loss"] for r in window] == [2.0, 2.0, 2.0]
    assert [r["avg"] for r in curve] == [2.0, 2.0, 2.0]


def test_a_read_only_connection_cannot_write(tmp_path):
    path = tmp_path / "w.duckdb"
    Storage(Settings(db_path=path)).close()
    con = connect(path, read_only=True)
    try:
        assert queries.runs(con) == []
        with pytest.raises(Exception, match="read-only"):
            con.execute("INSERT INTO runs (run_id, created_ts, updated_ts) VALUES ('x', 0, 0)")
    finally:
        con.close()


def test_ranks_compare_within_their_restart_round(tmp_path):
    """The demo: node1 (ranks 2, 3; rank 3 a 1.35x straggler) isolated, the job restarted on node0
    with the same global batch, so its ranks computed twice the micro-batches a step. Over the whole
    run rank 3 looked faster than the median (0.93x); within round 0 it is 1.35x, and the restarted
    round's ranks are 1.0x of theirs."""
    from collector.read import views
    from dashboard.pages import ranks as page

    storage = Storage(Settings(db_path=tmp_path / "d.duckdb", writer=WriterSettings(linger_s=0.0, min_interval_s=0.0)))
    started = [{"ts": 1.0, "step": 0, "attempt": 0, "kind": "run_started", "data": {"restart": 0, "attempt_floor": 0}}]
    again = [{"ts": 90.0, "step": 60, "attempt": 2, "kind": "run_started", "data": {"restart": 1, "attempt_floor": 2}}]
    try:
        for rank in range(4):
            compute = 0.135 if rank == 3 else 0.1
            storage.ingest_blocking(decode(make_batch(
                rank=rank, run=RUN if rank == 0 else None, events=started,
                sections={wire.STEP: steps_section(range(1, 61), step_s=0.15, fwd_s=compute / 2, bwd_s=compute / 2,
                                                      opt_s=0.0)})))
        for rank in range(2):
            storage.ingest_blocking(decode(make_batch(
                rank=rank, batch_seq=1, incarnation="inc1", events=again,
                sections={wire.STEP: steps_section(range(61, 161), attempt=2, step_s=0.25, fwd_s=0.1, bwd_s=0.1,
                                                      opt_s=0.0)})))
        rows = storage.read(views.rank_rounds, "run1")
        whole = storage.read(views.rank_time, "run1")
    finally:
        storage.close()
    assert [(r["round"], r["rank"], r["num_steps"]) for r in rows] == [(0, 0, 60), (0, 1, 60), (0, 2, 60), (0, 3, 60),
                                                                      (1, 0, 100), (1, 1, 100)]
    table = page.slowest_table(rows)
    assert (table[0]["rank"], table[0]["round"], table[0]["node"], table[0]["compute_ratio"]) == (3, 0, "node1", 1.35)
    assert {(t["round"], t["rank"]): t["compute_ratio"] for t in table[1:]} == {
        (0, 0): 1.0, (0, 1): 1.0, (0, 2): 1.0, (1, 0): 1.0, (1, 1): 1.0}
    # over the whole run, the median rank carries the restarted round's bigger steps
    median = sorted(r["compute_s"] for r in whole)[1:3]
    assert next(r["compute_s"] for r in whole if r["rank"] == 3) < sum(median) / 2
