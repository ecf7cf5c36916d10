"""The DuckDB schema: tables, views and the migrations that create them.

Table and column names are a contract (DESIGN.md section 5, docs/schema.md, the
SQL cookbook). Times are unix seconds (UTC) in DOUBLE columns named `*_ts`;
durations are seconds named `*_s`; sizes are bytes. JSON columns hold objects
that vary by record (config, evidence, event data).

`MIGRATIONS` is an append-only list: version N's statements run once, in one
transaction, and `schema_version` records it. Opening a database applies what is
missing, so opening twice (or opening an old file) is safe.
"""

from __future__ import annotations

import time

import duckdb

_TABLES_V1 = [
    """CREATE TABLE runs (
        run_id VARCHAR PRIMARY KEY,
        created_ts DOUBLE NOT NULL,
        updated_ts DOUBLE NOT NULL,
        status VARCHAR NOT NULL DEFAULT 'running',
        config JSON,
        mesh JSON,
        world_size INTEGER,
        code_version VARCHAR,
        data_version VARCHAR,
        node_map JSON,
        started_ts DOUBLE
    )""",
    """CREATE TABLE ranks (
        run_id VARCHAR NOT NULL,
        rank INTEGER NOT NULL,
        node VARCHAR,
        dp INTEGER,
        tp INTEGER,
        pp INTEGER,
        pid BIGINT,
        incarnation VARCHAR,
        first_seen_ts DOUBLE NOT NULL,
        last_seen_ts DOUBLE NOT NULL,
        agent_drops BIGINT NOT NULL DEFAULT 0,
        PRIMARY KEY (run_id, rank)
    )""",
    """CREATE TABLE steps (
        run_id VARCHAR NOT NULL,
        attempt INTEGER NOT NULL,
        step BIGINT NOT NULL,
        rank INTEGER NOT NULL,
        ts DOUBLE,
        loss DOUBLE,
        grad_norm DOUBLE,
        loss_scale DOUBLE,
        lr DOUBLE,
        tokens BIGINT,
        step_s DOUBLE,
        fwd_s DOUBLE,
        bwd_s DOUBLE,
        opt_s DOUBLE,
        data_s DOUBLE,
        comm_exposed_s DOUBLE,
        mem_bytes BIGINT,
        skipped BOOLEAN,
        node VARCHAR
    )""",
    """CREATE TABLE collectives (
        run_id VARCHAR NOT NULL,
        attempt INTEGER NOT NULL,
        step BIGINT NOT NULL,
        rank INTEGER NOT NULL,
        seq BIGINT,
        group_seq BIGINT,
        op VARCHAR,
        axis VARCHAR,
        group_id INTEGER,
        peer INTEGER,
        bytes BIGINT,
        start_ts DOUBLE,
        duration_s DOUBLE,
        wait_s DOUBLE
    )""",
    """CREATE TABLE scalars (
        run_id VARCHAR NOT NULL,
        attempt INTEGER NOT NULL,
        step BIGINT NOT NULL,
        rank INTEGER NOT NULL,
        ts DOUBLE,
        name VARCHAR NOT NULL,
        value DOUBLE,
        attrs JSON
    )""",
    """CREATE TABLE heartbeats (
        run_id VARCHAR NOT NULL,
        rank INTEGER NOT NULL,
        ts DOUBLE NOT NULL,
        node VARCHAR,
        pid BIGINT,
        phase VARCHAR,
        step BIGINT,
        last_seq BIGINT
    )""",
    """CREATE TABLE events (
        run_id VARCHAR NOT NULL,
        rank INTEGER NOT NULL,
        ts DOUBLE NOT NULL,
        step BIGINT,
        attempt INTEGER,
        kind VARCHAR NOT NULL,
        data JSON
    )""",
    """CREATE TABLE incidents (
        id BIGINT PRIMARY KEY,
        run_id VARCHAR NOT NULL,
        kind VARCHAR NOT NULL,
        severity VARCHAR NOT NULL,
        rank INTEGER,
        node VARCHAR,
        step_from BIGINT,
        step_to BIGINT,
        opened_ts DOUBLE NOT NULL,
        updated_ts DOUBLE NOT NULL,
        closed_ts DOUBLE,
        status VARCHAR NOT NULL DEFAULT 'open',
        evidence JSON,
        root_cause VARCHAR,
        confidence DOUBLE
    )""",
    """CREATE TABLE actions (
        id BIGINT PRIMARY KEY,
        run_id VARCHAR NOT NULL,
        incident_id BIGINT,
        kind VARCHAR NOT NULL,
        status VARCHAR NOT NULL,
        dry_run BOOLEAN NOT NULL DEFAULT false,
        requested_ts DOUBLE NOT NULL,
        finished_ts DOUBLE,
        detail JSON
    )""",
    """CREATE TABLE checkpoints (
        run_id VARCHAR NOT NULL,
        step BIGINT NOT NULL,
        attempt INTEGER NOT NULL,
        path VARCHAR,
        num_shards INTEGER,
        bytes BIGINT,
        checksums JSON,
        verified BOOLEAN NOT NULL DEFAULT false,
        write_s DOUBLE,
        ts DOUBLE NOT NULL,
        num_ranks INTEGER NOT NULL DEFAULT 1,
        PRIMARY KEY (run_id, step, attempt)
    )""",
    """CREATE TABLE nodes (
        run_id VARCHAR NOT NULL,
        node VARCHAR NOT NULL,
        ranks JSON,
        status VARCHAR NOT NULL DEFAULT 'healthy',
        reason VARCHAR,
        updated_ts DOUBLE NOT NULL,
        PRIMARY KEY (run_id, node)
    )""",
    """CREATE TABLE commands (
        id BIGINT PRIMARY KEY,
        run_id VARCHAR NOT NULL,
        kind VARCHAR NOT NULL,
        args JSON,
        ranks JSON,
        issued_ts DOUBLE NOT NULL,
        status VARCHAR NOT NULL,
        delivered JSON,
        acks JSON,
        updated_ts DOUBLE NOT NULL
    )""",
    """CREATE TABLE batches (
        run_id VARCHAR NOT NULL,
        rank INTEGER NOT NULL,
        incarnation VARCHAR NOT NULL,
        batch_seq BIGINT NOT NULL,
        received_ts DOUBLE NOT NULL,
        rows BIGINT NOT NULL,
        PRIMARY KEY (run_id, rank, incarnation, batch_seq)
    )""",
]

