"""The read side's aggregate views: what the dashboard draws, computed in DuckDB.

Every function here answers one chart (or one page's table) in one query, with
the answer already small: curves are cut into at most `max_points` buckets of
equal step width with min/max per bucket (so a spike survives the cut), rank x
step grids into at most `max_steps` columns, and per-collective rows into sums per
(axis, op) or quantiles per group. A 64-rank x 10,000-step run answers each in
well under the dashboard's 300 ms (bench/bench_dashboard.py).

Like collector/read/queries.py, these are plain functions over a DuckDB cursor: the query
API serves them (`/v1/runs/<run>/view/<name>`, collector/http/routes/query.py) and the
dashboard's file mode calls them on a closed file, so no query is written twice.
Step ranges are optional and inclusive. The effective curve here is, per step, the
highest attempt that reached it (a rolled-back attempt's steps show only in
`lineage`): `steps_effective` decides per (step, rank), which costs a join of every
row against the later attempts' rows (~35 ms on 640,000 rows, paid by every view);
per step it is a GROUP BY first and a small join after, 3-6x cheaper, and the two
differ only while a rollback's new attempt is partly ingested (a step some ranks
already replayed shows just those ranks until the others' rows arrive).
"""

from __future__ import annotations

from typing import Any

from collector.read import queries
from collector.read.goodput import goodput
from collector.read.queries import RANKS_PER_REPLICA, Cursor, Rows, records
from collector.store.schema import LAST_IN_RANK_SQL

DEFAULT_COMM_STEPS = 200  # the comm views read the last this many steps unless given a range

# The run's rows of the effective attempt per step (see the module doc), as CTE `eff`
# (step, attempt) and the rows `es`: parameters $r (run), $lo and $hi (steps).
_EFFECTIVE = """
    eff AS (SELECT step, max(attempt) AS attempt FROM steps
            WHERE run_id = $r AND step BETWEEN $lo AND $hi GROUP BY step),
    es AS (SELECT s.* FROM steps s JOIN eff USING (step, attempt) WHERE s.run_id = $r)"""
_BIG = 2**62  # an open end of a step range


