"""The writer thread: group commit, isolation of a bad batch, back-pressure."""

from __future__ import annotations

import threading
from concurrent.futures import Future

import pytest

from agent import wire
from collector.decode import decode
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
