"""Retention: roll old per-collective rows up into per-step summaries, and compact a file.

A rank writes a `collectives` row per communication op: 20 ops a step is 20 rows
for one `steps` row, ~90% of a file's bytes (bench/bench_storage.py). Past an age
nobody debugs single ops any more, so `rollup` replaces a step's rows by

- `collectives_rollup`: one row per (run, attempt, step, rank, axis, op, group_id)
  with the op count, the sums of bytes, duration_s and wait_s, their maxima, and
  the first entry / last completion time: every total of `comm_ops` and every
  column of `collective_summary` stays exact; `comm_latency` sees per-rank-step
  means instead of single ops (its boxes are then per-step statistics);
- `collective_waits_rollup`: who waited for whom, per (run, attempt, step, waiter,
  waited_for), computed exactly as `comm_waits` does from the raw rows (the
  collective instances are matched by group_seq within the step), so that view
  keeps its answer too.

A step is rolled up whole, and only when all of its rows entered before the cutoff
(`start_ts`, the ranks' clocks): a collective instance is never split between the
raw table and the summary. The work goes in chunks of about `max_rows` raw rows,
each one transaction (on a live collector: one writer job, so ingest interleaves),
and is idempotent: rolled-up rows are gone, so a second pass finds nothing to do.
The age has a floor, `MIN_ROLLUP_AGE_S`, far beyond every detection window (the
longest, analysis/rules.toml's transient and rollback windows, is an hour; the
detectors read the live feed, not these rows).

DuckDB reuses the blocks that deleted rows free, but does not give them back to
the file system: a file stops growing after a rollup instead of shrinking.
`compact` rewrites a closed file into a fresh one (COPY FROM DATABASE), which
does shrink it; docs/scale.md has the measured figures.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import duckdb

from collector.store.schema import LAST_IN_RANK_SQL
from collector.threads import name_native

log = logging.getLogger("collector.offline.retention")

HOUR_S = 3600.0
DAY_S = 24 * HOUR_S
MIN_ROLLUP_AGE_S = DAY_S  # raw collectives younger than this are never rolled up
DEFAULT_ROLLUP_EVERY_S = HOUR_S
DEFAULT_CHUNK_ROWS = 500_000  # raw rows per rollup transaction (~1 s of writer time, bench/bench_storage.py)

_AGE_UNITS = {"": 1.0, "s": 1.0, "m": 60.0, "h": HOUR_S, "d": DAY_S, "w": 7 * DAY_S}


def parse_age(text: str) -> float:
    """'7d', '36h', '90m', '3600s', '3600' -> seconds."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*", str(text).lower())
    if not m:
        raise ValueError(f"not an age: {text!r} (e.g. 7d, 36h, 90m, 3600s)")
    return float(m.group(1)) * _AGE_UNITS[m.group(2)]


def check_age(older_than_s: float, minimum_s: float = MIN_ROLLUP_AGE_S) -> float:
    """`older_than_s`, or ValueError below the floor."""
    if not older_than_s >= minimum_s:
        raise ValueError(f"a rollup age of {older_than_s:g} s is below the minimum of {minimum_s:g} s "
                         f"({minimum_s / HOUR_S:g} h): younger collectives stay raw for the detectors, "
                         "the dashboard's op-level views and postmortems")
    return older_than_s


@dataclass(frozen=True, slots=True)
class Chunk:
    """Steps [step_from, step_to] of one (run, attempt), every one of them eligible."""

    run_id: str
    attempt: int
    step_from: int
    step_to: int
    num_rows: int


@dataclass(slots=True)
class RollupResult:
    num_steps: int = 0
    raw_rows: int = 0  # collectives rows summarised and deleted
    rollup_rows: int = 0  # collectives_rollup rows written
    wait_rows: int = 0  # collective_waits_rollup rows written
    num_chunks: int = 0

    def add(self, other: "RollupResult") -> None:
        for f in ("num_steps", "raw_rows", "rollup_rows", "wait_rows", "num_chunks"):
            setattr(self, f, getattr(self, f) + getattr(other, f))


def plan(con: duckdb.DuckDBPyConnection, cutoff_ts: float, *, max_rows: int = DEFAULT_CHUNK_ROWS,
         run_id: str | None = None) -> list[Chunk]:
    """The chunks a rollup at `cutoff_ts` would take: runs of consecutive eligible
    steps (every row entered before the cutoff) of one (run, attempt), cut where their
    rows pass `max_rows` (a chunk has at least one step)."""
    rows = con.execute("""
        WITH s AS (SELECT run_id, attempt, step, count(*) AS n FROM collectives
                   WHERE run_id = coalesce($run, run_id) GROUP BY ALL
                   HAVING max(coalesce(start_ts, 'inf'::DOUBLE)) < $cutoff),
             i AS (SELECT *, step - row_number() OVER (PARTITION BY run_id, attempt ORDER BY step) AS island
                   FROM s),
             c AS (SELECT *, (sum(n) OVER (PARTITION BY run_id, attempt, island ORDER BY step) - n) // $max AS part
                   FROM i)
        SELECT run_id, attempt, min(step), max(step), sum(n)::BIGINT FROM c
        GROUP BY run_id, attempt, island, part ORDER BY run_id, attempt, min(step)""",
                       {"cutoff": float(cutoff_ts), "max": max(1, int(max_rows)), "run": run_id}).fetchall()
    return [Chunk(r, int(a), int(lo), int(hi), int(n)) for r, a, lo, hi, n in rows]


