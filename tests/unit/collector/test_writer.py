"""The writer thread: group commit, isolation of a bad batch, back-pressure."""

from __future__ import annotations

import threading
from concurrent.futures import Future

import pytest

from agent import wire
from collector.decode import BatchRejected, decode
from collector.settings import Settings
from collector.storage import Storage
from collector.writer import QueueFull, StorageError
from tests.unit.collector.collector_batches import make_batch, steps_section


def hold_writer(storage: Storage) -> threading.Event:
    """Occupy the writer thread until the returned event is set, so that what is
    submitted meanwhile lands in one group."""
    release, started = threading.Event(), threading.Event()

    def block(ctx) -> None:
        started.set()
        release.wait(10)

    storage.write(block)
    started.wait(10)
    return release


def test_queued_batches_share_one_commit(storage):
    release = hold_writer(storage)
    futures = []
    for rank in range(5):
        f = Future()
        storage._writer.submit_batch(decode(make_batch(rank=rank, sections={wire.STEP: steps_section([1])})), f)
        futures.append(f)
    assert storage.queue_depth() == 5
    release.set()
    assert [f.result(10).accepted for f in futures] == [1] * 5
    sample = storage.metrics.registry.get_sample_value
    assert sample("llmwatch_collector_group_requests_count") == 1
    assert sample("llmwatch_collector_group_requests_sum") == 5


def test_a_batch_the_database_refuses_fails_alone(storage):
    release = hold_writer(storage)
    good = [decode(make_batch(rank=r, sections={wire.STEP: steps_section([1])})) for r in (0, 1)]
    bad = decode(make_batch(rank=2, sections={wire.STEP: steps_section([1])}))
    bad.rank = 2**40  # past INTEGER: only possible by bypassing decode's checks
    futures = [Future(), Future(), Future()]
    for batch, f in zip([good[0], bad, good[1]], futures):
        storage._writer.submit_batch(batch, f)
    release.set()
    assert futures[0].result(10).accepted == 1 and futures[2].result(10).accepted == 1
    with pytest.raises(StorageError) as info:
        futures[1].result(10)
    assert info.value.status == 422 and "could not be stored" in str(info.value)
    with storage.cursor() as cur:
        assert cur.execute("SELECT rank FROM steps ORDER BY rank").fetchall() == [(0,), (1,)]
        assert cur.execute("SELECT count(*) FROM batches").fetchall() == [(2,)]


def test_back_pressure_when_the_queue_is_full(tmp_path):
    storage = Storage(Settings(db_path=tmp_path / "q.duckdb", queue_max_bytes=1000, group_linger_s=0.0))
    try:
        release = hold_writer(storage)
        body = decode(make_batch(sections={wire.STEP: steps_section(range(20))}))
        assert body.nbytes > 500
        first = Future()
        storage._writer.submit_batch(body, first)  # an empty queue takes any one batch
        with pytest.raises(QueueFull):
            storage._writer.submit_batch(decode(make_batch(batch_seq=1)), Future())
        release.set()
        assert first.result(10).accepted == 20
    finally:
        storage.close()


def steps_batch(steps, **header) -> bytes:
    return make_batch(sections={wire.STEP: steps_section(steps)}, **header)


def sample(storage: Storage, name: str, **labels) -> float:
    return storage.metrics.registry.get_sample_value(name, labels) or 0.0


def test_the_same_key_with_other_content_is_a_409_the_same_bytes_a_duplicate(storage):
    first, other = steps_batch([1, 2]), steps_batch([7, 8, 9])
    assert storage.ingest_blocking(decode(first)).accepted == 2
    again = storage.ingest_blocking(decode(first))  # a retry or a spool replay: the same bytes
    assert again.duplicate and again.accepted == 0
    with pytest.raises(BatchRejected) as info:
        storage.ingest_blocking(decode(other))
    assert info.value.status == 409
    assert "batch_seq=0) is already stored with other content" in str(info.value)
    with storage.cursor() as cur:
        assert cur.execute("SELECT step FROM steps ORDER BY step").fetchall() == [(1,), (2,)]
        (digest,), = cur.execute("SELECT content_hash FROM batches").fetchall()
    assert digest == decode(first).content_hash
    assert sample(storage, "llmwatch_collector_duplicate_batches_total") == 1
    assert sample(storage, "llmwatch_collector_conflicting_batches_total") == 1


def test_copies_inside_one_group_commit_are_compared_in_memory(storage):
    release = hold_writer(storage)
    bodies = [steps_batch([1]), steps_batch([1]), steps_batch([5]), steps_batch([1], batch_seq=1)]
    futures = [Future() for _ in bodies]
    for body, f in zip(bodies, futures):
        storage._writer.submit_batch(decode(body), f)
    release.set()
    assert futures[0].result(10).accepted == 1 and futures[3].result(10).accepted == 1
    assert futures[1].result(10).duplicate
    with pytest.raises(BatchRejected) as info:
        futures[2].result(10)
    assert info.value.status == 409
    assert sample(storage, "llmwatch_collector_group_requests_count") == 1  # one group, no retry alone
    with storage.cursor() as cur:
        assert cur.execute("SELECT count(*) FROM steps").fetchall() == [(2,)]


def test_many_stored_repeats_cost_one_lookup(storage, monkeypatch):
    bodies = [steps_batch([s], batch_seq=s) for s in range(20)]
    release = hold_writer(storage)
    stored = [Future() for _ in bodies]
    for body, f in zip(bodies, stored):
        storage._writer.submit_batch(decode(body), f)
    release.set()
    assert [f.result(10).accepted for f in stored] == [1] * 20
    calls = []
    lookup = storage._writer._stored_hashes
    monkeypatch.setattr(storage._writer, "_stored_hashes", lambda keys: calls.append(len(keys)) or lookup(keys))
    release = hold_writer(storage)
    futures = [Future() for _ in range(21)]
    for body, f in zip(bodies + [steps_batch([99], batch_seq=3)], futures):
        storage._writer.submit_batch(decode(body), f)
    release.set()
    assert all(f.result(10).duplicate for f in futures[:20])
    with pytest.raises(BatchRejected):
        futures[20].result(10)
    assert calls == [20]  # one query for the whole group's repeats
