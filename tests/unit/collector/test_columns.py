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


def _rows(table):
    """A table's rows with NaN as a string, so that equal tables compare equal."""
    return [{k: "NaN" if isinstance(v, float) and v != v else v for k, v in row.items()} for row in table.to_pylist()]


def test_a_group_s_table_is_its_batches_tables_one_after_another():
    """Whatever the group: batches with the same columns (transposed at once), some from an older
    agent without the optional columns (one by one), NULLs, dictionaries that agree, extend or
    disagree, sizes from 1 row up. Each kind's group table holds each batch's own rows in order."""
    rng = np.random.default_rng(7)
    ops = ["all_reduce", "all_gather", "send", "recv"]
    for trial in range(40):
        bodies = []
        old_agent = trial % 3 == 0
        for rank in range(int(rng.integers(1, 9))):
            n = int(rng.integers(1, 5)) if trial % 2 else 3
            given = {"loss": np.where(rng.random(n) < 0.3, wire.NULL_F64, rng.normal(size=n)),
                     "tokens": np.where(rng.random(n) < 0.3, wire.NOT_MEASURED, 64)}
            step = columns(wire.STEP, n, step=np.arange(n) + 10 * rank, **given)
            beat = columns(wire.HEARTBEAT, 1, last_op=int(rng.integers(-1, 2)), last_axis=0)
            summ = columns(wire.COLLECTIVE_SUMMARY, 2, op=[0, 1], axis=[1, 0],
                           wait_s=[wire.NULL_F64, 0.5])
            if old_agent and rank % 2:  # an older agent: no optional column at all
                step = {k: v for k, v in step.items() if not cols._COLUMNS[wire.STEP][k].optional}
                beat = {k: v for k, v in beat.items() if not cols._COLUMNS[wire.HEARTBEAT][k].optional}
            if trial % 4 == 1:  # dictionaries as long as the group's, some in another order
                op_dict = [ops[i] for i in rng.permutation(3)]
            else:  # a prefix, or longer; one rank's in another order
                op_dict = (ops if rank % 4 != 3 else ops[::-1])[:2 + rank % 3]
            dicts = {"op": op_dict, "axis": ["dp", "tp"], "phase": ["forward", "backward"], "name": []}
            bodies.append(make_batch(rank=rank, batch_seq=rank, dicts=dicts, sections={
                wire.STEP: (n, step), wire.HEARTBEAT: (1, beat), wire.COLLECTIVE_SUMMARY: (2, summ)}))
        batches = [decode(b) for b in bodies]
        for kind in (wire.STEP, wire.HEARTBEAT, wire.COLLECTIVE_SUMMARY):
            group = cols.section_table(kind, batches)
            alone = [row for b in batches for row in _rows(cols.section_table(kind, [b]))]
            assert _rows(group) == alone, (trial, kind)
