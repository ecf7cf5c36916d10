"""The detection runner: detectors on their own thread, fed by a subscription,
findings written back as incidents, and ingest never waiting for them."""

from __future__ import annotations

import threading

import numpy as np
import pyarrow as pa
import pytest

from agent import wire
from collector.decode import decode
from collector.detection import DetectionRunner, run_tables
from collector.feed import Commit, Subscription
from collector.incidents import Finding
from collector.settings import Settings
from collector.storage import Storage
from tests.polling import wait_until
from tests.unit.collector.collector_batches import make_batch, steps_section


class SlowRank:
    """A fake detector: a rank whose step_s is over 1 s is a straggler while it stays so."""

    name = "slow_rank"

    def new_state(self, run_id: str) -> dict:
        return {"slow": set()}

    def __call__(self, state, tables, now):
        steps = tables.get("steps")
        if steps is None:
            return []
        out = []
        for row in steps.select(["rank", "step", "step_s"]).to_pylist():
            slow = row["step_s"] > 1.0
            if slow:
                state["slow"].add(row["rank"])
                out.append(Finding(kind="straggler", rank=row["rank"], step_from=row["step"], ts=now,
                                   evidence={"step_s": row["step_s"]}))
            elif row["rank"] in state["slow"]:
                state["slow"].discard(row["rank"])
                out.append(Finding(kind="straggler", rank=row["rank"], resolved=True, ts=now))
        return out


def steps_batch(rank: int, seq: int, step_s: float, step: int | None = None) -> bytes:
    step = seq if step is None else step
    return make_batch(rank=rank, batch_seq=seq, sections={wire.STEP: steps_section([step], step_s=step_s)})


@pytest.fixture
def fast_settings(tmp_path) -> Settings:
    return Settings(db_path=tmp_path / "d.duckdb", group_linger_s=0.0, group_min_interval_s=0.0)


def test_findings_open_update_and_close_an_incident(fast_settings):
    storage = Storage(fast_settings, detectors=[SlowRank()], detection_tick_s=0.05)
    try:
        storage.ingest_blocking(decode(steps_batch(1, 0, step_s=0.5)))
        storage.ingest_blocking(decode(steps_batch(1, 1, step_s=2.0)))
        assert wait_until(lambda: len(storage.incidents("run1")) == 1)
        storage.ingest_blocking(decode(steps_batch(1, 2, step_s=2.5)))
        assert wait_until(lambda: storage.incidents("run1")[0]["step_to"] == 2)
        (inc,) = storage.incidents("run1")
        assert (inc["kind"], inc["rank"], inc["status"], inc["step_from"], inc["evidence"]) == (
            "straggler", 1, "open", 1, {"step_s": 2.5})
        storage.ingest_blocking(decode(steps_batch(1, 3, step_s=0.5)))
        assert wait_until(lambda: storage.incidents("run1")[0]["status"] == "closed")
        assert len(storage.incidents("run1")) == 1  # one incident for the one cause
        assert storage.detection.num_errors == 0
    finally:
        storage.close()


def test_a_slow_detector_does_not_delay_acks(fast_settings):
    """A detector stuck in its pass, and ten ingests in a row: were it on the ingest
    path none would be acknowledged; beside it every one is, while it is still stuck,
    and the runner's bounded queue drops what it cannot look at (counted, and told)."""
    passes, started, release = [], threading.Event(), threading.Event()

    def slow(state, tables, now):
        started.set()
        passes.append(now)
        release.wait(60)  # stuck until the test has its ten acks (bounded: never hangs the suite)
        return []

    storage = Storage(fast_settings, detectors=[slow], detection_queue_commits=1, detection_tick_s=60.0)
    try:
        storage.ingest_blocking(decode(steps_batch(0, 0, step_s=0.1)))
        assert started.wait(10)  # the detector is now in a pass
        for seq in range(1, 11):
            assert storage.ingest_blocking(decode(steps_batch(0, seq, step_s=0.1))).accepted == 1
        assert len(passes) == 1 and not release.is_set()  # all ten acknowledged during the one stuck pass
        release.set()
        assert wait_until(lambda: storage.detection.num_gaps >= 1)  # it was told commits were dropped
        assert storage.metrics.registry.get_sample_value(
            "llmwatch_collector_subscriber_dropped_commits_total", {"subscriber": "detection"}) >= 1
    finally:
        storage.close()