_VIEWS_V1 = [
    # The effective curve: after a rollback the same (run, step, rank) exists once per
    # attempt; only the highest attempt counts. Written as a join against the (few)
    # rows of later attempts rather than a window over every row: ~70x faster on 10M rows.
    """CREATE OR REPLACE VIEW steps_effective AS
        WITH latest AS (SELECT run_id, step, rank, max(attempt) AS attempt FROM steps WHERE attempt > 0
                        GROUP BY run_id, step, rank)
        SELECT s.* FROM steps s LEFT JOIN latest l USING (run_id, step, rank)
        WHERE l.attempt IS NULL OR s.attempt = l.attempt""",
    """CREATE OR REPLACE VIEW steps_history AS
        WITH latest AS (SELECT run_id, step, rank, max(attempt) AS attempt FROM steps WHERE attempt > 0
                        GROUP BY run_id, step, rank)
        SELECT s.*, l.attempt IS NULL OR s.attempt = l.attempt AS effective
        FROM steps s LEFT JOIN latest l USING (run_id, step, rank)""",
    """CREATE OR REPLACE VIEW step_summary AS
        SELECT run_id, attempt, step,
               count(*) AS num_ranks,
               median(step_s) AS median_step_s,
               max(step_s) AS max_step_s,
               min(step_s) AS min_step_s,
               arg_max(rank, step_s) AS slowest_rank,
               avg(loss) AS loss_mean,
               sum(tokens) AS tokens,
               max(ts) AS ts
        FROM steps GROUP BY run_id, attempt, step""",
    """CREATE OR REPLACE VIEW collective_summary AS
        SELECT run_id, attempt, step, op, axis,
               count(*) AS num_ops,
               sum(bytes) AS bytes,
               avg(duration_s) AS mean_duration_s,
               max(duration_s) AS max_duration_s,
               avg(wait_s) AS mean_wait_s,
               max(wait_s) AS max_wait_s,
               sum(wait_s) AS total_wait_s
        FROM collectives GROUP BY run_id, attempt, step, op, axis""",
]

