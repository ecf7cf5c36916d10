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

from collector.store.schema import GOODPUT_SQL

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


def run_begun_ts(cur: Cursor, run_id: str) -> float | None:
    """When the run began: its agents' start (`started_ts`), else when its first batch came."""
    row = cur.execute("SELECT coalesce(started_ts, created_ts) FROM runs WHERE run_id = ?", [run_id]).fetchone()
    return None if row is None or row[0] is None else float(row[0])


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
        # a job that records only each rank's own loss (agent.watch): that is its loss curve
        column = "coalesce(loss, local_loss)" if metric == "loss" else metric
        source, params = f"SELECT step, rank, {column} AS v FROM steps_effective WHERE run_id = ?", [run_id]
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


def bad_batches(cur: Cursor, run_id: str) -> Rows:
    """The sample windows the run's rollbacks skipped, in data order."""
    return records(cur, "SELECT * FROM bad_batches WHERE run_id = ? ORDER BY epoch, sample_from, sample_to",
                   [run_id])


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
        "ranks": "SELECT run_id, rank, node, dp, tp, pp, hw_id FROM ranks WHERE run_id = ? ORDER BY rank",
        "nodes": "SELECT run_id, node, ranks::VARCHAR AS ranks, status FROM nodes WHERE run_id = ? ORDER BY node",
    }
    return {name: cur.sql(sql, params=[run_id]).to_arrow_table() for name, sql in queries.items()}


# -- a closed run as a whole: `collector replay` and `collector postmortem` ---------------
_RUN_ROWS = {  # table -> (columns, order): every row of a run, JSON as text
    "steps": ("*", "ts, rank"),
    "collectives": ("*", "start_ts, rank"),
    "collectives_rollup": ("*", "start_ts, rank"),  # summaries: the agent's (agent/summary.py) or the rollup's
    "heartbeats": ("*", "ts, rank"),
    "device_health": ("*", "ts, rank"),
    "events": ("* REPLACE (data::VARCHAR AS data)", "ts, rank"),
    "scalars": ("* EXCLUDE (attrs)", "ts, rank"),
}


def run_ids(cur: Cursor) -> list[str]:
    """Every run of the file, oldest first."""
    return [r[0] for r in cur.execute("SELECT run_id FROM runs ORDER BY created_ts, run_id").fetchall()]


def run_tables(cur: Cursor, run_id: str) -> dict[str, pa.Table]:
    """Every row of one run, in time order, as Arrow tables keyed by table name (steps,
    collectives, heartbeats, events, scalars, and `run_meta_tables`): what `collector
    replay` cuts back into the commits a live collector saw (analysis/replay.py)."""
    out = run_meta_tables(cur, run_id)
    for name, (columns, order) in _RUN_ROWS.items():
        out[name] = cur.sql(f"SELECT {columns} FROM {name} WHERE run_id = $run_id ORDER BY {order}",
                            params={"run_id": run_id}).to_arrow_table()
    return out


def run_span(cur: Cursor, run_id: str) -> dict[str, Any]:
    """The run's wall-clock span: `start_ts` (the run's own start or its first row, whichever
    came first: a restart's run info moves runs.started_ts to the restart)
    and `end_ts` (its last step or event), unix s; None when the run has no rows."""
    rows = records(cur, """
        SELECT least((SELECT started_ts FROM runs WHERE run_id = $r),
                     (SELECT min(ts - coalesce(step_s, 0)) FROM steps WHERE run_id = $r),
                     (SELECT min(ts) FROM heartbeats WHERE run_id = $r)) AS start_ts,
               greatest((SELECT max(ts) FROM steps WHERE run_id = $r),
                        (SELECT max(ts) FROM events WHERE run_id = $r)) AS end_ts""", {"r": run_id})
    return rows[0]


# The ranks of one data-parallel replica (tp x pp, from runs.mesh; 1 without a mesh):
# they all report the replica's tokens. A scalar subquery over the `$r` parameter.
RANKS_PER_REPLICA = """coalesce((SELECT
        greatest(coalesce(TRY_CAST(json_extract(mesh, '$.tp') AS INTEGER), 1), 1)
        * greatest(coalesce(TRY_CAST(json_extract(mesh, '$.pp') AS INTEGER), 1), 1)
    FROM runs WHERE run_id = $r), 1)"""


def step_time_parts(cur: Cursor, run_id: str) -> Rows:
    """Step seconds and tokens of the run, per (effective, skipped): a step lasts as long
    as its slowest rank (max step_s), capped at the time since the step before it ended
    (so overlapping steps are not counted twice), and its tokens are the sum over its ranks divided by
    tp x pp (every rank of a data-parallel replica reports the replica's tokens; the
    same rule as the step_summary view). `effective`: the attempt steps_effective
    keeps; a rolled-back attempt's steps are not."""
    return records(cur, f"""
        WITH per_step AS (
            SELECT attempt, step, bool_and(effective) AS effective, coalesce(bool_or(skipped), false) AS skipped,
                   max(step_s) AS step_s, max(ts) AS end_ts, sum(tokens) / {RANKS_PER_REPLICA} AS tokens
            FROM steps_history WHERE run_id = $r GROUP BY attempt, step),
        -- a step's time is its slowest rank's step_s, but no more than since the step before
        -- it ended: the ranks' windows do not line up, and summing each step's slowest rank
        -- would count the overlap twice (goodput above 100%)
        own AS (SELECT *, least(step_s, end_ts - lag(end_ts) OVER (ORDER BY end_ts, attempt, step)) AS own_s
                FROM per_step)
        SELECT effective, skipped, count(*) AS num_steps, coalesce(sum(coalesce(own_s, step_s)), 0) AS step_s,
               coalesce(sum(tokens), 0) AS tokens
        FROM own GROUP BY effective, skipped ORDER BY effective DESC, skipped""", {"r": run_id})



