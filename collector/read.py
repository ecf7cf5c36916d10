"""The read side: every query the query API, the CLI and an offline replay run.

Plain functions over a DuckDB cursor (or connection), returning rows as dicts
with JSON columns parsed. They hold no state and need no `Storage`: the live
collector calls them on a cursor of its own (`Storage.cursor()`, beside the
writer's transactions), and anything else on a closed file opened with
`collector.storage.connect(path, read_only=True)`. Routes hold no SQL; this
module holds it all.
"""

from __future__ import annotations

import json
from typing import Any

import duckdb
import pyarrow as pa

Cursor = duckdb.DuckDBPyConnection
Rows = list[dict[str, Any]]

STEP_METRICS = ("loss", "grad_norm", "loss_scale", "lr", "tokens", "step_s", "fwd_s", "bwd_s", "opt_s",
                "data_s", "comm_exposed_s", "mem_bytes")


def records(cur: Cursor, sql: str, params: list | None = None) -> Rows:
    """Rows as dicts; JSON columns parsed."""
    cur.execute(sql, params or [])
    names = [d[0] for d in cur.description]
    is_json = [str(d[1]) == "JSON" for d in cur.description]
    return [{n: (json.loads(v) if j and v is not None else v) for n, j, v in zip(names, is_json, row)}
            for row in cur.fetchall()]


def _one(cur: Cursor, sql: str, params: list) -> Any:
    (value,), = cur.execute(sql, params).fetchall()
    return value


def open_incidents(cur: Cursor) -> dict[str, int]:
    """run_id -> number of open incidents (runs without any left out)."""
    rows = records(cur, "SELECT run_id, count(*) AS n FROM incidents WHERE status = 'open' GROUP BY run_id")
    return {r["run_id"]: r["n"] for r in rows}


def runs(cur: Cursor) -> Rows:
    return records(cur, """
        SELECT run_id, status, created_ts, updated_ts, started_ts, world_size, code_version, data_version
        FROM runs ORDER BY created_ts DESC""")


def run(cur: Cursor, run_id: str) -> dict[str, Any] | None:
    rows = records(cur, """
        SELECT r.*,
               (SELECT count(*) FROM ranks k WHERE k.run_id = r.run_id) AS num_ranks,
               (SELECT max(step) FROM steps s WHERE s.run_id = r.run_id) AS last_step,
               (SELECT max(attempt) FROM steps s WHERE s.run_id = r.run_id) AS last_attempt,
               (SELECT count(*) FROM incidents i WHERE i.run_id = r.run_id AND i.status = 'open') AS open_incidents
        FROM runs r WHERE run_id = ?""", [run_id])
    return rows[0] if rows else None


def steps(cur: Cursor, run_id: str, metric: str, *, rank: int | None = None, step_from: int | None = None,
          step_to: int | None = None, max_points: int = 2000) -> Rows:
    """A metric's effective curve, downsampled to at most `max_points` buckets of
    equal step width (min/max/avg per bucket, over the ranks asked for), so a
    chart of a million steps costs one small answer. `metric` is a steps column
    or else a scalar name."""
    if metric in STEP_METRICS:
        source, params = f"SELECT step, rank, {metric} AS v FROM steps_effective WHERE run_id = ?", [run_id]
    else:
        source = """SELECT step, rank, value AS v FROM scalars WHERE run_id = ? AND name = ?
                    QUALIFY attempt = max(attempt) OVER (PARTITION BY step, rank)"""
        params = [run_id, metric]
    conds = [(c, v) for c, v in (("rank = ?", rank), ("step >= ?", step_from), ("step <= ?", step_to))
             if v is not None]
    filt = f"WHERE {' AND '.join(c for c, _ in conds)}" if conds else ""
    return records(cur, f"""
        WITH s AS (SELECT * FROM ({source}) {filt}),
             w AS (SELECT min(step) AS lo,
                          greatest(1, ceil((max(step) - min(step) + 1) / ?))::BIGINT AS width FROM s)
        SELECT min(step) AS step, max(step) AS step_to, min(v) AS min, max(v) AS max, avg(v) AS avg,
               count(*) AS num_points
        FROM s, w GROUP BY (step - lo) // width ORDER BY 1""",
                   [*params, *(v for _, v in conds), max(1, int(max_points))])


