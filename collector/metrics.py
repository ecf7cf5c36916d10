"""Prometheus exposition: the collector's own health and each live run's gauges.

Everything lives in one `CollectorRegistry` per collector (not the global one),
so tests and several collectors in one process do not collide. Counters are
bumped by the writer after each commit; run gauges are kept in memory from the
committed step rows (per rank: the row with the highest step of its latest
batch) and aggregated only when Prometheus scrapes. Open incidents are counted
from the `incidents` table at scrape time.

The exposition holds no data rows, only aggregates; it still names runs and shows
their live losses, so GET /metrics needs the read token (collector/http/gate.py) unless
the collector runs with --public-metrics.
"""

from __future__ import annotations

import math
import struct
import threading
import time
from collections.abc import Callable, Iterable

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily

from agent import wire
from collector.ingest.decode import DecodedBatch


def _measured(x: float) -> float | None:
    """A step float as the agent sent it: None for its NULL ("not measured"), else itself
    (a NaN loss stays NaN: that one was measured)."""
    return None if x != x and struct.pack("<d", x) == _NULL_BYTES else x


_NULL_BYTES = struct.pack("<q", wire.NULL_F64_BITS)
_F64, _I64 = struct.Struct("<d"), struct.Struct("<q")


class RunGauges:
    """Latest per-rank step figures of each run, updated by the writer thread."""

    def __init__(self, live_s: float, clock: Callable[[], float] = time.time) -> None:
        self.live_s = live_s
        self._clock = clock
        self._lock = threading.Lock()
        # run_id -> rank -> (step, loss, tokens, step_s); run_id -> last update ts
        self._ranks: dict[str, dict[int, tuple[int, float, int, float]]] = {}
        self._seen: dict[str, float] = {}
        self._tp_pp: dict[str, int] = {}

    def observe_all(self, batches: Iterable[DecodedBatch]) -> None:
        """A commit's batches, under one lock: at 100,000 ranks a commit holds thousands."""
        now = self._clock()
        with self._lock:
            for batch in batches:
                self._seen[batch.run_id] = now
                if batch.run is not None and batch.run.mesh:
                    mesh = batch.run.mesh
                    tp, pp = mesh.get("tp", 1), mesh.get("pp", 1)
                    if isinstance(tp, int) and isinstance(pp, int) and tp > 0 and pp > 0:
                        self._tp_pp[batch.run_id] = tp * pp
                sec = batch.sections.get(wire.STEP)
                if sec is None:
                    continue
                v = sec.views  # each column's bytes (decode's, format "B"; unpacked here)
                steps = v["step"].cast("q") if v["step"].format == "B" else v["step"]
                # the row with the highest step (the first of equals): a flush holds a few,
                # where max() over the view is a few times quicker than numpy's argmax
                i = (max(range(sec.n), key=steps.__getitem__) if sec.n <= 32
                     else int(np.argmax(sec.array("step"))))
                self._ranks.setdefault(batch.run_id, {})[batch.rank] = (
                    steps[i], _measured(_F64.unpack_from(v["loss"], 8 * i)[0]), _I64.unpack_from(v["tokens"], 8 * i)[0],
                    _measured(_F64.unpack_from(v["step_s"], 8 * i)[0]))

    def snapshot(self) -> dict[str, tuple[int, float, float]]:
        """run_id -> (latest step, mean loss at it, tokens/s) for runs seen within live_s.

        tokens/s: the `tokens` of every rank at the latest step, summed, divided by
        the slowest of their step_s and by tp*pp (ranks of one data-parallel
        replica report the same tokens) when the run's mesh is known."""
        horizon = self._clock() - self.live_s
        out = {}
        with self._lock:
            for run_id in [r for r, ts in self._seen.items() if ts < horizon]:
                self._seen.pop(run_id)
                self._ranks.pop(run_id, None)
                self._tp_pp.pop(run_id, None)
            for run_id in self._seen:
                rows = list(self._ranks.get(run_id, {}).values())
                if not rows:
                    continue
                step = max(r[0] for r in rows)
                at = [r for r in rows if r[0] == step]
                # a value the loop did not measure (NULL: None here) is left out; a gauge
                # with nothing measured is NaN, Prometheus's "no value"
                losses = [r[1] for r in at if r[1] is not None]
                loss = sum(losses) / len(losses) if losses else math.nan
                if any(r[2] < 0 or r[3] is None for r in at):
                    tps = math.nan  # some rank's tokens or step time not measured
                else:
                    slowest_s = max(r[3] for r in at)
                    tokens = sum(r[2] for r in at) / self._tp_pp.get(run_id, 1)
                    tps = tokens / slowest_s if slowest_s > 0 else 0.0
                out[run_id] = (step, loss, tps)
        return out


GOODPUT_REFRESH_S = 15.0  # a live run's goodput by cause is read again at most this often
GOODPUT_READS_PER_SCRAPE = 8  # and for at most this many runs per scrape (the others keep their last figures)


