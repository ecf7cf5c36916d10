"""The one writer thread: every write to DuckDB, as group commits.

Request handlers decode and validate a batch (a small one on the event loop, a
large one on a worker thread), then hand it here with a future. The thread
takes everything queued (up to a row and byte budget; a small group, under
`SMALL_GROUP_ROWS`, starts at most every `group_min_interval_s`; and while the
group is under `group_min_rows` and requests keep arriving (no pause longer
than `group_gap_s`) it waits up to `group_linger_s` for more, because DuckDB's
cost per row halves when one transaction appends a whole row group, 122,880
rows, which it then writes straight to the file instead of through the WAL),
sorts out batches whose key is taken (in this group or earlier: `BatchKeys`; the
same bytes again are acknowledged as duplicates, other bytes refused with 409),
builds one Arrow table per target table (`columns`), inserts them all, the
batch keys, rank/run/node/checkpoint upserts and command deliveries in ONE
transaction, commits, and only then resolves the futures. A request is thus
acknowledged after its rows are durable, and the cost of a commit is shared by
every request that arrived while the previous one ran.

If a group's transaction fails, it is rolled back and each job retried alone,
so one unstorable batch (which `decode` should already have refused) cannot
sink its neighbours. Jobs that are not ingest (`submit_call`: commands,
incidents, actions) run in order, each in its own transaction.
"""

from __future__ import annotations

import asyncio
import json
import logging
import queue
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import duckdb
import pyarrow as pa

from collector import columns
from collector.batchkeys import CONFLICT, DUPLICATE, FRESH, BatchKeys, Key
from collector.commands import Command, CommandBook, CommandPlan
from collector.liveness import Liveness, LivenessPlan
from collector.decode import BatchRejected, CheckpointSaved, CheckpointVerified, DecodedBatch, RunFinished, json_text
from collector.metrics import CollectorMetrics

log = logging.getLogger("collector.writer")

_STOP = object()
# Errors that mean "this data cannot be stored" (answered 422), not "storage is broken" (503).
_DATA_ERRORS = (duckdb.ConstraintException, duckdb.ConversionException, duckdb.InvalidInputException,
                duckdb.OutOfRangeException, OverflowError, pa.ArrowException)
ID_TABLES = ("commands", "incidents", "actions")


class QueueFull(RuntimeError):
    """The write queue holds more bytes than allowed: the sender should retry later."""


class StorageError(RuntimeError):
    """The database refused a write. `status`: 422 for data it cannot hold, 503 otherwise."""

    def __init__(self, reason: str, status: int) -> None:
        super().__init__(reason)
        self.status = status


@dataclass(slots=True)
class IngestOutcome:
    accepted: int
    duplicate: bool
    commands: list[dict[str, Any]]


class _Job:
    __slots__ = ("batch", "tables", "call", "nbytes", "nrows", "loop", "future")

    def __init__(self, *, batch=None, tables=None, call=None, nbytes=0, nrows=0, loop=None, future=None) -> None:
        self.batch: DecodedBatch | None = batch
        self.tables: dict[str, pa.Table] | None = tables
        self.call: Callable[["WriteContext"], Any] | None = call
        self.nbytes, self.nrows = nbytes, nrows
        self.loop: asyncio.AbstractEventLoop | None = loop
        self.future: asyncio.Future | Future = future


class WriteContext:
    """What a `submit_call` function gets: the connection inside an open
    transaction, id allocation, the command book and the clock. `after_commit`
    callbacks run only if the transaction commits."""

    def __init__(self, writer: "Writer") -> None:
        self.con = writer._con
        self.book = writer.book
        self.now = writer._clock()
        self._writer = writer
        self._after: list[Callable[[], None]] = []

    def next_id(self, table: str) -> int:
        return self._writer._next_id(table)

    def after_commit(self, fn: Callable[[], None]) -> None:
        self._after.append(fn)


def _resolve_many(items: list[tuple[asyncio.Future, Any, BaseException | None]]) -> None:
    for fut, result, exc in items:
        if fut.done():  # the request was cancelled (client went away)
            continue
        if exc is not None:
            fut.set_exception(exc)
        else:
            fut.set_result(result)


SMALL_GROUP_ROWS = 10_000  # below this a commit's fixed cost dominates its per-row cost


