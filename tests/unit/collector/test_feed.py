"""Post-commit subscribers: the committed tables handed over, a full queue drops
and says so, and the writer never waits for a subscriber."""

from __future__ import annotations

import threading
import time

import pyarrow as pa
import pytest

from agent import wire
from collector.ingest.decode import decode
from collector.settings import Settings, WriterSettings
from collector.storage import Storage
from collector.store.feed import Commit, Feed, Subscription, committed_tables, merged
from tests.unit.collector.collector_batches import columns, make_batch, steps_section


def commit(seq: int, nbytes: int = 8) -> Commit:
    return Commit(seq=seq, commit_ts=float(seq), run_ids=frozenset({"r"}),
                  tables={"steps": pa.table({"x": pa.array(bytes(nbytes), pa.uint8())})})


def test_a_full_queue_drops_and_the_next_delivery_says_how_many():
    sub = Subscription("s", max_commits=2)
    assert [sub.offer(commit(i)) for i in range(1, 6)] == [True, True, False, False, False]
    assert sub.num_dropped == 3
    first, second = sub.get(0), sub.get(0)
    assert (first.commit.seq, first.missed, second.commit.seq, second.missed) == (1, 0, 2, 0)
    gap = sub.get(0)  # the drops came after the last queued commit: a gap notice alone
    assert (gap.commit, gap.missed) == (None, 3)
    assert sub.get(0) is None
    sub.offer(commit(6))
    sub.offer(commit(7))
    sub.offer(commit(8))  # dropped
    sub.get(0), sub.get(0)
    sub.offer(commit(9))
    assert (d := sub.get(0)).commit.seq == 9 and d.missed == 1  # the gap rides on the next commit


def test_the_byte_bound_and_an_empty_queue_takes_any_one():
    sub = Subscription("s", max_commits=100, max_bytes=100)
    assert sub.offer(commit(1, nbytes=1000))  # bigger than the bound, but the queue was empty
    assert not sub.offer(commit(2, nbytes=8))
    sub.get(0)
    assert sub.offer(commit(3, nbytes=60)) and not sub.offer(commit(4, nbytes=60))


def test_close_wakes_a_waiting_get_and_refuses_offers():
    sub = Subscription("s")
    sub.offer(commit(1))
    sub.close()
    assert not sub.offer(commit(2))
    assert sub.get(5).commit.seq == 1  # what was queued is still read
    t0 = time.monotonic()
    assert sub.get(60) is None and time.monotonic() - t0 < 30  # woken, not timed out


def test_wake_ends_a_waiting_get_once_and_a_commit_still_comes_first():
    sub = Subscription("s")
    woke = threading.Timer(0.05, sub.wake)
    woke.start()
    t0 = time.monotonic()
    assert sub.get(60) is None and time.monotonic() - t0 < 30  # woken, not timed out
    woke.join()
    sub.wake()
    sub.offer(commit(1))
    assert sub.get(60).commit.seq == 1  # queued commits are delivered before the wake
    assert sub.get(60) is None  # then the wake, once
    t0 = time.monotonic()
    assert sub.get(0.05) is None and time.monotonic() - t0 >= 0.05  # and the next get waits again


def test_unsubscribe_and_drop_metric():
    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry()
    feed = Feed(registry)
    sub = feed.subscribe("slow", max_commits=1)
    for i in range(3):
        feed.publish(commit_ts=1.0, run_ids=frozenset({"r"}), tables=commit(i).tables)
    assert registry.get_sample_value("llmwatch_collector_subscriber_dropped_commits_total",
                                     {"subscriber": "slow"}) == 2
    feed.unsubscribe(sub)
    assert not feed.active and sub.closed


def test_prepared_tables_join_the_row_table_of_the_same_name():
    agent = pa.table({"run_id": pa.array(["a"]).dictionary_encode(), "value": [1.0]})
    otlp = pa.table({"run_id": ["b"], "value": [2.0], "attrs": ['{"k":1}']})
    got = committed_tables({"scalars": agent}, [("scalars", otlp)])
    assert got["scalars"].to_pylist() == [{"run_id": "a", "value": 1.0, "attrs": None},
                                          {"run_id": "b", "value": 2.0, "attrs": '{"k":1}'}]
    assert committed_tables({"steps": agent}, [])["steps"] is agent  # one part: passed on as it is