class _RunCollector:
    """Custom collector: builds the per-run gauge families at scrape time. A live run's
    goodput by cause (the `goodput` view: ~15 ms of DuckDB on a run of 100k steps) is read
    only when its step moved, at most every GOODPUT_REFRESH_S, and for at most
    GOODPUT_READS_PER_SCRAPE runs a scrape: a scrape costs the same however many runs are live."""

    def __init__(self, gauges: RunGauges, open_incidents: Callable[[], dict[str, int]],
                 goodput: Callable[[str], dict[str, float]] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._gauges = gauges
        self._open_incidents = open_incidents
        self._goodput = goodput
        self._clock = clock
        self._causes: dict[str, tuple[int, float, dict[str, float]]] = {}  # run -> (step, read at, cause -> s)

    def _goodput_of(self, snap: dict[str, tuple[int, float, float]]) -> dict[str, dict[str, float]]:
        if self._goodput is None:
            return {}
        now, reads = self._clock(), 0
        for run_id in sorted(snap, key=lambda r: self._causes.get(r, (None, -math.inf))[1]):  # stalest first
            at_step = snap[run_id][0]
            had = self._causes.get(run_id)
            if reads >= GOODPUT_READS_PER_SCRAPE or (had is not None and (
                    had[0] == at_step or now - had[1] < GOODPUT_REFRESH_S)):
                continue
            reads += 1
            try:
                self._causes[run_id] = (at_step, now, self._goodput(run_id))
            except Exception:  # a read that failed keeps the last figures; the scrape still answers
                continue
        for gone in set(self._causes) - set(snap):
            del self._causes[gone]
        return {run_id: causes for run_id, (_, _, causes) in self._causes.items()}

    def collect(self):
        step = GaugeMetricFamily("llmwatch_run_step", "Latest step reported by any rank", labels=["run_id"])
        loss = GaugeMetricFamily("llmwatch_run_loss", "Mean loss over the ranks at the latest step", labels=["run_id"])
        tps = GaugeMetricFamily("llmwatch_run_tokens_per_s", "Tokens per second at the latest step", labels=["run_id"])
        inc = GaugeMetricFamily("llmwatch_run_open_incidents", "Incidents with status open", labels=["run_id"])
        snap = self._gauges.snapshot()
        for run_id, (at_step, at_loss, at_tps) in snap.items():
            step.add_metric([run_id], at_step)
            loss.add_metric([run_id], at_loss)
            tps.add_metric([run_id], at_tps)
        counts = self._open_incidents()
        for run_id in sorted(set(snap) | set(counts)):
            inc.add_metric([run_id], counts.get(run_id, 0))
        good = GaugeMetricFamily("llmwatch_run_goodput_seconds",
                                 "Wall time of a live run by cause (the goodput view; productive is what counted)",
                                 labels=["run_id", "cause"])
        for run_id, causes in sorted(self._goodput_of(snap).items()):
            for cause, seconds in sorted(causes.items()):
                good.add_metric([run_id, cause], seconds)
        yield from (step, loss, tps, inc, good)


class CollectorMetrics:
    """The collector's registry and its instruments."""

    def __init__(self, *, live_run_s: float = 600.0, clock: Callable[[], float] = time.time) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.rows_ingested = Counter("llmwatch_collector_rows_ingested", "Rows committed, by table", ["table"], registry=r)
        self.batches = Counter("llmwatch_collector_batches", "Batches committed (duplicates excluded)", registry=r)
        self.duplicate_batches = Counter("llmwatch_collector_duplicate_batches", "Batches acknowledged as already stored", registry=r)
        self.conflicting_batches = Counter(
            "llmwatch_collector_conflicting_batches",
            "Batches refused (409) because their key was stored with other content", registry=r)
        self.rejects = Counter("llmwatch_collector_rejects", "Requests refused, by reason", ["reason"], registry=r)
        self.queue_depth = Gauge("llmwatch_collector_write_queue_depth", "Write jobs waiting for the writer thread", registry=r)
        self.commit_seconds = Histogram(
            "llmwatch_collector_commit_seconds", "Duration of one group commit", registry=r,
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0))
        self.group_size = Histogram(
            "llmwatch_collector_group_requests", "Requests per group commit", registry=r,
            buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096))
        self.runs = RunGauges(live_run_s, clock)

    def watch_queue(self, depth: Callable[[], int]) -> None:
        self.queue_depth.set_function(depth)

    def watch_incidents(self, open_incidents: Callable[[], dict[str, int]],
                        goodput: Callable[[str], dict[str, float]] | None = None) -> None:
        """The scrape-time run families: open incidents, and a live run's goodput by cause
        (`goodput(run_id)` -> {cause: seconds})."""
        self.registry.register(_RunCollector(self.runs, open_incidents, goodput))

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