class Writer:
    def __init__(self, con: duckdb.DuckDBPyConnection, *, metrics: CollectorMetrics,
                 clock: Callable[[], float] = time.time, group_max_rows: int = 2_000_000,
                 group_max_bytes: int = 256 << 20, group_min_rows: int = 131_072, group_linger_s: float = 0.05,
                 group_gap_s: float = 0.005, group_min_interval_s: float = 0.5, queue_max_bytes: int = 512 << 20,
                 command_ttl_s: float = 3600.0, liveness_sweep_s: float = 2.0) -> None:
        self._con = con
        self._metrics = metrics
        self._clock = clock
        self._group_max_rows = group_max_rows
        self._group_max_bytes = group_max_bytes
        self._group_min_rows = group_min_rows
        self._group_linger_s = group_linger_s
        self._group_gap_s = group_gap_s
        self._group_min_interval_s = group_min_interval_s
        self._last_commit = 0.0  # time.monotonic() at the start of the last group commit
        self._queue_max_bytes = queue_max_bytes
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._queued_bytes = 0
        self._queued_jobs = 0
        self._keys = BatchKeys.load(con)
        self.book = CommandBook(command_ttl_s)
        self.liveness = Liveness(con, liveness_sweep_s)
        self._load_commands()
        self._ids = {t: con.execute(f"SELECT coalesce(max(id), 0) + 1 FROM {t}").fetchall()[0][0] for t in ID_TABLES}
        self._thread = threading.Thread(target=self._run, name="collector-writer", daemon=True)

    # -- submitting (any thread) --------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def depth(self) -> int:
        return self._queued_jobs

    def alive(self) -> bool:
        return self._thread.is_alive()

    def submit_batch(self, batch: DecodedBatch, future: asyncio.Future | Future) -> None:
        self._put(_Job(batch=batch, nbytes=batch.nbytes, nrows=batch.num_rows, future=future,
                       loop=future.get_loop() if isinstance(future, asyncio.Future) else None))

    def submit_tables(self, tables: dict[str, pa.Table], future: asyncio.Future | Future) -> None:
        nrows = sum(t.num_rows for t in tables.values())
        nbytes = sum(t.nbytes for t in tables.values())
        self._put(_Job(tables=tables, nbytes=nbytes, nrows=nrows, future=future,
                       loop=future.get_loop() if isinstance(future, asyncio.Future) else None))

    def submit_call(self, fn: Callable[[WriteContext], Any]) -> Future:
        fut: Future = Future()
        self._put(_Job(call=fn, future=fut), check_budget=False)
        return fut

    def _put(self, job: _Job, check_budget: bool = True) -> None:
        with self._lock:
            if check_budget and self._queued_bytes + job.nbytes > self._queue_max_bytes and self._queued_jobs:
                raise QueueFull(f"write queue holds {self._queued_bytes} bytes (limit {self._queue_max_bytes})")
            self._queued_bytes += job.nbytes
            self._queued_jobs += 1
        self._q.put(job)

    def stop(self, timeout_s: float = 60.0) -> None:
        """Write everything queued, then end the thread."""
        if self._thread.is_alive():
            self._q.put(_STOP)
            self._thread.join(timeout_s)

    # -- the thread ----------------------------------------------------------
    def _take(self, job: _Job) -> None:
        with self._lock:
            self._queued_bytes -= job.nbytes
            self._queued_jobs -= 1

    def _run(self) -> None:
        pending: _Job | None = None
        while True:
            job = pending if pending is not None else self._q.get()
            pending = None
            if job is _STOP:
                return
            self._take(job)
            if job.call is not None:
                self._run_call(job)
                continue
            group, nrows, nbytes = [job], job.nrows, job.nbytes
            now = time.monotonic()
            linger_until = now + self._group_linger_s
            # A trickle of small requests (a few ranks flushing 5x a second) would otherwise
            # pay a whole commit each (~5 ms of fixed DuckDB cost, on the trainer's CPUs when
            # the collector is embedded): a small group commits at most every
            # group_min_interval_s. Under load groups are big and never wait for this.
            gather_until = self._last_commit + self._group_min_interval_s
            while nrows < self._group_max_rows and nbytes < self._group_max_bytes:
                now = time.monotonic()
                if nrows >= self._group_min_rows:
                    wait_s = 0.0
                elif now < gather_until and nrows < SMALL_GROUP_ROWS:
                    wait_s = gather_until - now
                else:  # linger only while requests keep coming: a pause of group_gap_s ends the wait
                    wait_s = min(linger_until - now, self._group_gap_s)
                try:
                    nxt = self._q.get(timeout=wait_s) if wait_s > 0 else self._q.get_nowait()
                except queue.Empty:
                    break
                if nxt is _STOP or nxt.call is not None:
                    pending = nxt  # keep order: commit this group first
                    break
                self._take(nxt)
                group.append(nxt)
                nrows += nxt.nrows
                nbytes += nxt.nbytes
            self._last_commit = time.monotonic()
            try:
                self._commit(group)
            except Exception as e:  # a bug, not bad input: fail the group, keep serving
                log.exception("group commit failed")
                self._finish([(j, None, StorageError(f"internal error: {e}", 500)) for j in group])

    def _run_call(self, job: _Job) -> None:
        ctx = WriteContext(self)
        try:
            self._con.execute("BEGIN TRANSACTION")
            result = job.call(ctx)
            self._con.execute("COMMIT")
        except Exception as e:
            self._safe_rollback()
            job.future.set_exception(e)
            return
        for fn in ctx._after:
            fn()
        job.future.set_result(result)

    def _safe_rollback(self) -> None:
        try:
            self._con.execute("ROLLBACK")
        except duckdb.Error:
            pass  # no transaction was open

    def _next_id(self, table: str) -> int:
        i = self._ids[table]
        self._ids[table] = i + 1
        return i

    # -- one group commit ----------------------------------------------------
    def _stored_hashes(self, keys: list[Key]) -> dict[Key, bytes | None]:
        """Stored content hashes of `keys` (all in `self._keys`: retries, spool replays).

        DuckDB does not use the composite primary key's index for this, so it is a
        filtered scan; row groups whose batch_seq range misses are skipped (a
        sender's seqs grow with time), which keeps one key at ~1 ms on millions
        of batches. Several keys are one join, whatever their number."""
        if len(keys) == 1:
            rows = self._con.execute(
                "SELECT run_id, rank, incarnation, batch_seq, content_hash FROM batches "
                "WHERE run_id = ? AND rank = ? AND incarnation = ? AND batch_seq = ?", list(keys[0])).fetchall()
        else:
            self._con.register("__keys", pa.table({
                "run_id": pa.array([k[0] for k in keys], pa.string()),
                "rank": pa.array([k[1] for k in keys], pa.int32()),
                "incarnation": pa.array([k[2] for k in keys], pa.string()),
                "batch_seq": pa.array([k[3] for k in keys], pa.int64())}))
            try:
                rows = self._con.execute(
                    "SELECT run_id, rank, incarnation, batch_seq, content_hash FROM batches "
                    "JOIN __keys USING (run_id, rank, incarnation, batch_seq)").fetchall()
            finally:
                self._con.unregister("__keys")
        return {(r, k, i, s): h for r, k, i, s, h in rows}

    def _commit(self, jobs: list[_Job]) -> None:
        now = self._clock()
        t0 = time.perf_counter()
        try:
            verdicts = iter(self._keys.sort_out(
                [(j.batch.key, j.batch.content_hash) for j in jobs if j.batch is not None], self._stored_hashes))
        except duckdb.Error as e:
            log.warning("batch keys could not be checked: %s", e)
            self._finish([(j, None, StorageError(f"batch keys could not be checked: {e}", 503)) for j in jobs])
            return
        verdict = [next(verdicts) if j.batch is not None else None for j in jobs]
        fresh = [j.batch for j, v in zip(jobs, verdict) if v == FRESH]
        # a conflicting request is refused: no command is delivered to it
        requests = [(j.batch.run_id, j.batch.rank) for j, v in zip(jobs, verdict) if v in (FRESH, DUPLICATE)]
        acks = [(b.run_id, b.rank, e.ts, e.special) for b in fresh for e in b.events if e.kind == "command_ack"]
        plan = self.book.plan(requests, acks, now)
        live = self.liveness.plan(fresh, now)
        tables: dict[str, pa.Table] = {}
        extra = [(name, t) for j in jobs if j.tables for name, t in j.tables.items()]
        try:
            tables = columns.ingest_tables(fresh)
            self._con.execute("BEGIN TRANSACTION")
            self._write_group(fresh, tables, extra, plan, live, now)
            self._con.execute("COMMIT")
        except Exception as e:
            self._safe_rollback()
            if len(jobs) > 1:
                for job in jobs:
                    self._commit([job])
                return
            log.warning("write refused: %s", e)
            status = 422 if isinstance(e, _DATA_ERRORS) else 503
            self._finish([(jobs[0], None, StorageError(f"rows could not be stored: {e}", status))])
            return
        for b in fresh:
            self._keys.add(b.key)
            self._metrics.runs.observe(b)
        self.book.apply(plan, now)
        self.liveness.apply(live, now)
        self._count(tables, extra, fresh, verdict, len(jobs), time.perf_counter() - t0)
        results, i = [], 0
        for job, v in zip(jobs, verdict):
            if job.batch is None:
                results.append((job, sum(t.num_rows for t in job.tables.values()), None))
            elif v == CONFLICT:
                b = job.batch
                log.warning("batch %s refused: its key was stored with other content", b.key)
                results.append((job, None, BatchRejected(
                    f"batch (run_id={b.run_id!r}, rank={b.rank}, incarnation={b.incarnation!r}, "
                    f"batch_seq={b.batch_seq}) is already stored with other content: a batch_seq may not "
                    f"be reused for other rows", 409)))
            else:
                dup = v == DUPLICATE
                results.append((job, IngestOutcome(0 if dup else job.batch.num_rows, dup, plan.deliveries[i]), None))
                i += 1
        self._finish(results)

    def _count(self, tables, extra, fresh, verdict, num_jobs, commit_s) -> None:
        m = self._metrics
        for name, t in list(tables.items()) + extra:
            m.rows_ingested.labels(name).inc(t.num_rows)
        m.batches.inc(len(fresh))
        m.duplicate_batches.inc(verdict.count(DUPLICATE))
        m.conflicting_batches.inc(verdict.count(CONFLICT))
        m.commit_seconds.observe(commit_s)
        m.group_size.observe(num_jobs)

    def _finish(self, results: list[tuple[_Job, Any, BaseException | None]]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list] = defaultdict(list)
        for job, result, exc in results:
            if job.loop is not None:
                by_loop[job.loop].append((job.future, result, exc))
            elif exc is not None:
                job.future.set_exception(exc)
            else:
                job.future.set_result(result)
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_resolve_many, items)
            except RuntimeError:
                pass  # the loop is closed: nobody is waiting any more

    def _insert(self, table: str, data: pa.Table) -> None:
        self._con.register("__ingest", data)
        try:
            self._con.execute(f"INSERT INTO {table} BY NAME SELECT * FROM __ingest")
        finally:
            self._con.unregister("__ingest")

    def _write_group(self, fresh: list[DecodedBatch], tables: dict[str, pa.Table],
                     extra: list[tuple[str, pa.Table]], plan: CommandPlan, live: LivenessPlan, now: float) -> None:
        for name, t in list(tables.items()) + extra:
            self._insert(name, t)
        self._write_liveness(live, now)
        if fresh:
            self._insert("batches", columns.batches_table(fresh, now))
            for b in fresh:
                self._run_side_effects(b, now)
        for cmd in plan.changed.values():
            self._update_command(cmd)

    def _write_liveness(self, live: LivenessPlan, now: float) -> None:
        """New runs and ranks, identity changes and drops now; last-seen times per sweep."""
        con = self._con
        if live.new_runs:
            con.executemany("INSERT INTO runs (run_id, created_ts, updated_ts) VALUES (?, ?, ?) ON CONFLICT DO NOTHING",
                            [(r, now, now) for r in live.new_runs])
        if live.rank_rows:
            con.register("__ranks", columns.ranks_table(live.rank_rows, live.drops, now))
            con.execute("""
                INSERT INTO ranks BY NAME SELECT * FROM __ranks
                ON CONFLICT (run_id, rank) DO UPDATE SET
                    node = excluded.node, pid = excluded.pid, incarnation = excluded.incarnation,
                    dp = coalesce(excluded.dp, ranks.dp), tp = coalesce(excluded.tp, ranks.tp),
                    pp = coalesce(excluded.pp, ranks.pp), last_seen_ts = excluded.last_seen_ts,
                    agent_drops = ranks.agent_drops + excluded.agent_drops""")
            con.unregister("__ranks")
        if live.last_seen:
            con.register("__seen", columns.last_seen_table(live.last_seen))
            con.execute("""
                UPDATE ranks SET last_seen_ts = greatest(ranks.last_seen_ts, s.last_seen_ts) FROM __seen s
                WHERE ranks.run_id = s.run_id AND ranks.rank = s.rank""")
            con.unregister("__seen")
            run_ts: dict[str, float] = {}
            for (run_id, _), ts in live.last_seen.items():
                run_ts[run_id] = max(ts, run_ts.get(run_id, ts))
            con.executemany("UPDATE runs SET updated_ts = greatest(updated_ts, ?) WHERE run_id = ?",
                            [(ts, run_id) for run_id, ts in run_ts.items()])

    def _run_side_effects(self, b: DecodedBatch, now: float) -> None:
        """Run info, nodes, checkpoints and run status carried by one batch."""
        con = self._con
        if b.run is not None:
            r = b.run
            con.execute("""
                UPDATE runs SET config = coalesce(?, config), mesh = coalesce(?, mesh),
                    world_size = coalesce(?, world_size), code_version = coalesce(?, code_version),
                    data_version = coalesce(?, data_version), node_map = coalesce(?, node_map),
                    started_ts = coalesce(?, started_ts), status = 'running', updated_ts = ?
                WHERE run_id = ?""",
                [b.run_json["config"], b.run_json["mesh"], r.world_size, r.code_version, r.data_version,
                 b.run_json["node_map"], r.started_ts, now, b.run_id])
            if r.node_map:
                by_node: dict[str, list[int]] = defaultdict(list)
                for rank, node in r.node_map.items():  # keys checked to be rank numbers by decode
                    by_node[node].append(int(rank))
                con.register("__nodes", pa.table({  # one statement: executemany costs ~1 ms a row
                    "node": pa.array(list(by_node), pa.string()),
                    "ranks": pa.array([json_text(sorted(r)) for r in by_node.values()], pa.string())}))
                con.execute("""
                    INSERT INTO nodes (run_id, node, ranks, status, updated_ts)
                    SELECT ?, node, ranks, 'healthy', ? FROM __nodes
                    ON CONFLICT (run_id, node) DO UPDATE SET ranks = excluded.ranks, updated_ts = excluded.updated_ts""",
                    [b.run_id, now])
                con.unregister("__nodes")
        for e in b.events:
            s = e.special
            if isinstance(s, CheckpointSaved):
                # every rank reports the shards it wrote: the row adds them up
                con.execute("""
                    INSERT INTO checkpoints VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, 1)
                    ON CONFLICT (run_id, step, attempt) DO UPDATE SET path = excluded.path,
                        num_shards = checkpoints.num_shards + excluded.num_shards,
                        bytes = checkpoints.bytes + excluded.bytes,
                        checksums = json_merge_patch(coalesce(checkpoints.checksums, '{}'),
                                                     coalesce(excluded.checksums, '{}')),
                        verified = checkpoints.verified AND excluded.verified,
                        write_s = greatest(checkpoints.write_s, excluded.write_s),
                        ts = greatest(checkpoints.ts, excluded.ts),
                        num_ranks = checkpoints.num_ranks + 1""",
                    [b.run_id, s.step, e.attempt or 0, s.path, s.num_shards, s.bytes, json_text(s.checksums),
                     s.verified, s.write_s, e.ts])
            elif isinstance(s, CheckpointVerified):
                con.execute("UPDATE checkpoints SET verified = ? WHERE run_id = ? AND step = ?",
                            [s.verified, b.run_id, s.step])
            elif isinstance(s, RunFinished):
                con.execute("UPDATE runs SET status = ?, updated_ts = ? WHERE run_id = ?", [s.status, now, b.run_id])

    def _update_command(self, cmd: Command) -> None:
        d = cmd.as_dict()
        self._con.execute(
            "UPDATE commands SET status = ?, delivered = ?, acks = ?, updated_ts = ? WHERE id = ?",
            [cmd.status, json_text(d["delivered"]), json_text(d["acks"]), cmd.updated_ts, cmd.id])

    def _load_commands(self) -> None:
        rows = self._con.execute("""
            SELECT id, run_id, kind, args, ranks, issued_ts, status, delivered, acks, updated_ts
            FROM commands WHERE issued_ts > ?""", [self._clock() - self.book.ttl_s]).fetchall()
        for cid, run_id, kind, args, ranks, issued_ts, status, delivered, acks, updated_ts in rows:
            self.book.add(Command(
                id=cid, run_id=run_id, kind=kind, args=json.loads(args) if args else {},
                ranks=json.loads(ranks) if ranks else None, issued_ts=issued_ts, status=status,
                delivered=json.loads(delivered) if delivered else [],
                acks={int(k): v for k, v in json.loads(acks).items()} if acks else {}, updated_ts=updated_ts))
