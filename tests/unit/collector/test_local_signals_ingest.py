"""The local signals end to end: an agent's batch -> decode -> Arrow -> DuckDB rows,
"not measured" as NULL; batches of the previous layout (an old agent, an old
spool) still decode, their new columns NULL; the launcher's rank -1 batches."""

from __future__ import annotations

import json
import math
import socket
import struct

import duckdb
import numpy as np
import pytest

from agent import Agent, AgentConfig, wire
from agent.spool import Spool
from collector.ingest import columns as cols
from collector.ingest.decode import BatchRejected, decode
from collector.store.schema import migrate

# The layout before the local signals, frozen here: what an older agent sent.
OLD_STEP = [("step", "q"), ("attempt", "i"), ("ts", "d"), ("loss", "d"), ("grad_norm", "d"), ("loss_scale", "d"),
            ("lr", "d"), ("tokens", "q"), ("step_s", "d"), ("fwd_s", "d"), ("bwd_s", "d"), ("opt_s", "d"),
            ("data_s", "d"), ("comm_exposed_s", "d"), ("mem_bytes", "q"), ("skipped", "b")]
OLD_HEARTBEAT = [("ts", "d"), ("step", "q"), ("phase", "h"), ("last_seq", "q")]
NEW_STEP = ["local_loss", "finite_fwd", "finite_bwd", "sample_epoch", "sample_from", "sample_to"]
NEW_HEARTBEAT = ["last_op", "last_axis", "last_group_id", "last_group_seq"]


def old_layout_batch(rank: int, steps: list[int], *, batch_seq: int = 0) -> bytes:
    """Bytes exactly as the previous agent framed them (written out here, not by encode_batch)."""
    n = len(steps)
    values = {"step": {"step": steps, "attempt": [0] * n, "ts": [100.0 + s for s in steps], "loss": [2.0] * n,
                       "skipped": [0] * n},
              "heartbeat": {"ts": [150.0], "step": [steps[-1]], "phase": [0], "last_seq": [9]}}
    area, layout = b"", {}
    sections = {"step": (n, OLD_STEP), "heartbeat": (1, OLD_HEARTBEAT)}
    for kind, (rows, spec) in sections.items():
        layout[kind] = {"n": rows, "columns": {}}
        for name, fmt in spec:
            given = values[kind].get(name, [1] * rows if fmt in "qibh" else [0.5] * rows)
            data = struct.pack(f"<{rows}{fmt}", *given)
            layout[kind]["columns"][name] = [len(area), len(data)]
            area += data + bytes((-len(data)) % 8)
    header = json.dumps({"run_id": "r", "rank": rank, "incarnation": "old", "batch_seq": batch_seq, "node": "n0",
                         "pid": 1, "sent_ts": 1.0, "dicts": {"phase": ["train"]}, "events": [],
                         "sections": layout}).encode()
    return struct.pack("<4sI", b"LWB1", len(header)) + header + bytes((-(8 + len(header))) % 8) + area


def store(*bodies: bytes) -> duckdb.DuckDBPyConnection:
    """Decode `bodies` as one group and insert its tables by name, as the writer does."""
    con = duckdb.connect()
    migrate(con)
    for name, table in cols.ingest_tables([decode(b) for b in bodies]).items():
        con.register("__t", table)
        con.execute(f"INSERT INTO {name} BY NAME SELECT * FROM __t")
        con.unregister("__t")
    return con


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def agent_batch(tmp_path):
    """The bytes of one batch a real Agent encoded (its collector away: read from its spool)."""
    cfg = AgentConfig(url=f"http://127.0.0.1:{_closed_port()}", spool_dir=str(tmp_path), capacity=16, timeout_s=0.5)
    agent = Agent(cfg, run_id="r", rank=5, node="n1")
    entered = iter([(41, "all_reduce", "dp", 4, 7), (-1, None, None, -1, -1)])
    agent.bind_seq_source(lambda: next(entered))
    agent.collective(1, 41, 7, "all_reduce", "dp", 4, -1, 64, 1.0, 0.1, 0.05)
    step = dict(loss=2.5, grad_norm=1.0, loss_scale=1.0, lr=1e-3, tokens=64, step_s=0.1, fwd_s=0.03, bwd_s=0.04,
                opt_s=0.01, data_s=0.0, comm_exposed_s=0.0, mem_bytes=1, skipped=False)
    agent.record_step(1, **step, local_loss=2.25, finite_fwd=1, finite_bwd=1, sample_epoch=0, sample_from=8,
                      sample_to=12)
    agent.record_step(2, **{**step, "loss": math.nan, "grad_norm": math.nan, "skipped": True}, local_loss=math.nan,
                      finite_fwd=0, finite_bwd=0, sample_epoch=0, sample_from=24, sample_to=28)
    agent.record_step(3, **{**step, "loss": 2.4})  # nothing measured
    agent.flush(0.5)
    agent._next_hb = 0.0  # a second heartbeat now: the seq source's "nothing entered yet" answer
    agent.flush(0.5)
    agent.close(timeout_s=0.5)
    spool = Spool(str(tmp_path), max_bytes=1 << 30)
    bodies = []
    while (payload := spool.peek()) is not None:
        bodies.append(bytes(payload))
        spool.pop()
    spool.close()
    return bodies