# v2: the blake2b-128 of each stored batch's body, so that a batch key seen again
# with other bytes is refused instead of acknowledged as a duplicate. Rows stored
# before it keep NULL (unknown: any content under their key counts as the same).
_BATCH_HASH_V2 = ["ALTER TABLE batches ADD COLUMN content_hash BLOB"]

# v3: the cause an incident is about, as the detector named it ("straggler:node1#1"),
# so that after a collector restart a finding about the same cause updates the open
# incident instead of opening a second one. Rows from before keep NULL (their cause
# is then "kind:rank:node").
_INCIDENT_CAUSE_V3 = ["ALTER TABLE incidents ADD COLUMN cause_key VARCHAR"]

# v4: the per-rank local signals the detectors name an origin with (analysis/frames.py):
# the replica's loss before the data-parallel average, whether this rank's forward
# output and local gradients were finite, the replica's sample window; and on the
# heartbeat, which collective `last_seq` is (so a hang names the op it waits in).
# Rows from older agents keep NULL (the detectors fall back, docs/rules.md).
_LOCAL_SIGNALS_V4 = [
    "ALTER TABLE steps ADD COLUMN local_loss DOUBLE",
    "ALTER TABLE steps ADD COLUMN finite_fwd TINYINT",
    "ALTER TABLE steps ADD COLUMN finite_bwd TINYINT",
    "ALTER TABLE steps ADD COLUMN sample_epoch BIGINT",
    "ALTER TABLE steps ADD COLUMN sample_from BIGINT",
    "ALTER TABLE steps ADD COLUMN sample_to BIGINT",
    "ALTER TABLE heartbeats ADD COLUMN last_op VARCHAR",
    "ALTER TABLE heartbeats ADD COLUMN last_axis VARCHAR",
    "ALTER TABLE heartbeats ADD COLUMN last_group_id INTEGER",
    "ALTER TABLE heartbeats ADD COLUMN last_group_seq BIGINT",
]

# v5: the alert outbox. One row per alert to deliver to one receiver (a webhook URL
# or an Alertmanager); it is written in the same transaction as the incident change
# it reports, so an alert is never lost to a crash, and it survives a restart until
# it is delivered or given up. `body` is the exact bytes that are signed and sent.
# Ids come from the writer (collector/alerts/outbox.py), like incidents': the sender is
# handed the committed rows, ids and all. `labels`: those of the firing alert the
# row carries, which the incident's resolved alert repeats (after a restart too).
_ALERT_OUTBOX_V5 = [
    """CREATE TABLE alert_outbox (
        id BIGINT PRIMARY KEY,
        run_id VARCHAR NOT NULL,
        incident_id BIGINT,
        action_id BIGINT,
        receiver VARCHAR NOT NULL,
        kind VARCHAR NOT NULL,
        status VARCHAR NOT NULL DEFAULT 'pending',
        body BLOB NOT NULL,
        labels JSON,
        created_ts DOUBLE NOT NULL,
        next_attempt_ts DOUBLE NOT NULL,
        attempts INTEGER NOT NULL DEFAULT 0,
        last_error VARCHAR,
        delivered_ts DOUBLE
    )""",
]

