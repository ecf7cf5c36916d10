"""The detection runner: the analysis on its own thread, fed by a subscription,
findings written back as incidents, and ingest never waiting for them. The runner's
mechanics are shown with stand-ins for the Analyzer (its `feed_run`, `runs` and
`drop_run`); the real analysis runs in the integration and end-to-end tests."""

from __future__ import annotations

import threading

import numpy as np
import pyarrow as pa
import pytest

from agent import wire
from analysis.findings import RESOLVED, Finding
from collector.ingest.decode import decode
from collector.live.detection import DetectionRunner, run_tables
from collector.read import queries
from collector.settings import Settings, WriterSettings
from collector.storage import Storage
from collector.store.feed import Commit, Subscription
from tests.polling import wait_until
from tests.unit.collector.collector_batches import make_batch, steps_section


class StandIn:
    """The Analyzer's face to the runner: one state per run in `runs`, `drop_run`,
    `feed_run(run_id, frames, now)` calling `judge(state, frames, now)` for findings, and
    `clean_through(run_id)`: the state's "clean_through" (a judge may set it)."""

    def __init__(self, judge=None) -> None:
        self.runs: dict[str, dict] = {}
        self.judge = judge or (lambda state, frames, now: [])

    def drop_run(self, run_id: str) -> None:
        self.runs.pop(run_id, None)

    def feed_run(self, run_id, frames, *, now):
        state = self.runs.setdefault(run_id, {"run_id": run_id})
        return self.judge(state, frames, now)

    def clean_through(self, run_id):
        return self.runs.get(run_id, {}).get("clean_through")


def slow_rank(state, frames, now) -> list[Finding]:
    """A rank whose step_s is over 1 s is a straggler while it stays so."""
    if frames.steps is None:
        return []
    slow, out = state.setdefault("slow", set()), []
    for row in frames.steps.select(["rank", "step", "step_s"]).iter_rows(named=True):
        key, rank = f"straggler:{row['rank']}", row["rank"]
        if row["step_s"] > 1.0:
            slow.add(rank)
            out.append(Finding(kind="straggler", key=key, run_id=state["run_id"], rank=rank, step_from=row["step"],
                               ts=now, evidence={"step_s": row["step_s"]}))
        elif rank in slow:
            slow.discard(rank)
            out.append(Finding(kind="straggler", key=key, run_id=state["run_id"], rank=rank, status=RESOLVED,
                               ts=now))
    return out


def steps_batch(rank: int, seq: int, step_s: float, step: int | None = None) -> bytes:
    step = seq if step is None else step
    return make_batch(rank=rank, batch_seq=seq, sections={wire.STEP: steps_section([step], step_s=step_s)})


@pytest.fixture
def fast_settings(tmp_path) -> Settings:
    return Settings(db_path=tmp_path / "d.duckdb", writer=WriterSettings(linger_s=0.0, min_interval_s=0.0))


def test_findings_open_update_and_close_an_incident(fast_settings):
    storage = Storage(fast_settings, analyzer=StandIn(slow_rank), detection_tick_s=0.05)
    try:
        storage.ingest_blocking(decode(steps_batch(1, 0, step_s=0.5)))
        storage.ingest_blocking(decode(steps_batch(1, 1, step_s=2.0)))
        assert wait_until(lambda: len(storage.read(queries.incidents, "run1")) == 1)
        storage.ingest_blocking(decode(steps_batch(1, 2, step_s=2.5)))
        assert wait_until(lambda: storage.read(queries.incidents, "run1")[0]["step_to"] == 2)
        (inc,) = storage.read(queries.incidents, "run1")
        assert (inc["kind"], inc["rank"], inc["status"], inc["step_from"], inc["evidence"]) == (
            "straggler", 1, "open", 1, {"step_s": 2.5})
        storage.ingest_blocking(decode(steps_batch(1, 3, step_s=0.5)))
        assert wait_until(lambda: storage.read(queries.incidents, "run1")[0]["status"] == "closed")
        assert len(storage.read(queries.incidents, "run1")) == 1  # one incident for the one cause
        assert storage.detection.num_errors == 0
    finally:
        storage.close()