def test_local_signals_reach_the_tables_and_not_measured_is_null(agent_batch):
    con = store(*agent_batch)
    rows = con.execute(f"SELECT step, {', '.join(NEW_STEP)} FROM steps ORDER BY step").fetchall()
    assert rows[0] == (1, 2.25, 1, 1, 0, 8, 12)
    assert math.isnan(rows[1][1]) and rows[1][2:] == (0, 0, 0, 24, 28)  # a NaN local loss stays NaN, not NULL
    assert rows[2] == (3, None, None, None, None, None, None)
    hbs = con.execute(f"SELECT last_seq, {', '.join(NEW_HEARTBEAT)} FROM heartbeats ORDER BY ts").fetchall()
    assert hbs == [(41, "all_reduce", "dp", 4, 7), (-1, None, None, None, None)]
    # the wire-only validity column is no table column
    assert "local_loss_valid" not in [r[0] for r in con.execute("DESCRIBE steps").fetchall()]
    assert con.execute("SELECT count(*) FROM steps WHERE typeof(finite_fwd) = 'TINYINT'").fetchone() == (3,)


def test_batches_of_the_previous_layout_decode_with_the_new_columns_null(agent_batch):
    old = old_layout_batch(rank=1, steps=[7, 8])
    batch = decode(old)
    assert set(batch.sections["step"].views) == {name for name, _ in OLD_STEP}
    con = store(old, *agent_batch)  # one group: old rows and new rows side by side
    got = con.execute(f"SELECT rank, step, loss, {', '.join(NEW_STEP)} FROM steps WHERE rank = 1 ORDER BY step")
    assert got.fetchall() == [(1, 7, 2.0, None, None, None, None, None, None),
                              (1, 8, 2.0, None, None, None, None, None, None)]
    assert con.execute("SELECT count(*) FROM steps WHERE rank = 5 AND sample_from IS NOT NULL").fetchone() == (2,)
    hb = con.execute(f"SELECT phase, last_seq, {', '.join(NEW_HEARTBEAT)} FROM heartbeats WHERE rank = 1")
    assert hb.fetchall() == [("train", 9, None, None, None, None)]
    alone = store(old)  # a group of old batches only
    nulls = alone.execute("SELECT count(*) FROM steps WHERE local_loss IS NULL AND finite_fwd IS NULL").fetchone()
    assert nulls == (2,)


def test_a_null_code_is_minus_one_and_only_for_the_columns_that_allow_it():
    hb = {c.name: np.zeros(1, c.numpy_dtype).tobytes() for c in wire.SCHEMA[wire.HEARTBEAT]}
    header = {"run_id": "r", "rank": 0, "incarnation": "i", "batch_seq": 0, "dicts": {"phase": ["x"], "op": ["a"]}}
    ok = dict(hb, last_op=np.array([-1], "<i2").tobytes(), last_axis=np.array([-1], "<i2").tobytes())
    assert decode(wire.encode_batch(header, {wire.HEARTBEAT: (1, ok)})).sections[wire.HEARTBEAT].n == 1
    with pytest.raises(BatchRejected, match="heartbeat.phase: code -1 outside its dictionary of 1"):
        decode(wire.encode_batch(header, {wire.HEARTBEAT: (1, dict(ok, phase=np.array([-1], "<i2").tobytes()))}))
    with pytest.raises(BatchRejected, match="heartbeat.last_op: code -2 outside"):
        decode(wire.encode_batch(header, {wire.HEARTBEAT: (1, dict(ok, last_op=np.array([-2], "<i2").tobytes()))}))
    with pytest.raises(BatchRejected, match="heartbeat.last_axis: code 0 outside its dictionary of 0"):
        decode(wire.encode_batch(header, {wire.HEARTBEAT: (1, dict(ok, last_axis=bytes(2)))}))


