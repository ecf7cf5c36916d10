"""The Flight Recorder read live (agent/flight.py): a fake dump shaped like torch 2.13's
`_dump_fr_trace(True, False, False)` into a real Recorder, the group table faked behind
torch.distributed's own names, and one real single-process gloo group."""

from __future__ import annotations

import logging
import math
import pickle
import struct
import time

import pytest

from agent import Agent, AgentConfig, flight, wire
from agent.flight import BUFFER_ENV, DEFAULT_BUFFER, NCCL_TIMING_ENV, FlightReader, Groups, _axis_of_desc, enable_env
from agent.ring import Recorder
from tests.polling import wait_until

NULL_BITS = struct.pack("<q", wire.NULL_F64_BITS)
T0_NS = 1_700_000_000_000_000_000  # the first entry's enqueue time (wall ns)
WORLD = ("0", "default_pg")


def is_null(x: float) -> bool:
    """`x` is the float NULL (not measured), bit for bit, not some other NaN."""
    return struct.pack("<d", x) == NULL_BITS


def entry(rid: int, *, pg=WORLD, seq: int | None = None, op: str = "gloo:all_reduce", created_ns: int | None = None,
          sizes=([4],), dtypes=("Float",), retired: bool = True, p2p: bool = False, p2p_seq: int = 0, **extra) -> dict:
    """One entry as torch 2.13 dumps it (NCCL's may add `duration_ms`)."""
    e = {"record_id": rid, "pg_id": int(pg[0]) if pg[0].isdigit() else 0, "process_group": tuple(pg),
         "thread_name": "python", "thread_id": "1", "collective_seq_id": rid + 1 if seq is None else seq,
         "p2p_seq_id": p2p_seq, "op_id": rid + 1, "profiling_name": op,
         "time_created_ns": T0_NS + rid * 1_000_000 if created_ns is None else created_ns,
         "input_sizes": [list(s) for s in sizes], "input_dtypes": list(dtypes),
         "output_sizes": [list(s) for s in sizes], "output_dtypes": list(dtypes), "state": "scheduled",
         "time_discovered_started_ns": None, "time_discovered_completed_ns": None, "retired": retired,
         "timeout_ms": 1_800_000, "is_p2p": p2p}
    e.update(extra)
    return e


class Dump:
    """`_dump_fr_trace`: the buffer's entries, oldest first, pickled; set `entries` between reads."""

    def __init__(self, entries=()):
        self.entries = list(entries)
        self.calls = 0

    def __call__(self) -> bytes:
        self.calls += 1
        return pickle.dumps({"version": "2.10", "pg_config": {}, "pg_status": {}, "entries": list(self.entries)})


class StaticGroups:
    """`Groups.of` from a fixed table: name -> (axis, group_id)."""

    def __init__(self, table=None):
        self.table = table or {"0": ("dp", 0)}

    def of(self, name, desc):
        return self.table[name]


def rows(rec: Recorder) -> list[dict]:
    """The collectives rows recorded so far, op and axis decoded."""
    buf = rec._active.collective
    out = []
    for i in range(buf.n):
        r = {c.name: col[i] for c, col in zip(wire.SCHEMA[buf.kind], buf.cols)}
        r["op"] = rec._op_codes.values[r["op"]]
        r["axis"] = rec._axis_codes.values[r["axis"]]
        out.append(r)
    return out


def reader(dump, rec=None, **kw) -> tuple[FlightReader, Recorder]:
    rec = rec or Recorder(256)
    kw.setdefault("step_of", lambda ns: (1, 0))
    kw.setdefault("groups", StaticGroups())
    return FlightReader(dump, rec, **kw), rec


# -- rows -----------------------------------------------------------------------------------
def test_an_entry_is_a_row_once_retired_and_each_record_id_only_once():
    dump = Dump([entry(0), entry(1), entry(2, retired=False)])
    r, rec = reader(dump)
    assert r.poll(force=True) == 2
    assert [x["seq"] for x in rows(rec)] == [0, 1]
    assert r.poll(force=True) == 0  # the same buffer again: nothing new
    dump.entries[2] = entry(2)  # the in-flight one completes
    dump.entries.append(entry(3, retired=False))
    assert r.poll(force=True) == 1
    assert [x["seq"] for x in rows(rec)] == [0, 1, 2]
    dump.entries[3] = entry(3)
    assert r.poll(force=True) == 1
    assert r.poll(force=True) == 0
    assert [x["seq"] for x in rows(rec)] == [0, 1, 2, 3]
    assert (r.num_reads, r.num_rows, r.num_lost, dump.calls) == (5, 4, 0, 5)
    assert r.stats()["in_flight"] == 0