def test_a_slow_detector_does_not_delay_acks(fast_settings):
    """A detector stuck in its pass, and ten ingests in a row: were it on the ingest
    path none would be acknowledged; beside it every one is, while it is still stuck,
    and the runner's bounded queue drops what it cannot look at (counted, and told)."""
    passes, started, release = [], threading.Event(), threading.Event()

    def slow(state, frames, now):
        started.set()
        passes.append(now)
        release.wait(60)  # stuck until the test has its ten acks (bounded: never hangs the suite)
        return []

    storage = Storage(fast_settings, analyzer=StandIn(slow), detection_queue_commits=1, detection_tick_s=60.0)
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


def test_a_failing_pass_is_counted_and_the_next_one_runs(fast_settings):
    def broken_once(state, frames, now):
        if not state.get("failed"):
            state["failed"] = True
            raise ZeroDivisionError("a detector's bug")
        return slow_rank(state, frames, now)

    storage = Storage(fast_settings, analyzer=StandIn(broken_once), detection_tick_s=60.0)
    try:
        storage.ingest_blocking(decode(steps_batch(2, 0, step_s=3.0)))
        assert wait_until(lambda: storage.detection.num_errors == 1)
        storage.ingest_blocking(decode(steps_batch(2, 1, step_s=3.0)))
        assert wait_until(lambda: len(storage.read(queries.incidents, "run1")) == 1)
        assert storage.detection.alive()
        assert storage.metrics.registry.get_sample_value("llmwatch_collector_detection_errors_total") == 1
    finally:
        storage.close()


def test_ticks_run_while_nothing_comes_and_states_are_per_run():
    seen = []

    def watcher(state, frames, now):
        state["n"] = state.get("n", 0) + 1
        seen.append((sorted(frames.tables()), state["n"]))
        return []

    sub = Subscription("t")
    analysis = StandIn(watcher)
    runner = DetectionRunner(sub, analysis, submit=lambda *a, **k: None, tick_s=0.05)
    steps = pa.table({"run_id": pa.array(["a", "b", "a"]).dictionary_encode(), "step": [1, 2, 3]})
    sub.offer(Commit(seq=1, commit_ts=0.0, run_ids=frozenset({"a", "b"}), tables={"steps": steps}))
    runner.start()
    try:
        assert wait_until(lambda: sum(1 for t, _ in seen if t == []) >= 4)  # ticks, for both runs
    finally:
        runner.stop()
    assert seen[0] == (["steps"], 1) and seen[1] == (["steps"], 1)  # one state per run
    assert analysis.runs["a"]["n"] >= 3 and analysis.runs["b"]["n"] >= 3


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
    states: list[int] = []

    def counting(state, frames, now):
        state.setdefault("id", len(states))
        calls.append(state["id"])
        if state["id"] == len(states):
            states.append(state["id"])
        return []

    sub = Subscription("g", max_commits=1)
    calls: list[int] = []
    runner = DetectionRunner(sub, StandIn(counting), submit=lambda *a, **k: None, tick_s=60.0)
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
    assert calls == [0, 1]  # after the gap the run's state started over


def test_the_runs_meta_rides_along_until_its_mesh_is_known_and_again_after_a_restart():
    """Rank 0's first batch brings the run info, each rank's first its coordinates: the
    run's runs and ranks rows are read for each pass until every rank is there, then no
    more, until a restart round (another world size) makes them unknown again."""
    reads: list[str] = []
    world = {"n": 2, "ranks": 1}

    def meta(run_id):
        reads.append(run_id)
        return {"runs": pa.table({"run_id": [run_id], "world_size": [world["n"]]}),
                "ranks": pa.table({"run_id": [run_id] * world["ranks"], "rank": list(range(world["ranks"]))})}

    got = []
    analysis = StandIn(lambda state, frames, now: got.append(sorted(frames.tables())) or [])
    runner = DetectionRunner(Subscription("m"), analysis, submit=lambda *a, **k: None, meta=meta)
    steps = {"steps": pa.table({"run_id": ["a"], "step": [1]})}
    runner.run_pass(steps, ["a"])
    world["ranks"] = 2  # the second rank's coordinates came
    runner.run_pass(steps, ["a"])
    runner.run_pass(steps, ["a"])
    assert reads == ["a", "a"] and got[:2] == [["ranks", "runs", "steps"]] * 2 and got[2] == ["steps"]
    restart = pa.table({"run_id": ["a"], "rank": pa.array([0], pa.int32()), "ts": [1.0], "kind": ["run_started"],
                        "data": ['{"restart": 1}'], "attempt": pa.array([1], pa.int32())})
    runner.run_pass({"events": restart}, ["a"])
    assert reads == ["a", "a", "a"] and got[3] == ["events", "ranks", "runs"]