# v6: step_summary.tokens counts each data-parallel replica once. `steps.tokens` is
# what the rank's replica processed, the same on its tp x pp ranks, so v1's plain
# sum counted the step tp x pp times over (runs.mesh says how many; a run without a
# mesh counts every rank, as an agent outside the trainer reports its own tokens).
_STEP_SUMMARY_V6 = [
    """CREATE OR REPLACE VIEW step_summary AS
        SELECT s.run_id, s.attempt, s.step,
               count(*) AS num_ranks,
               median(s.step_s) AS median_step_s,
               max(s.step_s) AS max_step_s,
               min(s.step_s) AS min_step_s,
               arg_max(s.rank, s.step_s) AS slowest_rank,
               avg(s.loss) AS loss_mean,
               CAST(round(sum(s.tokens) / any_value(
                   greatest(coalesce(TRY_CAST(json_extract(r.mesh, '$.tp') AS INTEGER), 1), 1)
                   * greatest(coalesce(TRY_CAST(json_extract(r.mesh, '$.pp') AS INTEGER), 1), 1))) AS BIGINT)
                   AS tokens,
               max(s.ts) AS ts
        FROM steps s LEFT JOIN runs r USING (run_id)
        GROUP BY s.run_id, s.attempt, s.step""",
]

# v7: automated healing (collector/store/actions.py). An action row says how it was taken
# (`mode`: 'auto' did it, 'shadow' only recorded what it would have done), the command
# it issued, the node or rank it was about, the training attempt it produced, when
# the trainer started it, and how long the run took to train again (`recovery_s`,
# from the incident's opened_ts to the first new step). Older rows get their mode
# from dry_run and their updated_ts from their last time. `bad_batches`: the samples
# a rollback skipped, from the trainer's `batch_skipped` events (each rank reports the
# same window: stored once). `nodes` remembers when a node was isolated and the
# incident that changed its status.
_HEALING_V7 = [
    "ALTER TABLE actions ADD COLUMN mode VARCHAR",
    "ALTER TABLE actions ADD COLUMN command_id BIGINT",
    "ALTER TABLE actions ADD COLUMN node VARCHAR",
    "ALTER TABLE actions ADD COLUMN rank INTEGER",
    "ALTER TABLE actions ADD COLUMN attempt INTEGER",
    "ALTER TABLE actions ADD COLUMN started_ts DOUBLE",
    "ALTER TABLE actions ADD COLUMN recovery_s DOUBLE",
    "ALTER TABLE actions ADD COLUMN updated_ts DOUBLE",
    """UPDATE actions SET mode = CASE WHEN dry_run THEN 'shadow' ELSE 'auto' END,
        updated_ts = coalesce(finished_ts, requested_ts)""",
    """CREATE TABLE bad_batches (
        run_id VARCHAR NOT NULL,
        epoch BIGINT NOT NULL,
        sample_from BIGINT NOT NULL,
        sample_to BIGINT NOT NULL,
        step BIGINT,
        incident_id BIGINT,
        verdict VARCHAR,
        ts DOUBLE NOT NULL,
        PRIMARY KEY (run_id, epoch, sample_from, sample_to)
    )""",
    "ALTER TABLE nodes ADD COLUMN isolated_ts DOUBLE",
    "ALTER TABLE nodes ADD COLUMN incident_id BIGINT",
]

# The member of one collective instance that entered it last, the one the others waited
# for: the latest start_ts, ties to the highest rank (arg_max alone picks among equal
# start_ts in whatever order DuckDB's threads meet them, and a view must answer the same
# each time). read/views.py comm_waits and the rollup's collective_waits_rollup both use it.
LAST_IN_RANK_SQL = "arg_max(rank, (start_ts, rank)) FILTER (WHERE start_ts IS NOT NULL)"