def test_a_completed_state_counts_as_retired():
    dump = Dump([entry(0, retired=False, state="completed")])
    r, rec = reader(dump)
    assert r.poll(force=True) == 1 and len(rows(rec)) == 1


def test_a_row_has_the_entrys_columns():
    dump = Dump([entry(0, seq=41, op="nccl:_reduce_scatter_base", sizes=([4, 8], [3]), dtypes=("BFloat16", "Long"),
                       created_ns=T0_NS + 250_000_000)])
    r, rec = reader(dump, step_of=lambda ns: (7 if ns == T0_NS + 250_000_000 else -9, 2),
                    groups=StaticGroups({"0": ("tp", 4)}), offset_s=lambda: 1.5)
    r.poll(force=True)
    (row,) = rows(rec)
    assert {k: v for k, v in row.items() if k not in ("duration_s", "wait_s")} == {
        "step": 7, "attempt": 2, "seq": 0, "group_seq": 41, "op": "_reduce_scatter_base", "axis": "tp",
        "group_id": 4, "peer": -1, "bytes": 4 * 8 * 2 + 3 * 8, "start_ts": (T0_NS + 250_000_000) / 1e9 + 1.5}
    # not measured (gloo, or NCCL without its timing): NULL, never 0 or another NaN
    assert is_null(row["duration_s"]) and is_null(row["wait_s"])


def test_an_attempt_given_by_step_of_wins_over_the_recorders_current_one():
    dump = Dump([entry(0)])
    rec = Recorder(8)
    rec.attempt = 5
    r, _ = reader(dump, rec, step_of=lambda ns: (3, 4))
    r.poll(force=True)
    assert (rows(rec)[0]["step"], rows(rec)[0]["attempt"]) == (3, 4)


def test_nccls_duration_is_the_rows_and_wait_stays_null():
    dump = Dump([entry(0, op="nccl:all_reduce", duration_ms=2.5), entry(1, op="nccl:all_reduce", duration_ms=None),
                 entry(2, op="nccl:all_reduce", duration_ms=-1.0)])
    r, rec = reader(dump)
    r.poll(force=True)
    got = rows(rec)
    assert got[0]["duration_s"] == 0.0025 and is_null(got[0]["wait_s"])
    assert is_null(got[1]["duration_s"]) and is_null(got[2]["duration_s"])  # no timing, or none measured


@pytest.mark.parametrize("name, op", [("gloo:all_reduce", "all_reduce"), ("nccl:all_gather_into_tensor_coalesced",
                                      "all_gather_into_tensor_coalesced"), ("barrier", "barrier"), ("", "unknown"),
                                      (None, "unknown")])
def test_the_op_is_the_profiling_name_without_its_backend(name, op):
    dump = Dump([entry(0, op=name)])
    r, rec = reader(dump)
    r.poll(force=True)
    assert rows(rec)[0]["op"] == op


@pytest.mark.parametrize("sizes, dtypes, nbytes", [
    (([4],), ("Float",), 16), (([2, 3], [5]), ("Half", "Double"), 12 + 40), (([],), ("Float",), 4),
    (([0, 9],), ("Float",), 0), (([3],), ("Float8_e4m3fn",), 3), (([3],), ("SomethingNew",), 12), ((), (), 0),
])
def test_bytes_are_the_inputs_elements_times_their_itemsize(sizes, dtypes, nbytes):
    dump = Dump([entry(0, sizes=sizes, dtypes=dtypes)])
    r, rec = reader(dump)
    r.poll(force=True)
    assert rows(rec)[0]["bytes"] == nbytes


def test_a_p2p_entry_is_numbered_by_its_p2p_sequence():
    dump = Dump([entry(0, op="nccl:send 1", p2p=True, seq=0, p2p_seq=6)])
    r, rec = reader(dump)
    r.poll(force=True)
    assert (rows(rec)[0]["group_seq"], rows(rec)[0]["op"]) == (6, "send 1")


