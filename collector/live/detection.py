"""Detection off the ingest path: the analysis on a thread of its own.

The `DetectionRunner` reads a post-commit subscription (collector/store/feed.py), so
ingest never waits for it: while a pass runs, the writer keeps committing and
acknowledging. A runner that falls behind takes the commits queued meanwhile in
one pass (up to `MAX_MERGED_COMMITS`: at many ranks much of a pass's cost is per
pass, so it catches up in fewer of them); one that falls further behind has its
queue drop commits (counted), and the next delivery says how many were missed.

It owns one `Analyzer` (analysis/engine.py), which keeps every run's state. Per
pass, for each run the commit holds:

    analyzer.feed_run(run_id, Frames.from_arrow(tables), now=now) -> findings

`tables` maps a target table (steps, collectives, heartbeats, events, scalars) to
the run's Arrow rows of that commit (zero copy). Until the run's mesh is known
(the run info comes with rank 0's first batch, the ranks' coordinates with each
rank's first, and again after a restart round) the run's `runs`, `ranks` and
`nodes` rows, read through `meta(run_id)` (the read side), ride along, so steps
can be assembled across ranks and peers compared within a pipeline stage. `now`
is the runner's clock (the analysis reads no clock). A "tick" pass with empty
tables runs every `tick_s` while no commit comes, so the analysis notices what
stopped (heartbeats of a crashed rank). Findings go back through the writer as
one `RecordFindings` intent per run and pass: submitted, never waited for.

After each run's pass its clean-through watermark (analysis/watermark.py) goes to
`watermarks` (collector/live/watermark.py), with a hold on each incident that
taints the weights until the policy settles it; the ingest answers carry it.

`wait_caught_up(seq)` is the one wait on it, for a reader that wants the verdict
on everything stored so far (the launcher's list at the end of a run): it returns
once commit `seq` was analyzed and every finding submitted by then is stored.

A pass that raises is logged and counted, and the next pass runs. On a gap
(commits missed) `on_gap(missed)` runs; by default every run's state is dropped,
so the analysis warms up again from the next commit rather than judge across a
hole it cannot see.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
from prometheus_client import CollectorRegistry, Counter, Histogram

from analysis import Analyzer, Frames
from analysis.engine import is_new_round
from analysis.kinds import TAINTS_WEIGHTS
from collector.live.watermark import Watermarks
from collector.store.feed import Commit, Subscription, merged
from collector.threads import name_native

log = logging.getLogger("collector.live.detection")

# (run_id, findings, done) -> None; never blocks (Storage.record_findings)
Submit = Callable[..., Any]
# a pass takes at most this many commits (those queued while the previous pass ran)
MAX_MERGED_COMMITS = 8
# run_id -> its runs, ranks and nodes rows (collector/read/queries.py run_meta_tables, through Storage.read)
Meta = Callable[[str], Mapping[str, pa.Table]]
# A run's meta rows are read again on every pass until every rank has reported its coordinates,
# unless the run has META_LARGE_RANKS ranks or more and a read took META_COSTLY_S or more: then
# not before META_COST_FACTOR times as long has passed. A 100,000-rank run reports over its first
# flush period (30 s), and each read of its ~100,000 rows into a new topology took ~0.3 s of the
# GIL, pass after pass: the writer's commits and the event loop waited for it (acks of 2-7 s).
# A smaller job's reads are never held back, however slow a loaded host makes one.
META_LARGE_RANKS = 1024
META_COSTLY_S = 0.05
META_COST_FACTOR = 10.0


def run_tables(commit: Commit, run_id: str) -> dict[str, pa.Table]:
    """The rows of `commit` that belong to `run_id` (the tables themselves when the
    commit holds that run only, the usual case)."""
    if len(commit.run_ids) == 1 and run_id in commit.run_ids:
        return dict(commit.tables)
    out = {}
    for name, t in commit.tables.items():
        if "run_id" not in t.schema.names:
            continue
        col = t["run_id"]
        if pa.types.is_dictionary(col.type):
            col = col.cast(col.type.value_type)
        part = t.filter(pc.equal(col, run_id))
        if part.num_rows:
            out[name] = part
    return out


class DetectionRunner:
    """Runs `analyzer` over each commit of `subscription`, per run, on its own thread."""

    def __init__(self, subscription: Subscription, analyzer: Analyzer, *, submit: Submit, meta: Meta | None = None,
                 clock: Callable[[], float] = time.time, tick_s: float = 1.0, idle_run_s: float = 600.0,
                 on_gap: Callable[[int], None] | None = None, registry: CollectorRegistry | None = None,
                 watermarks: Watermarks | None = None,
                 mark_known_good: Callable[[str, int, int], Any] | None = None,
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        """`meta(run_id)`: the run's runs, ranks and nodes rows (None: the commits carry
        what the analysis needs). `tick_s`: a run without a pass this long gets one with
        empty tables. `idle_run_s`: a run without rows this long is forgotten. `watermarks`:
        where each pass leaves the run's clean-through watermark (collector/live/watermark.py).
        `monotonic`: what times the meta reads (META_COSTLY_S; tests step it)."""
        self.analyzer = analyzer
        self.watermarks = watermarks
        self._mark_known_good = mark_known_good  # (run_id, attempt, step): checkpoints.known_good
        self._marked: dict[str, tuple[int, int]] = {}  # run -> the watermark last sent there
        self._unmarked: dict[str, set[tuple[int, int]]] = {}  # run -> checkpoints reported above it
        self._sub = subscription
        self._submit = submit
        self._meta = meta
        self._clock = clock
        self._tick_s, self._idle_run_s = tick_s, idle_run_s
        self._on_gap = on_gap or (lambda missed: self.forget())
        self._complete: set[str] = set()  # runs whose size and every rank's coordinates the analysis has
        self._meta_due: dict[str, float] = {}  # run_id -> monotonic() before which its meta is not read
        self._monotonic = monotonic
        self._last_rows: dict[str, float] = {}  # run_id -> time.monotonic() of its last commit
        self._last_pass: dict[str, float] = {}  # run_id -> time.monotonic() of its last pass
        self._stop = threading.Event()
        self._progress = threading.Condition()  # guards the two below: wait_caught_up waits on it
        self._seen_seq = 0  # the newest commit analyzed (or skipped as missed)
        self._unrecorded = 0  # findings submitted whose commit has not come yet
        self._thread = threading.Thread(target=self._run, name="collector-detection", daemon=True)
        self.num_passes = self.num_gaps = self.num_errors = 0
        self._metrics = _Metrics(registry)

    def start(self) -> None:
        self._thread.start()

    def alive(self) -> bool:
        return self._thread.is_alive()

    def stop(self, timeout_s: float = 10.0) -> None:
        """End after the pass in progress (what is still queued is not looked at)."""
        self._stop.set()
        self._sub.close()
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    def forget(self, run_id: str | None = None) -> None:
        """Drop the analysis of `run_id` (None: of every run); it starts over from its next rows."""
        for r in list(self.analyzer.runs) if run_id is None else [run_id]:
            self.analyzer.drop_run(r)
            self._complete.discard(r)
            self._meta_due.pop(r, None)
            self._marked.pop(r, None)
            if self.watermarks is not None:
                self.watermarks.forget(r)

    def _run(self) -> None:
        name_native("lw-detection")
        while not self._stop.is_set():
            delivery = self._sub.get(self._tick_s)
            if self._stop.is_set() or (delivery is None and self._sub.closed):
                return
            if delivery is not None and delivery.missed:
                self.num_gaps += 1
                self._metrics.gaps.inc()
                log.warning("detection missed %d commits (its queue was full)", delivery.missed)
                self._on_gap(delivery.missed)
            if delivery is not None and delivery.commit is not None:
                # behind the writer: the commits queued meanwhile go in the same pass (a pass's
                # cost is largely per pass at many ranks, so catching up takes fewer of them)
                commit = merged([delivery.commit, *self._sub.take_queued(MAX_MERGED_COMMITS - 1)])
                self.run_commit(commit)
                with self._progress:
                    self._seen_seq = commit.seq
                    self._progress.notify_all()
            self.tick()

    def run_commit(self, commit: Commit) -> None:
        now = time.monotonic()
        for run_id in sorted(commit.run_ids):
            self._last_rows[run_id] = now
            self.run_pass(run_tables(commit, run_id), [run_id])

    def tick(self) -> None:
        """A pass with empty tables for each run that had none for `tick_s`; runs
        without rows for `idle_run_s` are forgotten."""
        now = time.monotonic()
        for run_id in [r for r, ts in self._last_rows.items() if now - ts > self._idle_run_s]:
            del self._last_rows[run_id]
            self._last_pass.pop(run_id, None)
            self._unmarked.pop(run_id, None)
            self.forget(run_id)
        due = [r for r in self._last_rows if now - self._last_pass.get(r, float("-inf")) >= self._tick_s]
        if due:
            self.run_pass({}, due)

    def run_pass(self, tables: Mapping[str, pa.Table], run_ids: Sequence[str]) -> None:
        """The analysis of each of `run_ids` over `tables`; findings submitted per run."""
        t0 = time.perf_counter()
        now = self._clock()
        for run_id in run_ids:
            self._last_pass[run_id] = time.monotonic()
            try:
                findings = self.analyzer.feed_run(run_id, self._frames(run_id, tables), now=now)
            except Exception:
                self.num_errors += 1
                self._metrics.errors.inc()
                log.exception("detection failed on run %s", run_id)
                continue
            if self.watermarks is not None:
                for f in findings:  # held before the watermark moves: a closed spike waits for the policy
                    if f.kind in TAINTS_WEIGHTS and not f.resolved:
                        self.watermarks.hold(run_id, f.key, f.step_from)
                self.watermarks.set(run_id, self.analyzer.clean_through(run_id))
                self._known_good(run_id, tables)
            if findings:
                self._metrics.findings.inc(len(findings))
                with self._progress:
                    self._unrecorded += 1
                try:
                    self._submit(run_id, findings, done=self._recorded)
                except BaseException:  # refused (a full write queue): no callback will count it done
                    self._recorded(None, None)
                    raise
        self.num_passes += 1
        self._metrics.pass_seconds.observe(time.perf_counter() - t0)

    def _known_good(self, run_id: str, tables: Mapping[str, pa.Table]) -> None:
        """Mark the run's checkpoints at or below its watermark known-good once the watermark
        passes one that was reported (its row may come after the watermark passed it), and
        once at a run's first watermark here (checkpoints reported before this collector
        started). A move that passes no checkpoint writes nothing: marking on every move
        cost the embedded collector one commit per pass."""
        mark = self.watermarks.get(run_id) if self._mark_known_good is not None else None
        unmarked = self._unmarked.setdefault(run_id, set())
        events = tables.get("events")
        if events is not None and events.num_rows:
            saved = events.filter(pc.equal(events["kind"], "checkpoint_saved")).select(["attempt", "step"])
            unmarked.update((int(a), int(st)) for a, st in zip(*(c.to_pylist() for c in saved.columns))
                            if a is not None and st is not None)
        if mark is None:
            return
        key = (mark["attempt"], mark["step"])
        unmarked.difference_update([c for c in unmarked if c[0] < key[0]])  # an older attempt's: never marked
        passed = {c for c in unmarked if c[0] == key[0] and c[1] <= key[1]}
        if run_id in self._marked and not passed:
            return
        self._marked[run_id] = key
        try:
            self._mark_known_good(run_id, *key)
        except Exception:  # noqa: BLE001 - refused (a full write queue): the next pass tries again
            self._marked.pop(run_id, None)
            return
        unmarked.difference_update(passed)

    def _frames(self, run_id: str, tables: Mapping[str, pa.Table]) -> Frames:
        """The run's rows, and its meta rows while its mesh is not known (a new round's is not)."""
        frames = Frames.from_arrow(tables)
        if is_new_round(frames):
            self._complete.discard(run_id)
            self._meta_due.pop(run_id, None)  # a new round's ranks: read at once
        if self._meta is None or run_id in self._complete:
            return frames
        now = self._monotonic()
        if now < self._meta_due.get(run_id, now):
            return frames  # read lately, at a cost (META_COSTLY_S): the analysis keeps what it read then
        meta = self._meta(run_id)
        took = self._monotonic() - now
        ranks = meta.get("ranks")
        if took >= META_COSTLY_S and ranks is not None and ranks.num_rows >= META_LARGE_RANKS:
            self._meta_due[run_id] = now + META_COST_FACTOR * took
        if _complete(meta):
            self._complete.add(run_id)
            self._meta_due.pop(run_id, None)
        return Frames.from_arrow({**tables, **meta})

    def _recorded(self, result: Any, error: BaseException | None) -> None:
        """On the writer thread, after the findings' commit: log a failure, count it done."""
        if error is not None:
            log.warning("findings could not be recorded: %s", error)
        with self._progress:
            self._unrecorded -= 1
            self._progress.notify_all()

    def wait_caught_up(self, seq: int, timeout_s: float) -> bool:
        """Waits (at most `timeout_s`) until commit `seq` and every one before it was analyzed
        and the findings submitted so far are stored. False on the timeout, or when the
        runner stopped first."""
        def done() -> bool:
            return (self._seen_seq >= seq and self._unrecorded <= 0) or self._stop.is_set()

        with self._progress:
            return self._progress.wait_for(done, timeout_s) and not self._stop.is_set()


def _complete(meta: Mapping[str, pa.Table]) -> bool:
    """The run's size is known and every rank has reported its coordinates."""
    runs, ranks = meta.get("runs"), meta.get("ranks")
    if runs is None or not runs.num_rows or ranks is None:
        return False
    world = runs.column("world_size")[0].as_py()
    return bool(world) and ranks.num_rows >= world


class _Metrics:
    def __init__(self, registry: CollectorRegistry | None) -> None:
        r = registry or CollectorRegistry()  # unregistered instruments when none is given
        self.pass_seconds = Histogram("llmwatch_collector_detection_pass_seconds",
                                      "Duration of one detection pass over a commit", registry=r,
                                      buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0))
        self.errors = Counter("llmwatch_collector_detection_errors", "Detection passes that raised", registry=r)
        self.findings = Counter("llmwatch_collector_detection_findings", "Findings handed to the writer",
                                registry=r)
        self.gaps = Counter("llmwatch_collector_detection_gaps",
                            "Times detection missed commits because its queue was full", registry=r)