def test_subscribers_get_the_committed_tables_with_runs_and_time(tmp_path):
    clock = [1000.0]
    storage = Storage(Settings(db_path=tmp_path / "f.duckdb",
                               writer=WriterSettings(linger_s=0.0)), clock=lambda: clock[0])
    try:
        sub = storage.subscribe("test")
        hb = columns(wire.HEARTBEAT, 1, ts=12.0, step=5, phase=1, last_seq=11)
        body = make_batch(sections={wire.STEP: steps_section([1, 2]), wire.HEARTBEAT: (1, hb)},
                          events=[{"ts": 3.0, "kind": "restart", "data": {}}])
        storage.ingest_blocking(decode(body))
        d = sub.get(10)
        assert d.missed == 0 and d.commit.commit_ts == 1000.0 and d.commit.run_ids == {"run1"}
        assert sorted(d.commit.tables) == ["events", "heartbeats", "steps"]
        assert d.commit.tables["steps"].column("step").to_pylist() == [1, 2]
        assert d.commit.tables["steps"].column("run_id").to_pylist() == ["run1", "run1"]
        assert storage.ingest_blocking(decode(body)).duplicate  # nothing committed, nothing sent
        storage.open_incident("run1", "hang", "critical").result(10)  # no rows either
        assert sub.get(0.2) is None
    finally:
        storage.close()


def test_a_subscriber_that_never_reads_does_not_hold_the_writer(tmp_path):
    storage = Storage(Settings(db_path=tmp_path / "g.duckdb", writer=WriterSettings(linger_s=0.0, min_interval_s=0.0)))
    try:
        stuck = storage.subscribe("stuck", max_commits=2)
        t0 = time.monotonic()
        for seq in range(10):
            assert storage.ingest_blocking(decode(make_batch(batch_seq=seq, sections={
                wire.STEP: steps_section([seq])}))).accepted == 1
        assert time.monotonic() - t0 < 30  # generous: it takes ~50 ms; a wait would never end
        assert stuck.depth == 2 and stuck.num_dropped == 8
        assert storage.metrics.registry.get_sample_value(
            "llmwatch_collector_subscriber_dropped_commits_total", {"subscriber": "stuck"}) == 8
        assert [stuck.get(0).commit.seq, stuck.get(0).commit.seq] == [1, 2]
        assert stuck.get(0).missed == 8
    finally:
        storage.close()


@pytest.mark.parametrize("max_commits", [0, -1])
def test_a_subscription_holds_at_least_one(max_commits):
    with pytest.raises(ValueError):
        Subscription("s", max_commits=max_commits)


def test_take_queued_hands_over_what_is_queued_and_stops_before_a_gap():
    sub = Subscription("s", max_commits=3)
    for seq in (1, 2, 3, 4, 5):  # 4 and 5 dropped: the gap rides on the next commit offered
        sub.offer(commit(seq))
    assert sub.get(0).commit.seq == 1
    assert [c.seq for c in sub.take_queued(8)] == [2, 3]
    sub.offer(commit(6))
    sub.offer(commit(7))
    assert sub.take_queued(8) == []  # 6 comes after the gap: `get` reports it
    d = sub.get(0)
    assert (d.commit.seq, d.missed) == (6, 2)
    assert [c.seq for c in sub.take_queued(1)] == [7] and sub.take_queued(1) == [] and sub.depth == 0


def test_merged_commits_keep_every_row_in_commit_order_with_the_last_ones_seq():
    steps = lambda run, values: pa.table({"run_id": pa.array([run] * len(values)).dictionary_encode(),  # noqa: E731
                                          "step": pa.array(values, pa.int64())})
    first = Commit(seq=4, commit_ts=1.0, run_ids=frozenset({"a"}), tables={"steps": steps("a", [1, 2])})
    second = Commit(seq=5, commit_ts=2.0, run_ids=frozenset({"b"}),
                    tables={"steps": steps("b", [7]), "events": pa.table({"run_id": ["b"], "kind": ["restart"]})})
    m = merged([first, second])
    assert (m.seq, m.commit_ts, m.run_ids) == (5, 2.0, frozenset({"a", "b"}))
    assert m.tables["steps"].column("step").to_pylist() == [1, 2, 7]
    assert m.tables["steps"].column("run_id").to_pylist() == ["a", "a", "b"]  # differing dictionaries, decoded
    assert m.tables["events"].num_rows == 1
    assert merged([first]) is first