# -- what is lost ---------------------------------------------------------------------------
def test_the_buffer_wrapping_past_unseen_entries_counts_them_lost():
    dump = Dump([entry(i) for i in range(4)])
    r, rec = reader(dump)
    assert r.poll(force=True) == 4
    dump.entries = [entry(i) for i in range(10, 13)]  # 4..9 were enqueued and evicted between reads
    assert r.poll(force=True) == 3
    assert r.num_lost == 6
    assert [x["seq"] for x in rows(rec)] == [0, 1, 2, 3, 10, 11, 12]
    assert r.stats()["lost"] == 6


def test_entries_evicted_in_flight_are_counted_lost_once():
    dump = Dump([entry(0, retired=False), entry(1)])
    r, rec = reader(dump)
    assert r.poll(force=True) == 1
    assert r.stats()["in_flight"] == 1
    dump.entries = [entry(5), entry(6, retired=False)]  # 0 (in flight) and 2..4 (never seen) are gone
    assert r.poll(force=True) == 1
    assert r.num_lost == 4 and r.stats()["in_flight"] == 1
    dump.entries = [entry(6), entry(7)]
    assert r.poll(force=True) == 2
    assert r.num_lost == 4 and r.stats()["in_flight"] == 0
    assert [x["seq"] for x in rows(rec)] == [1, 5, 6, 7]


def test_the_in_flight_entries_remembered_are_bounded(monkeypatch):
    monkeypatch.setattr(flight, "_PENDING_MAX", 2)
    dump = Dump([entry(i, retired=False) for i in range(4)])
    r, rec = reader(dump)
    assert r.poll(force=True) == 0
    assert r.stats()["in_flight"] == 2


def test_an_empty_buffer_reads_nothing():
    r, rec = reader(Dump([]))
    assert r.poll(force=True) == 0
    assert r.last_entered() == -1 and r.num_reads == 1


# -- what the heartbeat names ---------------------------------------------------------------
def test_last_entered_names_the_newest_entry_in_flight_or_not():
    dump = Dump([entry(0)])
    r, _ = reader(dump, groups=StaticGroups({"0": ("dp", 0), "3": ("tp", 2)}))
    assert r.last_entered() == -1  # nothing read yet
    r.poll(force=True)
    assert r.last_entered() == (0, "all_reduce", "dp", 0, 1)
    dump.entries += [entry(1, pg=("3", "mesh_tp"), seq=8, op="nccl:all_gather", retired=False)]
    r.poll(force=True)
    assert r.last_entered() == (1, "all_gather", "tp", 2, 8)  # a hung rank's stays here
    r.poll(force=True)
    assert r.last_entered() == (1, "all_gather", "tp", 2, 8)
    dump.entries[1] = entry(1, pg=("3", "mesh_tp"), seq=8, op="nccl:all_gather")  # it completes: still the newest
    r.poll(force=True)
    assert r.last_entered() == (1, "all_gather", "tp", 2, 8)
    dump.entries += [entry(2, op="nccl:send", p2p=True, p2p_seq=1, retired=False)]
    r.poll(force=True)
    assert r.last_entered() == 2  # a p2p op names no collective


def test_the_agent_heartbeat_names_the_readers_last_entered():
    agent = Agent(AgentConfig(url=None, device_health=False, capacity=16), run_id="r", rank=0)
    dump = Dump([entry(0), entry(1, seq=9, op="nccl:reduce_scatter", retired=False)])
    r = FlightReader(dump, agent, step_of=lambda ns: (1, 0), groups=StaticGroups())
    agent.bind_seq_source(r.last_entered)
    r.poll(force=True)
    agent._heartbeat()
    hb = agent._active.heartbeat
    assert hb.n == 1
    assert hb.column("last_seq")[0] == 1 and hb.column("last_group_seq")[0] == 9
    assert agent._op_codes.values[hb.column("last_op")[0]] == "reduce_scatter"
    assert agent._axis_codes.values[hb.column("last_axis")[0]] == "dp"
    agent.close()


