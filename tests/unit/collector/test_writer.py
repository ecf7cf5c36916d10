"""The writer thread: group commit, isolation of a bad batch, back-pressure, and the
engine's contract with its projections (plan, write, apply; intents answered)."""

from __future__ import annotations

import threading
from concurrent.futures import Future

import pytest

from agent import wire
from collector.ingest.decode import BatchRejected, decode
from collector.settings import Settings, WriterSettings
from collector.storage import Storage
from collector.store.projection import Group, Projection
from collector.store.writer import QueueFull, StorageError
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
    storage = Storage(Settings(db_path=tmp_path / "q.duckdb",
                               writer=WriterSettings(queue_max_bytes=1000, linger_s=0.0)))
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
    admission = storage._writer.admission
    lookup = admission._stored_hashes
    monkeypatch.setattr(admission, "_stored_hashes", lambda keys: calls.append(len(keys)) or lookup(keys))
    release = hold_writer(storage)
    futures = [Future() for _ in range(21)]
    for body, f in zip(bodies + [steps_batch([99], batch_seq=3)], futures):
        storage._writer.submit_batch(decode(body), f)
    release.set()
    assert all(f.result(10).duplicate for f in futures[:20])
    with pytest.raises(BatchRejected):
        futures[20].result(10)
    assert calls == [20]  # one query for the whole group's repeats


# -- the engine: projections and intents -------------------------------------------
class Notes(Projection):
    """A projection the engine has never heard of: it stores intents as events and
    keeps what the table holds in memory, as the real ones do."""

    name = "notes"

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.stored: list[str] = []

    def plan(self, group: Group) -> list[str]:
        self.calls.append("plan")
        return list(group.intents.get(self.name, []))

    def write(self, con, plan: list[str], group: Group) -> None:
        self.calls.append("write")
        for note in plan:
            if note == "boom":
                raise RuntimeError("this note cannot be stored")
            con.execute("INSERT INTO events (run_id, rank, ts, kind) VALUES ('notes', 0, ?, ?)", [group.now, note])

    def apply(self, plan: list[str], group: Group) -> None:
        self.calls.append("apply")
        self.stored.extend(plan)

    def results(self, plan: list[str]) -> list:
        return [f"noted {n}" for n in plan]


@pytest.fixture
def noted(settings):
    notes = Notes()
    storage = Storage(settings, extra_projections=[notes])
    yield storage, notes
    storage.close()


def test_an_added_projection_plans_writes_and_applies_in_the_group(noted):
    storage, notes = noted
    release = hold_writer(storage)
    batch, note = Future(), storage._writer.submit_intent("notes", "hello")
    storage._writer.submit_batch(decode(steps_batch([1, 2])), batch)
    release.set()
    assert note.result(10) == "noted hello" and batch.result(10).accepted == 2
    assert notes.calls == ["plan", "write", "apply"]  # one group: the intent and the batch together
    assert notes.stored == ["hello"]
    assert sample(storage, "llmwatch_collector_group_requests_count") == 1
    with storage.cursor() as cur:
        assert cur.execute("SELECT kind FROM events WHERE run_id = 'notes'").fetchall() == [("hello",)]


def test_a_failed_group_applies_nothing_and_retries_each_job_alone(noted):
    storage, notes = noted
    release = hold_writer(storage)
    boom, batch = storage._writer.submit_intent("notes", "boom"), Future()
    storage._writer.submit_batch(decode(steps_batch([1])), batch)
    release.set()
    with pytest.raises(RuntimeError, match="cannot be stored"):
        boom.result(10)  # the intent's own error, not a StorageError
    assert batch.result(10).accepted == 1
    # the group, then each alone: the batch's retry applied, the failures did not
    assert notes.calls.count("plan") == 3 and notes.calls.count("apply") == 1
    assert notes.stored == []
    with storage.cursor() as cur:
        assert cur.execute("SELECT count(*) FROM steps").fetchall() == [(1,)]
        assert cur.execute("SELECT count(*) FROM events WHERE run_id = 'notes'").fetchall() == [(0,)]


def test_the_ranks_of_one_flush_share_a_commit_though_they_come_some_ms_apart(tmp_path):
    """The ranks flush in the same instant (agent/agent.py), but each one's batch reaches the
    writer some ms after the last (each rank's flusher shares a CPU with its training): a
    small group waits `linger_s` for them, past `gap_s`, and they share one commit."""
    storage = Storage(Settings(db_path=tmp_path / "f.duckdb",
                               writer=WriterSettings(min_interval_s=0.0, linger_s=1.0, gap_s=0.005)))
    try:
        futures = []
        for rank in range(3):
            f: Future = Future()
            storage._writer.submit_batch(decode(make_batch(rank=rank, sections={wire.STEP: steps_section([1])})), f)
            futures.append(f)
            threading.Event().wait(0.03)  # 30 ms apart: six gaps
        assert [f.result(10).accepted for f in futures] == [1] * 3
        sample = storage.metrics.registry.get_sample_value
        assert sample("llmwatch_collector_group_requests_count") == 1
    finally:
        storage.close()


def test_an_intent_does_not_wait_for_the_small_group_interval(tmp_path):
    storage = Storage(Settings(db_path=tmp_path / "i.duckdb",
                               writer=WriterSettings(min_interval_s=30.0, linger_s=0.05)),
                      extra_projections=[Notes()])
    try:
        storage.ingest_blocking(decode(steps_batch([1])))  # the first group commits at once
        assert storage._writer.submit_intent("notes", "now").result(10) == "noted now"  # not 30 s later
    finally:
        storage.close()


@pytest.mark.parametrize("kind", ["agent_closed", "rank_exited"])
def test_a_closing_batch_does_not_wait_for_the_small_group_interval(tmp_path, kind):
    """An agent's last flush and the launcher's exit reports: their senders wait on the ack to
    exit, so a group holding one commits at once; any other small batch waits its turn."""
    storage = Storage(Settings(db_path=tmp_path / "c.duckdb",
                               writer=WriterSettings(min_interval_s=30.0, linger_s=0.05)))
    try:
        storage.ingest_blocking(decode(steps_batch([1])))  # the first group commits at once
        plain, closing = Future(), Future()
        storage._writer.submit_batch(decode(make_batch(batch_seq=1, sections={wire.STEP: steps_section([2])})),
                                     plain)
        event = {"ts": 2.0, "step": 2, "attempt": 0, "kind": kind, "data": {}}
        storage._writer.submit_batch(decode(make_batch(batch_seq=2, events=[event])), closing)
        assert closing.result(10).accepted == 1  # not 30 s later
        assert plain.result(10).accepted == 1  # it rode in the same group
    finally:
        storage.close()


def test_waiting_on_the_writer_thread_for_the_writer_raises_instead_of_hanging(noted):
    storage, _ = noted

    def on_writer(ctx):
        fut = storage._writer.submit_intent("notes", "later")
        with pytest.raises(RuntimeError, match="deadlock"):
            fut.result(1)
        return fut

    fut = storage.write(on_writer).result(10)
    assert fut.result(10) == "noted later"


def test_an_unknown_projection_is_refused_at_once(storage):
    with pytest.raises(ValueError, match="no projection"):
        storage._writer.submit_intent("nope", object())
