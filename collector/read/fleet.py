"""Fleet memory, the read side: each node's history across runs, from a DuckDB file
and from the Parquet archive (`collector archive`), as analysis/fleet.py's history rows.

Two sources, one shape (HISTORY_COLUMNS, what analysis/fleet.py reads):

- `file_history(cur, ...)`: a collector's own file, live or closed (a long-lived
  collector holds many runs);
- `archive_history(dir, ...)`: the archive's `ranks`, `nodes` and `incidents` folders
  (hive layout, docs/scale.md), through collector/offline/archive.py `open_archive` (a
  connection of its own: the collector's may read no file, collector/sql/). Runs of an
  older schema are read by name (a column they lack is NULL), an empty or missing
  archive is no history.

`history(...)` joins them: a run in both is read from the file only (it may have gone
on since it was archived). The rows are about the nodes given (the run's), within
[since_ts, until_ts), and never about the run itself.

Per node and run: `seen` (the node held ranks of the run; at its first rank's first
row), `isolated` (the policy took it out; at the isolation), and each incident that
names it, by kind (at its opening).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import duckdb
import polars as pl
import pyarrow as pa

from analysis import fleet as analysis_fleet

log = logging.getLogger("collector.read.fleet")

HISTORY_COLUMNS = ("run_id", "past_run_id", "node", "ts", "what", "incident_id", "hw_id")
HISTORY_SCHEMA = pa.schema([("run_id", pa.string()), ("past_run_id", pa.string()), ("node", pa.string()),
                            ("ts", pa.float64()), ("what", pa.string()), ("incident_id", pa.int64()),
                            ("hw_id", pa.string())])
# The history rows of tables named ranks, nodes and incidents (the file's own, or views of the
# archive's), with each row's hardware id (its node's ranks' in that run): the rows of the nodes
# named, or of the hardware ids given (a node renamed since), within [since, until).
_HISTORY_SQL = """
    WITH hw AS (SELECT run_id, node, max(hw_id) AS hw_id FROM ranks WHERE node IS NOT NULL GROUP BY run_id, node),
    h AS (
        SELECT run_id AS past_run_id, node, min(first_seen_ts) AS ts, 'seen' AS what, NULL::BIGINT AS incident_id,
               max(hw_id) AS hw_id
        FROM ranks WHERE node IS NOT NULL GROUP BY run_id, node
        UNION ALL
        SELECT n.run_id, n.node, n.isolated_ts, 'isolated', n.incident_id::BIGINT, hw.hw_id
        FROM nodes n LEFT JOIN hw ON hw.run_id = n.run_id AND hw.node = n.node WHERE n.isolated_ts IS NOT NULL
        UNION ALL
        SELECT i.run_id, i.node, i.opened_ts, i.kind, i.id::BIGINT, hw.hw_id
        FROM incidents i LEFT JOIN hw ON hw.run_id = i.run_id AND hw.node = i.node WHERE i.node IS NOT NULL)
    SELECT $run AS run_id, past_run_id, node, ts, what, incident_id, hw_id FROM h
    WHERE past_run_id <> $run AND NOT list_contains($skip, past_run_id) AND ts >= $since AND ts < $until
        AND ($nodes IS NULL OR node IN (SELECT unnest($nodes))
             OR (hw_id IS NOT NULL AND list_contains($hw, hw_id)))
    ORDER BY ts, past_run_id, node"""


def _params(run_id: str, nodes: Iterable[str] | None, since_ts: float, until_ts: float,
            skip: Iterable[str] = (), hw_ids: Iterable[str] = ()) -> dict:
    """The query's parameters; `nodes` None: every node (`collector nodes`)."""
    return {"run": run_id, "nodes": None if nodes is None else sorted({str(n) for n in nodes}),
            "since": float(since_ts), "until": float(until_ts), "skip": sorted({str(r) for r in skip}),
            "hw": sorted({str(h) for h in hw_ids if h})}


def run_nodes(cur, run_id: str) -> list[str]:
    """The nodes of `run_id` in the file: those that held its ranks, and its spares."""
    return [n for (n,) in cur.execute(
        "SELECT DISTINCT node FROM ranks WHERE run_id = $r AND node IS NOT NULL UNION "
        "SELECT node FROM nodes WHERE run_id = $r ORDER BY 1", {"r": run_id}).fetchall()]


def file_run_ids(cur) -> list[str]:
    return [r for (r,) in cur.execute("SELECT run_id FROM runs ORDER BY 1").fetchall()]


def run_hw_ids(cur, run_id: str) -> list[str]:
    """The hardware ids of `run_id`'s ranks in the file."""
    return [h for (h,) in cur.execute("SELECT DISTINCT hw_id FROM ranks WHERE run_id = $r AND hw_id IS NOT NULL "
                                      "ORDER BY 1", {"r": run_id}).fetchall()]