# -- when it reads --------------------------------------------------------------------------
def test_poll_reads_at_most_once_per_interval_on_its_clock():
    now = [100.0]
    dump = Dump([entry(0)])
    r, rec = reader(dump, interval_s=1.0, clock=lambda: now[0])
    assert r.poll() == 1 and dump.calls == 1
    now[0] = 100.5
    dump.entries.append(entry(1))
    assert r.poll() == 0 and dump.calls == 1  # too soon: not even dumped
    now[0] = 101.0
    assert r.poll() == 1 and dump.calls == 2
    now[0] = 101.1
    dump.entries.append(entry(2))
    assert r.poll(force=True) == 1 and dump.calls == 3  # flush/close: read now
    now[0] = 102.0
    assert r.poll() == 0 and dump.calls == 3  # a forced read restarts the interval
    now[0] = 102.1
    assert r.poll() == 0 and dump.calls == 4
    assert r.num_reads == 4 and r.read_s >= r.max_read_s > 0.0


def test_a_flush_reads_what_half_a_period_has_retired_so_its_batch_carries_its_steps_ops():
    """`tick` runs at the start of every flush: past half a period since the last read it reads
    though not due, so the ops come in the batch of their steps (the ranks flush in the same
    instant, and the collector judged a step whose ops came a flush late without them)."""
    now = [100.0]
    dump = Dump([entry(0)])
    r, rec = reader(dump, interval_s=1.0, clock=lambda: now[0])
    assert r.tick() == pytest.approx(1.0) and dump.calls == 1
    now[0] = 100.3
    dump.entries.append(entry(1))
    r.tick()
    assert dump.calls == 1  # a follow-up flush 0.3 s later: not read again
    now[0] = 100.97  # the next flush, a little before the read falls due
    assert r.tick() == pytest.approx(1.0) and dump.calls == 2
    assert [x["seq"] for x in rows(rec)] == [0, 1]


def test_the_offset_is_read_at_each_read():
    offsets = iter([0.25, -0.5])
    dump = Dump([entry(0)])
    r, rec = reader(dump, offset_s=lambda: next(offsets))
    r.poll(force=True)
    dump.entries.append(entry(1))
    r.poll(force=True)
    got = rows(rec)
    assert got[0]["start_ts"] == T0_NS / 1e9 + 0.25
    assert got[1]["start_ts"] == (T0_NS + 1_000_000) / 1e9 - 0.5


def test_the_agent_calls_its_pollers_on_each_cycle_and_survives_one_that_raises(caplog):
    agent = Agent(AgentConfig(url=None, device_health=False, capacity=16), run_id="r", rank=0)
    calls = []

    def failing():
        calls.append("failing")
        raise RuntimeError("no buffer")

    dump = Dump([entry(0)])
    r = FlightReader(dump, agent, step_of=lambda ns: (1, 0), groups=StaticGroups())
    agent.add_poller(failing)
    agent.add_poller(r.poll)
    with caplog.at_level(logging.WARNING, logger="llmwatch.agent"):
        assert agent.flush(1.0) is True
        assert agent.flush(1.0) is True
    assert calls == ["failing", "failing"]
    assert r.num_reads == 1  # its own interval: the second cycle came too soon
    assert agent.stats()["recorded"]["collective"] == 1
    assert sum("a source failed" in m for m in caplog.messages) == 1
    agent.close()


# -- groups ---------------------------------------------------------------------------------
@pytest.mark.parametrize("desc, axis", [
    ("mesh_tp", "tp"), ("mesh_dp_shard", "dp_shard"), ("mesh_", "mesh_"), ("default_pg", None), ("undefined", None),
    ("", None), ("experts", "experts"),
])
def test_axis_of_desc(desc, axis):
    assert _axis_of_desc(desc) == axis


class PG:
    """A process group, as far as the group table goes (hashable by identity)."""

    def __init__(self, desc: str = "undefined"):
        self.group_desc = desc


class FakeWorld:
    """torch.distributed's `_world`: `pg_names` {group: name}, `pg_group_ranks` {group: {global rank: group
    rank}}, `default_pg` the world group."""

    def __init__(self):
        self.pg_names, self.pg_group_ranks, self.default_pg = {}, {}, None

    def add(self, name: str, ranks, desc: str = "undefined", *, world: bool = False) -> PG:
        pg = PG(desc)
        self.pg_names[pg] = name
        self.pg_group_ranks[pg] = {g: i for i, g in enumerate(ranks)}
        if world:
            self.default_pg = pg
        return pg