def step_summary(cur: Cursor, run_id: str, *, step_from: int | None = None, step_to: int | None = None,
                 limit: int = 2000) -> Rows:
    """Per step of the effective attempt: median/max/min step_s, slowest rank, mean loss.
    The latest `limit` steps of the range."""
    if step_from is None:  # aggregate only the steps that can be returned
        last = _one(cur, "SELECT max(step) FROM steps WHERE run_id = ? AND step <= coalesce(?, step)",
                    [run_id, step_to])
        step_from = None if last is None else last - limit + 1
    return records(cur, """
        SELECT * FROM (
            SELECT * FROM step_summary WHERE run_id = ? AND step >= coalesce(?, step) AND step <= coalesce(?, step)
            QUALIFY attempt = max(attempt) OVER (PARTITION BY step)
            ORDER BY step DESC LIMIT ?)
        ORDER BY step""", [run_id, step_from, step_to, limit])


def ranks(cur: Cursor, run_id: str) -> Rows:
    """Every rank of the run with its latest heartbeat."""
    return records(cur, """
        SELECT k.*, h.ts AS heartbeat_ts, h.phase, h.step AS heartbeat_step, h.last_seq
        FROM ranks k LEFT JOIN (
            SELECT rank, max(ts) AS ts, arg_max(phase, ts) AS phase, arg_max(step, ts) AS step,
                   arg_max(last_seq, ts) AS last_seq
            FROM heartbeats WHERE run_id = ? GROUP BY rank) h USING (rank)
        WHERE k.run_id = ? ORDER BY k.rank""", [run_id, run_id])


def collectives(cur: Cursor, run_id: str, *, step_from: int | None = None, step_to: int | None = None,
                last_steps: int = 20) -> Rows:
    """collective_summary rows of the effective attempt; without a range, the last steps."""
    if step_from is None and step_to is None:
        last = _one(cur, "SELECT max(step) FROM collectives WHERE run_id = ?", [run_id])
        if last is None:
            return []
        step_from = last - last_steps + 1
    return records(cur, """
        SELECT * FROM collective_summary
        WHERE run_id = ? AND step >= coalesce(?, step) AND step <= coalesce(?, step)
        QUALIFY attempt = max(attempt) OVER (PARTITION BY step)
        ORDER BY step, axis, op""", [run_id, step_from, step_to])


def incidents(cur: Cursor, run_id: str, *, status: str | None = None) -> Rows:
    return records(cur, "SELECT * FROM incidents WHERE run_id = ? AND status = coalesce(?, status) "
                        "ORDER BY opened_ts, id", [run_id, status])


def actions(cur: Cursor, run_id: str) -> Rows:
    return records(cur, "SELECT * FROM actions WHERE run_id = ? ORDER BY requested_ts, id", [run_id])


def checkpoints(cur: Cursor, run_id: str) -> Rows:
    return records(cur, "SELECT * FROM checkpoints WHERE run_id = ? ORDER BY step, attempt", [run_id])


def nodes(cur: Cursor, run_id: str) -> Rows:
    return records(cur, "SELECT * FROM nodes WHERE run_id = ? ORDER BY node", [run_id])


def events(cur: Cursor, run_id: str, *, kind: str | None = None, limit: int = 500) -> Rows:
    """The latest `limit` events of the run (of one kind if given), newest first."""
    return records(cur, """
        SELECT * FROM events WHERE run_id = ? AND kind = coalesce(?, kind)
        ORDER BY ts DESC LIMIT ?""", [run_id, kind, limit])


def heartbeats_latest(cur: Cursor, run_id: str) -> Rows:
    return records(cur, """
        SELECT rank, max(ts) AS ts, arg_max(node, ts) AS node, arg_max(pid, ts) AS pid,
               arg_max(phase, ts) AS phase, arg_max(step, ts) AS step, arg_max(last_seq, ts) AS last_seq
        FROM heartbeats WHERE run_id = ? GROUP BY rank ORDER BY rank""", [run_id])


def commands(cur: Cursor, run_id: str) -> Rows:
    return records(cur, "SELECT * FROM commands WHERE run_id = ? ORDER BY id", [run_id])


def run_meta_tables(cur: Cursor, run_id: str) -> dict[str, pa.Table]:
    """A run's `runs`, `ranks` and `nodes` rows as Arrow tables, JSON as text: what
    the detectors need besides the rows of a commit (analysis/frames.py)."""
    queries = {
        "runs": """SELECT run_id, world_size, status, config::VARCHAR AS config, mesh::VARCHAR AS mesh,
                          node_map::VARCHAR AS node_map FROM runs WHERE run_id = ?""",
        "ranks": "SELECT run_id, rank, node, dp, tp, pp FROM ranks WHERE run_id = ? ORDER BY rank",
        "nodes": "SELECT run_id, node, ranks::VARCHAR AS ranks, status FROM nodes WHERE run_id = ? ORDER BY node",
    }
    return {name: cur.execute(sql, [run_id]).to_arrow_table() for name, sql in queries.items()}