_CHUNK = "run_id = $r AND attempt = $a AND step BETWEEN $lo AND $hi"


def rollup_chunk(con: duckdb.DuckDBPyConnection, chunk: Chunk) -> RollupResult:
    """Summarise and delete one chunk's raw rows. Runs inside the caller's transaction
    (the writer's job, or `rollup`'s own)."""
    p = {"r": chunk.run_id, "a": chunk.attempt, "lo": chunk.step_from, "hi": chunk.step_to}
    (rollup_rows,), = con.execute(f"""
        INSERT INTO collectives_rollup BY NAME
        SELECT run_id, attempt, step, rank, axis, op, group_id, peer, count(*) AS num_ops,
               sum(bytes)::BIGINT AS bytes, sum(duration_s) AS duration_s, max(duration_s) AS max_duration_s,
               sum(wait_s) AS wait_s, max(wait_s) AS max_wait_s, min(start_ts) AS start_ts,
               max(start_ts + coalesce(duration_s, 0)) AS end_ts, avg(start_ts) AS mean_start_ts,
               avg(start_ts + coalesce(duration_s, 0)) AS mean_end_ts,
               max(seq) AS max_seq, max(group_seq) AS max_group_seq
        FROM collectives WHERE {_CHUNK} GROUP BY ALL""", p).fetchall()
    # who waited for whom, as read/views.py comm_waits computes it from raw rows
    (wait_rows,), = con.execute(f"""
        INSERT INTO collective_waits_rollup BY NAME
        WITH c AS (SELECT * FROM collectives WHERE {_CHUNK}),
             g AS (SELECT step, axis, group_id, group_seq, {LAST_IN_RANK_SQL} AS last_rank, max(start_ts) AS last_ts
                   FROM c WHERE group_seq IS NOT NULL AND op NOT IN ('send', 'recv')
                   GROUP BY ALL HAVING count(*) > 1)
        SELECT $r AS run_id, $a AS attempt, c.step, c.rank AS waiter, g.last_rank AS waited_for,
               count(*) AS num_ops,
               sum(least(g.last_ts - c.start_ts, coalesce(c.wait_s, g.last_ts - c.start_ts))) AS wait_s
        FROM c JOIN g USING (step, axis, group_id, group_seq)
        WHERE c.rank <> g.last_rank GROUP BY ALL""", p).fetchall()
    (raw_rows,), = con.execute(f"DELETE FROM collectives WHERE {_CHUNK}", p).fetchall()
    return RollupResult(num_steps=chunk.step_to - chunk.step_from + 1, raw_rows=int(raw_rows),
                        rollup_rows=int(rollup_rows), wait_rows=int(wait_rows), num_chunks=1)


def checkpoint(con: duckdb.DuckDBPyConnection) -> bool:
    """CHECKPOINT: fold the WAL into the file, so the freed blocks can be reused. False
    when DuckDB declines (another transaction running); its automatic checkpoint
    (checkpoint_threshold) comes later anyway."""
    try:
        con.execute("CHECKPOINT")
        return True
    except duckdb.Error as e:
        log.info("checkpoint after the rollup deferred: %s", e)
        return False


def rollup(con: duckdb.DuckDBPyConnection, *, older_than_s: float, now: float | None = None,
           max_rows: int = DEFAULT_CHUNK_ROWS, run_id: str | None = None,
           minimum_s: float = MIN_ROLLUP_AGE_S) -> RollupResult:
    """Roll up every step whose collectives all entered more than `older_than_s` before
    `now` (default: the clock), chunk by chunk, each chunk one transaction, then
    checkpoint. For a file no collector holds (`collector rollup`); a live collector
    runs the same chunks on its writer thread (`RollupJob`)."""
    check_age(older_than_s, minimum_s)
    cutoff = (time.time() if now is None else now) - older_than_s
    total = RollupResult()
    for chunk in plan(con, cutoff, max_rows=max_rows, run_id=run_id):
        con.execute("BEGIN TRANSACTION")
        try:
            result = rollup_chunk(con, chunk)
            con.execute("COMMIT")
        except BaseException:
            con.execute("ROLLBACK")
            raise
        total.add(result)
    if total.num_chunks:
        checkpoint(con)
    return total