def file_history(cur, run_id: str, nodes: Sequence[str] | None, *, since_ts: float, until_ts: float,
                 hw_ids: Sequence[str] = ()) -> pa.Table:
    """The history rows of `nodes` (None: every node) and `hw_ids` in the file's runs other than `run_id`."""
    if nodes is not None and not nodes and not hw_ids:
        return HISTORY_SCHEMA.empty_table()
    return cur.sql(_HISTORY_SQL, params=_params(run_id, nodes, since_ts, until_ts, hw_ids=hw_ids)) \
        .to_arrow_table().cast(HISTORY_SCHEMA)


def archive_history(archive_dir: str | Path, run_id: str, nodes: Sequence[str] | None, *, since_ts: float,
                    until_ts: float, skip_runs: Iterable[str] = (), hw_ids: Sequence[str] = ()) -> pa.Table:
    """The history rows of `nodes` (None: every node) and `hw_ids` in the archive's runs (not
    `run_id`, nor `skip_runs`)."""
    root = Path(archive_dir)
    if (nodes is not None and not nodes and not hw_ids) or not root.is_dir():
        return HISTORY_SCHEMA.empty_table()
    from collector.offline.archive import open_archive

    con = open_archive(root, threads=1)
    try:
        return con.sql(_HISTORY_SQL, params=_params(run_id, nodes, since_ts, until_ts, skip_runs, hw_ids)) \
            .to_arrow_table().cast(HISTORY_SCHEMA)
    finally:
        con.close()


def history(cur, run_id: str, *, since_ts: float, until_ts: float, archive_dir: str | Path | None = None,
            nodes: Sequence[str] | None = None, hw_ids: Sequence[str] | None = None) -> pa.Table:
    """The history rows of the run's nodes and hardware (default: `run_nodes`, `run_hw_ids`) in
    the file's other runs, and in the archive's runs the file does not hold."""
    nodes = run_nodes(cur, run_id) if nodes is None else list(nodes)
    hw_ids = run_hw_ids(cur, run_id) if hw_ids is None else list(hw_ids)
    return fleet_history(cur, run_id, nodes, since_ts=since_ts, until_ts=until_ts, archive_dir=archive_dir,
                         hw_ids=hw_ids)


def fleet_history(cur, run_id: str, nodes: Sequence[str] | None, *, since_ts: float, until_ts: float,
                  archive_dir: str | Path | None = None, hw_ids: Sequence[str] = ()) -> pa.Table:
    """The history rows of `nodes` (None: every node) and `hw_ids` in the runs other than `run_id`
    (`""`: every run) of the file behind `cur` (None: none) and of the archive."""
    parts = [file_history(cur, run_id, nodes, since_ts=since_ts, until_ts=until_ts, hw_ids=hw_ids)] \
        if cur is not None else []
    if archive_dir is not None:
        try:
            parts.append(archive_history(archive_dir, run_id, nodes, since_ts=since_ts, until_ts=until_ts,
                                         skip_runs=file_run_ids(cur) if cur is not None else (), hw_ids=hw_ids))
        except duckdb.Error as e:  # a damaged archive costs the history, not the run's detection
            log.warning("cannot read the archive %s: %s", archive_dir, e)
    return pa.concat_tables(parts) if parts else HISTORY_SCHEMA.empty_table()


class RunHistories:
    """The live collector's history of each run's nodes, for the detection runner's meta
    rows (collector/live/detection.py): read through `read` (Storage.read: a cursor of
    its own) and the archive, and kept `max_age_s` per run and node set. A run's meta is
    read every pass until every rank has reported; its nodes' history is read again only
    when the set grows (a rank of a new node reported, a spare joined) or it got old."""

    def __init__(self, read: Callable[..., pa.Table], *, window_s: float, archive_dir: str | Path | None = None,
                 clock: Callable[[], float] = time.time, max_age_s: float = 60.0, max_runs: int = 256) -> None:
        self._read, self._archive = read, archive_dir
        self.window_s, self.max_age_s, self.max_runs = window_s, max_age_s, max_runs
        self._clock = clock
        self._cache: dict[str, tuple[tuple, float, pa.Table]] = {}

    def for_run(self, run_id: str, nodes: Iterable[str], hw_ids: Iterable[str] = ()) -> pa.Table:
        names = tuple(sorted({str(n) for n in nodes if n is not None}))
        hw = tuple(sorted({str(h) for h in hw_ids if h}))
        key = (names, hw)
        had = self._cache.get(run_id)
        if had is not None and had[0] == key and time.monotonic() - had[1] < self.max_age_s:
            return had[2]
        now = self._clock()
        table = self._read(history, run_id, since_ts=now - self.window_s, until_ts=now, archive_dir=self._archive,
                           nodes=list(names), hw_ids=list(hw))
        if len(self._cache) >= self.max_runs and run_id not in self._cache:
            self._cache.pop(next(iter(self._cache)))  # the oldest run's
        self._cache[run_id] = (key, time.monotonic(), table)
        return table