def _bucket_width(cur: Cursor, table: str, run_id: str, step_from: int | None, step_to: int | None,
                  max_points: int) -> tuple[int, int, int] | None:
    """(lo, hi, width) of the run's steps in `table` over the range; None without rows."""
    lo, hi = cur.execute(f"SELECT min(step), max(step) FROM {table} WHERE run_id = ? "
                         "AND step >= coalesce(?, step) AND step <= coalesce(?, step)",
                         [run_id, step_from, step_to]).fetchone()
    if lo is None:
        return None
    width = max(1, -(-(hi - lo + 1) // max(1, int(max_points))))
    return int(lo), int(hi), int(width)


# A job that knows only each rank's own loss (agent.watch, llmwatch-instrument, the Lightning
# callback) leaves `loss` NULL and records `local_loss`: its curve is their mean over the ranks,
# which is what data-parallel training averages.
_STEPS_WITH_LOSS = "SELECT * REPLACE (coalesce(loss, local_loss) AS loss) FROM steps"


def overview(cur: Cursor, run_id: str, *, step_from: int | None = None, step_to: int | None = None,
             max_points: int = 1000) -> Rows:
    """The run's training curves per bucket of steps: each step is first reduced over its
    ranks (mean of the finite losses and grad-norms, the smallest loss scale, the
    replica-counted tokens over the slowest rank's step_s), then the steps of a bucket
    give min/avg/max. `ts`: the bucket's last step's end (the wall-time axis);
    `num_nonfinite`: rank values that were NaN/Inf (a NaN step has no mean to draw)."""
    b = _bucket_width(cur, "steps", run_id, step_from, step_to, max_points)
    if b is None:
        return []
    lo, hi, width = b
    return records(cur, f"""
        WITH per_attempt AS (  -- each (attempt, step) over its ranks, then the step's highest attempt
            SELECT attempt, step, max(ts) AS ts,
                   avg(loss) FILTER (WHERE isfinite(loss)) AS loss,
                   avg(grad_norm) FILTER (WHERE isfinite(grad_norm)) AS grad_norm,
                   min(loss_scale) AS loss_scale, avg(lr) AS lr,
                   sum(tokens) / {RANKS_PER_REPLICA} / nullif(max(step_s), 0) AS tokens_per_s,
                   max(step_s) AS step_s,
                   count(*) FILTER (WHERE NOT isfinite(loss) OR NOT isfinite(grad_norm)) AS num_nonfinite,
                   coalesce(bool_or(skipped), false) AS skipped
            FROM ({_STEPS_WITH_LOSS}) WHERE run_id = $r AND step BETWEEN $lo AND $hi GROUP BY attempt, step),
        per_step AS (SELECT * FROM per_attempt QUALIFY attempt = max(attempt) OVER (PARTITION BY step))
        SELECT min(step) AS step, max(step) AS step_to, max(ts) AS ts,
               min(loss) AS loss_min, avg(loss) AS loss, max(loss) AS loss_max,
               min(grad_norm) AS grad_norm_min, avg(grad_norm) AS grad_norm, max(grad_norm) AS grad_norm_max,
               min(loss_scale) AS loss_scale, avg(lr) AS lr,
               min(tokens_per_s) AS tokens_per_s_min, avg(tokens_per_s) AS tokens_per_s,
               max(tokens_per_s) AS tokens_per_s_max, avg(step_s) AS step_s, max(step_s) AS step_s_max,
               sum(num_nonfinite) AS num_nonfinite, count(*) FILTER (WHERE skipped) AS num_skipped
        FROM per_step GROUP BY (step - $lo) // $w ORDER BY 1""",
                   {"r": run_id, "lo": lo, "hi": hi, "w": width})


def scalar_curves(cur: Cursor, run_id: str, *, prefix: str = "eval/", step_from: int | None = None,
                  step_to: int | None = None, max_points: int = 500) -> Rows:
    """Free-form scalars whose name starts with `prefix` (the trainer's `eval/<domain>_loss`),
    mean over ranks per step of the latest attempt, bucketed per name."""
    b = _bucket_width(cur, "scalars", run_id, step_from, step_to, max_points)
    if b is None:
        return []
    lo, hi, width = b
    return records(cur, """
        WITH s AS (SELECT name, step, avg(value) AS value, max(ts) AS ts FROM (
                       SELECT * FROM scalars WHERE run_id = $r AND starts_with(name, $p) AND step BETWEEN $lo AND $hi
                       QUALIFY attempt = max(attempt) OVER (PARTITION BY name, step, rank))
                   GROUP BY name, step)
        SELECT name, max(step) AS step, max(ts) AS ts, avg(value) AS value, min(value) AS min, max(value) AS max
        FROM s GROUP BY name, (step - $lo) // $w ORDER BY name, 2""",
                   {"r": run_id, "p": prefix, "lo": lo, "hi": hi, "w": width})


def lineage(cur: Cursor, run_id: str, *, max_points: int = 600) -> Rows:
    """The full history by attempt: each attempt's mean loss per bucket of steps, and
    whether those steps are the effective curve's (`effective`: no later attempt
    replaced them). A rollback shows as an attempt whose tail is not effective and a
    later one that starts again below it."""
    b = _bucket_width(cur, "steps", run_id, None, None, max_points)
    if b is None:
        return []
    lo, _, width = b
    return records(cur, f"""
        WITH per_attempt AS (
            SELECT attempt, step, avg(loss) FILTER (WHERE isfinite(loss)) AS loss, max(ts) AS ts
            FROM ({_STEPS_WITH_LOSS}) WHERE run_id = $r GROUP BY attempt, step),
        per_step AS (SELECT *, attempt = max(attempt) OVER (PARTITION BY step) AS effective FROM per_attempt)
        SELECT attempt, effective, min(step) AS step, max(step) AS step_to, avg(loss) AS loss, max(ts) AS ts
        FROM per_step GROUP BY attempt, effective, (step - $lo) // $w ORDER BY attempt, step""",
                   {"r": run_id, "lo": lo, "w": width})


def attempts(cur: Cursor, run_id: str) -> Rows:
    """Each training attempt's first and last step and time: where a rollback or a
    restart began again (the annotations every time chart carries)."""
    return records(cur, """
        SELECT attempt, min(step) AS step_from, max(step) AS step_to, min(ts) AS ts_from, max(ts) AS ts_to,
               count(DISTINCT rank) AS num_ranks
        FROM steps WHERE run_id = ? GROUP BY attempt ORDER BY attempt""", [run_id])


def step_grid(cur: Cursor, run_id: str, *, step_from: int | None = None, step_to: int | None = None,
              max_steps: int = 300) -> Rows:
    """rank x step of the effective attempt over the range: step_s (mean per bucket and
    max, so one slow step shows) and compute_s (fwd + bwd + opt: the rank's own work)."""
    b = _bucket_width(cur, "steps", run_id, step_from, step_to, max_steps)
    if b is None:
        return []
    lo, hi, width = b
    return records(cur, f"""
        WITH {_EFFECTIVE}
        SELECT $lo + (step - $lo) // $w * $w AS step, rank, avg(step_s) AS step_s, max(step_s) AS step_s_max,
               avg(fwd_s + bwd_s + opt_s) AS compute_s
        FROM es GROUP BY ALL ORDER BY step, rank""", {"r": run_id, "lo": lo, "hi": hi, "w": width})


def rank_time(cur: Cursor, run_id: str, *, step_from: int | None = None, step_to: int | None = None) -> Rows:
    """Per rank over the range, mean seconds per step: compute (fwd + bwd + opt), data
    loading, exposed communication (blocked on a collective), and the rest of the step;
    with the rank's node and mesh coordinates. A straggler has more compute; the ranks
    waiting for it have more exposed communication."""
    return records(cur, f"""
        WITH {_EFFECTIVE},
             per_rank AS (
                SELECT rank, count(*) AS num_steps, avg(step_s) AS step_s, avg(fwd_s + bwd_s + opt_s) AS compute_s,
                       avg(data_s) AS data_s, avg(comm_exposed_s) AS comm_exposed_s,
                       greatest(0, avg(step_s - coalesce(fwd_s + bwd_s + opt_s, 0) - coalesce(data_s, 0)
                                       - coalesce(comm_exposed_s, 0))) AS other_s
                FROM es GROUP BY rank)
        SELECT p.rank, k.node, k.dp, k.tp, k.pp, p.* EXCLUDE (rank)
        FROM per_rank p LEFT JOIN ranks k ON k.run_id = $r AND k.rank = p.rank ORDER BY p.rank""",
                   {"r": run_id, "lo": -_BIG if step_from is None else int(step_from),
                    "hi": _BIG if step_to is None else int(step_to)})


def rank_rounds(cur: Cursor, run_id: str, *, step_from: int | None = None, step_to: int | None = None) -> Rows:
    """Per restart round and rank over the range (the effective attempt's steps): mean step
    time and compute (fwd + bwd + opt). Only ranks of one
    layout compare: a restart on fewer nodes keeps the global batch, so each replica's step
    carries more micro-batches after it (the demo's ranks computed 0.14 s a step before
    node1 was isolated and 0.19 s after). A round's attempts start at its `run_started`
    events' `attempt_floor` (trainer/supervisor.py); a job without them is one round."""
    return records(cur, f"""
        WITH {_EFFECTIVE},
             rounds AS (SELECT DISTINCT
                               coalesce(TRY_CAST(json_extract_string(data, '$.restart') AS INTEGER), 0) AS round,
                               coalesce(TRY_CAST(json_extract_string(data, '$.attempt_floor') AS INTEGER), 0) AS floor
                        FROM events WHERE run_id = $r AND kind = 'run_started'),
             tagged AS (SELECT es.*, coalesce((SELECT max(round) FROM rounds WHERE floor <= es.attempt), 0) AS round
                        FROM es),
             per AS (SELECT round, rank, any_value(node) AS node, count(*) AS num_steps, avg(step_s) AS step_s,
                            avg(fwd_s + bwd_s + opt_s) AS compute_s
                     FROM tagged GROUP BY round, rank)
        SELECT p.round, p.rank, coalesce(p.node, k.node) AS node, k.dp, k.tp, k.pp, p.num_steps, p.step_s,
               p.compute_s
        FROM per p LEFT JOIN ranks k ON k.run_id = $r AND k.rank = p.rank ORDER BY p.round, p.rank""",
                   {"r": run_id, "lo": -_BIG if step_from is None else int(step_from),
                    "hi": _BIG if step_to is None else int(step_to)})


def mesh(cur: Cursor, run_id: str) -> Rows:
    """Every rank with its place in the mesh and what its health is made of: its node's
    status, the open incidents that name it or its node, and its last heartbeat."""
    return records(cur, """
        WITH hb AS (SELECT rank, max(ts) AS heartbeat_ts, arg_max(phase, ts) AS phase,
                           max(interval_s) AS heartbeat_interval_s FROM heartbeats
                    WHERE run_id = $r GROUP BY rank),
             inc AS (SELECT k.rank, count(*) AS num_open, string_agg(DISTINCT i.kind, ', ') AS kinds
                     FROM ranks k JOIN incidents i ON i.run_id = k.run_id AND i.status = 'open'
                          AND (i.rank = k.rank OR (i.rank IS NULL AND i.node = k.node))
                     WHERE k.run_id = $r GROUP BY k.rank)
        SELECT k.rank, k.node, k.dp, k.tp, k.pp, coalesce(n.status, 'healthy') AS node_status, n.reason,
               coalesce(inc.num_open, 0) AS open_incidents, inc.kinds AS incident_kinds,
               hb.heartbeat_ts, hb.phase, hb.heartbeat_interval_s
        FROM ranks k LEFT JOIN nodes n ON n.run_id = k.run_id AND n.node = k.node
             LEFT JOIN inc USING (rank) LEFT JOIN hb USING (rank)
        WHERE k.run_id = $r ORDER BY k.rank""", {"r": run_id})


# The run's last step with collectives at or before $to (raw or rolled up).
_COMM_LAST_STEP = """SELECT max(step) FROM (
    SELECT max(step) AS step FROM collectives WHERE run_id = $r AND step <= coalesce($to, step)
    UNION ALL SELECT max(step) FROM collectives_rollup WHERE run_id = $r AND step <= coalesce($to, step))"""


def _comm_range(cur: Cursor, run_id: str, step_from: int | None, step_to: int | None,
                last_steps: int) -> tuple[int, int] | None:
    if step_from is None:
        last = cur.execute(_COMM_LAST_STEP, {"r": run_id, "to": step_to}).fetchone()[0]
        if last is None:
            return None
        return int(last) - max(1, int(last_steps)) + 1, int(last)
    hi = step_to if step_to is not None else cur.execute(_COMM_LAST_STEP, {"r": run_id, "to": None}).fetchone()[0]
    return (int(step_from), int(hi)) if hi is not None else None


# The effective attempt's collectives over [$lo, $hi]: a rollback repeats steps, and
# only the highest attempt's ops count, as for steps_effective. Old steps may be
# rolled up (collector/offline/retention.py): `c` holds the raw rows, `cr` the per-step
# summaries (collectives_rollup), `cw` the rolled-up waits (collective_waits_rollup);
# a (step, rank) is in one or the other, and the effective attempt is decided over both.
_COMM_EFFECTIVE = """
    craw AS (SELECT * FROM collectives WHERE run_id = $r AND step BETWEEN $lo AND $hi),
    croll AS (SELECT * FROM collectives_rollup WHERE run_id = $r AND step BETWEEN $lo AND $hi),
    ceff AS (SELECT step, rank, max(attempt) AS attempt FROM (
                 SELECT step, rank, attempt FROM craw UNION ALL SELECT step, rank, attempt FROM croll)
             GROUP BY step, rank),
    c AS (SELECT craw.* FROM craw JOIN ceff USING (step, rank, attempt)),
    cr AS (SELECT croll.* FROM croll JOIN ceff USING (step, rank, attempt))"""
# The comm views sort by seconds rounded to the nanosecond, then by their keys: DuckDB's
# threads add a sum in any order, and equal totals must list the same on every read.


def comm_ops(cur: Cursor, run_id: str, *, step_from: int | None = None, step_to: int | None = None,
             last_steps: int = DEFAULT_COMM_STEPS) -> Rows:
    """Per (mesh axis, op) over the range: ops, bytes, and seconds per rank-step spent in
    them: `duration_s` in all, `exposed_s` the compute thread was blocked (wait_s),
    `overlapped_s` hidden behind compute (the rest)."""
    r = _comm_range(cur, run_id, step_from, step_to, last_steps)
    if r is None:
        return []
    return records(cur, f"""
        WITH {_COMM_EFFECTIVE},
             u AS (SELECT axis, op, step, rank, 1 AS num_ops, bytes, duration_s, wait_s FROM c
                   UNION ALL SELECT axis, op, step, rank, num_ops, bytes, duration_s, wait_s FROM cr),
             n AS (SELECT count(DISTINCT (step, rank)) AS rank_steps FROM u)
        SELECT axis, op, sum(num_ops)::BIGINT AS num_ops, sum(bytes) AS bytes,
               sum(duration_s) / any_value(n.rank_steps) AS duration_s,
               sum(wait_s) / any_value(n.rank_steps) AS exposed_s,
               greatest(0, sum(duration_s) - sum(wait_s)) / any_value(n.rank_steps) AS overlapped_s,
               min(step) AS step_from, max(step) AS step_to
        FROM u, n GROUP BY axis, op ORDER BY round(sum(duration_s), 9) DESC, axis, op""",
                   {"r": run_id, "lo": r[0], "hi": r[1]})


def comm_latency(cur: Cursor, run_id: str, *, step_from: int | None = None, step_to: int | None = None,
                 last_steps: int = DEFAULT_COMM_STEPS, max_groups: int = 64) -> Rows:
    """The distribution of one op's duration per (axis, group, op), as box statistics
    (p5, p25, median, p75, p99, max): a slow link shows as one group's box above its
    axis's others. The `max_groups` groups with the most time, for a big mesh.
    Over rolled-up steps a sample is a rank-step's mean duration of the op (its
    summary row), not one op: the quantiles there are per-step statistics, while
    num_ops, total_s and max_s stay exact."""
    r = _comm_range(cur, run_id, step_from, step_to, last_steps)
    if r is None:
        return []
    return records(cur, f"""
        WITH {_COMM_EFFECTIVE},
             u AS (SELECT axis, group_id, op, 1 AS num_ops, duration_s, duration_s AS max_s, duration_s AS sample_s
                   FROM c
                   UNION ALL SELECT axis, group_id, op, num_ops, duration_s, max_duration_s,
                                    duration_s / num_ops FROM cr)
        SELECT axis, group_id, op, sum(num_ops)::BIGINT AS num_ops, sum(duration_s) AS total_s,
               quantile_cont(sample_s, 0.05) AS p5_s, quantile_cont(sample_s, 0.25) AS p25_s,
               median(sample_s) AS p50_s, quantile_cont(sample_s, 0.75) AS p75_s,
               quantile_cont(sample_s, 0.99) AS p99_s, max(max_s) AS max_s
        FROM u GROUP BY axis, group_id, op ORDER BY round(sum(duration_s), 9) DESC, axis, group_id, op
        LIMIT $g""",
                   {"r": run_id, "lo": r[0], "hi": r[1], "g": max(1, int(max_groups))})


def comm_waits(cur: Cursor, run_id: str, *, step_from: int | None = None, step_to: int | None = None,
               last_steps: int = DEFAULT_COMM_STEPS) -> Rows:
    """Who waited for whom: for every collective instance (one group's op at one
    group_seq), the rank that entered last is the one the others waited for, each for
    the time between its own entry and that one's, but no longer than it was blocked
    on the op (wait_s): an async op started early and waited on later (the command
    channel's broadcast, a bucketed all-reduce) overlapped compute, and cost nothing.
    Summed per (waiter, waited_for) over the range, in seconds per step. Rolled-up
    steps contribute the same pairs, computed the same way when they were rolled up
    (collective_waits_rollup). Steps a large job's agents summarized (docs/scale.md) have
    no op rows: there each summary's mean op stands for its `num_ops` ops, matched across
    the group by the highest group_seq, as the detectors read them (analysis/frames.py
    `ops_from_summaries`): exact where one member is the last in at every op (a straggler
    is), else the waits read smaller, alike for every member."""
    r = _comm_range(cur, run_id, step_from, step_to, last_steps)
    if r is None:
        return []
    return records(cur, f"""
        WITH {_COMM_EFFECTIVE},
             g AS (SELECT step, axis, group_id, group_seq, {LAST_IN_RANK_SQL} AS last_rank, max(start_ts) AS last_ts
                   FROM c WHERE group_seq IS NOT NULL AND op NOT IN ('send', 'recv')
                   GROUP BY ALL HAVING count(*) > 1),
             -- the agents' summaries: the summary rows of steps the rollup did not write waits for
             s AS (SELECT * FROM cr WHERE max_group_seq IS NOT NULL AND mean_start_ts IS NOT NULL
                       AND op NOT IN ('send', 'recv')
                       AND NOT EXISTS (SELECT 1 FROM collective_waits_rollup w WHERE w.run_id = $r
                                       AND w.attempt = cr.attempt AND w.step = cr.step)),
             gs AS (SELECT step, axis, group_id, max_group_seq, arg_max(rank, (mean_start_ts, rank)) AS last_rank,
                           max(mean_start_ts) AS last_ts
                    FROM s GROUP BY ALL HAVING count(*) > 1),
             n AS (SELECT greatest(1, count(DISTINCT step)) AS num_steps FROM (
                       SELECT step FROM c UNION ALL SELECT step FROM cr)),
             pairs AS (
                SELECT c.rank AS waiter, g.last_rank AS waited_for, 1 AS num_ops,
                       least(g.last_ts - c.start_ts, coalesce(c.wait_s, g.last_ts - c.start_ts)) AS wait_s
                FROM c JOIN g USING (step, axis, group_id, group_seq) WHERE c.rank <> g.last_rank
                UNION ALL
                SELECT s.rank, gs.last_rank, s.num_ops,
                       s.num_ops * least(gs.last_ts - s.mean_start_ts,
                                         coalesce(s.wait_s / s.num_ops, gs.last_ts - s.mean_start_ts))
                FROM s JOIN gs USING (step, axis, group_id, max_group_seq) WHERE s.rank <> gs.last_rank
                UNION ALL
                SELECT w.waiter, w.waited_for, w.num_ops, w.wait_s
                FROM collective_waits_rollup w JOIN ceff e ON e.step = w.step AND e.rank = w.waiter
                     AND e.attempt = w.attempt
                WHERE w.run_id = $r AND w.step BETWEEN $lo AND $hi)
        SELECT waiter, waited_for, sum(num_ops)::BIGINT AS num_ops, sum(wait_s) / any_value(n.num_steps) AS wait_s
        FROM pairs, n GROUP BY waiter, waited_for ORDER BY round(sum(wait_s), 9) DESC, waiter, waited_for""",
                   {"r": run_id, "lo": r[0], "hi": r[1]})


def runs_overview(cur: Cursor, *, limit: int = 50) -> Rows:
    """The newest runs with what a side-by-side table shows: status, size, last step,
    attempts, incidents (open and all) and actions."""
    return records(cur, """
        SELECT r.run_id, r.status, r.world_size, r.created_ts, r.started_ts, r.updated_ts, r.mesh,
               (SELECT max(step) FROM steps s WHERE s.run_id = r.run_id) AS last_step,
               (SELECT max(attempt) FROM steps s WHERE s.run_id = r.run_id) AS last_attempt,
               (SELECT count(*) FROM incidents i WHERE i.run_id = r.run_id) AS num_incidents,
               (SELECT count(*) FROM incidents i WHERE i.run_id = r.run_id AND i.status = 'open') AS open_incidents,
               (SELECT count(*) FROM actions a WHERE a.run_id = r.run_id) AS num_actions
        FROM runs r ORDER BY r.created_ts DESC LIMIT ?""", [max(1, int(limit))])


def run_goodput(cur: Cursor, run_id: str) -> dict[str, Any]:
    """The run's goodput and what it is made of (collector/read/goodput.py), as a dict, with
    `causes`: its wall time by cause (queries.goodput_causes: the `goodput` view's rows)."""
    g = goodput(queries.step_time_parts(cur, run_id), queries.run_span(cur, run_id))
    causes = [{k: v for k, v in row.items() if k != "run_id"} for row in queries.goodput_causes(cur, run_id)]
    return {**{f: getattr(g, f) for f in g.__dataclass_fields__}, "goodput": g.goodput,
            "tokens_per_s": g.tokens_per_s, "causes": causes}


VIEWS: dict[str, Any] = {  # name -> function: what the query API serves under /view/<name>
    "overview": overview, "scalars": scalar_curves, "lineage": lineage, "attempts": attempts,
    "grid": step_grid, "rank_time": rank_time, "rank_rounds": rank_rounds, "mesh": mesh, "comm_ops": comm_ops,
    "comm_latency": comm_latency, "comm_waits": comm_waits,
}
