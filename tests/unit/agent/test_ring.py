"""The hot-path buffers: stores, swap, drops, dictionary encoding, slow path."""

import enum
import math
import struct

import pytest

from agent import wire
from agent.ring import BufferSet, Codes, Recorder

STEP = dict(loss=2.5, grad_norm=1.25, loss_scale=65536.0, lr=3e-4, tokens=4096, step_s=0.5, fwd_s=0.1, bwd_s=0.2,
            opt_s=0.05, data_s=0.01, comm_exposed_s=0.02, mem_bytes=123456789, skipped=True)
NULL_BITS = struct.pack("<q", wire.NULL_F64_BITS)


def is_null(x: float) -> bool:
    """`x` is the float NULL (not measured), not some other NaN."""
    return struct.pack("<d", x) == NULL_BITS


def _row(buf, i):
    return {c.name: col[i] for c, col in zip(wire.SCHEMA[buf.kind], buf.cols)}


def test_record_step_stores_every_column_in_schema_order():
    rec = Recorder(capacity=4, clock=lambda: 1000.5)
    rec.attempt = 2
    rec.record_step(7, **STEP)
    buf = rec._step_buf
    assert buf.n == 1
    assert _row(buf, 0) == {
        "step": 7, "attempt": 2, "ts": 1000.5, "loss": 2.5, "grad_norm": 1.25, "loss_scale": 65536.0,
        "lr": 3e-4, "tokens": 4096, "step_s": 0.5, "fwd_s": 0.1, "bwd_s": 0.2, "opt_s": 0.05, "data_s": 0.01,
        "comm_exposed_s": 0.02, "mem_bytes": 123456789, "skipped": 1,
        # the local signals, not given: "not measured" (NULL once decoded)
        "local_loss": 0.0, "local_loss_valid": 0, "finite_fwd": -1, "finite_bwd": -1, "sample_epoch": -1,
        "sample_from": -1, "sample_to": -1,
    }


def test_record_step_stores_the_local_signals_given_by_keyword():
    rec = Recorder(capacity=4, clock=lambda: 1000.5)
    rec.record_step(7, **STEP, local_loss=float("nan"), finite_fwd=0, finite_bwd=1, sample_epoch=2,
                    sample_from=40, sample_to=48)
    rec.record_step(7, **STEP, local_loss=3.25)
    row, second = _row(rec._step_buf, 0), _row(rec._step_buf, 1)
    assert math.isnan(row["local_loss"]) and row["local_loss_valid"] == 1  # NaN is a value, not "not measured"
    assert (row["finite_fwd"], row["finite_bwd"], row["sample_epoch"], row["sample_from"], row["sample_to"]) == (
        0, 1, 2, 40, 48)
    assert (second["local_loss"], second["local_loss_valid"], second["finite_fwd"]) == (3.25, 1, -1)


def test_collective_and_scalar_dictionary_encode_strings():
    rec = Recorder(capacity=8, clock=lambda: 5.0)
    rec.collective(1, 0, 0, "all_reduce", "dp", 0, -1, 1024, 10.0, 0.25, 0.125)
    rec.collective(1, 1, 0, "all_gather", "tp", 2, -1, 2048, 11.0, 0.5, 0.0)
    rec.collective(1, 2, 1, "all_reduce", "dp", 0, -1, 1024, 12.0, 0.25, 0.125)
    rec.record_scalar(3, "eval/loss", 1.5)
    rec.record_scalar(4, "eval/loss", 1.25)
    coll = rec._coll_buf
    op = coll.column("op")
    axis = coll.column("axis")
    assert list(op[:3]) == [0, 1, 0] and list(axis[:3]) == [0, 1, 0]
    assert rec._codes["op"].values == ["all_reduce", "all_gather"]
    assert rec._codes["axis"].values == ["dp", "tp"]
    assert _row(coll, 1) == {"step": 1, "attempt": 0, "seq": 1, "group_seq": 0, "op": 1, "axis": 1, "group_id": 2,
                             "peer": -1, "bytes": 2048, "start_ts": 11.0, "duration_s": 0.5, "wait_s": 0.0}
    assert list(rec._scalar_buf.column("name")[:2]) == [0, 0]
    assert list(rec._scalar_buf.column("value")[:2]) == [1.5, 1.25]


def test_codes_take_the_plain_value_of_str_enums_and_overflow_raises():
    class Axis(str, enum.Enum):
        DP = "dp"

    codes = Codes()
    assert codes[Axis.DP] == 0 and codes["dp"] == 0 and codes["tp"] == 1
    assert codes.values == ["dp", "tp"] and all(type(v) is str for v in codes.values)
    for i in range(wire.MAX_DICT_ENTRIES - 2):
        codes[f"s{i}"]
    with pytest.raises(OverflowError):
        codes["one too many"]


def test_full_buffer_drops_and_counts_without_raising():
    rec = Recorder(capacity=3)
    for step in range(5):
        rec.record_step(step, **STEP)
        rec.record_scalar(step, "x", 1.0)
    assert rec._step_buf.n == 3 and rec._step_buf.num_dropped == 2
    assert rec._scalar_buf.n == 3 and rec._scalar_buf.num_dropped == 2
    assert list(rec._step_buf.column("step")) == [0, 1, 2]


