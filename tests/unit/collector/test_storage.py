"""Storage round trips: batches built with encode_batch in, exact values out."""

from __future__ import annotations

import math
from concurrent.futures import Future

import numpy as np
import pytest

from agent import wire
from collector.ingest.decode import decode
from collector.read import queries
from collector.storage import Storage
from tests.unit.collector.collector_batches import columns, make_batch, steps_section


def ingest(storage: Storage, body: bytes):
    return storage.ingest_blocking(decode(body))


def rows(storage: Storage, sql: str, params=None):
    with storage.cursor() as cur:
        return cur.execute(sql, params or []).fetchall()


def test_steps_round_trip_exact_values(storage):
    n = 3
    given = dict(loss=[2.5, float("nan"), 1.25], grad_norm=[0.5, 0.25, 0.125], loss_scale=65536.0,
                 lr=[1e-4, 2e-4, 3e-4], tokens=[4096, 4097, 4098], step_s=[0.1, 0.2, 0.3], fwd_s=0.01,
                 bwd_s=0.02, opt_s=0.03, data_s=0.04, comm_exposed_s=0.05, mem_bytes=2**40, skipped=[0, 1, 0],
                 ts=[1000.5, 1001.5, 1002.5])
    out = ingest(storage, make_batch(rank=3, sections={wire.STEP: steps_section([7, 8, 9], attempt=2, **given)}))
    assert (out.accepted, out.duplicate, out.commands) == (3, False, [])
    got = rows(storage, """SELECT run_id, attempt, step, rank, ts, loss, grad_norm, loss_scale, lr, tokens, step_s,
                                  fwd_s, bwd_s, opt_s, data_s, comm_exposed_s, mem_bytes, skipped, node
                           FROM steps ORDER BY step""")
    assert len(got) == n
    assert got[0] == ("run1", 2, 7, 3, 1000.5, 2.5, 0.5, 65536.0, 1e-4, 4096, 0.1, 0.01, 0.02, 0.03, 0.04, 0.05,
                      2**40, False, "node1")
    assert math.isnan(got[1][5]) and got[1][17] is True  # NaN loss is kept, skipped decoded


def test_collectives_scalars_heartbeats_events(storage):
    coll = columns(wire.COLLECTIVE, 2, step=5, attempt=0, seq=[10, 11], group_seq=[3, 4], op=[1, 0], axis=[0, 1],
                   group_id=[0, 2], peer=-1, bytes=[1 << 20, 1 << 10], start_ts=[10.0, 10.5],
                   duration_s=[0.25, 0.5], wait_s=[0.125, 0.0])
    scal = columns(wire.SCALAR, 1, step=5, attempt=1, ts=11.0, name=1, value=3.5)
    hb = columns(wire.HEARTBEAT, 1, ts=12.0, step=5, phase=1, last_seq=11)
    events = [{"ts": 13.0, "step": 5, "attempt": 0, "kind": "restart", "data": {"reason": "test", "n": [1, 2]}}]
    out = ingest(storage, make_batch(rank=1, sections={wire.COLLECTIVE: (2, coll), wire.SCALAR: (1, scal),
                                                       wire.HEARTBEAT: (1, hb)}, events=events))
    assert out.accepted == 5
    assert rows(storage, "SELECT seq, group_seq, op, axis, group_id, peer, bytes, start_ts, duration_s, wait_s, rank "
                         "FROM collectives ORDER BY seq") == [
        (10, 3, "all_gather", "dp", 0, -1, 1 << 20, 10.0, 0.25, 0.125, 1),
        (11, 4, "all_reduce", "tp", 2, -1, 1 << 10, 10.5, 0.5, 0.0, 1)]
    assert rows(storage, "SELECT attempt, step, rank, ts, name, value, attrs FROM scalars") == [
        (1, 5, 1, 11.0, "eval_ppl", 3.5, None)]
    assert rows(storage, "SELECT rank, ts, node, pid, phase, step, last_seq FROM heartbeats") == [
        (1, 12.0, "node0", 101, "backward", 5, 11)]
    assert rows(storage, "SELECT rank, ts, step, attempt, kind, data->>'reason', data->'n' FROM events") == [
        (1, 13.0, 5, 0, "restart", "test", "[1,2]")]