class RollupJob:
    """`collector serve --rollup-after AGE`: every `every_s`, plan the rollup on a read
    cursor and run its chunks one writer job each (`submit(fn)`: Storage.write, which
    runs `fn(ctx)` on the writer thread in a transaction of its own), so a big
    rollup never holds the writer for longer than one chunk. Then a checkpoint, on
    the writer thread too (after that job's commit)."""

    def __init__(self, submit: Callable[[Callable[[Any], Any]], Future],
                 read: Callable[..., Any], *, older_than_s: float, every_s: float = DEFAULT_ROLLUP_EVERY_S,
                 max_rows: int = DEFAULT_CHUNK_ROWS, clock: Callable[[], float] = time.time,
                 minimum_s: float = MIN_ROLLUP_AGE_S, job_timeout_s: float = 600.0) -> None:
        self.older_than_s = check_age(older_than_s, minimum_s)
        self._submit, self._read = submit, read
        self.every_s, self.max_rows, self._clock = max(1.0, every_s), max_rows, clock
        self._job_timeout_s = job_timeout_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="collector-rollup", daemon=True)
        self.totals = RollupResult()
        self.passes = 0

    def start(self) -> "RollupJob":
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 30.0) -> None:
        """Stop between chunks (one in flight finishes on the writer)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    def alive(self) -> bool:
        return self._thread.is_alive()

    def run_once(self) -> RollupResult:
        """One pass: every eligible chunk now, then a checkpoint."""
        cutoff = self._clock() - self.older_than_s
        chunks = self._read(plan, cutoff, max_rows=self.max_rows)
        done = RollupResult()
        for chunk in chunks:
            if self._stop.is_set():
                break
            done.add(self._submit(lambda ctx, c=chunk: rollup_chunk(ctx.con, c)).result(self._job_timeout_s))
        if done.num_chunks and not self._stop.is_set():
            def after(ctx) -> None:
                ctx.after_commit(lambda: checkpoint(ctx.con))
            self._submit(after).result(self._job_timeout_s)
        self.totals.add(done)
        self.passes += 1
        if done.num_chunks:
            log.info("rolled up %d steps: %d collectives rows became %d summary rows", done.num_steps,
                     done.raw_rows, done.rollup_rows)
        return done

    def _loop(self) -> None:
        name_native("lw-rollup")
        while not self._stop.is_set():
            try:
                self.run_once()
            except Exception:  # a failed pass is logged and tried again next period; ingest goes on
                log.exception("collectives rollup failed")
            self._stop.wait(self.every_s)


# -- compaction: rewrite a closed file ------------------------------------------------------
@dataclass(slots=True)
class CompactResult:
    bytes_before: int
    bytes_after: int
    rows: dict[str, int]


def file_bytes(path: str | Path) -> int:
    """The database file's size plus its WAL's."""
    p = Path(path)
    wal = Path(str(p) + ".wal")
    return (p.stat().st_size if p.exists() else 0) + (wal.stat().st_size if wal.exists() else 0)


def compact(path: str | Path, *, out: str | Path | None = None) -> CompactResult:
    """Rewrite the closed database `path` into a fresh file (DuckDB's COPY FROM DATABASE:
    tables with their keys, views, every row), check every table's row count, and
    replace `path` with it (or write `out` and leave `path` alone). What deleted rows
    freed is then given back to the file system."""
    path = Path(path)
    target = Path(out) if out is not None else path.with_name(path.name + ".compacting")
    if out is not None and target.exists():
        raise FileExistsError(f"{target} exists")
    target.unlink(missing_ok=True)
    Path(str(target) + ".wal").unlink(missing_ok=True)
    con = duckdb.connect(str(path))  # folds a leftover WAL in, and takes the file's lock for the copy
    try:
        con.execute("CHECKPOINT")
        before = file_bytes(path)
        con.execute(f"ATTACH '{_sql_text(target)}' AS compacted")
        src = con.execute("SELECT current_database()").fetchone()[0]
        con.execute(f'COPY FROM DATABASE "{src}" TO compacted')
        rows = {}
        for (table,) in con.execute("SELECT table_name FROM duckdb_tables() WHERE database_name = ? "
                                    "ORDER BY table_name", [src]).fetchall():
            n_src = con.execute(f'SELECT count(*) FROM "{src}".main."{table}"').fetchone()[0]
            n_dst = con.execute(f'SELECT count(*) FROM compacted.main."{table}"').fetchone()[0]
            if n_src != n_dst:
                raise RuntimeError(f"compaction lost rows of {table}: {n_src} -> {n_dst}")
            rows[table] = int(n_dst)
        con.execute("CHECKPOINT compacted")
        con.execute("DETACH compacted")
    except BaseException:
        con.close()
        target.unlink(missing_ok=True)
        raise
    con.close()
    if out is None:
        os.replace(target, path)
        Path(str(path) + ".wal").unlink(missing_ok=True)  # checkpointed above: nothing in it
        target = path
    return CompactResult(bytes_before=before, bytes_after=file_bytes(target), rows=rows)


def _sql_text(path: Path) -> str:
    return str(path).replace("'", "''")