# v8: retention (collector/offline/retention.py). Old `collectives` rows are rolled up into
# per-step summaries and deleted: one row per (run, attempt, step, rank, axis, op,
# group_id) with counts, sums and maxima (every total and collective_summary column
# stays exact), and who waited for whom per step, as read/views.py comm_waits computes
# it from the raw rows. collective_summary reads both the raw rows and the summaries.
_ROLLUP_V8 = [
    """CREATE TABLE collectives_rollup (
        run_id VARCHAR NOT NULL,
        attempt INTEGER NOT NULL,
        step BIGINT NOT NULL,
        rank INTEGER NOT NULL,
        axis VARCHAR,
        op VARCHAR,
        group_id INTEGER,
        num_ops BIGINT NOT NULL,
        bytes BIGINT,
        duration_s DOUBLE,
        max_duration_s DOUBLE,
        wait_s DOUBLE,
        max_wait_s DOUBLE,
        start_ts DOUBLE,
        end_ts DOUBLE
    )""",
    """CREATE TABLE collective_waits_rollup (
        run_id VARCHAR NOT NULL,
        attempt INTEGER NOT NULL,
        step BIGINT NOT NULL,
        waiter INTEGER NOT NULL,
        waited_for INTEGER NOT NULL,
        num_ops BIGINT NOT NULL,
        wait_s DOUBLE
    )""",
    """CREATE OR REPLACE VIEW collective_summary AS
        WITH u AS (
            SELECT run_id, attempt, step, op, axis, 1 AS num_ops, bytes, duration_s, duration_s AS max_duration_s,
                   wait_s, wait_s AS max_wait_s FROM collectives
            UNION ALL
            SELECT run_id, attempt, step, op, axis, num_ops, bytes, duration_s, max_duration_s, wait_s, max_wait_s
            FROM collectives_rollup)
        SELECT run_id, attempt, step, op, axis,
               sum(num_ops)::BIGINT AS num_ops,
               sum(bytes) AS bytes,
               sum(duration_s) / sum(num_ops) FILTER (WHERE duration_s IS NOT NULL) AS mean_duration_s,
               max(max_duration_s) AS max_duration_s,
               sum(wait_s) / sum(num_ops) FILTER (WHERE wait_s IS NOT NULL) AS mean_wait_s,
               max(max_wait_s) AS max_wait_s,
               sum(wait_s) AS total_wait_s
        FROM u GROUP BY run_id, attempt, step, op, axis""",
]

# v9: device health (agent/device_health.py): one sample per heartbeat per rank. GPU
# columns come from NVML and are NULL without it (a CPU host, no pynvml); the host's
# memory and the process's CPU time are always there. Read by the `device_health`
# detector (analysis/detectors/device_health.py).
_DEVICE_HEALTH_V9 = [
    """CREATE TABLE device_health (
        run_id VARCHAR NOT NULL,
        rank INTEGER NOT NULL,
        ts DOUBLE NOT NULL,
        node VARCHAR,
        step BIGINT,
        gpu_index INTEGER,
        temperature_c DOUBLE,
        power_w DOUBLE,
        sm_clock_mhz BIGINT,
        throttle_reasons BIGINT,
        ecc_uncorrectable BIGINT,
        retired_pages BIGINT,
        mem_available_bytes BIGINT,
        mem_total_bytes BIGINT,
        cpu_s DOUBLE
    )""",
]

# v10: step_summary.loss_mean of a job we did not write. Its ranks report only their own
# loss (`local_loss`; `loss`, the global mean, would take a collective), so v6's avg(loss)
# was NULL there: the mean is now over each rank's loss, its local_loss where loss is NULL
# (the read side's curves do the same: collector/read/queries.py).
_STEP_SUMMARY_V10 = [_STEP_SUMMARY_V6[0].replace("avg(s.loss) AS loss_mean", "avg(coalesce(s.loss, s.local_loss)) AS loss_mean")]
assert _STEP_SUMMARY_V10[0] != _STEP_SUMMARY_V6[0]

# v11: a checkpoint at or below the run's known-good watermark (every step up to it judged by
# every detector, nothing that taints the weights unsettled at or before it, the replicas'
# checksums agreeing past it: analysis/watermark.py) is `known_good`; the trainer never prunes
# the newest one. Rows from before keep false.
_KNOWN_GOOD_V11 = ["ALTER TABLE checkpoints ADD COLUMN known_good BOOLEAN DEFAULT false"]

