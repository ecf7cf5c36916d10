"""Prometheus exposition: health counters and live run gauges."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from agent import wire
from collector.ingest.decode import decode
from collector.metrics import RunGauges
from tests.unit.collector.collector_batches import make_batch, steps_section


def samples(storage) -> dict[tuple, float]:
    out = {}
    for fam in text_string_to_metric_families(storage.metrics.exposition().decode()):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_health_counters_and_run_gauges(storage):
    run = {"mesh": {"dp": 2, "tp": 2, "pp": 1}}
    bodies = [make_batch(rank=rank, run=run if rank == 0 else None, sections={
        wire.STEP: steps_section([9, 10], loss=[3.0, 2.0 + rank], tokens=1000, step_s=[1.0, 0.5 + rank * 0.25])})
        for rank in range(4)]
    for body in bodies:
        storage.ingest_blocking(decode(body))
    storage.ingest_blocking(decode(bodies[0]))  # sent again (the same bytes): a duplicate
    storage.open_incident("run1", "spike", "warning").result()
    got = samples(storage)
    assert got[("llmwatch_collector_rows_ingested_total", (("table", "steps"),))] == 8
    assert got[("llmwatch_collector_batches_total", ())] == 4
    assert got[("llmwatch_collector_duplicate_batches_total", ())] == 1
    assert got[("llmwatch_collector_commit_seconds_count", ())] == 6  # 5 ingests, the incident
    assert got[("llmwatch_collector_write_queue_depth", ())] == 0
    run_label = (("run_id", "run1"),)
    assert got[("llmwatch_run_step", run_label)] == 10
    assert got[("llmwatch_run_loss", run_label)] == 3.5  # mean of 2, 3, 4, 5
    assert got[("llmwatch_run_tokens_per_s", run_label)] == 4000 / 1.25 / 2  # tp*pp = 2 ranks per replica
    assert got[("llmwatch_run_open_incidents", run_label)] == 1
    # the run's wall time by cause (the goodput view): its two steps (the batches' steps are skipped ones)
    causes = {dict(labels)["cause"]: v for (name, labels), v in got.items()
              if name == "llmwatch_run_goodput_seconds" and dict(labels)["run_id"] == "run1"}
    assert causes == {"skipped": 2.0}


def test_goodput_is_read_when_a_run_moved_and_for_a_bounded_number_of_runs_a_scrape():
    from collector.metrics import GOODPUT_READS_PER_SCRAPE, GOODPUT_REFRESH_S, _RunCollector

    class Snap:
        runs: dict = {}

        def snapshot(self):
            return dict(self.runs)

    reads, clock = [], [0.0]

    def goodput(run_id):
        reads.append(run_id)
        return {"productive": 1.0}

    snap = Snap()
    snap.runs = {f"r{i}": (1, 2.0, 3.0) for i in range(GOODPUT_READS_PER_SCRAPE + 2)}
    col = _RunCollector(snap, lambda: {}, goodput, clock=lambda: clock[0])

    def scrape():
        fams = {f.name: f for f in col.collect()}
        return {s.labels["run_id"] for s in fams["llmwatch_run_goodput_seconds"].samples}

    assert len(scrape()) == GOODPUT_READS_PER_SCRAPE and len(reads) == GOODPUT_READS_PER_SCRAPE
    assert len(scrape()) == len(snap.runs)  # the rest on the next scrape
    reads.clear()
    assert scrape() == set(snap.runs) and reads == []  # nothing moved: nothing read
    snap.runs["r0"] = (2, 2.0, 3.0)
    scrape()
    assert reads == []  # moved, but read less than GOODPUT_REFRESH_S ago
    clock[0] = GOODPUT_REFRESH_S
    scrape()
    assert reads == ["r0"]
    del snap.runs["r1"]
    assert "r1" not in scrape()  # a run gone quiet leaves the family


def test_runs_leave_the_gauges_when_quiet():
    clock = [0.0]
    gauges = RunGauges(live_s=10.0, clock=lambda: clock[0])
    gauges.observe_all([decode(make_batch(sections={wire.STEP: steps_section([1], loss=1.0, step_s=1.0, tokens=5)}))])
    assert gauges.snapshot() == {"run1": (1, 1.0, 5.0)}
    clock[0] = 11.0
    assert gauges.snapshot() == {}


def test_unmeasured_values_stay_out_of_the_gauges():
    """A loop that records only its loss (record_step(step, loss=...)): the agent sends
    NULL tokens and step times; tokens/s is "no value" (NaN), not negative, and a rank
    that did not measure its loss leaves the mean alone; a measured NaN loss stays NaN."""
    import math
    gauges = RunGauges(live_s=10.0, clock=lambda: 0.0)
    for rank, loss in ((0, 2.0), (1, wire.NULL_F64)):
        gauges.observe_all([decode(make_batch(rank=rank, sections={wire.STEP: steps_section(
            [7], loss=loss, tokens=wire.NOT_MEASURED, step_s=wire.NULL_F64)}))])
    (step, loss, tps), = gauges.snapshot().values()
    assert (step, loss) == (7, 2.0) and math.isnan(tps)
    gauges.observe_all([decode(make_batch(rank=0, sections={wire.STEP: steps_section(
        [8], loss=math.nan, tokens=64, step_s=0.5)}))])
    (step, loss, tps), = gauges.snapshot().values()
    assert step == 8 and math.isnan(loss) and tps == 128.0


def test_a_batch_s_gauges_come_from_its_highest_step_the_first_of_equals():
    """A flush of a few steps (a Python max) or of many (numpy): the row with the highest step,
    the first of two rows at that step (a replayed step's older row), whatever the order."""
    import numpy as np
    gauges = RunGauges(live_s=10.0, clock=lambda: 0.0)
    for steps in ([3, 9, 9, 2], list(range(40, 0, -1)) + [40]):
        n = len(steps)
        loss = np.arange(n, dtype=float) + 1.0
        gauges.observe_all([decode(make_batch(sections={wire.STEP: steps_section(
            steps, loss=loss, step_s=np.ones(n), tokens=np.full(n, 4))}))])
        (step, got, _), = gauges.snapshot().values()
        first = steps.index(max(steps))
        assert (step, got) == (max(steps), loss[first]), steps