def goodput_causes(cur: Cursor, run_id: str) -> Rows:
    """The run's wall time by cause, the `goodput` view's rows for one run (collector/store/schema.py
    GOODPUT_SQL: productive, slowdown per incident, skipped, detection, redone, recovery,
    checkpoint, idle), largest first: `cause`, `incident_id` (a slow-down's), `seconds`,
    `num_steps` (NULL for time outside steps) and `share` of the wall time."""
    return records(cur, GOODPUT_SQL.format(runs="run_id = $r") + " ORDER BY seconds DESC, cause, incident_id",
                   {"r": run_id})


def goodput_seconds(cur: Cursor, run_id: str) -> dict[str, float]:
    """`goodput_causes` summed by cause (the slow-downs of every incident together): {cause: s}."""
    out: dict[str, float] = {}
    for row in goodput_causes(cur, run_id):
        out[row["cause"]] = out.get(row["cause"], 0.0) + float(row["seconds"] or 0.0)
    return out


def cost_inputs(cur: Cursor, run_id: str) -> dict[str, Any]:
    """The run's side of the cost model's inputs (analysis/costmodel.py, analysis/policy.py
    `RunPolicy`): its last step (its config's `steps`; None for a job whose end is not known),
    its start-up (its first step's end less its start: a restart's cost before one happened),
    its checkpoints' steps (a restart resumes from the newest before the step it reached), the
    time from each of its restarts and isolations to its new round's first step (recovery_s
    counts from the incident's opening, which for a slow-down was long before the decision),
    its nodes, and for our trainer (a config with `parallel`) its data-parallel replicas now
    (world size over tp x pp) and the global batch's micro-batches (dp x micro_batches: a
    restart on fewer replicas keeps the global batch), a rebalance's inputs."""
    row = cur.execute(
        "SELECT TRY_CAST(json_extract(config, '$.steps') AS BIGINT), "
        "(SELECT min(ts) FROM steps WHERE run_id = $r) - started_ts, world_size, "
        "TRY_CAST(json_extract(config, '$.parallel.dp') AS BIGINT), "
        "TRY_CAST(json_extract(config, '$.parallel.tp') AS BIGINT) * "
        "TRY_CAST(json_extract(config, '$.parallel.pp') AS BIGINT), "
        "TRY_CAST(json_extract(config, '$.parallel.micro_batches') AS BIGINT) FROM runs WHERE run_id = $r",
        {"r": run_id}).fetchone()
    steps_total, startup, world, dp0, model, micro = row if row else (None,) * 6
    dp = world // model if world and model and world % model == 0 else None
    global_micro = dp0 * micro if dp0 and micro else None
    ckpts = [int(s) for (s,) in cur.execute("SELECT DISTINCT step FROM checkpoints WHERE run_id = $r ORDER BY step",
                                            {"r": run_id}).fetchall()]
    restarts = [float(x) for (x,) in cur.execute(
        "SELECT finished_ts - requested_ts FROM actions WHERE run_id = $r AND kind IN ('restart', 'isolate') "
        "AND status = 'done' AND mode = 'auto' AND finished_ts >= requested_ts ORDER BY id", {"r": run_id}).fetchall()]
    nodes = [str(n) for (n,) in cur.execute(
        "SELECT node FROM nodes WHERE run_id = $r AND status <> 'spare' UNION SELECT DISTINCT node FROM ranks "
        "WHERE run_id = $r AND node IS NOT NULL ORDER BY 1", {"r": run_id}).fetchall()]
    spares = [str(n) for (n,) in cur.execute(
        "SELECT node FROM nodes WHERE run_id = $r AND status = 'spare' ORDER BY 1", {"r": run_id}).fetchall()]
    return {"steps_total": int(steps_total) if steps_total is not None and steps_total > 0 else None,
            "startup_s": float(startup) if startup is not None and startup >= 0 else None,
            "ckpt_steps": ckpts, "restart_costs": restarts, "nodes": nodes, "spares": spares,
            "dp": dp, "micro_batches": global_micro}

def step_window(cur: Cursor, run_id: str, *, step_from: int, step_to: int, max_points: int = 400) -> Rows:
    """loss, grad_norm and loss_scale of the effective curve over [step_from, step_to],
    per step (or per bucket of equal step width past `max_points`): the mean of the
    finite values over the ranks, and how many values were non-finite (a NaN step has
    no mean to draw, only its count)."""
    return records(cur, """
        WITH s AS (SELECT step, coalesce(loss, local_loss) AS loss, grad_norm, loss_scale, skipped
                   FROM steps_effective WHERE run_id = $r AND step BETWEEN $lo AND $hi),
             w AS (SELECT greatest(1, ceil(($hi - $lo + 1) / $n))::BIGINT AS width)
        SELECT min(step) AS step, max(step) AS step_to,
               avg(loss) FILTER (WHERE isfinite(loss)) AS loss,
               avg(grad_norm) FILTER (WHERE isfinite(grad_norm)) AS grad_norm,
               avg(loss_scale) FILTER (WHERE isfinite(loss_scale)) AS loss_scale,
               count(*) FILTER (WHERE NOT isfinite(loss) OR NOT isfinite(grad_norm)) AS num_nonfinite,
               coalesce(bool_or(skipped), false) AS skipped
        FROM s, w GROUP BY (step - $lo) // width ORDER BY 1""",
                   {"r": run_id, "lo": int(step_from), "hi": int(step_to), "n": max(1, int(max_points))})