def test_a_failing_detector_is_counted_and_the_others_still_run(fast_settings):
    def broken(state, tables, now):
        raise ZeroDivisionError("a detector's bug")

    storage = Storage(fast_settings, detectors=[broken, SlowRank()], detection_tick_s=60.0)
    try:
        storage.ingest_blocking(decode(steps_batch(2, 0, step_s=3.0)))
        assert wait_until(lambda: len(storage.incidents("run1")) == 1)
        assert storage.detection.num_errors >= 1
        assert storage.metrics.registry.get_sample_value("llmwatch_collector_detector_errors_total",
                                                         {"detector": "broken"}) >= 1
    finally:
        storage.close()


def test_ticks_run_while_nothing_comes_and_states_are_per_run():
    seen = []

    def watcher(state, tables, now):
        state["n"] = state.get("n", 0) + 1
        seen.append((sorted(tables), state["n"]))
        return []

    sub = Subscription("t")
    runner = DetectionRunner(sub, [watcher], submit=lambda *a, **k: None, tick_s=0.05)
    steps = pa.table({"run_id": pa.array(["a", "b", "a"]).dictionary_encode(), "step": [1, 2, 3]})
    sub.offer(Commit(seq=1, commit_ts=0.0, run_ids=frozenset({"a", "b"}), tables={"steps": steps}))
    runner.start()
    try:
        assert wait_until(lambda: sum(1 for t, _ in seen if t == []) >= 4)  # ticks, for both runs
    finally:
        runner.stop()
    assert seen[0] == (["steps"], 1) and seen[1] == (["steps"], 1)  # one state per run
    assert runner.state("watcher", "a")["n"] >= 3 and runner.state("watcher", "b")["n"] >= 3


def test_run_tables_splits_a_commit_by_run():
    steps = pa.table({"run_id": pa.array(["a", "b", "a"]).dictionary_encode(), "step": [1, 2, 3]})
    events = pa.table({"run_id": ["b"], "kind": ["restart"]})
    commit = Commit(seq=1, commit_ts=0.0, run_ids=frozenset({"a", "b"}), tables={"steps": steps, "events": events})
    a, b = run_tables(commit, "a"), run_tables(commit, "b")
    assert sorted(a) == ["steps"] and a["steps"].column("step").to_pylist() == [1, 3]
    assert sorted(b) == ["events", "steps"] and b["steps"].column("step").to_pylist() == [2]
    alone = Commit(seq=2, commit_ts=0.0, run_ids=frozenset({"a"}), tables={"steps": steps})
    assert run_tables(alone, "a")["steps"] is steps  # one run: no filtering, no copy


def test_a_gap_drops_the_states_by_default():
    class Counting:
        name = "counting"
        num_states = 0

        def new_state(self, run_id):
            self.num_states += 1
            return {}

        def __call__(self, state, tables, now):
            calls.append(self.num_states)
            return []

    sub = Subscription("g", max_commits=1)
    calls: list[int] = []
    runner = DetectionRunner(sub, [Counting()], submit=lambda *a, **k: None, tick_s=60.0)
    table = {"steps": pa.table({"run_id": ["a"], "step": np.array([1])})}
    for seq in (1, 2, 3):  # 2 and 3 are dropped: the queue holds one
        sub.offer(Commit(seq=seq, commit_ts=0.0, run_ids=frozenset({"a"}), tables=table))
    runner.start()
    try:
        assert wait_until(lambda: runner.num_gaps == 1 and len(calls) == 1)
        sub.offer(Commit(seq=4, commit_ts=0.0, run_ids=frozenset({"a"}), tables=table))
        assert wait_until(lambda: len(calls) == 2)
    finally:
        runner.stop()
    assert calls == [1, 2]  # after the gap the run's state started over