@pytest.fixture
def world(monkeypatch):
    from torch.distributed import distributed_c10d as c10d

    fake = FakeWorld()
    monkeypatch.setattr(c10d, "_world", fake)
    return fake


def test_groups_resolve_from_torchs_tables(world):
    world.add("0", range(8), "default_pg", world=True)
    world.add("1", [6, 2], "mesh_tp")
    world.add("2", [1, 5, 3], "undefined")
    world.add("3", [7, 4], "experts")
    g = Groups()
    assert g.of("0", "default_pg") == ("dp", 0)  # the world group of a plain DDP/FSDP job
    assert g.of("1", "mesh_tp") == ("tp", 2)  # group_id: its smallest global rank
    assert g.of("2", "undefined") == ("pg2", 1)
    assert g.of("3", "experts") == ("experts", 4)


def test_groups_take_the_callers_names_by_group_or_by_name(world):
    world.add("0", range(4), "default_pg", world=True)
    ep = world.add("1", [0, 1], "undefined")
    world.add("2", [2, 3], "undefined")
    g = Groups({ep: "ep", "2": "cp"}, world_axis="fsdp")
    assert g.of("1", "undefined") == ("ep", 0)
    assert g.of("2", "undefined") == ("cp", 2)
    assert g.of("0", "default_pg") == ("fsdp", 0)


def test_groups_take_a_device_meshs_dim_names(world):
    world.add("0", range(4), "default_pg", world=True)
    a = world.add("1", [0, 2], "undefined")
    b = world.add("2", [1, 3], "undefined")

    class Mesh:
        mesh_dim_names = ("dp", "tp", "pp")

        def get_group(self, i):
            if i == 2:
                raise RuntimeError("no group of its own")
            return (a, b)[i]

    g = Groups(mesh=Mesh())
    assert (g.of("1", "undefined"), g.of("2", "undefined")) == (("dp", 0), ("tp", 1))


def test_a_group_made_after_the_first_read_is_found_and_a_gone_one_keeps_its_entrys_name(world):
    world.add("0", range(2), "default_pg", world=True)
    g = Groups()
    assert g.of("0", "default_pg") == ("dp", 0)
    world.add("5", [1], "mesh_cp")
    assert g.of("5", "mesh_cp") == ("cp", 1)
    assert g.of("9", "mesh_pp") == ("pp", 0)  # destroyed already: what the entry says
    assert g.of("10", "undefined") == ("pg10", 0)


def test_groups_without_an_initialized_process_group():
    g = Groups()  # torch.distributed not initialized in this process: nothing in its tables
    assert g.of("0", "default_pg") == ("pg0", 0)
    assert g.of("1", "mesh_tp") == ("tp", 0)


# -- where there is no recorder -------------------------------------------------------------
def test_create_without_a_dump_returns_none_with_one_warning(monkeypatch, caplog):
    monkeypatch.setattr(flight, "_dumper", lambda: None)
    with caplog.at_level(logging.WARNING, logger="llmwatch.agent"):
        assert FlightReader.create(Recorder(4), step_of=lambda ns: (0, 0)) is None
    assert len(caplog.records) == 1 and "_dump_fr_trace" in caplog.messages[0]


def test_create_when_torch_lacks_the_private_api_returns_none_with_one_warning(monkeypatch, caplog):
    from torch._C import _distributed_c10d as c10d

    monkeypatch.delattr(c10d, "_dump_fr_trace")
    assert flight._dumper() is None
    with caplog.at_level(logging.WARNING, logger="llmwatch.agent"):
        assert FlightReader.create(Recorder(4), step_of=lambda ns: (0, 0)) is None
    assert len(caplog.records) == 1 and "collectives are not recorded" in caplog.messages[0]


def test_create_with_the_private_api_returns_a_reader_passing_its_options():
    r = FlightReader.create(Recorder(4), step_of=lambda ns: (0, 0), interval_s=2.5)
    assert isinstance(r, FlightReader) and r.interval_s == 2.5