@pytest.mark.parametrize("large", [True, False])
def test_a_costly_meta_read_is_not_repeated_on_every_pass_until_its_cost_is_small_beside_the_time(large):
    """A large run's read of its meta rows (META_LARGE_RANKS ranks or more) that took
    META_COSTLY_S or more is not made again before META_COST_FACTOR times as long has passed;
    the passes between keep what the analysis has. A cheap read is made on every pass as
    before, a new round's meta is read at once, and a smaller run's on every pass however
    long it took."""
    from collector.live import detection

    clock = {"t": 100.0}
    cost = {"s": 0.2}
    reads: list[float] = []
    n = detection.META_LARGE_RANKS if large else detection.META_LARGE_RANKS - 1

    def meta(run_id):
        reads.append(clock["t"])
        clock["t"] += cost["s"]  # the read's own time, on the runner's clock
        return {"runs": pa.table({"run_id": [run_id], "world_size": [2 * n]}),  # half its ranks: never complete
                "ranks": pa.table({"run_id": [run_id] * n, "rank": list(range(n))})}

    got = []
    analysis = StandIn(lambda state, frames, now: got.append("ranks" in frames.tables()) or [])
    runner = DetectionRunner(Subscription("c"), analysis, submit=lambda *a, **k: None, meta=meta,
                             monotonic=lambda: clock["t"])
    steps = {"steps": pa.table({"run_id": ["a"], "step": [1]})}
    wait_s = detection.META_COST_FACTOR * cost["s"]
    if not large:
        for _ in range(4):
            runner.run_pass(steps, ["a"])
        assert len(reads) == 4 and got == [True] * 4
        return
    runner.run_pass(steps, ["a"])
    for _ in range(3):  # within the wait: no read
        clock["t"] += wait_s / 4
        runner.run_pass(steps, ["a"])
    assert len(reads) == 1 and got == [True, False, False, False]
    clock["t"] = reads[0] + wait_s + 0.01  # the wait is over
    runner.run_pass(steps, ["a"])
    assert len(reads) == 2 and got[-1] is True
    cost["s"] = detection.META_COSTLY_S / 10  # cheap now (the last read was costly: its wait first)
    clock["t"] = reads[1] + wait_s + 0.01
    for _ in range(3):
        runner.run_pass(steps, ["a"])
    assert len(reads) == 5 and got[-3:] == [True, True, True]
    cost["s"] = 0.2
    runner.run_pass(steps, ["a"])  # costly again: the next pass waits ...
    runner.run_pass(steps, ["a"])
    assert len(reads) == 6 and got[-1] is False
    restart = pa.table({"run_id": ["a"], "rank": pa.array([0], pa.int32()), "ts": [1.0], "kind": ["run_started"],
                        "data": ['{"restart": 1}'], "attempt": pa.array([1], pa.int32())})
    runner.run_pass({"events": restart}, ["a"])  # ... but not a new round's
    assert len(reads) == 7 and got[-1] is True