# The share of each run's wall time in steps that counted: a step counts in its last attempt, at
# its slowest rank's step_s; the wall from the first step's start to the last one's end. The same
# SQL is docs/fleet.md's `goodput_per_run` (a test holds them equal), run here on the file's
# `steps` or the archive's (collector/offline/archive.py `open_archive`).
GOODPUT_PER_RUN_SQL = """WITH s AS (
    SELECT run_id, attempt, step, max(step_s) AS step_s, min(ts - step_s) AS start_ts, max(ts) AS end_ts
    FROM steps WHERE step_s IS NOT NULL{where}
    GROUP BY run_id, attempt, step),
e AS (
    SELECT s.*, max(attempt) OVER (PARTITION BY run_id, step) AS last_attempt FROM s)
SELECT run_id, count(DISTINCT step) AS steps, max(attempt) AS attempts,
       sum(CASE WHEN attempt = last_attempt THEN step_s ELSE 0 END) AS counted_s,
       max(end_ts) - min(start_ts) AS wall_s,
       sum(CASE WHEN attempt = last_attempt THEN step_s ELSE 0 END) / (max(end_ts) - min(start_ts)) AS goodput
FROM e
GROUP BY run_id
ORDER BY run_id"""
MAX_GOODPUT_RUNS = 50  # the newest runs whose goodput the fleet report reads (each a scan of its steps)


def run_goodputs(cur, run_ids: Sequence[str]) -> dict[str, float | None]:
    """run id -> goodput (GOODPUT_PER_RUN_SQL), of the runs among `run_ids` with steps."""
    if not run_ids:
        return {}
    rows = cur.execute(GOODPUT_PER_RUN_SQL.format(where=" AND run_id IN (SELECT unnest($runs))"),
                       {"runs": sorted(set(run_ids))}).fetchall()
    return {r[0]: (float(r[5]) if r[5] is not None and r[4] else None) for r in rows}


def _goodputs(cur, archive_dir: str | Path | None, run_ids: list[str]) -> dict[str, float | None]:
    """The runs' goodput from the file behind `cur` (None: none), then from the archive for the rest."""
    out = run_goodputs(cur, run_ids) if cur is not None else {}
    rest = [r for r in run_ids if r not in out]
    if rest and archive_dir is not None and Path(archive_dir).is_dir():
        from collector.offline.archive import open_archive

        try:
            con = open_archive(archive_dir, threads=1)
            try:
                out.update(run_goodputs(con, rest))
            finally:
                con.close()
        except duckdb.Error as e:
            log.warning("cannot read the archive %s: %s", archive_dir, e)
    return out


def node_records(cur, *, since_ts: float, until_ts: float, rules, archive_dir: str | Path | None = None) -> dict:
    """The fleet over [since_ts, until_ts) in the file behind `cur` (None: none) and the archive:
    `nodes`, every node's record, worst first (analysis/fleet.py `summarize`, with `by_kind` and
    `flagged` by the rules' `[node_history]`); `runs`, every run with when it began, its nodes and
    its goodput (the newest MAX_GOODPUT_RUNS); `cells`, per run and node its faults, their kinds
    and whether it was isolated. What `collector nodes` prints, `GET /v1/fleet/nodes` answers and
    the dashboard's Fleet page draws."""
    cfg = rules.node_history
    history = pl.from_arrow(fleet_history(cur, "", None, since_ts=since_ts, until_ts=until_ts,
                                          archive_dir=archive_dir))
    summary = analysis_fleet.summarize(history, since_ts=since_ts, fault_kinds=cfg.fault_kinds)
    kinds = analysis_fleet.faults_by_kind(history, since_ts=since_ts, fault_kinds=cfg.fault_kinds)
    cells, runs = analysis_fleet.grid(history, cfg.fault_kinds)
    newest = [r["run_id"] for r in runs[-MAX_GOODPUT_RUNS:]]
    goodput = _goodputs(cur, archive_dir, newest)
    for r in runs:
        r["goodput"] = goodput.get(r["run_id"])
    return {"since_ts": since_ts, "until_ts": until_ts, "flag_runs": cfg.flag_runs,
            "fault_kinds": list(cfg.fault_kinds), "num_runs": len(runs),
            "nodes": [{**row, "by_kind": kinds.get(row["node"], {}),
                       "flagged": analysis_fleet.is_flagged(row["fault_runs"], cfg.flag_runs)}
                      for row in summary.iter_rows(named=True)],
            "runs": runs, "cells": cells}