def test_swap_hands_over_the_filled_set_and_installs_an_empty_one():
    rec = Recorder(capacity=4)
    rec.record_step(1, **STEP)
    rec.collective(1, 0, 0, "send", "pp", 0, 1, 8, 1.0, 0.1, 0.1)
    drained = rec._swap()
    assert drained.num_rows() == {"step": 1, "collective": 1, "scalar": 0, "heartbeat": 0}
    assert drained.dict_sizes == {"op": 1, "axis": 1, "name": 0, "phase": 0}
    assert rec._step_buf is not drained.step and rec._step_buf.n == 0
    rec.record_step(2, **STEP)
    assert drained.step.n == 1 and list(drained.step.views()["step"]) == [1]
    assert rec._dict_snapshot(drained) == {"op": ["send"], "axis": ["pp"], "name": [], "phase": []}
    rec._recycle(drained)
    assert drained.is_empty() and rec._swap().step.n == 1  # the spare is reused for the next swap
    assert rec._step_buf is drained.step


def test_views_are_zero_copy_and_sized_to_the_filled_rows():
    bufs = BufferSet(capacity=10)
    bufs.step.n = 3
    views = bufs.step.views()
    assert [c.name for c in wire.SCHEMA["step"]] == list(views)
    assert all(v.nbytes == 3 * c.itemsize for c, v in zip(wire.SCHEMA["step"], views.values()))


def test_slow_path_coerces_what_the_arrays_refuse_and_drops_the_rest():
    rec = Recorder(capacity=4)
    # tokens and mem_bytes as floats, lr an int: coerced
    rec.record_step(1, **{**STEP, "tokens": 4096.0, "mem_bytes": 1e9, "lr": 1})
    row = _row(rec._step_buf, 0)
    assert row["tokens"] == 4096 and row["mem_bytes"] == 10**9 and row["lr"] == 1.0 and row["loss"] == 2.5
    rec.record_step(2, **{**STEP, "loss": "not a number"})  # cannot be stored: dropped, counted, no raise
    rec.collective(1, 0, 0, ["unhashable"], "dp", 0, -1, 8, 1.0, 0.1, 0.1)
    assert rec._step_buf.n == 1 and rec._step_buf.num_dropped == 1
    assert rec._coll_buf.n == 0 and rec._coll_buf.num_dropped == 1
    rec.record_step(3, **STEP)  # the half-written row of the failed record is overwritten
    assert rec._step_buf.n == 2 and list(rec._step_buf.column("step")[:2]) == [1, 3]


def test_heartbeat_and_events_go_into_the_active_set():
    rec = Recorder(capacity=2)
    rec.set_phase("forward", 9)
    rec._record_heartbeat(1.0, rec._hb_step, rec._phase, 41)
    rec._record_heartbeat(2.0, rec._hb_step, rec._phase, 42, "all_reduce", "dp", 4, 7, 30.0)
    rec._add_event({"kind": "x"})
    drained = rec._swap()
    first = _row(drained.heartbeat, 0)
    # an interval not given is the float NULL (its own NaN bits), read as NULL by the collector
    assert struct.pack("<d", first.pop("interval_s")) == struct.pack("<q", wire.NULL_F64_BITS)
    assert first == {"ts": 1.0, "step": 9, "phase": 0, "last_seq": 41, "last_op": -1,
                     "last_axis": -1, "last_group_id": -1, "last_group_seq": -1}
    # the collective's op and axis are codes of the collectives' own dictionaries
    assert _row(drained.heartbeat, 1) == {"ts": 2.0, "step": 9, "phase": 0, "last_seq": 42, "last_op": 0,
                                          "last_axis": 0, "last_group_id": 4, "last_group_seq": 7, "interval_s": 30.0}
    assert rec._dict_snapshot(drained)["op"] == ["all_reduce"] and rec._dict_snapshot(drained)["axis"] == ["dp"]
    assert rec._dict_snapshot(drained)["phase"] == ["forward"]
    assert drained.events == [{"kind": "x"}]


def test_values_not_given_are_stored_as_not_measured():
    rec = Recorder(capacity=4, clock=lambda: 10.0)
    rec.record_step(5, loss=2.0)
    rec.record_step(6, loss=None, grad_norm=float("nan"), tokens=None)  # None is "not given" too
    row, second = _row(rec._step_buf, 0), _row(rec._step_buf, 1)
    assert row["loss"] == 2.0 and row["skipped"] == 0
    for name in ("grad_norm", "loss_scale", "lr", "step_s", "fwd_s", "bwd_s", "opt_s", "data_s", "comm_exposed_s"):
        assert is_null(row[name]), name
    assert row["tokens"] == -1 and row["mem_bytes"] == -1
    assert is_null(second["loss"]) and second["tokens"] == -1
    assert math.isnan(second["grad_norm"]) and not is_null(second["grad_norm"])  # a measured NaN stays a NaN
    assert not is_null(float("nan")) and not is_null(math.inf - math.inf)
    # a NULL loss or grad norm is no non-finite value: no urgent flush; the measured NaN asked for one
    assert rec.num_urgent == 1


def test_step_s_not_given_is_the_time_since_the_previous_steps_call():
    now = [100.0]
    rec = Recorder(capacity=8, clock=lambda: now[0])
    for step, t in ((1, 100.0), (2, 100.25), (3, 100.75), (10, 101.0), (11, 102.0)):
        now[0] = t
        rec.record_step(step, loss=1.0)
    now[0] = 103.0
    rec.record_step(12, loss=1.0, step_s=0.125)  # given: taken as is
    step_s = rec._step_buf.column("step_s")
    assert is_null(step_s[0]) and is_null(step_s[3])  # the first call, and after a jump (a resume, a rollback)
    assert (step_s[1], step_s[2], step_s[4], step_s[5]) == (0.25, 0.5, 1.0, 0.125)
