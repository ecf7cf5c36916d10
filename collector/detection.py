"""Detection off the ingest path: detectors on a thread of their own.

The `DetectionRunner` reads a post-commit subscription (collector/feed.py), so
ingest never waits for it: while a pass runs, the writer keeps committing and
acknowledging, and if the runner falls behind its queue drops commits (counted)
and the next delivery says how many were missed.

Per pass, for each run the commit holds, every detector is called with that
run's state and rows:

    detector(state, tables, now) -> list of findings

`tables` maps a target table (steps, collectives, heartbeats, events, scalars) to
the run's Arrow rows of that commit (zero copy: `polars.from_arrow` makes frames
of them without copying). `state` is the detector's own object for that run,
from its `new_state(run_id)` (a dict when it has none), kept between passes so a pass
never rereads history. `now` is the runner's clock (detectors read no clock). A
detector is pure: no I/O, no threads. A "tick" pass with empty tables runs every
`tick_s` while no commit comes, so a detector notices what stopped (heartbeats of
a crashed rank). Findings (collector/incidents.py `Finding`, or any object with
its attributes) go back through the writer as one `RecordFindings` intent per
run and pass: submitted, never waited for.

A detector that raises is logged and counted and the others still run. On a
gap (commits missed) `on_gap(missed)` runs; by default every state is dropped, so
detectors warm up again from the next commit rather than judge across a hole they
cannot see (a read-side resync, collector/read.py, can replace that).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import pyarrow as pa
import pyarrow.compute as pc
from prometheus_client import CollectorRegistry, Counter, Histogram

from collector.feed import Commit, Subscription
from collector.incidents import Finding, as_finding

log = logging.getLogger("collector.detection")


class Detector(Protocol):
    """A detector: a callable (a function, or an object with `__call__`). Optional:
    `name` (else the function's name) and `new_state(run_id)` (else a dict per run)."""

    def __call__(self, state: Any, tables: Mapping[str, pa.Table], now: float) -> Sequence[Any]: ...


# (run_id, findings, done) -> None; never blocks (Storage.record_findings)
Submit = Callable[..., Any]


def detector_name(detector: Detector) -> str:
    return getattr(detector, "name", None) or getattr(detector, "__name__", None) or type(detector).__name__


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
    """Runs `detectors` over each commit of `subscription` on its own thread."""

    def __init__(self, subscription: Subscription, detectors: Sequence[Detector], *, submit: Submit,
                 clock: Callable[[], float] = time.time, tick_s: float = 1.0, idle_run_s: float = 600.0,
                 on_gap: Callable[[int], None] | None = None, registry: CollectorRegistry | None = None) -> None:
        """`tick_s`: a run without a pass this long gets one with empty tables.
        `idle_run_s`: a run without rows this long is forgotten (its states too)."""
        self._sub = subscription
        self._detectors = [(detector_name(d), d) for d in detectors]
        self._submit = submit
        self._clock = clock
        self._tick_s, self._idle_run_s = tick_s, idle_run_s
        self._on_gap = on_gap or (lambda missed: self._states.clear())
        self._states: dict[tuple[str, str], Any] = {}  # (detector, run_id) -> state
        self._last_rows: dict[str, float] = {}  # run_id -> time.monotonic() of its last commit
        self._last_pass: dict[str, float] = {}  # run_id -> time.monotonic() of its last pass
        self._stop = threading.Event()
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

    def state(self, detector: str, run_id: str) -> Any:
        return self._states.get((detector, run_id))

    def _run(self) -> None:
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
                self.run_commit(delivery.commit)
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
            for key in [k for k in self._states if k[1] == run_id]:
                del self._states[key]
        due = [r for r in self._last_rows if now - self._last_pass.get(r, float("-inf")) >= self._tick_s]
        if due:
            self.run_pass({}, due)

    def run_pass(self, tables: Mapping[str, pa.Table], run_ids: Sequence[str]) -> None:
        """Every detector over `tables` for each of `run_ids`; findings submitted per run."""
        t0 = time.perf_counter()
        now = self._clock()
        for run_id in run_ids:
            self._last_pass[run_id] = time.monotonic()
            findings: list[Finding] = []
            for name, detector in self._detectors:
                key = (name, run_id)
                state = self._states.get(key)
                if state is None:
                    new_state = getattr(detector, "new_state", None)
                    state = self._states[key] = new_state(run_id) if new_state is not None else {}
                try:
                    findings.extend(as_finding(f) for f in detector(state, tables, now) or ())
                except Exception:
                    self.num_errors += 1
                    self._metrics.errors.labels(name).inc()
                    log.exception("detector %s failed on run %s", name, run_id)
            if findings:
                self._metrics.findings.inc(len(findings))
                self._submit(run_id, findings, done=self._recorded)
        self.num_passes += 1
        self._metrics.pass_seconds.observe(time.perf_counter() - t0)

    def _recorded(self, result: Any, error: BaseException | None) -> None:
        """On the writer thread, after the findings' commit: only log a failure."""
        if error is not None:
            log.warning("findings could not be recorded: %s", error)


class _Metrics:
    def __init__(self, registry: CollectorRegistry | None) -> None:
        r = registry or CollectorRegistry()  # unregistered instruments when none is given
        self.pass_seconds = Histogram("llmwatch_collector_detection_pass_seconds",
                                      "Duration of one detection pass over a commit", registry=r,
                                      buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0))
        self.errors = Counter("llmwatch_collector_detector_errors", "Detector calls that raised", ["detector"],
                              registry=r)
        self.findings = Counter("llmwatch_collector_detection_findings", "Findings handed to the writer",
                                registry=r)
        self.gaps = Counter("llmwatch_collector_detection_gaps",
                            "Times detection missed commits because its queue was full", registry=r)
