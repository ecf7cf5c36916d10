"""The one writer thread: every write to DuckDB, as group commits.

Request handlers decode and validate a batch (a small one on the event loop, a
large one on a worker thread), then hand it here with a future. The thread
takes everything queued (up to a row and byte budget; a small group, under
`SMALL_GROUP_ROWS`, starts at most every `group_min_interval_s` and waits
`group_linger_s` for the rest of its flush; and while a larger group is under
`group_min_rows` and requests keep arriving (no pause longer than `group_gap_s`)
it waits up to `group_linger_s` for more, because DuckDB's
cost per row falls when one transaction appends whole row groups, which it then
writes straight to the file instead of through the WAL (our tables' row groups
are `storage.ROW_GROUP_ROWS`, 32,768 rows: `group_min_rows` is four).

One group commit (see collector/store/projection.py for the parts):
1. the admission sorts out batches whose key is taken (the same bytes again are
   acknowledged as duplicates, other bytes refused with 409);
2. one Arrow table per target table is built from the fresh batches (`columns`);
3. every projection plans (liveness, batch keys, run info, commands, incidents);
4. the row tables and every projection's writes go in ONE transaction, committed;
5. every projection applies its plan, the subscribers are offered the committed
   tables (collector/store/feed.py: never waited for), and only then are the futures
   resolved. A request is thus acknowledged after its rows are durable, and the
   cost of a commit is shared by every request that arrived while the previous
   one ran.

Intents (`submit_intent`: issue a command, record findings) join the group like
batches, but a group holding one does not linger: it commits what is queued at
once. So does a group holding a closing batch (`CLOSING_EVENTS`: an agent's last
flush, the launcher's report of a rank's exit): its sender is a process waiting
for the ack to exit, and the job's end, or its restart round, waits for it.
Submitting never waits, from any thread, the writer's own included; what it
returns is a future (whose `result()` refuses to wait on the writer thread,
where it would wait forever) or, given `done`, a callback run after the commit.

If a group's transaction fails, it is rolled back and each job retried alone,
so one unstorable batch (which `decode` should already have refused) cannot
sink its neighbours. `submit_call` functions (anything else) run in order, each
in its own transaction.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Protocol

import duckdb
import pyarrow as pa

from collector.ingest import columns
from collector.ingest.decode import BatchRejected, DecodedBatch
from collector.metrics import CollectorMetrics
from collector.store.feed import Feed, committed_run_ids, committed_tables
from collector.store.projection import CONFLICT, DUPLICATE, FRESH, Group, Ids, Projection
from collector.threads import name_native

log = logging.getLogger("collector.store.writer")

_STOP = object()
# Errors that mean "this data cannot be stored" (answered 422), not "storage is broken" (503).
_DATA_ERRORS = (duckdb.ConstraintException, duckdb.ConversionException, duckdb.InvalidInputException,
                duckdb.OutOfRangeException, OverflowError, pa.ArrowException)
SMALL_GROUP_ROWS = 10_000  # below this a commit's fixed cost dominates its per-row cost

Done = Callable[[Any, BaseException | None], None]  # (result, error) after the commit, on the writer thread


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


class Admission(Protocol):
    """Which batches of a group are new (collector/store/dedupe.py)."""

    def sort_out(self, batches: Sequence[DecodedBatch]) -> list[str]: ...


class Replies(Protocol):
    """The projection whose plan answers ingest requests (the commands they carry)."""

    def deliveries(self, plan: Any) -> list[list[dict[str, Any]]]: ...


class WriterFuture(Future):
    """A writer job's future. `result()` on the writer thread itself, before the job
    ran, would wait forever: it raises instead."""

    def __init__(self, writer_thread: threading.Thread) -> None:
        super().__init__()
        self._writer_thread = writer_thread

    def result(self, timeout: float | None = None) -> Any:
        if not self.done() and threading.current_thread() is self._writer_thread:
            raise RuntimeError("waiting for a writer job on the writer thread would deadlock; pass done=")
        return super().result(timeout)


# Events that end their sender's life: a batch holding one commits without waiting out
# group_min_interval_s (the agent's close and the launcher's exit report wait on its ack).
CLOSING_EVENTS = frozenset({"agent_closed", "rank_exited"})


def _urgent(job: "_Job") -> bool:
    """Its submitter is waiting: an intent, or a batch holding a closing event."""
    return job.intent is not None or (job.batch is not None
                                      and any(e.kind in CLOSING_EVENTS for e in job.batch.events))


class _Job:
    __slots__ = ("batch", "tables", "intent", "target", "call", "nbytes", "nrows", "loop", "future")

    def __init__(self, *, batch=None, tables=None, intent=None, target=None, call=None, nbytes=0, nrows=0,
                 loop=None, future=None) -> None:
        self.batch: DecodedBatch | None = batch
        self.tables: dict[str, pa.Table] | None = tables
        self.intent, self.target = intent, target  # an intent for the projection named `target`
        self.call: Callable[["WriteContext"], Any] | None = call
        self.nbytes, self.nrows = nbytes, nrows
        self.loop: asyncio.AbstractEventLoop | None = loop
        self.future: asyncio.Future | Future | Done = future


class WriteContext:
    """What a `submit_call` function gets: the connection inside an open
    transaction, id allocation and the clock. `after_commit` callbacks run only if
    the transaction commits."""

    def __init__(self, writer: "Writer") -> None:
        self.con = writer._con
        self.now = writer._clock()
        self._ids = writer.ids
        self._after: list[Callable[[], None]] = []

    def next_id(self, table: str) -> int:
        return self._ids.take(table)

    def after_commit(self, fn: Callable[[], None]) -> None:
        self._after.append(fn)


def _resolve(fut: asyncio.Future | Future | Done, result: Any, exc: BaseException | None) -> None:
    if callable(fut) and not isinstance(fut, (asyncio.Future, Future)):
        try:
            fut(result, exc)
        except Exception:  # a callback's bug must not stop the writer
            log.exception("a writer callback failed")
        return
    if fut.done():  # the request was cancelled (client went away)
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(result)


def _resolve_many(items: list[tuple[asyncio.Future, Any, BaseException | None]]) -> None:
    for fut, result, exc in items:
        _resolve(fut, result, exc)


class Writer:
    def __init__(self, con: duckdb.DuckDBPyConnection, *, admission: Admission, projections: Sequence[Projection],
                 replies: Replies, ids: Ids, metrics: CollectorMetrics, feed: Feed | None = None,
                 clock: Callable[[], float] = time.time, group_max_rows: int = 2_000_000,
                 group_max_bytes: int = 256 << 20, group_min_rows: int = 131_072, group_linger_s: float = 0.05,
                 group_gap_s: float = 0.005, group_min_interval_s: float = 0.5,
                 queue_max_bytes: int = 512 << 20) -> None:
        self._con = con
        self.admission = admission
        self.projections = list(projections)
        self._by_name = {p.name: i for i, p in enumerate(self.projections)}
        self._replies = replies
        self._replies_at = next(i for i, p in enumerate(self.projections) if p is replies)
        self.ids = ids
        self.feed = feed or Feed()
        self._metrics = metrics
        self._clock = clock
        self._group_max_rows = group_max_rows
        self._group_max_bytes = group_max_bytes
        self._group_min_rows = group_min_rows
        self._group_linger_s = group_linger_s
        self._group_gap_s = group_gap_s
        self._group_min_interval_s = group_min_interval_s
        self._last_commit = 0.0  # time.monotonic() at the start of the last group commit
        # generations (`generation`): commits counted, and the last that changed each table
        self._commits = 0
        self._changed: dict[str, int] = {}
        self._changed_all = 0  # the last commit that may have changed any table
        self._queue_max_bytes = queue_max_bytes
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._queued_bytes = 0
        self._queued_jobs = 0
        self._thread = threading.Thread(target=self._run, name="collector-writer", daemon=True)

    # -- submitting (any thread) --------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def depth(self) -> int:
        return self._queued_jobs

    def alive(self) -> bool:
        return self._thread.is_alive()

    def on_writer_thread(self) -> bool:
        return threading.current_thread() is self._thread

    def generation(self, *tables: str) -> int:
        """The number of the last commit that changed any of `tables` (any thread; it only
        grows while this writer lives). Counted after the commit, so rows read after reading
        it are at least that new: a reader that saw the same number before reading has
        nothing to read again (the ETag of collector/http/routes/query.py)."""
        return max([self._changed_all, *(self._changed.get(t, 0) for t in tables)])

    def _changed_tables(self, names: Iterable[str] | None) -> None:
        """Count a commit on the writer thread; `names` the tables it changed, None: any."""
        self._commits += 1
        if names is None:
            self._changed_all = self._commits
            return
        for t in names:
            self._changed[t] = self._commits

    def submit_batch(self, batch: DecodedBatch, future: asyncio.Future | Future) -> None:
        self._put(_Job(batch=batch, nbytes=batch.nbytes, nrows=batch.num_rows, future=future,
                       loop=future.get_loop() if isinstance(future, asyncio.Future) else None))

    def submit_tables(self, tables: dict[str, pa.Table], future: asyncio.Future | Future) -> None:
        nrows = sum(t.num_rows for t in tables.values())
        nbytes = sum(t.nbytes for t in tables.values())
        self._put(_Job(tables=tables, nbytes=nbytes, nrows=nrows, future=future,
                       loop=future.get_loop() if isinstance(future, asyncio.Future) else None))

    def submit_intent(self, target: str, intent: Any, *, done: Done | None = None) -> WriterFuture | None:
        """Hand `intent` to the projection named `target` in the next group commit.
        Never blocks and never refuses for back-pressure. Returns a future, or None
        when `done(result, error)` is given (called on the writer thread after the
        commit: it must not block)."""
        if target not in self._by_name:
            raise ValueError(f"no projection named {target!r}")
        fut = done if done is not None else WriterFuture(self._thread)
        self._put(_Job(intent=intent, target=target, future=fut), check_budget=False)
        return None if done is not None else fut

    def submit_call(self, fn: Callable[[WriteContext], Any]) -> WriterFuture:
        fut = WriterFuture(self._thread)
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
        self.feed.close()

    # -- the thread ----------------------------------------------------------
    def _take(self, job: _Job) -> None:
        with self._lock:
            self._queued_bytes -= job.nbytes
            self._queued_jobs -= 1

    def _run(self) -> None:
        name_native("lw-writer")
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
            urgent = _urgent(job)  # its submitter is waiting: commit what is queued now
            now = time.monotonic()
            linger_until = now + self._group_linger_s
            # A trickle of small requests (a few ranks flushing 5x a second) would otherwise
            # pay a whole commit each (~5 ms of fixed DuckDB cost, on the trainer's CPUs when
            # the collector is embedded): a small group commits at most every
            # group_min_interval_s. Under load groups are big and never wait for this.
            gather_until = self._last_commit + self._group_min_interval_s
            while nrows < self._group_max_rows and nbytes < self._group_max_bytes:
                now = time.monotonic()
                if urgent or nrows >= self._group_min_rows:
                    wait_s = 0.0
                elif nrows < SMALL_GROUP_ROWS:  # gather a trickle: at most one commit per interval, and the
                    # ranks that flushed in the same instant (agent/agent.py: on a grid) reach the writer
                    # some ms apart, each rank's flusher sharing a CPU with its training thread
                    wait_s = max(gather_until, linger_until) - now
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
                urgent = urgent or _urgent(nxt)
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
            _resolve(job.future, None, e)
            return
        self._changed_tables(None)  # a call may write any table
        for fn in ctx._after:
            fn()
        _resolve(job.future, result, None)

    def _safe_rollback(self) -> None:
        try:
            self._con.execute("ROLLBACK")
        except duckdb.Error:
            pass  # no transaction was open

    # -- one group commit ----------------------------------------------------
    def _commit(self, jobs: list[_Job]) -> None:
        now = self._clock()
        t0 = time.perf_counter()
        batches = [j.batch for j in jobs if j.batch is not None]
        try:
            verdicts = self.admission.sort_out(batches)
        except duckdb.Error as e:
            log.warning("batch keys could not be checked: %s", e)
            self._finish([(j, None, StorageError(f"batch keys could not be checked: {e}", 503)) for j in jobs])
            return
        group = Group(now=now, batches=batches, verdicts=verdicts,
                      fresh=[b for b, v in zip(batches, verdicts) if v == FRESH],
                      extra=[(name, t) for j in jobs if j.tables for name, t in j.tables.items()])
        for j in jobs:
            if j.intent is not None:
                group.intents.setdefault(j.target, []).append(j.intent)
        try:
            group.tables = columns.ingest_tables(group.fresh)
            plans = [p.plan(group) for p in self.projections]
            self._con.execute("BEGIN TRANSACTION")
            for name, t in list(group.tables.items()) + group.extra:
                self._insert(name, t)
            for p, plan in zip(self.projections, plans):
                p.write(self._con, plan, group)
            self._con.execute("COMMIT")
        except Exception as e:
            self._safe_rollback()
            if len(jobs) > 1:
                for job in jobs:
                    self._commit([job])
                return
            self._fail_alone(jobs[0], e)
            return
        self._changed_tables(self._touched(group, plans))
        for p, plan in zip(self.projections, plans):
            try:
                p.apply(plan, group)
            except Exception:  # committed already: keep answering; the mirror may lag until restart
                log.exception("projection %s could not apply a committed plan", p.name)
        self._count(group, len(jobs), time.perf_counter() - t0)
        if self.feed.active and (group.tables or group.extra):
            self.feed.publish(commit_ts=now, run_ids=committed_run_ids(group.fresh, group.extra),
                              tables=committed_tables(group.tables, group.extra))
        self._finish(self._results(jobs, group, plans))

    def _touched(self, group: Group, plans: list[Any]) -> set[str] | None:
        """The tables a group commit changed; None: any (a projection that wrote without
        saying which tables)."""
        out = {name for name, t in list(group.tables.items()) + group.extra if t.num_rows}
        for p, plan in zip(self.projections, plans):
            if p.wrote(plan):
                if p.writes is None:
                    return None
                out.update(p.writes)
        return out

    def _fail_alone(self, job: _Job, e: Exception) -> None:
        if job.intent is not None:  # its submitter gets the error itself (as a submit_call would)
            log.warning("intent for %s refused: %s", job.target, e)
            self._finish([(job, None, e)])
            return
        log.warning("write refused: %s", e)
        status = 422 if isinstance(e, _DATA_ERRORS) else 503
        self._finish([(job, None, StorageError(f"rows could not be stored: {e}", status))])

    def _results(self, jobs: list[_Job], group: Group, plans: list[Any]) -> list[tuple[_Job, Any, Any]]:
        deliveries = iter(self._replies.deliveries(plans[self._replies_at]))
        answers = {name: iter(self.projections[i].results(plans[i])) for name, i in self._by_name.items()
                   if name in group.intents}
        verdicts = iter(group.verdicts)
        results = []
        for job in jobs:
            if job.intent is not None:
                answer = next(answers[job.target])
                if isinstance(answer, BaseException):
                    results.append((job, None, answer))
                else:
                    results.append((job, answer, None))
            elif job.batch is None:
                results.append((job, sum(t.num_rows for t in job.tables.values()), None))
            elif (v := next(verdicts)) == CONFLICT:
                b = job.batch
                log.warning("batch %s refused: its key was stored with other content", b.key)
                results.append((job, None, BatchRejected(
                    f"batch (run_id={b.run_id!r}, rank={b.rank}, incarnation={b.incarnation!r}, "
                    f"batch_seq={b.batch_seq}) is already stored with other content: a batch_seq may not "
                    f"be reused for other rows", 409)))
            else:
                dup = v == DUPLICATE
                results.append((job, IngestOutcome(0 if dup else job.batch.num_rows, dup, next(deliveries)), None))
        return results

    def _count(self, group: Group, num_jobs: int, commit_s: float) -> None:
        m = self._metrics
        for name, t in list(group.tables.items()) + group.extra:
            m.rows_ingested.labels(name).inc(t.num_rows)
        m.runs.observe_all(group.fresh)
        m.batches.inc(len(group.fresh))
        m.duplicate_batches.inc(group.verdicts.count(DUPLICATE))
        m.conflicting_batches.inc(group.verdicts.count(CONFLICT))
        m.commit_seconds.observe(commit_s)
        m.group_size.observe(num_jobs)

    def _finish(self, results: list[tuple[_Job, Any, BaseException | None]]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list] = defaultdict(list)
        for job, result, exc in results:
            if job.loop is not None:
                by_loop[job.loop].append((job.future, result, exc))
            else:
                _resolve(job.future, result, exc)
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