# v12: goodput by cause (collector/read/goodput.py, docs/postmortem.md): a run's wall time, from its
# start to its last step or event, split into causes that add up to it, one row per (run, cause),
# and per incident for the slow-downs. A step lasts as long as its slowest rank, capped at the time
# since the step before it ended (step_time_parts' rule: no overlap counted twice); the rest of the
# wall time lies in the gaps between steps, before the first and after the last.
#
#   productive  the steps that counted (steps_effective, not skipped), less the slow-downs
#   slowdown    per incident of a costed kind (straggler, slow_link, data_stall): its
#               cost_s_per_step x its effective steps (scaled down when they add up past productive)
#   skipped     effective steps the optimizer skipped (a NaN, an fp16 overflow)
#   detection   steps a rollback replaced that ran after the incident's first step and before it
#               was opened: what waiting for the detector cost
#   redone      the other steps a rollback or a restart replaced
#   recovery    gaps in which the attempt changed or a rank exited (not cleanly: a rank's exit 0 is the
#               end of the run), restarted or rolled back (a round's run_started with restart > 0;
#               the first round's start-up is idle: before schema v13 both were counted as recovery)
#   checkpoint  the rest of a gap after a checkpoint, up to the save's stall (checkpoint_queued)
#   idle        the rest: start-up, evaluation, the end of the run
# The view's query, with `{runs}` the filter on every table it reads (DuckDB does not push a
# filter on run_id through its windows): the view over all runs, and collector/read/queries.py
# `goodput_causes` over one (`run_id = $r`). A change here takes a migration re-creating the view.
GOODPUT_SQL = """WITH per_step AS (
        SELECT run_id, attempt, step, bool_and(effective) AS effective,
               coalesce(bool_or(skipped), false) AS skipped, max(step_s) AS step_s, max(ts) AS end_ts
        FROM steps_history WHERE {runs} GROUP BY run_id, attempt, step),
    timed AS (
        SELECT *, lag(end_ts) OVER w AS prev_end, lag(attempt) OVER w AS prev_attempt,
               lag(step) OVER w AS prev_step,
               greatest(coalesce(least(step_s, end_ts - lag(end_ts) OVER w), step_s, 0), 0) AS own_s
        FROM per_step WINDOW w AS (PARTITION BY run_id ORDER BY end_ts, attempt, step)),
    span AS (
        SELECT run_id, min(start_ts) AS start_ts, max(end_ts) AS end_ts FROM (
            SELECT run_id, ts - coalesce(step_s, 0) AS start_ts, ts AS end_ts FROM steps WHERE {runs}
            UNION ALL SELECT run_id, started_ts, NULL FROM runs WHERE {runs}
            UNION ALL SELECT run_id, ts, NULL FROM heartbeats WHERE {runs}
            UNION ALL SELECT run_id, NULL, ts FROM events WHERE {runs}) GROUP BY run_id),
    bounds AS (
        SELECT t.run_id, min(t.end_ts - t.own_s) AS first_start, max(t.end_ts) AS last_end,
               any_value(s.start_ts) AS start_ts, any_value(s.end_ts) AS end_ts
        FROM timed t JOIN span s USING (run_id) GROUP BY t.run_id),
    gaps AS (
        SELECT run_id, prev_end AS gap_from, end_ts - own_s AS gap_to, attempt <> prev_attempt AS new_attempt,
               prev_step, prev_attempt
        FROM timed WHERE prev_end IS NOT NULL
        UNION ALL SELECT run_id, least(start_ts, first_start), first_start, false, NULL, NULL FROM bounds
        UNION ALL SELECT run_id, last_end, greatest(end_ts, last_end), false, NULL, NULL FROM bounds),
    stalls AS (
        SELECT run_id, step, attempt, max(TRY_CAST(json_extract(data, '$.stall_s') AS DOUBLE)) AS stall_s
        FROM events WHERE {runs} AND kind = 'checkpoint_queued' GROUP BY run_id, step, attempt),
    marks AS (
        SELECT run_id, ts FROM events
        WHERE {runs} AND (kind IN ('run_restarting', 'rollback_started', 'checkpoint_loaded')
              OR (kind = 'run_started' AND coalesce(TRY_CAST(json_extract_string(data, '$.restart') AS INTEGER), 0) > 0)
              OR (kind = 'rank_exited' AND NOT (TRY_CAST(json_extract_string(data, '$.exit_code') AS INTEGER) = 0
                                                AND coalesce(json_extract_string(data, '$.cause'), 'exited') = 'exited')))),
    judged AS (
        SELECT g.run_id, g.gap_to - g.gap_from AS gap_s,
               g.new_attempt OR EXISTS (SELECT 1 FROM marks m WHERE m.run_id = g.run_id AND m.ts > g.gap_from
                                        AND m.ts <= g.gap_to) AS recovery,
               least(greatest(coalesce(st.stall_s, 0), 0), g.gap_to - g.gap_from) AS stall_s
        FROM gaps g LEFT JOIN stalls st
            ON st.run_id = g.run_id AND st.step = g.prev_step AND st.attempt = g.prev_attempt),
    replaced AS (
        SELECT t.run_id, t.own_s, EXISTS (
            SELECT 1 FROM incidents i JOIN actions a ON a.incident_id = i.id AND a.kind = 'rollback'
            WHERE i.run_id = t.run_id AND i.step_from IS NOT NULL AND t.step >= i.step_from
              AND t.end_ts <= i.opened_ts) AS before_detection
        FROM timed t WHERE NOT t.effective),
    slow AS (
        SELECT i.run_id, i.id AS incident_id, count(*) AS num_steps,
               count(*) * TRY_CAST(json_extract(i.evidence, '$.cost_s_per_step') AS DOUBLE) AS seconds
        FROM incidents i JOIN timed t ON t.run_id = i.run_id AND t.effective AND NOT t.skipped
            AND t.step BETWEEN i.step_from AND coalesce(i.step_to, i.step_from)
        WHERE i.kind IN ('straggler', 'slow_link', 'data_stall')
          AND TRY_CAST(json_extract(i.evidence, '$.cost_s_per_step') AS DOUBLE) > 0
        GROUP BY i.run_id, i.id, i.evidence),
    productive AS (
        SELECT run_id, sum(own_s) AS seconds, count(*) AS num_steps FROM timed
        WHERE effective AND NOT skipped GROUP BY run_id),
    scale AS (  -- slow-downs that overlap are not counted past the productive time
        SELECT p.run_id, least(1.0, p.seconds / greatest(sum(s.seconds), 1e-12)) AS k
        FROM productive p JOIN slow s USING (run_id) GROUP BY p.run_id, p.seconds),
    parts AS (
        SELECT p.run_id, 'productive' AS cause, NULL::BIGINT AS incident_id,
               p.seconds - coalesce((SELECT sum(s.seconds) * any_value(k.k) FROM slow s JOIN scale k USING (run_id)
                                     WHERE s.run_id = p.run_id), 0) AS seconds, p.num_steps
        FROM productive p
        UNION ALL SELECT s.run_id, 'slowdown', s.incident_id, s.seconds * k.k, s.num_steps
        FROM slow s JOIN scale k USING (run_id)
        UNION ALL SELECT run_id, 'skipped', NULL, sum(own_s), count(*) FROM timed
        WHERE effective AND skipped GROUP BY run_id
        UNION ALL SELECT run_id, CASE WHEN before_detection THEN 'detection' ELSE 'redone' END, NULL,
                         sum(own_s), count(*)
        FROM replaced GROUP BY run_id, before_detection
        UNION ALL SELECT run_id, 'recovery', NULL, sum(gap_s), NULL FROM judged WHERE recovery GROUP BY run_id
        UNION ALL SELECT run_id, 'checkpoint', NULL, sum(stall_s), NULL FROM judged
        WHERE NOT recovery GROUP BY run_id
        UNION ALL SELECT run_id, 'idle', NULL, sum(gap_s - stall_s), NULL FROM judged
        WHERE NOT recovery GROUP BY run_id)
    SELECT run_id, cause, incident_id, seconds, num_steps,
           seconds / nullif(sum(seconds) OVER (PARTITION BY run_id), 0) AS share
    FROM parts WHERE seconds > 0 OR cause = 'productive'"""