def test_the_launchers_batches_are_events_only_and_make_no_ranks_row():
    header = {"run_id": "r", "rank": wire.LAUNCHER_RANK, "incarnation": "launcher", "batch_seq": 0,
              "events": [{"ts": 5.0, "step": -1, "kind": "rank_exited",
                          "data": {"rank": 1, "exit_code": 17, "signal": None, "cause": "exited"}}]}
    b = decode(wire.encode_batch(header, {}))
    assert cols.events_table([b]).to_pylist()[0]["rank"] == -1
    assert cols.ranks_table([b], {}, 1.0).num_rows == 0
    steps = {c.name: np.zeros(1, c.numpy_dtype).tobytes() for c in wire.SCHEMA[wire.STEP]}
    with pytest.raises(BatchRejected, match="the launcher"):
        decode(wire.encode_batch(header, {wire.STEP: (1, steps)}))
    with pytest.raises(BatchRejected, match="rank must be >= 0"):
        decode(wire.encode_batch({**header, "rank": -2}, {}))


def _spooled_bodies(tmp_path, record) -> list[bytes]:
    """The batches a real Agent encoded for `record(agent)` (its collector away: from its spool)."""
    clock = iter(100.0 + 0.5 * i for i in range(1000))
    cfg = AgentConfig(url=f"http://127.0.0.1:{_closed_port()}", spool_dir=str(tmp_path), capacity=16, timeout_s=0.5)
    agent = Agent(cfg, run_id="r", rank=0, node="n1", clock=lambda: next(clock))
    record(agent)
    agent.close(timeout_s=0.5)
    spool = Spool(str(tmp_path), max_bytes=1 << 30)
    bodies = []
    while (payload := spool.peek()) is not None:
        bodies.append(bytes(payload))
        spool.pop()
    spool.close()
    return bodies


MEASURED = ["loss", "grad_norm", "loss_scale", "lr", "tokens", "step_s", "fwd_s", "bwd_s", "opt_s", "data_s",
            "comm_exposed_s", "mem_bytes"]


def test_step_values_not_given_are_null_in_the_tables_and_a_nan_loss_stays_nan(tmp_path):
    def record(agent):
        agent.record_step(1, loss=2.5)
        agent.record_step(2, loss=math.nan, lr=1e-3)
        agent.record_step(3, grad_norm=0.5, tokens=64, mem_bytes=0)

    full = old_layout_batch(rank=1, steps=[1])  # every value given (0.5, 1): none of it NULL
    con = store(*_spooled_bodies(tmp_path, record), full)
    got = {r[0]: dict(zip(MEASURED, r[1:])) for r in con.execute(
        f"SELECT step, {', '.join(MEASURED)} FROM steps WHERE rank = 0 ORDER BY step").fetchall()}
    assert got[1] == {**dict.fromkeys(MEASURED), "loss": 2.5}  # step_s: the first call has no previous one
    assert math.isnan(got[2].pop("loss"))  # measured NaN: the NaN detector's finding, not "not measured"
    assert got[2] == {**dict.fromkeys(MEASURED[1:]), "lr": 1e-3, "step_s": 0.5}  # step_s from the agent's clock
    assert got[3] == {**dict.fromkeys(MEASURED), "grad_norm": 0.5, "tokens": 64, "mem_bytes": 0, "step_s": 0.5}
    nulls = con.execute(f"SELECT {', '.join(f'count({c})' for c in MEASURED)} FROM steps WHERE rank = 1").fetchone()
    assert nulls == (1,) * len(MEASURED)
