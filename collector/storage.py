"""Storage: the one module that talks to DuckDB (with writer.py for the writes).

`Storage` opens the database locked down (no files, no network, no settings
changes from SQL), applies migrations, starts the writer thread, and answers
the dashboard's queries on cursors of their own: DuckDB's MVCC lets readers run
beside the writer's transactions, so a query never waits for a commit and a
commit never waits for a query.

Writes (ingest, commands, incidents, actions, node status) all go through the
writer thread; the methods here only queue them and return futures.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import duckdb
import pyarrow as pa
from prometheus_client import Gauge

from collector.commands import Command, validate_request
from collector.decode import DecodedBatch, json_text
from collector.metrics import CollectorMetrics
from collector.schema import migrate
from collector.settings import Settings
from collector.sqlguard import SelectResult, SqlRefused, run_select
from collector.sqlslots import SqlDeadline, SqlSlots
from collector.writer import IngestOutcome, WriteContext, Writer

# Applied to every connection we open: SQL can reach no file but the database,
# no network, no extension, and cannot change these settings.
DUCKDB_LOCKDOWN = {
    "enable_external_access": False,
    "autoinstall_known_extensions": False,
    "autoload_known_extensions": False,
    "lock_configuration": True,
}

# The HTTP answer to a query comes this long after its timeout at the latest, whether
# or not DuckDB has honoured the interrupt yet (it normally does within milliseconds).
SQL_ANSWER_GRACE_S = 0.5

STEP_METRICS = ("loss", "grad_norm", "loss_scale", "lr", "tokens", "step_s", "fwd_s", "bwd_s", "opt_s",
                "data_s", "comm_exposed_s", "mem_bytes")
INCIDENT_FIELDS = ("kind", "severity", "rank", "node", "step_from", "step_to", "status", "evidence",
                   "root_cause", "confidence")
_JSON_FIELDS = frozenset({"evidence", "detail"})


def connect(path: str | Path, *, read_only: bool = False, threads: int = 2, memory_limit: str = "2GB",
            checkpoint_threshold: str = "64MB", max_temp_size: str = "4GB") -> duckdb.DuckDBPyConnection:
    """Open a database file with `DUCKDB_LOCKDOWN` (and, writable, the WAL size that
    triggers an automatic checkpoint). `max_temp_size` caps what queries may spill to
    disk beside the file (DuckDB's default is 90% of the free disk)."""
    config = {**DUCKDB_LOCKDOWN, "threads": threads, "memory_limit": memory_limit,
              "max_temp_directory_size": max_temp_size}
    if not read_only:
        config["checkpoint_threshold"] = checkpoint_threshold
    return duckdb.connect(str(path), read_only=read_only, config=config)


def _records(cur: duckdb.DuckDBPyConnection, sql: str, params: list | None = None) -> list[dict[str, Any]]:
    """Rows as dicts; JSON columns parsed."""
    cur.execute(sql, params or [])
    names = [d[0] for d in cur.description]
    is_json = [str(d[1]) == "JSON" for d in cur.description]
    out = []
    for row in cur.fetchall():
        out.append({n: (json.loads(v) if j and v is not None else v) for n, j, v in zip(names, is_json, row)})
    return out


class Storage:
    """One open collector database: its writer thread, its readers, its metrics.
    Opening applies migrations; `close()` drains the writer and checkpoints."""

    def __init__(self, settings: Settings, *, metrics: CollectorMetrics | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.settings = settings
        self._clock = clock
        self._con = connect(settings.db_path, threads=settings.duckdb_threads,
                            memory_limit=settings.duckdb_memory_limit,
                            checkpoint_threshold=settings.duckdb_checkpoint_threshold,
                            max_temp_size=settings.duckdb_max_temp_size)
        self._closed = False
        try:
            migrate(self._con)
            self.metrics = metrics or CollectorMetrics(live_run_s=settings.live_run_s, clock=clock)
            self._writer = Writer(self._con, metrics=self.metrics, clock=clock,
                                  group_max_rows=settings.group_max_rows, group_max_bytes=settings.group_max_bytes,
                                  group_min_rows=settings.group_min_rows, group_linger_s=settings.group_linger_s,
                                  group_gap_s=settings.group_gap_s, group_min_interval_s=settings.group_min_interval_s,
                                  queue_max_bytes=settings.queue_max_bytes, command_ttl_s=settings.command_ttl_s)
        except BaseException:
            self._con.close()
            raise
        self._read_root = self._con.cursor()
        self._read_lock = threading.Lock()
        self._init_sql()
        self.metrics.watch_queue(self.queue_depth)
        self.metrics.watch_incidents(self.open_incidents)
        self._writer.start()

    def close(self) -> None:
        """Write what is queued, checkpoint (fold the WAL into the file), close."""
        if self._closed:
            return
        self._closed = True
        self._close_sql()
        self._writer.stop()
        self._read_root.close()
        self._con.execute("CHECKPOINT")
        self._con.close()

    def queue_depth(self) -> int:
        return self._writer.depth()

    def health(self) -> tuple[bool, str]:
        """(healthy, why not). Unhealthy: closed, or the writer thread is gone (nothing
        could be stored: every ingest would wait for a commit that never comes)."""
        if self._closed:
            return False, "storage is closed"
        if not self._writer.alive():
            return False, "the writer thread has died; see the collector's log"
        return True, ""

    # -- writes ----------------------------------------------------------------
    async def ingest(self, batch: DecodedBatch) -> IngestOutcome:
        """Store a batch; returns once it is committed (or known to be stored)."""
        fut = asyncio.get_running_loop().create_future()
        self._writer.submit_batch(batch, fut)
        return await fut

    async def ingest_tables(self, tables: dict[str, pa.Table]) -> int:
        """Append prepared tables (OTLP scalars) in the next group commit."""
        fut = asyncio.get_running_loop().create_future()
        self._writer.submit_tables(tables, fut)
        return await fut

    def ingest_blocking(self, batch: DecodedBatch) -> IngestOutcome:
        """`ingest` for callers without an event loop (tests, replaying files)."""
        fut: Future = Future()
        self._writer.submit_batch(batch, fut)
        return fut.result()

    def write(self, fn: Callable[[WriteContext], Any]) -> Future:
        """Run `fn(ctx)` on the writer thread inside one transaction."""
        return self._writer.submit_call(fn)

    def issue_command(self, run_id: str, kind: str, args: dict[str, Any], ranks: list[int] | None) -> Future:
        """Store a command (see commands.py); the future gives its row, or KeyError for
        an unknown run. Raises ValueError at once for a malformed request."""
        validate_request(kind, args, ranks)

        def call(ctx: WriteContext) -> dict[str, Any]:
            found = ctx.con.execute("SELECT world_size FROM runs WHERE run_id = ?", [run_id]).fetchall()
            if not found:
                raise KeyError(f"unknown run {run_id!r}")
            targets = sorted(set(ranks)) if ranks is not None else (
                list(range(found[0][0])) if found[0][0] else None)
            cmd = Command(id=ctx.next_id("commands"), run_id=run_id, kind=kind, args=args, ranks=targets,
                          issued_ts=ctx.now, updated_ts=ctx.now)
            ctx.con.execute("INSERT INTO commands VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                            [cmd.id, run_id, kind, json_text(args), json_text(targets), cmd.issued_ts, cmd.status,
                             "[]", "{}", cmd.updated_ts])
            ctx.after_commit(lambda: ctx.book.add(cmd))
            return cmd.as_dict()
        return self.write(call)

    def open_incident(self, run_id: str, kind: str, severity: str, **fields: Any) -> Future:
        """Insert an incident (fields: INCIDENT_FIELDS); the future gives its id."""
        unknown = set(fields) - set(INCIDENT_FIELDS)
        if unknown:
            raise ValueError(f"unknown incident fields {sorted(unknown)}")

        def call(ctx: WriteContext) -> int:
            iid = ctx.next_id("incidents")
            row = {"id": iid, "run_id": run_id, "kind": kind, "severity": severity, "opened_ts": ctx.now,
                   "updated_ts": ctx.now, "status": "open", **fields}
            if "evidence" in row:
                row["evidence"] = json_text(row["evidence"])
            names = list(row)
            ctx.con.execute(f"INSERT INTO incidents ({', '.join(names)}) VALUES ({', '.join('?' * len(names))})",
                            [row[n] for n in names])
            return iid
        return self.write(call)

    def update_incident(self, incident_id: int, **fields: Any) -> Future:
        """Change fields of an incident; status "closed" also sets closed_ts."""
        unknown = set(fields) - set(INCIDENT_FIELDS)
        if unknown or not fields:
            raise ValueError(f"give some of {INCIDENT_FIELDS}; unknown {sorted(unknown)}")

        def call(ctx: WriteContext) -> None:
            row = {k: (json_text(v) if k in _JSON_FIELDS else v) for k, v in fields.items()}
            row["updated_ts"] = ctx.now
            if fields.get("status") == "closed":
                row["closed_ts"] = ctx.now
            sets = ", ".join(f"{k} = ?" for k in row)
            ctx.con.execute(f"UPDATE incidents SET {sets} WHERE id = ?", [*row.values(), incident_id])
        return self.write(call)

    def record_action(self, run_id: str, kind: str, status: str, *, incident_id: int | None = None,
                      dry_run: bool = False, detail: Any = None) -> Future:
        def call(ctx: WriteContext) -> int:
            aid = ctx.next_id("actions")
            ctx.con.execute("INSERT INTO actions VALUES (?, ?, ?, ?, ?, ?, ?, NULL, ?)",
                            [aid, run_id, incident_id, kind, status, dry_run, ctx.now, json_text(detail)])
            return aid
        return self.write(call)

    def finish_action(self, action_id: int, status: str, detail: Any = None) -> Future:
        def call(ctx: WriteContext) -> None:
            ctx.con.execute("UPDATE actions SET status = ?, finished_ts = ?, detail = coalesce(?, detail) WHERE id = ?",
                            [status, ctx.now, json_text(detail), action_id])
        return self.write(call)

    def set_node_status(self, run_id: str, node: str, status: str, reason: str | None = None) -> Future:
        if status not in ("healthy", "suspect", "isolated"):
            raise ValueError("node status is healthy, suspect or isolated")

        def call(ctx: WriteContext) -> None:
            ctx.con.execute("""
                INSERT INTO nodes (run_id, node, status, reason, updated_ts) VALUES (?, ?, ?, ?, ?)
                ON CONFLICT (run_id, node) DO UPDATE SET status = excluded.status, reason = excluded.reason,
                    updated_ts = excluded.updated_ts""", [run_id, node, status, reason, ctx.now])
        return self.write(call)

    # -- reads -----------------------------------------------------------------
    @contextmanager
    def cursor(self) -> Iterator[duckdb.DuckDBPyConnection]:
        """A connection of its own to the same database, for one reader."""
        with self._read_lock:
            cur = self._read_root.cursor()
        try:
            yield cur
        finally:
            cur.close()

    # -- read-only SQL (POST /v1/sql) ----------------------------------------------
    def _init_sql(self) -> None:
        s = self.settings
        self._sql = SqlSlots(num_slots=s.sql_max_concurrent, queue_timeout_s=s.sql_queue_timeout_s,
                             max_waiting=s.sql_max_waiting)
        self._sql_cursors: set[duckdb.DuckDBPyConnection] = set()  # running: interrupted by close()
        self._sql_cursors_lock = threading.Lock()
        # Saturation of the slots, on /metrics (registered here: the slots live here).
        r = self.metrics.registry
        Gauge("llmwatch_collector_sql_running", "SQL queries running, each on one of sql_max_concurrent slots",
              registry=r).set_function(lambda: self._sql.num_running)
        Gauge("llmwatch_collector_sql_waiting", "SQL requests waiting for a slot",
              registry=r).set_function(lambda: self._sql.num_waiting)

    def _close_sql(self) -> None:
        """Drop waiting queries, interrupt running ones until they have stopped (a query
        may register its cursor just after a round), then join the slots' threads."""
        self._sql.close(wait=False)
        while self._sql.num_running:
            with self._sql_cursors_lock:
                for cur in self._sql_cursors:
                    cur.interrupt()
            time.sleep(0.01)
        self._sql.close()

    def sql(self, sql: str, *, fmt: str = "json", max_rows: int | None = None, timeout_s: float | None = None,
            encode_row: Callable[[tuple], bytes] | None = None) -> SelectResult:
        """Read-only SQL (see sqlguard) on one of `sql_max_concurrent` slots, for callers
        without an event loop. SqlBusy when no slot frees within sql_queue_timeout_s;
        SqlRefused when refused, failed or timed out."""
        job, timeout_s = self._sql_job(sql, fmt=fmt, max_rows=max_rows, timeout_s=timeout_s, encode_row=encode_row)
        try:
            return self._sql.run_blocking(job, deadline_s=timeout_s + SQL_ANSWER_GRACE_S)
        except SqlDeadline:
            raise SqlRefused(f"query timed out after {timeout_s:g} s") from None

    async def sql_async(self, sql: str, *, fmt: str = "json", max_rows: int | None = None,
                        timeout_s: float | None = None,
                        encode_row: Callable[[tuple], bytes] | None = None) -> SelectResult:
        """`sql` awaited: the request waits for a slot without holding any thread, and
        the answer comes at the timeout even if DuckDB has not stopped yet (the query
        keeps its slot until it does)."""
        job, timeout_s = self._sql_job(sql, fmt=fmt, max_rows=max_rows, timeout_s=timeout_s, encode_row=encode_row)
        try:
            return await self._sql.run(job, deadline_s=timeout_s + SQL_ANSWER_GRACE_S)
        except SqlDeadline:
            raise SqlRefused(f"query timed out after {timeout_s:g} s") from None

    def _sql_job(self, sql: str, *, fmt: str, max_rows: int | None, timeout_s: float | None,
                 encode_row: Callable[[tuple], bytes] | None) -> tuple[Callable[[], SelectResult], float]:
        s = self.settings
        max_rows = s.sql_max_rows if max_rows is None else min(max_rows, s.sql_max_rows)
        timeout_s = timeout_s or s.sql_timeout_s

        def job() -> SelectResult:
            with self.cursor() as cur:
                with self._sql_cursors_lock:
                    self._sql_cursors.add(cur)
                try:
                    return run_select(cur, sql, max_rows=max_rows, max_bytes=s.sql_max_bytes, timeout_s=timeout_s,
                                      fmt=fmt, encode_row=encode_row)
                finally:
                    with self._sql_cursors_lock:
                        self._sql_cursors.discard(cur)
        return job, timeout_s

    def _q(self, sql: str, params: list | None = None) -> list[dict[str, Any]]:
        with self.cursor() as cur:
            return _records(cur, sql, params)

    def open_incidents(self) -> dict[str, int]:
        rows = self._q("SELECT run_id, count(*) AS n FROM incidents WHERE status = 'open' GROUP BY run_id")
        return {r["run_id"]: r["n"] for r in rows}

    def runs(self) -> list[dict[str, Any]]:
        return self._q("""
            SELECT run_id, status, created_ts, updated_ts, started_ts, world_size, code_version, data_version
            FROM runs ORDER BY created_ts DESC""")

    def run(self, run_id: str) -> dict[str, Any] | None:
        rows = self._q("""
            SELECT r.*,
                   (SELECT count(*) FROM ranks k WHERE k.run_id = r.run_id) AS num_ranks,
                   (SELECT max(step) FROM steps s WHERE s.run_id = r.run_id) AS last_step,
                   (SELECT max(attempt) FROM steps s WHERE s.run_id = r.run_id) AS last_attempt,
                   (SELECT count(*) FROM incidents i WHERE i.run_id = r.run_id AND i.status = 'open') AS open_incidents
            FROM runs r WHERE run_id = ?""", [run_id])
        return rows[0] if rows else None

    def steps(self, run_id: str, metric: str, *, rank: int | None = None, step_from: int | None = None,
              step_to: int | None = None, max_points: int = 2000) -> list[dict[str, Any]]:
        """A metric's effective curve, downsampled server-side to at most `max_points`
        buckets of equal step width (min/max/avg per bucket, over the ranks asked for).
        `metric` is a steps column or else a scalar name."""
        if metric in STEP_METRICS:
            source, params = f"SELECT step, rank, {metric} AS v FROM steps_effective WHERE run_id = ?", [run_id]
        else:
            source = """SELECT step, rank, value AS v FROM scalars WHERE run_id = ? AND name = ?
                        QUALIFY attempt = max(attempt) OVER (PARTITION BY step, rank)"""
            params = [run_id, metric]
        conds = [(c, v) for c, v in (("rank = ?", rank), ("step >= ?", step_from), ("step <= ?", step_to))
                 if v is not None]
        where, wparams = [c for c, _ in conds], [v for _, v in conds]
        filt = f"WHERE {' AND '.join(where)}" if where else ""
        return self._q(f"""
            WITH s AS (SELECT * FROM ({source}) {filt}),
                 w AS (SELECT min(step) AS lo,
                              greatest(1, ceil((max(step) - min(step) + 1) / ?))::BIGINT AS width FROM s)
            SELECT min(step) AS step, max(step) AS step_to, min(v) AS min, max(v) AS max, avg(v) AS avg,
                   count(*) AS num_points
            FROM s, w GROUP BY (step - lo) // width ORDER BY 1""", [*params, *wparams, max(1, int(max_points))])

    def step_summary(self, run_id: str, *, step_from: int | None = None, step_to: int | None = None,
                     limit: int = 2000) -> list[dict[str, Any]]:
        """Per step of the effective attempt: median/max/min step_s, slowest rank, mean loss.
        The latest `limit` steps of the range."""
        if step_from is None:  # aggregate only the steps that can be returned
            (last,), = self._q_tuple("SELECT max(step) FROM steps WHERE run_id = ? AND step <= coalesce(?, step)",
                                     [run_id, step_to])
            step_from = None if last is None else last - limit + 1
        return self._q("""
            SELECT * FROM (
                SELECT * FROM step_summary WHERE run_id = ? AND step >= coalesce(?, step) AND step <= coalesce(?, step)
                QUALIFY attempt = max(attempt) OVER (PARTITION BY step)
                ORDER BY step DESC LIMIT ?)
            ORDER BY step""", [run_id, step_from, step_to, limit])

    def ranks(self, run_id: str) -> list[dict[str, Any]]:
        return self._q("""
            SELECT k.*, h.ts AS heartbeat_ts, h.phase, h.step AS heartbeat_step, h.last_seq
            FROM ranks k LEFT JOIN (
                SELECT rank, max(ts) AS ts, arg_max(phase, ts) AS phase, arg_max(step, ts) AS step,
                       arg_max(last_seq, ts) AS last_seq
                FROM heartbeats WHERE run_id = ? GROUP BY rank) h USING (rank)
            WHERE k.run_id = ? ORDER BY k.rank""", [run_id, run_id])

    def collectives(self, run_id: str, *, step_from: int | None = None, step_to: int | None = None,
                    last_steps: int = 20) -> list[dict[str, Any]]:
        """collective_summary rows of the effective attempt; without a range, the last steps."""
        if step_from is None and step_to is None:
            (last,), = self._q_tuple("SELECT max(step) FROM collectives WHERE run_id = ?", [run_id])
            if last is None:
                return []
            step_from = last - last_steps + 1
        return self._q("""
            SELECT * FROM collective_summary
            WHERE run_id = ? AND step >= coalesce(?, step) AND step <= coalesce(?, step)
            QUALIFY attempt = max(attempt) OVER (PARTITION BY step)
            ORDER BY step, axis, op""", [run_id, step_from, step_to])

    def _q_tuple(self, sql: str, params: list) -> list[tuple]:
        with self.cursor() as cur:
            return cur.execute(sql, params).fetchall()

    def incidents(self, run_id: str, *, status: str | None = None) -> list[dict[str, Any]]:
        return self._q("SELECT * FROM incidents WHERE run_id = ? AND status = coalesce(?, status) ORDER BY opened_ts",
                       [run_id, status])

    def actions(self, run_id: str) -> list[dict[str, Any]]:
        return self._q("SELECT * FROM actions WHERE run_id = ? ORDER BY requested_ts", [run_id])

    def checkpoints(self, run_id: str) -> list[dict[str, Any]]:
        return self._q("SELECT * FROM checkpoints WHERE run_id = ? ORDER BY step, attempt", [run_id])

    def nodes(self, run_id: str) -> list[dict[str, Any]]:
        return self._q("SELECT * FROM nodes WHERE run_id = ? ORDER BY node", [run_id])

    def events(self, run_id: str, *, kind: str | None = None, limit: int = 500) -> list[dict[str, Any]]:
        return self._q("""
            SELECT * FROM events WHERE run_id = ? AND kind = coalesce(?, kind)
            ORDER BY ts DESC LIMIT ?""", [run_id, kind, limit])

    def heartbeats_latest(self, run_id: str) -> list[dict[str, Any]]:
        return self._q("""
            SELECT rank, max(ts) AS ts, arg_max(node, ts) AS node, arg_max(pid, ts) AS pid,
                   arg_max(phase, ts) AS phase, arg_max(step, ts) AS step, arg_max(last_seq, ts) AS last_seq
            FROM heartbeats WHERE run_id = ? GROUP BY rank ORDER BY rank""", [run_id])

    def commands(self, run_id: str) -> list[dict[str, Any]]:
        return self._q("SELECT * FROM commands WHERE run_id = ? ORDER BY id", [run_id])
