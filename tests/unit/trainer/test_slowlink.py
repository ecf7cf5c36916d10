"""`slowlink@...`: parsed, fired in its window on its rank only, written to the ground truth, and
applied by the comm layer as real waiting inside the op (not as compute)."""

import json
import time

import pytest
import torch

from trainer.comm import Comm
from trainer.config import ConfigError
from trainer.faults import NO_FAULTS, FaultInjector, parse_injection
from trainer.parallel_dims import ParallelDims


def test_parse():
    s = parse_injection("slowlink@rank=3,axis=tp,from=30,factor=4,to=80")
    assert (s.kind, s.rank, s.axis, s.step, s.factor, s.to_step) == ("slowlink", 3, "tp", 30, 4.0, 80)
    assert parse_injection("slowlink@rank=1,axis=dp,from=5,factor=2").to_step == 1 << 62


@pytest.mark.parametrize("spec", ["slowlink@rank=1,axis=ib,from=3,factor=2", "slowlink@rank=1,axis=tp,factor=2",
                                  "slowlink@rank=1,axis=tp,from=3,factor=0.5", "slowlink@rank=1,from=3,factor=2",
                                  "slowlink@rank=1,axis=tp,from=5,factor=2,to=4"])
def test_parse_errors(spec):
    with pytest.raises(ConfigError):
        parse_injection(spec)


def test_rank_out_of_the_world_is_refused():
    with pytest.raises(ConfigError):
        parse_injection("slowlink@rank=4,axis=tp,from=1,factor=2", world_size=4)


def test_window_rank_and_truth(tmp_path):
    specs = [parse_injection("slowlink@rank=2,axis=tp,from=3,factor=4,to=5")]
    mine = FaultInjector(specs, rank=2, node=1, run_dir=tmp_path)
    other = FaultInjector(specs, rank=1, node=0, run_dir=tmp_path)
    got = [mine.step_faults(s, 0, (0, s, s + 1)) for s in range(1, 8)]
    assert [f.slow_links for f in got] == [(), (), (("tp", 4.0),), (("tp", 4.0),), (("tp", 4.0),), (), ()]
    assert all(f.slowdown == 1.0 and not f.nan for f in got)  # its compute stays normal
    assert got[0] is NO_FAULTS
    assert all(other.step_faults(s, 0, (0, s, s + 1)) is NO_FAULTS for s in range(1, 8))
    rows = [json.loads(x) for x in (tmp_path / "injections.jsonl").read_text().splitlines()]
    assert len(rows) == 1
    assert {k: rows[0][k] for k in ("kind", "rank", "node", "step", "attempt", "factor", "axis")} == {
        "kind": "slowlink", "rank": 2, "node": 1, "step": 3, "attempt": 0, "factor": 4.0, "axis": "tp"}


def test_two_axes_on_one_rank_are_two_faults(tmp_path):
    specs = [parse_injection("slowlink@rank=0,axis=tp,from=1,factor=2"),
             parse_injection("slowlink@rank=0,axis=dp,from=1,factor=3")]
    inj = FaultInjector(specs, rank=0, node=0, run_dir=tmp_path)
    assert inj.step_faults(1, 0, (0, 1, 2)).slow_links == (("dp", 3.0), ("tp", 2.0))
    assert len((tmp_path / "injections.jsonl").read_text().splitlines()) == 2


class ListSink:
    def __init__(self):
        self.rows = []

    def collective(self, *row):
        self.rows.append(row)


class SleepyWork:
    """An async op's work object that takes `s` seconds to complete (no future)."""

    def __init__(self, s):
        self.s = s

    def wait(self):
        time.sleep(self.s)


def _comm():
    sink = ListSink()
    return Comm(ParallelDims(dp=1, tp=1, pp=1, sp=False, nodes=1, rank=0, world_size=1),
                device=torch.device("cpu"), sink=sink), sink


def test_the_comm_layer_stretches_the_slow_axis_by_waiting_inside_the_op():
    comm, sink = _comm()
    comm.begin_step(7, (("tp", 3.0),))
    assert (comm.slowness("tp"), comm.slowness("dp")) == (3.0, 1.0)
    cpu0 = comm.blocked_cpu_s
    comm._timed("all_reduce", "tp", 0, -1, 1024, 0, 0, lambda a: time.sleep(0.02), False)  # a sync op
    h = comm._timed("all_reduce", "tp", 0, -1, 1024, 1, 1, lambda a: SleepyWork(0.02), True)  # an async one
    h.wait()
    (_, _, _, _, _, _, _, nbytes, _, dur_sync, wait_sync), (*_, dur_async, wait_async) = sink.rows
    assert nbytes == 1024
    assert dur_sync >= 3 * 0.02 and wait_sync == dur_sync  # the delay is inside the timed region...
    assert dur_async >= 3 * 0.02 and wait_async >= 2 * 0.02
    assert comm.blocked_cpu_s - cpu0 < dur_sync + dur_async  # ...and is waiting, not compute
    assert comm.end_step().wait_s == pytest.approx(wait_sync + wait_async)