_GOODPUT_V12 = ["CREATE OR REPLACE VIEW goodput AS " + GOODPUT_SQL.format(runs="true")]
# v13: the first round's start and the ranks' clean exits at the end are not recovery (the same view again)
_GOODPUT_V13 = list(_GOODPUT_V12)

# v14: agents of large jobs summarize their collectives (agent/summary.py): one row per (attempt, step,
# rank, op, axis, group_id, peer) in `collectives_rollup`, as the rollup makes them from old op rows,
# plus what the detectors read (the ops' mean entry and completion, the highest seq and group_seq:
# analysis/frames.py `ops_from_summaries`) and the send/recv peer. `collectives.sampled`: 1 for the op rows such an agent
# ships for a sampled step or while the collector asks; NULL from an agent that ships every op.
_AGENT_SUMMARIES_V14 = [
    "ALTER TABLE collectives_rollup ADD COLUMN peer INTEGER",
    "ALTER TABLE collectives_rollup ADD COLUMN mean_start_ts DOUBLE",
    "ALTER TABLE collectives_rollup ADD COLUMN mean_end_ts DOUBLE",
    "ALTER TABLE collectives_rollup ADD COLUMN max_seq BIGINT",
    "ALTER TABLE collectives_rollup ADD COLUMN max_group_seq BIGINT",
    "ALTER TABLE collectives ADD COLUMN sampled TINYINT",
]