def test_checkpoints_are_marked_known_good_when_the_watermark_passes_one_not_at_every_move():
    """The first watermark marks what is at or below it (checkpoints reported before this
    collector started); after that a move writes only when it passes a checkpoint reported
    since, however late its report came; an older attempt's report is never due."""
    from collector.live.watermark import Watermarks

    marks: list[tuple[str, int, int]] = []
    analysis = StandIn(lambda state, frames, now: [])
    runner = DetectionRunner(Subscription("k"), analysis, submit=lambda *a, **k: None,
                             watermarks=Watermarks(hold_for_policy=False),
                             mark_known_good=lambda run_id, attempt, step: marks.append((run_id, attempt, step)))

    def at(step: int, *saved: tuple[int, int]) -> None:
        analysis.runs.setdefault("a", {"run_id": "a"})["clean_through"] = (1, step, step)
        tables = {"steps": pa.table({"run_id": ["a"], "step": [step]})}
        if saved:
            n = len(saved)
            tables["events"] = pa.table({"run_id": ["a"] * n, "rank": pa.array([0] * n, pa.int32()), "ts": [1.0] * n,
                                         "kind": ["checkpoint_saved"] * n, "data": ["{}"] * n,
                                         "attempt": pa.array([a for a, _ in saved], pa.int32()),
                                         "step": pa.array([s for _, s in saved], pa.int64())})
        runner.run_pass(tables, ["a"])

    at(3)
    assert marks == [("a", 1, 3)]  # the first
    at(4)
    at(5, (1, 8))  # reported ahead of the watermark
    at(7)
    assert marks == [("a", 1, 3)]
    at(9)  # passes step 8
    assert marks[1:] == [("a", 1, 9)]
    at(10, (1, 6), (0, 2))  # a report that came after the watermark passed its step; an old attempt's
    assert marks[2:] == [("a", 1, 10)]
    at(11)
    at(12)
    assert marks[3:] == []  # nothing reported since: no write


def test_wait_detected_returns_once_every_acknowledged_batch_was_judged_and_its_findings_stored(fast_settings):
    """The end of a run asks for the verdict on everything stored: `wait_detected` holds
    until the pass over the last commit ran and its findings are in the incidents table
    (no poll after it), and says False when its bound runs out first."""
    release = threading.Event()

    def judge(state, frames, now):
        if frames.steps is None:
            return []
        release.wait(30)  # the pass is slow until the test lets it go (bounded)
        return slow_rank(state, frames, now)

    storage = Storage(fast_settings, analyzer=StandIn(judge), detection_tick_s=60.0)
    try:
        storage.ingest_blocking(decode(steps_batch(1, 0, step_s=2.0)))  # acknowledged: its pass is stuck
        assert storage.wait_detected(0.2) is False
        assert storage.read(queries.incidents, "run1") == []
        release.set()
        assert storage.wait_detected(10.0) is True
        assert [(i["kind"], i["rank"]) for i in storage.read(queries.incidents, "run1")] == [("straggler", 1)]
    finally:
        storage.close()


def test_wait_detected_without_detection_returns_at_once(tmp_path):
    storage = Storage(Settings(db_path=tmp_path / "n.duckdb"))
    try:
        assert storage.wait_detected(0.0) is True
    finally:
        storage.close()


def test_a_runner_behind_the_writer_takes_the_queued_commits_in_one_pass():
    passes: list[list[int]] = []
    release = threading.Event()

    def recording(state, frames, now):
        if frames.steps is not None:
            passes.append(frames.steps["step"].to_list())
            release.wait(10)  # the first pass holds the runner while more commits queue
        return []

    sub = Subscription("m")
    runner = DetectionRunner(sub, StandIn(recording), submit=lambda *a, **k: None, tick_s=60.0)
    table = lambda step: {"steps": pa.table({"run_id": ["a"], "step": np.array([step])})}  # noqa: E731
    sub.offer(Commit(seq=1, commit_ts=0.0, run_ids=frozenset({"a"}), tables=table(1)))
    runner.start()
    try:
        assert wait_until(lambda: len(passes) == 1)
        for seq in range(2, 13):  # 11 commits while the pass runs
            sub.offer(Commit(seq=seq, commit_ts=0.0, run_ids=frozenset({"a"}), tables=table(seq)))
        release.set()
        assert runner.wait_caught_up(12, timeout_s=30)
    finally:
        runner.stop()
    assert passes == [[1], list(range(2, 10)), [10, 11, 12]]  # at most MAX_MERGED_COMMITS (8) a pass
    assert runner.num_gaps == 0