def test_dictionaries_differ_per_batch_within_one_group(storage):
    """Two batches with different dictionaries committed in one group keep their strings."""
    a = make_batch(rank=0, sections={wire.COLLECTIVE: (1, columns(wire.COLLECTIVE, 1, step=1, op=0, axis=0))},
                   dicts={"op": ["send"], "axis": ["pp"]})
    b = make_batch(rank=1, sections={wire.COLLECTIVE: (1, columns(wire.COLLECTIVE, 1, step=1, op=1, axis=0))},
                   dicts={"op": ["x", "recv"], "axis": ["embed"]})
    writer = storage._writer
    futures = [Future(), Future()]
    writer.submit_batch(decode(a), futures[0])  # queued back to back: one group
    writer.submit_batch(decode(b), futures[1])
    assert [f.result().accepted for f in futures] == [1, 1]
    assert rows(storage, "SELECT rank, op, axis FROM collectives ORDER BY rank") == [(0, "send", "pp"), (1, "recv", "embed")]


def test_duplicate_batch_stored_once_within_a_group_and_after(storage):
    body = make_batch(rank=2, batch_seq=5, sections={wire.STEP: steps_section([1, 2])})
    writer = storage._writer
    futures = [Future() for _ in range(3)]
    for f in futures:
        writer.submit_batch(decode(body), f)
    results = [f.result() for f in futures]
    assert sum(not r.duplicate for r in results) == 1
    assert [r.accepted for r in results if r.duplicate] == [0, 0]
    assert ingest(storage, body).duplicate
    assert rows(storage, "SELECT count(*) FROM steps") == [(2,)]
    assert rows(storage, "SELECT rank, incarnation, batch_seq, rows FROM batches") == [(2, "inc0", 5, 2)]
    # another incarnation with the same batch_seq is another batch
    assert not ingest(storage, make_batch(rank=2, batch_seq=5, incarnation="inc1",
                                          sections={wire.STEP: steps_section([3])})).duplicate


def test_dedupe_survives_reopen(settings):
    body = make_batch(batch_seq=7, sections={wire.STEP: steps_section([1])})
    first = Storage(settings)
    try:
        assert not ingest(first, body).duplicate
        assert not ingest(first, make_batch(batch_seq=9, sections={wire.STEP: steps_section([2])})).duplicate
    finally:
        first.close()
    second = Storage(settings)
    try:
        assert ingest(second, body).duplicate
        assert not ingest(second, make_batch(batch_seq=8, sections={wire.STEP: steps_section([3])})).duplicate
        assert rows(second, "SELECT count(*) FROM steps") == [(3,)]
    finally:
        second.close()


def test_run_info_nodes_checkpoints_and_status(storage):
    run = {"run_id": "run1", "config": {"lr": 0.001}, "mesh": {"dp": 2, "tp": 2, "pp": 1}, "world_size": 4,
           "node_map": {"0": "n0", "1": "n0", "2": "n1", "3": "n1"}, "code_version": "abc123",
           "data_version": "v1", "started_ts": 99.0}
    events = [{"ts": 5.0, "step": 10, "attempt": 0, "kind": "checkpoint_saved",
               "data": {"step": 10, "path": "/ck/10", "num_shards": 4, "bytes": 1234, "checksums": ["a", "b"],
                        "write_s": 0.5, "verified": False}},
              {"ts": 6.0, "step": 10, "attempt": 0, "kind": "checkpoint_verified", "data": {"step": 10}}]
    ingest(storage, make_batch(run=run, events=events, coords={"dp": 0, "tp": 0, "pp": 0},
                               stats={"dropped": {"step": 2, "collective": 3}}))
    (r,) = rows(storage, "SELECT status, config->>'lr', mesh->>'tp', world_size, code_version, data_version, "
                         "node_map->>'2', started_ts FROM runs")
    assert r == ("running", "0.001", "2", 4, "abc123", "v1", "n1", 99.0)
    assert rows(storage, "SELECT node, ranks, status FROM nodes ORDER BY node") == [
        ("n0", "[0,1]", "healthy"), ("n1", "[2,3]", "healthy")]
    assert rows(storage, "SELECT step, attempt, path, num_shards, bytes, checksums, verified, write_s, ts "
                         "FROM checkpoints") == [(10, 0, "/ck/10", 4, 1234, '["a","b"]', True, 0.5, 5.0)]
    assert rows(storage, "SELECT rank, node, dp, tp, pp, pid, incarnation, agent_drops FROM ranks") == [
        (0, "node0", 0, 0, 0, 100, "inc0", 5)]
    ingest(storage, make_batch(batch_seq=1, stats={"dropped": {"step": 1}},
                               events=[{"ts": 7.0, "kind": "run_finished", "data": {"status": "finished"}}]))
    assert rows(storage, "SELECT status FROM runs") == [("finished",)]
    assert rows(storage, "SELECT agent_drops FROM ranks") == [(6,)]