# v15: fleet memory. `ranks.hw_id`: the rank's hardware id (its GPU's NVML UUID, or the agent's
# LLMWATCH_HW_ID), so a node's history follows its hardware when its hostname changes, and not the
# hostname when the hardware behind it was replaced (collector/read/fleet.py).
_HW_ID_V15 = ["ALTER TABLE ranks ADD COLUMN hw_id VARCHAR"]

# v16: each heartbeat says its agent's heartbeat interval, so that silence is read against the
# rank's own cadence (analysis/liveness.py): an agent of a 100,000-rank job beats every 30 s, and
# 3 s without one is not a crash there. NULL from an older agent (the rules' fixed times apply).
_HEARTBEAT_INTERVAL_V16 = ["ALTER TABLE heartbeats ADD COLUMN interval_s DOUBLE"]

MIGRATIONS: list[tuple[int, list[str]]] = [
    (1, _TABLES_V1 + _VIEWS_V1),
    (2, _BATCH_HASH_V2),
    (3, _INCIDENT_CAUSE_V3),
    (4, _LOCAL_SIGNALS_V4),
    (5, _ALERT_OUTBOX_V5),
    (6, _STEP_SUMMARY_V6),
    (7, _HEALING_V7),
    (8, _ROLLUP_V8),
    (9, _DEVICE_HEALTH_V9),
    (10, _STEP_SUMMARY_V10),
    (11, _KNOWN_GOOD_V11),
    (12, _GOODPUT_V12),
    (13, _GOODPUT_V13),
    (14, _AGENT_SUMMARIES_V14),
    (15, _HW_ID_V15),
    (16, _HEARTBEAT_INTERVAL_V16),
]


class SchemaTooNew(RuntimeError):
    """The file was written by a newer collector (schema version beyond MIGRATIONS)."""


def current_version(con: duckdb.DuckDBPyConnection) -> int:
    con.execute("CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL, applied_ts DOUBLE NOT NULL)")
    (version,), = con.execute("SELECT max(version) FROM schema_version").fetchall()
    return 0 if version is None else int(version)


def migrate(con: duckdb.DuckDBPyConnection, migrations: list[tuple[int, list[str]]] = MIGRATIONS) -> list[int]:
    """Apply every migration newer than the database's version, each in its own
    transaction. Returns the versions applied (empty when already current).

    A file at a newer version than this code knows (written by a newer collector)
    is refused with SchemaTooNew, before anything is written: an older collector
    could not fill the columns a newer one reads, and would corrupt its file."""
    have = current_version(con)
    known = max((version for version, _ in migrations), default=0)
    if have > known:
        raise SchemaTooNew(f"the database is at schema version {have}, newer than this collector's {known}: "
                           f"open it with the collector version that wrote it, or a newer one")
    applied = []
    for version, statements in sorted(migrations):
        if version <= have:
            continue
        con.execute("BEGIN TRANSACTION")
        try:
            for sql in statements:
                con.execute(sql)
            con.execute("INSERT INTO schema_version (version, applied_ts) VALUES (?, ?)", [version, time.time()])
            con.execute("COMMIT")
        except Exception:
            con.execute("ROLLBACK")
            raise
        applied.append(version)
    return applied