# -- the environment ------------------------------------------------------------------------
def test_enable_env_sets_what_is_unset():
    env = {}
    assert enable_env(env) == {BUFFER_ENV: str(DEFAULT_BUFFER), NCCL_TIMING_ENV: "1"}
    assert env == {BUFFER_ENV: str(DEFAULT_BUFFER), NCCL_TIMING_ENV: "1"}
    assert enable_env(env) == {}  # idempotent


def test_enable_env_keeps_what_the_user_set():
    env = {BUFFER_ENV: "500", NCCL_TIMING_ENV: "0"}
    assert enable_env(env) == {}
    assert env == {BUFFER_ENV: "500", NCCL_TIMING_ENV: "0"}
    env = {"TORCH_NCCL_TRACE_BUFFER_SIZE": "100"}  # the older name of the buffer size
    assert enable_env(env) == {NCCL_TIMING_ENV: "1"}
    env = {BUFFER_ENV: ""}  # set empty: unset
    assert enable_env(env, nccl_timing=False) == {BUFFER_ENV: str(DEFAULT_BUFFER)}
    assert NCCL_TIMING_ENV not in env


# -- real torch -----------------------------------------------------------------------------
def test_a_real_gloo_groups_all_reduces_become_rows(tmp_path):
    import torch

    dist = torch.distributed
    # every other test initializes its process groups in processes of its own: one left here is a leak
    assert dist.is_available() and not dist.is_initialized(), "torch.distributed is initialized in the test process"
    rec = Recorder(256)
    r = FlightReader.create(rec, step_of=lambda ns: (5, 1), offset_s=lambda: 0.0)
    assert r is not None
    r.poll(force=True)  # the recorder is per process: what earlier tests' groups left in it
    first = rec._active.collective.n
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        t0 = time.time()
        x = torch.ones(4)
        for _ in range(3):
            dist.all_reduce(x)
        t1 = time.time()
        # gloo retires an entry from its worker thread, maybe just after wait() returned: read until all are
        def retired() -> bool:
            r.poll(force=True)
            return rec._active.collective.n - first >= 3

        assert wait_until(retired, 10.0)
        last = r.last_entered()
    finally:
        dist.destroy_process_group()
    # a row is written once its op retired: an entry gloo retired after the next one's is read later
    got = sorted(rows(rec)[first:], key=lambda x: x["seq"])
    assert [(x["op"], x["axis"], x["group_id"], x["bytes"], x["step"], x["attempt"], x["peer"]) for x in got] == [
        ("all_reduce", "dp", 0, 16, 5, 1, -1)] * 3
    assert [x["group_seq"] for x in got] == [1, 2, 3]  # the group's own numbering, the same on every member
    assert [x["seq"] for x in got] == list(range(got[0]["seq"], got[0]["seq"] + 3))
    assert all(t0 - 1e-3 <= x["start_ts"] <= t1 + 1e-3 for x in got)  # wall clock, like time.time()
    assert all(is_null(x["duration_s"]) and is_null(x["wait_s"]) for x in got)  # gloo: no timing
    assert last == (got[-1]["seq"], "all_reduce", "dp", 0, 3)
    assert not math.isnan(r.max_read_s)


def test_reads_come_sooner_when_ops_would_fill_half_the_buffer_before_the_next():
    now = [0.0]
    dump = Dump()
    r = FlightReader(dump, Recorder(1024), step_of=lambda ns: (1, 0), interval_s=1.0, capacity=100,
                     clock=lambda: now[0])
    r.poll(force=True)
    assert r.tick() == pytest.approx(1.0)  # nothing new: once a second
    now[0] = 1.0
    dump.entries = [entry(i) for i in range(100, 200)]  # 200 ops a second into a buffer of 100 (it wrapped)
    r.poll()
    assert r.tick() == pytest.approx(0.25)  # half the buffer is 50 ops: a quarter of a second
    now[0] = 1.25
    dump.entries = [entry(i) for i in range(150, 250)]
    r.poll()
    assert r.tick() == pytest.approx(0.25)
    r.min_interval_s = 0.4
    now[0] = 1.5
    dump.entries = [entry(i) for i in range(200, 300)]
    r.poll()
    assert r.tick() == pytest.approx(0.4)  # never more often than min_interval_s
