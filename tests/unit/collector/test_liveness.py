"""ranks/runs upkeep: identity changes and drops at once, last-seen times per sweep."""

from __future__ import annotations

from agent import wire
from collector.ingest.decode import decode
from collector.storage import Storage
from tests.unit.collector.collector_batches import make_batch, steps_section


def ingest_at(storage, clock, ts, **kw):
    clock[0] = ts
    return storage.ingest_blocking(decode(make_batch(sections={wire.STEP: steps_section([kw.get("batch_seq", 0)])},
                                                     **kw)))


def rank_rows(storage):
    with storage.cursor() as cur:
        return cur.execute("SELECT rank, node, pid, first_seen_ts, last_seen_ts, agent_drops FROM ranks "
                           "ORDER BY rank").fetchall()


def run_updated(storage):
    with storage.cursor() as cur:
        return cur.execute("SELECT created_ts, updated_ts FROM runs").fetchall()


def test_new_ranks_at_once_last_seen_per_sweep(settings):
    clock = [100.0]
    storage = Storage(settings, clock=lambda: clock[0])
    try:
        ingest_at(storage, clock, 100.0, rank=0)
        assert rank_rows(storage) == [(0, "node0", 100, 100.0, 100.0, 0)]
        ingest_at(storage, clock, 100.5, rank=0, batch_seq=1)  # same identity, before the sweep
        assert rank_rows(storage)[0][4] == 100.0
        ingest_at(storage, clock, 101.0, rank=1)  # a new rank is written at once
        assert [r[0] for r in rank_rows(storage)] == [0, 1]
        ingest_at(storage, clock, 101.2, rank=0, batch_seq=2, stats={"dropped": {"step": 4}})
        assert rank_rows(storage)[0][5] == 4  # drops at once, exactly
        ingest_at(storage, clock, 101.4, rank=0, batch_seq=3, node="moved")
        assert rank_rows(storage)[0][1] == "moved"
        ingest_at(storage, clock, 102.5, rank=1, batch_seq=1)  # 2.5 s after the first sweep: sweep
        rows = rank_rows(storage)
        assert (rows[0][4], rows[1][4]) == (101.4, 102.5)
        assert run_updated(storage) == [(100.0, 102.5)]
    finally:
        storage.close()