def test_views_effective_vs_history_after_rollback(storage):
    """Attempt 0 ran steps 0-5; a rollback to step 3 re-ran 3-5 as attempt 1."""
    for rank in (0, 1):
        ingest(storage, make_batch(rank=rank, batch_seq=0, sections={
            wire.STEP: steps_section(range(6), attempt=0, loss=np.arange(6) * 1.0, step_s=1.0 + rank)}))
        ingest(storage, make_batch(rank=rank, batch_seq=1, sections={
            wire.STEP: steps_section(range(3, 6), attempt=1, loss=np.arange(3, 6) * 0.5, step_s=2.0 - rank)}))
    assert rows(storage, "SELECT count(*) FROM steps_history") == [(18,)]
    assert rows(storage, "SELECT count(*) FROM steps_history WHERE effective") == [(12,)]
    effective = rows(storage, "SELECT step, attempt, loss FROM steps_effective WHERE rank = 0 ORDER BY step")
    assert effective == [(0, 0, 0.0), (1, 0, 1.0), (2, 0, 2.0), (3, 1, 1.5), (4, 1, 2.0), (5, 1, 2.5)]
    summary = rows(storage, "SELECT attempt, step, num_ranks, median_step_s, max_step_s, min_step_s, slowest_rank, "
                            "loss_mean FROM step_summary WHERE step = 4 ORDER BY attempt")
    assert summary == [(0, 4, 2, 1.5, 2.0, 1.0, 1, 4.0), (1, 4, 2, 1.5, 2.0, 1.0, 0, 2.0)]
    api = storage.read(queries.step_summary, "run1")
    assert [(r["step"], r["attempt"], r["slowest_rank"]) for r in api][-3:] == [(3, 1, 0), (4, 1, 0), (5, 1, 0)]


def test_step_summary_of_a_job_with_only_local_losses_is_the_ranks_mean(storage):
    """A job we did not write reports each rank's own loss (local_loss) and no global one."""
    for rank, local in ((0, 2.0), (1, 4.0)):
        ingest(storage, make_batch(rank=rank, sections={
            wire.STEP: steps_section(range(3), loss=wire.NULL_F64, local_loss=local + np.arange(3))}))
    assert rows(storage, "SELECT step, loss_mean FROM step_summary ORDER BY step") == [(0, 3.0), (1, 4.0), (2, 5.0)]


def test_steps_api_downsamples_effective_curve(storage):
    ingest(storage, make_batch(sections={wire.STEP: steps_section(range(100), loss=np.arange(100) * 1.0)}))
    ingest(storage, make_batch(batch_seq=1, sections={wire.STEP: steps_section(range(50, 60), attempt=1, loss=-1.0)}))
    points = storage.read(queries.steps, "run1", "loss", max_points=10)
    assert len(points) == 10
    assert points[0] == {"step": 0, "step_to": 9, "min": 0.0, "max": 9.0, "avg": 4.5, "num_points": 10}
    assert points[5]["min"] == points[5]["max"] == -1.0  # steps 50-59 from attempt 1
    assert storage.read(queries.steps, "run1", "loss", rank=5) == []
    assert storage.read(queries.steps, "nope", "loss") == []


def test_collective_summary_and_query_api(storage):
    coll = columns(wire.COLLECTIVE, 4, step=[1, 1, 2, 2], attempt=0, op=0, axis=0, bytes=100, duration_s=[1.0, 3.0, 2.0, 2.0],
                   wait_s=[0.5, 0.0, 0.0, 0.25])
    ingest(storage, make_batch(sections={wire.COLLECTIVE: (4, coll)}))
    got = storage.read(queries.collectives, "run1")
    assert [(r["step"], r["op"], r["axis"], r["num_ops"], r["bytes"], r["max_duration_s"], r["total_wait_s"])
            for r in got] == [(1, "all_reduce", "dp", 2, 200, 3.0, 0.5), (2, "all_reduce", "dp", 2, 200, 2.0, 0.25)]
    assert storage.read(queries.collectives, "run1", step_from=2, step_to=2)[0]["step"] == 2
    assert storage.read(queries.run, "run1")["num_ranks"] == 1
    assert storage.read(queries.run, "missing") is None
    assert [r["run_id"] for r in storage.read(queries.runs)] == ["run1"]


def test_incidents_actions_node_status(storage):
    ingest(storage, make_batch(sections={wire.STEP: steps_section([1])}))
    iid = storage.open_incident("run1", "straggler", "warning", rank=3, node="n1", evidence={"ratio": 1.5}).result()
    storage.update_incident(iid, root_cause="slow node", confidence=0.9).result()
    aid = storage.record_action("run1", "isolate", "running", incident_id=iid, dry_run=True).result()
    storage.finish_action(aid, "done", {"ok": True}).result()
    storage.set_node_status("run1", "n1", "isolated", "straggler").result()
    assert storage.read(queries.open_incidents) == {"run1": 1}
    storage.update_incident(iid, status="closed").result()
    (inc,) = storage.read(queries.incidents, "run1")
    assert (inc["status"], inc["root_cause"], inc["evidence"], inc["closed_ts"] is not None) == (
        "closed", "slow node", {"ratio": 1.5}, True)
    (act,) = storage.read(queries.actions, "run1")
    assert (act["status"], act["dry_run"], act["detail"], act["incident_id"]) == ("done", True, {"ok": True}, iid)
    assert [(n["node"], n["status"], n["reason"]) for n in storage.read(queries.nodes, "run1")] == [("n1", "isolated", "straggler")]
    with pytest.raises(ValueError):
        storage.open_incident("run1", "x", "info", colour="red")


