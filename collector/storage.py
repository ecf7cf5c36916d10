"""Storage: one open collector database, and the one place that wires it.

`Storage` opens the database locked down (no files, no network, no settings
changes from SQL), applies migrations, starts the writer thread with its
projections (collector/store/projection.py), and answers queries on cursors of their
own: DuckDB's MVCC lets readers run beside the writer's transactions, so a
query never waits for a commit and a commit never waits for a query. The
queries themselves are collector/read/'s functions of a cursor; `Storage.read` opens
a cursor and calls one.

Writes (ingest, commands, incidents, actions, node status) all go through the
writer thread; the methods here only queue them and return futures (or take a
`done` callback): submitting never blocks, whatever thread calls it, and only
`ingest_blocking` waits for its commit. Actions and node status are intents of
the actions projection (collector/store/actions.py), like commands and incidents; the
samples a rollback skipped (`batch_skipped` events) fill `bad_batches` in their
batch's transaction. Subscribers
(`subscribe`) get each commit's rows after it; an `Analyzer` given to the
constructor runs on a subscriber thread of its own (collector/live/detection.py).
With alert receivers in the settings, incident changes and actions also write
alert_outbox rows in their transaction, and a sender delivers them (collector/alerts/delivery.py).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import duckdb
import pyarrow as pa
from prometheus_client import Counter, Gauge

from analysis import Analyzer, Finding
from analysis.policy import Policy
from collector.alerts.delivery import RetryPolicy, Sender, Transport, urllib_transport
from collector.alerts.outbox import AlertOutbox
from collector.alerts.receivers import build_receivers
from collector.ingest.decode import DecodedBatch
from collector.live.detection import DetectionRunner
from collector.live.policy import IncidentWatch, PolicyRunner
from collector.live.watermark import Watermarks
from collector.metrics import CollectorMetrics
from collector.offline.retention import DAY_S, RollupJob, check_age
from collector.read import queries
from collector.read.fleet import RunHistories
from collector.settings import Settings
from collector.sql.guard import SelectResult, SqlRefused, run_select
from collector.sql.slots import SqlDeadline, SqlSlots
from collector.store.actions import (
    ActionsProjection,
    BadBatchesProjection,
    MarkKnownGood,
    RecordAction,
    SetNodeStatus,
    UpdateAction,
)
from collector.store.commands import CommandsProjection, IssueCommand, validate_request
from collector.store.dedupe import BatchKeysProjection
from collector.store.feed import Feed, Subscription
from collector.store.incidents import (
    IncidentsProjection,
    OpenIncident,
    RecordFindings,
    UpdateIncident,
    check_fields,
)
from collector.store.liveness import LivenessProjection
from collector.store.projection import Ids, Projection
from collector.store.runinfo import RunInfoProjection
from collector.store.schema import migrate
from collector.store.writer import Done, IngestOutcome, WriteContext, Writer

log = logging.getLogger("collector.storage")

# Applied to every connection we open: SQL can reach no file but the database,
# no network, no extension, and cannot change these settings.
DUCKDB_LOCKDOWN = {
    "enable_external_access": False,
    "autoinstall_known_extensions": False,
    "autoload_known_extensions": False,
    "lock_configuration": True,
}

def _log_refusal(result: Any, error: BaseException | None) -> None:
    if error is not None:  # the row stays as it was in the table: after a restart it is tried again
        log.warning("an alert delivery's status could not be stored: %s", error)


# The HTTP answer to a query comes this long after its timeout at the latest, whether
# or not DuckDB has honoured the interrupt yet (it normally does within milliseconds).
SQL_ANSWER_GRACE_S = 0.5


# The row group of the tables we write, in rows (DuckDB's default: 122,880). A
# transaction that appends at least one whole row group to a table writes it straight
# to the database file ("optimistic write"); a smaller one goes through the WAL first
# and is written again at the checkpoint. A group commit of 16 clients' 4,200-row
# batches (64,000 collective rows) is under DuckDB's default, and cost 1.1-1.2 us of
# CPU a row; in 32,768-row groups 0.7-0.85 (bench_ingest's "writer alone"), for a
# file ~10% larger. DuckDB keeps the size per attach, not in the file: every writable
# open sets it.
ROW_GROUP_ROWS = 32_768


def connect(path: str | Path, *, read_only: bool = False, threads: int = 2, memory_limit: str = "2GB",
            checkpoint_threshold: str = "64MB", max_temp_size: str = "4GB",
            row_group_rows: int | None = ROW_GROUP_ROWS) -> duckdb.DuckDBPyConnection:
    """Open a database file with `DUCKDB_LOCKDOWN` (and, writable, the WAL size that
    triggers an automatic checkpoint, and `row_group_rows`). `max_temp_size` caps what
    queries may spill to disk beside the file (DuckDB's default is 90% of the free disk).

    A row group size is an option of ATTACH, not of a connection: a writable file is
    attached to an in-memory database that is then detached (the file is the default
    database, named after it as `duckdb.connect(path)` would, for every cursor), and only
    then are external access and the configuration locked."""
    config = {**DUCKDB_LOCKDOWN, "threads": threads, "memory_limit": memory_limit,
              "max_temp_directory_size": max_temp_size}
    if read_only:
        return duckdb.connect(str(path), read_only=True, config=config)
    config["checkpoint_threshold"] = checkpoint_threshold
    name = Path(path).name.split(".")[0]  # DuckDB's name for the file's database
    if not row_group_rows or name.lower() in ("", "memory", "system", "temp"):  # names taken
        return duckdb.connect(str(path), config=config)
    late = {k: config.pop(k) for k in ("enable_external_access", "lock_configuration")}
    # where queries spill: beside the file, as for a file opened directly (in memory: ./.tmp)
    con = duckdb.connect(":memory:", config={**config, "temp_directory": f"{path}.tmp"})
    try:
        literal = str(path).replace("'", "''")
        con.execute(f"ATTACH '{literal}' AS {_ident(name)} (ROW_GROUP_SIZE {int(row_group_rows)})")
        con.execute(f"USE {_ident(name)}")
        con.execute("DETACH memory")
        for key, value in late.items():
            con.execute(f"SET {key} = {str(value).lower()}")
    except BaseException:
        con.close()
        raise
    return con


def _ident(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


class Storage:
    """One open collector database: its writer thread, its readers, its metrics.
    Opening applies migrations; `close()` stops detection, drains the writer and
    checkpoints."""

    def __init__(self, settings: Settings, *, metrics: CollectorMetrics | None = None,
                 clock: Callable[[], float] = time.time, analyzer: Analyzer | None = None,
                 detection_tick_s: float = 1.0, detection_queue_commits: int = 64,
                 extra_projections: Sequence[Projection] = (), alert_transport: Transport | None = None,
                 policy: Policy | None = None) -> None:
        """`analyzer`: the analysis (analysis/engine.py), run on a detection thread
        (collector/live/detection.py) when given; None detects nothing.
        `extra_projections`: more parts for the writer, after the built-in ones.
        `alert_transport`: how the alert sender POSTs (default: urllib; tests fake it).
        `policy`: the healing policy (analysis/policy.py), carried out on a thread of
        its own (collector/live/policy.py); None acts on nothing."""
        if settings.retention.rollup_after_s:
            check_age(settings.retention.rollup_after_s)  # ValueError before anything starts
        self.settings = settings
        self._policy = policy
        self._clock = clock
        self._alert_transport = alert_transport or urllib_transport
        self._con = connect(settings.db_path, threads=settings.duckdb.threads,
                            memory_limit=settings.duckdb.memory_limit,
                            checkpoint_threshold=settings.duckdb.checkpoint_threshold,
                            max_temp_size=settings.duckdb.max_temp_size)
        self._closed = False
        self._instance = secrets.token_hex(4)  # etag(): a restarted collector's numbers start over
        try:
            migrate(self._con)
            self.metrics = metrics or CollectorMetrics(live_run_s=settings.live_run_s, clock=clock)
            self._writer = self._build_writer(extra_projections)
        except BaseException:
            self._con.close()
            raise
        self._read_root = self._con.cursor()
        self._read_lock = threading.Lock()
        self._init_sql()
        self.metrics.watch_queue(self.queue_depth)
        self.metrics.watch_incidents(lambda: self.read(queries.open_incidents),
                                     lambda run_id: self.read(queries.goodput_seconds, run_id))
        self._writer.start()
        if self.sender is not None:
            self.sender.offer(self._outbox.pending_at_start)  # what an earlier run left undelivered
            self._outbox.pending_at_start = []
            self.sender.start()
        self.detection: DetectionRunner | None = None
        # what the ingest answers tell the ranks is known-good (None without detection)
        self.watermarks = Watermarks(
            hold_for_policy=policy is not None,
            end_wait_s=policy.cfg.end_of_run_wait_s if policy is not None and policy.mode_of("rollback") == "auto"
            else 0.0) if analyzer is not None else None
        # the history of each run's nodes in other runs (node_history), when that detector runs
        self._histories = RunHistories(self.read, window_s=DAY_S * analyzer.rules.node_history.window_days,
                                       archive_dir=settings.archive_dir, clock=clock) \
            if any(d.name == "node_history" for d in getattr(analyzer, "detectors", ())) else None
        if analyzer is not None:
            self.detection = DetectionRunner(
                self.subscribe("detection", max_commits=detection_queue_commits), analyzer,
                submit=self.record_findings, meta=self._run_meta,
                clock=clock, tick_s=detection_tick_s, registry=self.metrics.registry, watermarks=self.watermarks,
                mark_known_good=self.mark_known_good)
            self.detection.start()
        self.policy: PolicyRunner | None = None
        if policy is not None:
            self.policy = PolicyRunner(self, policy, self.subscribe("policy"), self._incident_watch, clock=clock)
            self.policy.start()
        self.rollup: RollupJob | None = None  # old collectives into per-step summaries, on the writer
        if settings.retention.rollup_after_s:
            self.rollup = RollupJob(self.write, self.read, older_than_s=settings.retention.rollup_after_s,
                                    every_s=settings.retention.rollup_every_s,
                                    max_rows=settings.retention.rollup_chunk_rows,
                                    clock=clock).start()

    def _build_writer(self, extra: Sequence[Projection]) -> Writer:
        """The writer and its projections, in the order their writes must run: runs
        rows (liveness) before the statements that update them (run info)."""
        s, con = self.settings, self._con
        ids = Ids(con)
        keys = BatchKeysProjection(con)
        commands = CommandsProjection(con, ids=ids, ttl_s=s.command_ttl_s, now=self._clock())
        self._outbox, self.sender = self._build_outbox()
        self._incident_watch = IncidentWatch(con) if self._policy is not None else None
        incident_hooks = [self._outbox] + ([self._incident_watch] if self._incident_watch is not None else [])
        projections = [LivenessProjection(con), keys, RunInfoProjection(), commands,
                       IncidentsProjection(con, ids=ids, hooks=incident_hooks),
                       ActionsProjection(con, ids=ids, hooks=[self._outbox]), BadBatchesProjection(),
                       self._outbox, *extra]
        return Writer(con, admission=keys, projections=projections, replies=commands, ids=ids,
                      metrics=self.metrics, feed=Feed(self.metrics.registry), clock=self._clock,
                      group_max_rows=s.writer.max_rows, group_max_bytes=s.writer.max_bytes,
                      group_min_rows=s.writer.min_rows, group_linger_s=s.writer.linger_s,
                      group_gap_s=s.writer.gap_s, group_min_interval_s=s.writer.min_interval_s,
                      queue_max_bytes=s.writer.queue_max_bytes)

    def _build_outbox(self) -> tuple[AlertOutbox, Sender | None]:
        """The alert outbox (collector/alerts/outbox.py) and, with receivers, its sender, whose
        results come back through the writer. ValueError for a bad receiver."""
        s = self.settings
        receivers = build_receivers(webhooks=s.alerts.webhooks, alertmanagers=s.alerts.alertmanagers,
                                    webhook_secret=s.alerts.webhook_secret)
        sender = None
        if receivers:
            counter = Counter("llmwatch_collector_alerts", "alert delivery attempts, by receiver and outcome "
                              "(delivered, retry, failed)", ["receiver", "outcome"], registry=self.metrics.registry)
            sender = Sender(receivers, report=lambda r: self._writer.submit_intent("outbox", r, done=_log_refusal),
                            policy=RetryPolicy(base_s=s.alerts.retry_base_s, cap_s=s.alerts.retry_cap_s,
                                               max_age_s=s.alerts.max_age_s, max_attempts=s.alerts.max_attempts),
                            transport=self._alert_transport, clock=self._clock, timeout_s=s.alerts.timeout_s,
                            count=lambda receiver, outcome: counter.labels(receiver, outcome).inc())
        outbox = AlertOutbox(self._con, receivers=receivers, external_url=s.alerts.external_url,
                             firing_hold_s=s.alerts.firing_hold_s,
                             on_commit=sender.offer if sender is not None else None)
        return outbox, sender

    def close(self) -> None:
        """Stop detection (its last findings are queued) and the alert sender (its last
        results are queued), write what is queued, checkpoint (fold the WAL into the
        file), close. Undelivered alerts stay pending for the next start."""
        if self._closed:
            return
        self._closed = True
        if self.rollup is not None:
            self.rollup.stop()
        if self.detection is not None:
            self.detection.stop()
        if self.policy is not None:
            self.policy.stop()  # its last decisions are queued for the writer
        if self.sender is not None:
            # The last findings' alerts (a run's end closes incidents) commit first, then
            # each receiver gets one more try of what is due: an embedded collector
            # stopped with its run may never open this file again.
            try:
                self._writer.submit_call(lambda ctx: None).result(timeout=30.0)
            except Exception:  # the writer is gone or stuck: what is pending stays pending
                log.warning("the alert outbox could not be brought up to date before closing")
            self.sender.stop(timeout_s=self.settings.alerts.timeout_s + 5.0, drain=True)
        self._close_sql()
        self._writer.stop()
        self._read_root.close()
        self._con.execute("CHECKPOINT")
        self._con.close()

    def _run_meta(self, run_id: str) -> dict[str, pa.Table]:
        """A run's meta rows for the detection runner (queries.run_meta_tables) and, when
        node_history runs, the history of its nodes in other runs (collector/read/fleet.py)."""
        tables = self.read(queries.run_meta_tables, run_id)
        if self._histories is not None:
            nodes = tables["ranks"].column("node").to_pylist() + tables["nodes"].column("node").to_pylist()
            tables["node_history"] = self._histories.for_run(run_id, nodes, tables["ranks"].column("hw_id").to_pylist())
        return tables

    def wait_detected(self, timeout_s: float) -> bool:
        """Waits (at most `timeout_s`) until detection has analyzed every commit made before
        this call and stored its findings: an acknowledged batch's verdict is then in the
        incidents table. True at once without detection; False on the timeout."""
        if self.detection is None:
            return True
        return self.detection.wait_caught_up(self._writer.feed.seq, timeout_s)

    def queue_depth(self) -> int:
        return self._writer.depth()

    def etag(self, *tables: str) -> str:
        """A validator of what `tables` hold (an HTTP entity tag): another with the next commit
        that changes any of them (collector/store/writer.py `generation`), and with every start
        of this collector. Read it before reading the rows it stands for."""
        return f'"{self._instance}-{self._writer.generation(*tables)}"'

    def health(self) -> tuple[bool, str]:
        """(healthy, why not). Unhealthy: closed, or the writer thread is gone (nothing
        could be stored: every ingest would wait for a commit that never comes)."""
        if self._closed:
            return False, "storage is closed"
        if not self._writer.alive():
            return False, "the writer thread has died; see the collector's log"
        if self.detection is not None and not self.detection.alive():
            return False, "the detection thread has died; see the collector's log"
        if self.sender is not None and not self.sender.alive():
            return False, "an alert sender thread has died; see the collector's log"
        if self.policy is not None and not self.policy.alive():
            return False, "the policy thread has died; see the collector's log"
        if self.rollup is not None and not self.rollup.alive():
            return False, "the rollup thread has died; see the collector's log"
        return True, ""

    def wants_ops(self, run_id: str) -> bool:
        """Whether `run_id`'s summarizing agents should ship op rows now: an incident whose
        evidence is the collectives is open on it (known where detection runs; agent/summary.py)."""
        watch = self._incident_watch
        return watch is not None and watch.wants_ops(run_id)

    def subscribe(self, name: str, *, max_commits: int = 64, max_bytes: int = 256 << 20) -> Subscription:
        """A queue that gets every later commit's rows (collector/store/feed.py). Read it on a
        thread of your own; a full queue drops commits and says so."""
        return self._writer.feed.subscribe(name, max_commits=max_commits, max_bytes=max_bytes)

    def on_writer_thread(self) -> bool:
        return self._writer.on_writer_thread()

    # -- writes ----------------------------------------------------------------
    async def ingest(self, batch: DecodedBatch) -> IngestOutcome:
        """Store a batch; returns once it is committed (or known to be stored)."""
        return await self.submit(batch)

    def submit(self, batch: DecodedBatch) -> asyncio.Future:
        """Queue a batch for the next group commit (QueueFull at once past the write queue's
        budget); the future gives its `IngestOutcome` once committed. Call on the event loop."""
        fut = asyncio.get_running_loop().create_future()
        self._writer.submit_batch(batch, fut)
        return fut

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
        """Run `fn(ctx)` on the writer thread inside one transaction of its own."""
        return self._writer.submit_call(fn)

    def issue_command(self, run_id: str, kind: str, args: dict[str, Any], ranks: list[int] | None, *,
                      done: Done | None = None) -> Future | None:
        """Store a command (see commands.py), in the next group commit. Never blocks:
        returns a future of its row (KeyError for an unknown run), or None and calls
        `done(row, error)` on the writer thread after the commit. Raises ValueError at
        once for a malformed request. Safe from any thread, the writer's included
        (where only `done` can tell the outcome: waiting there would deadlock)."""
        validate_request(kind, args, ranks)
        return self._writer.submit_intent("commands", IssueCommand(run_id, kind, args, ranks), done=done)

    def record_findings(self, run_id: str, findings: Sequence[Finding], *,
                        done: Done | None = None) -> Future | None:
        """Open, update or close incidents from the analysis's findings (collector/store/incidents.py),
        in the next group commit. Never blocks; the result is the incident id per finding."""
        intent = RecordFindings(run_id, tuple(findings))
        return self._writer.submit_intent("incidents", intent, done=done)

    def open_incident(self, run_id: str, kind: str, severity: str, *, done: Done | None = None,
                      **fields: Any) -> Future | None:
        """Insert an incident (fields: incidents.INCIDENT_FIELDS); the future gives its id."""
        check_fields(fields)
        return self._writer.submit_intent("incidents", OpenIncident(run_id, {"kind": kind, "severity": severity,
                                                                             **fields}), done=done)

    def update_incident(self, incident_id: int, *, done: Done | None = None, settled: bool = False,
                        **fields: Any) -> Future | None:
        """Change fields of an incident; a status other than "open" also sets closed_ts.
        `settled`: this root cause is a verdict (a rerun's): detectors' later updates
        of the incident no longer replace its root cause or confidence."""
        if not fields:
            raise ValueError("give some incident fields to change")
        check_fields(fields)
        return self._writer.submit_intent("incidents", UpdateIncident(incident_id, fields, settled=settled),
                                          done=done)

    def record_action(self, run_id: str, kind: str, status: str, *, mode: str = "auto",
                      incident_id: int | None = None, command_id: int | None = None, node: str | None = None,
                      rank: int | None = None, detail: Any = None, done: Done | None = None,
                      dry_run: bool | None = None) -> Future | None:
        """Record an action (collector/store/actions.py), in the next group commit, with its
        alerts. Never blocks: a future of its id (ValueError for a malformed one), or
        None and `done(id, error)` after the commit. `dry_run=True` is the older
        spelling of mode="shadow"."""
        if dry_run:
            mode = "shadow"
        intent = RecordAction(run_id, kind, status, mode, incident_id=incident_id, command_id=command_id,
                              node=node, rank=rank, detail=detail)
        return self._writer.submit_intent("actions", intent, done=done)

    def update_action(self, action_id: int, *, done: Done | None = None, **fields: Any) -> Future | None:
        """Set fields of an action (actions.UPDATE_FIELDS: status, command_id, attempt,
        started_ts, finished_ts, recovery_s, detail); a terminal status sets finished_ts
        unless given. Never blocks; the future gives the row after (KeyError: no such action)."""
        return self._writer.submit_intent("actions", UpdateAction(action_id, fields), done=done)

    def finish_action(self, action_id: int, status: str, detail: Any = None, *,
                      done: Done | None = None) -> Future | None:
        """`update_action` with a status and, when given, a new detail."""
        return self.update_action(action_id, status=status, done=done,
                                  **({"detail": detail} if detail is not None else {}))

    def set_node_status(self, run_id: str, node: str, status: str, reason: str | None = None, *,
                        incident_id: int | None = None, done: Done | None = None) -> Future | None:
        """A node's status (healthy, suspect, isolated: which sets isolated_ts), in the
        next group commit. Never blocks; ValueError through the future for another status."""
        return self._writer.submit_intent("actions", SetNodeStatus(run_id, node, status, reason, incident_id),
                                          done=done)

    def mark_known_good(self, run_id: str, attempt: int, step: int, *, done: Done | None = None) -> Future | None:
        """The run's checkpoints of `attempt` at or below `step` are known-good (`checkpoints.known_good`),
        in the next group commit. Never blocks."""
        return self._writer.submit_intent("actions", MarkKnownGood(run_id, int(attempt), int(step)), done=done)

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
        self._sql = SqlSlots(num_slots=s.sql.max_concurrent, queue_timeout_s=s.sql.queue_timeout_s,
                             max_waiting=s.sql.max_waiting)
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
        """Read-only SQL (see collector/sql/guard.py) on one of `sql_max_concurrent` slots, for callers
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
        max_rows = s.sql.max_rows if max_rows is None else min(max_rows, s.sql.max_rows)
        timeout_s = timeout_s or s.sql.timeout_s

        def job() -> SelectResult:
            with self.cursor() as cur:
                with self._sql_cursors_lock:
                    self._sql_cursors.add(cur)
                try:
                    return run_select(cur, sql, max_rows=max_rows, max_bytes=s.sql.max_bytes, timeout_s=timeout_s,
                                      fmt=fmt, encode_row=encode_row)
                finally:
                    with self._sql_cursors_lock:
                        self._sql_cursors.discard(cur)
        return job, timeout_s

    # -- the read side (collector/read/), each query on a cursor of its own ------------------
    def read(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """`fn(cursor, *args, **kwargs)` on a cursor of its own: any function of
        collector/read/ (`storage.read(queries.incidents, run_id)`). The read side's
        functions take a cursor, so a route, the CLI or a test calls them through this,
        and a closed file's reader (the dashboard's DbSource) calls the same ones."""
        with self.cursor() as cur:
            return fn(cur, *args, **kwargs)
