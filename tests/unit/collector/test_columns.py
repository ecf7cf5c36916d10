"""Group assembly: many batches -> one Arrow table per table, strings intact."""

from __future__ import annotations

import numpy as np

from agent import wire
from collector.ingest import columns as cols
from collector.ingest.decode import decode
from tests.unit.collector.collector_batches import columns, make_batch, steps_section


def coll_batch(rank: int, ops: list[str], code: int) -> bytes:
    return make_batch(rank=rank, batch_seq=rank, dicts={"op": ops, "axis": ["dp", "tp"]},
                      sections={wire.COLLECTIVE: (2, columns(wire.COLLECTIVE, 2, op=code, axis=[0, 1], seq=[rank, rank]))})


def test_dictionaries_that_agree_extend_or_disagree():
    batches = [decode(coll_batch(r, ops, code)) for r, (ops, code) in
               enumerate([(["a"], 0), (["a", "b"], 1), (["a", "b", "c"], 2), (["c", "a"], 0), (["a"], 0)])]
    table = cols.section_table(wire.COLLECTIVE, batches)
    assert table.column("op").to_pylist() == ["a", "a", "b", "b", "c", "c", "c", "c", "a", "a"]
    assert table.column("axis").to_pylist() == ["dp", "tp"] * 5
    assert table.column("rank").to_pylist() == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4]
    assert table.column("seq").to_pylist() == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4]
    assert table.column("run_id").to_pylist() == ["run1"] * 10


def test_single_batch_columns_are_not_copied():
    body = make_batch(sections={wire.STEP: steps_section([5, 6], loss=[1.5, 2.5])})
    batch = decode(body)
    table = cols.section_table(wire.STEP, [batch])
    assert table.column("loss").to_pylist() == [1.5, 2.5]
    loss_buffer = table.column("loss").chunk(0).buffers()[1]
    body_address = np.frombuffer(body, np.uint8).ctypes.data
    assert body_address <= loss_buffer.address < body_address + len(body)  # points into the request body


def test_events_and_batches_tables():
    b = decode(make_batch(rank=2, batch_seq=3, events=[{"ts": 1.0, "kind": "k", "data": {"a": 1}}],
                          sections={wire.STEP: steps_section([1])}))
    assert cols.events_table([b]).to_pylist() == [
        {"run_id": "run1", "rank": 2, "ts": 1.0, "step": None, "attempt": None, "kind": "k", "data": '{"a":1}'}]
    assert cols.batches_table([b], 9.0).to_pylist() == [
        {"run_id": "run1", "rank": 2, "incarnation": "inc0", "batch_seq": 3, "received_ts": 9.0, "rows": 2,
         "content_hash": b.content_hash}]
    assert len(b.content_hash) == 16
    assert cols.section_table(wire.SCALAR, [b]) is None