def test_sql_is_read_only_on_storage(storage):
    ingest(storage, make_batch(sections={wire.STEP: steps_section([1, 2, 3])}))
    result = storage.sql("SELECT step FROM steps ORDER BY step", max_rows=2)
    assert (result.rows, result.truncated, result.types) == ([(1,), (2,)], True, ["BIGINT"])
    assert storage.sql("SELECT count(*) FROM steps", fmt="arrow").table.to_pylist() == [{"count_star()": 3}]



def test_the_launchers_spares_are_spare_nodes_until_one_takes_a_place(storage):
    """Rank 0 lists the spares left with the run: each is a `spare` node without ranks, not a node
    of the job (the cost model's inputs count it apart); once one is in the node map (it took an
    isolated node's place) it is `healthy` with its ranks, and an isolated node stays isolated."""
    run = {"run_id": "run1", "world_size": 4, "node_map": {"0": "node0", "1": "node0", "2": "node1", "3": "node1"},
           "spares": ["node2"]}
    ingest(storage, make_batch(run=run))
    assert rows(storage, "SELECT node, ranks, status FROM nodes ORDER BY node") == [
        ("node0", "[0,1]", "healthy"), ("node1", "[2,3]", "healthy"), ("node2", None, "spare")]
    inputs = storage.read(queries.cost_inputs, "run1")
    assert (inputs["nodes"], inputs["spares"]) == (["node0", "node1"], ["node2"])
    storage.set_node_status("run1", "node1", "isolated", "straggler").result(timeout=10)
    ingest(storage, make_batch(batch_seq=1, incarnation="inc1", run={
        **run, "node_map": {"0": "node0", "1": "node0", "2": "node2", "3": "node2"}, "spares": []}))
    assert rows(storage, "SELECT node, ranks, status FROM nodes ORDER BY node") == [
        ("node0", "[0,1]", "healthy"), ("node1", "[2,3]", "isolated"), ("node2", "[2,3]", "healthy")]
    assert storage.read(queries.cost_inputs, "run1")["spares"] == []


def _row_groups(con, table: str) -> list[int]:
    """The rows of each of `table`'s row groups (its first column's segments, summed)."""
    return [n for (n,) in con.execute(f"SELECT sum(count) FROM pragma_storage_info('{table}') WHERE column_path = '[0]' "
                                      "GROUP BY row_group_id ORDER BY row_group_id").fetchall()]


def test_the_collectors_tables_are_written_in_row_groups_a_group_commit_fills(tmp_path):
    """A transaction that appends a whole row group writes it straight to the file instead of
    through the WAL (half the cost a row): at DuckDB's 122,880 rows, a group commit of 16
    clients' batches (64,000 collective rows) never did. Every writable open sets the size
    (DuckDB keeps it per attach, not in the file)."""
    from collector.storage import ROW_GROUP_ROWS, connect

    path = tmp_path / "telemetry.duckdb"
    for _ in range(2):  # created, then reopened
        con = connect(path)
        con.execute("CREATE TABLE IF NOT EXISTS t (i BIGINT, x DOUBLE)")
        con.execute("INSERT INTO t SELECT range, range * 0.5 FROM range(80000)")
        con.execute("CHECKPOINT")
        con.close()
    con = connect(path, read_only=True)
    sizes = _row_groups(con, "t")
    con.close()
    assert sum(sizes) == 160_000 and max(sizes) == ROW_GROUP_ROWS and len(sizes) >= -(-160_000 // ROW_GROUP_ROWS)
    # a file whose name is one DuckDB gives its own databases still opens, in DuckDB's default groups
    for name in ("memory", "temp"):
        con = connect(tmp_path / f"{name}.duckdb")
        con.execute("CREATE TABLE t AS SELECT range AS i FROM range(130000)")
        con.close()
        con = connect(tmp_path / f"{name}.duckdb", read_only=True)  # in the file, not in a scratch database
        assert con.execute("SELECT count(*) FROM t").fetchone() == (130_000,)
        assert max(_row_groups(con, "t")) > ROW_GROUP_ROWS
        con.close()