def test_a_slow_link_stretches_the_link_time_not_the_wait_for_late_peers():
    """An op that waited 0.2 s for a late peer took 0.01 s on the link: the slow link adds
    (factor - 1) x 0.01 s, not x 0.2 s. Stretching the wait made the peers late again, by more:
    a 4x link grew each step's wait geometrically and hung the job within five steps."""
    comm, sink = _comm()
    comm.begin_step(1, (("dp", 4.0),))
    comm._timed("all_reduce", "dp", 0, -1, 4096, 0, 0, lambda a: time.sleep(0.01), False)  # its peers were there
    comm._timed("all_reduce", "dp", 0, -1, 4096, 1, 1, lambda a: time.sleep(0.2), False)  # a late peer
    (*_, first, _), (*_, late, _) = sink.rows
    assert first >= 0.04  # 0.01 on the link, x 4
    assert 0.2 + 3 * 0.01 <= late < 0.2 + 3 * 0.05, late  # the wait, plus three link times (not 3 x 0.2)
    comm._timed("all_reduce", "dp", 0, -1, 512, 2, 2, lambda a: time.sleep(0.03), False)  # another size: its own
    assert sink.rows[-1][-2] >= 0.12


def test_two_slow_ranks_keep_their_healthy_link_time_and_a_later_round_starts_from_it(tmp_path):
    """Healthy steps teach the link time (0.01 s); when the link turns slow it is handed to the fault
    injector, which keeps it on disk, and a restarted rank (a new Comm) that only ever sees slowed,
    waiting ops (0.3 s: the other slow rank's stretch) still stretches by 3 x 0.01 s, not 3 x 0.3 s."""
    specs = [parse_injection("slowlink@rank=0,axis=dp,from=2,factor=4")]
    comm, sink = _comm()
    inj = FaultInjector(specs, rank=0, node=0, run_dir=tmp_path)
    comm.link_memory(inj.link_times(), inj.remember_links)
    comm.begin_step(1, inj.step_faults(1, 0, (0, 0, 8)).slow_links)
    comm._timed("all_reduce", "dp", 0, -1, 4096, 0, 0, lambda a: time.sleep(0.01), False)  # healthy
    comm.begin_step(2, inj.step_faults(2, 0, (0, 8, 16)).slow_links)
    assert inj.link_times() == {("all_reduce", "dp", 4096): pytest.approx(0.01, abs=0.005)}
    again = FaultInjector(specs, rank=0, node=0, run_dir=tmp_path)  # the next round's rank, same hardware
    comm2, sink2 = _comm()
    comm2.link_memory(again.link_times(), again.remember_links)
    comm2.begin_step(40, again.step_faults(40, 1, (0, 0, 8)).slow_links)
    comm2._timed("all_reduce", "dp", 0, -1, 4096, 0, 0, lambda a: time.sleep(0.3), False)  # waited for a peer
    assert 0.3 + 3 * 0.01 <= sink2.rows[-1][-2] < 0.3 + 3 * 0.05


def test_a_new_step_without_the_fault_is_healthy_again():
    comm, _ = _comm()
    comm.begin_step(1, (("dp", 2.0),))
    comm.begin_step(2)
    assert comm.slowness("dp") == 1.0


class LateWakeWork:
    """An async op that completed at once (its future's callback ran), whose waiting thread got
    its core back only `s` seconds later: a loaded host's scheduler."""

    def __init__(self, s):
        self.s = s

    def get_future(self):
        fut = torch.futures.Future()
        fut.set_result(None)
        return fut

    def wait(self):
        time.sleep(self.s)


def test_an_async_ops_wait_ends_at_its_completion_not_when_the_thread_woke():
    """Blocked on the op until it completed: the time the thread then waited for its core was the
    scheduler's (the cookbook's run on a loaded host had an axis with more wait than duration)."""
    comm, sink = _comm()
    comm.begin_step(3)
    h = comm._timed("all_reduce", "dp", 0, -1, 1024, 0, 0, lambda a: LateWakeWork(0.03), True)
    time.sleep(0.01)  # compute, during which the op completes
    h.wait()
    (*_, dur, wait), = sink.rows
    assert dur < 0.01 and wait == 0.0  # it was done before wait() was called: nothing was exposed
    h2 = comm._timed("all_reduce", "dp", 0, -1, 1024, 1, 1, lambda a: SleepyWork(0.02), True)
    h2.wait()  # no future: its completion is when wait() returned
    assert sink.rows[-1][-1] >= 0.02 and sink.rows[-1][-1] == pytest.approx(sink.rows[-1][-2], abs=1e-3)
