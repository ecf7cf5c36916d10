"""The instrumented comm layer over real gloo processes."""

import os
import time

import pytest
import torch
import torch.distributed as dist

from tests import ranks
from trainer.comm import Comm
from trainer.launch import free_port
from trainer.parallel_dims import Axis, ParallelDims

pytestmark = pytest.mark.integration


class ListSink:
    def __init__(self):
        self.rows = []

    def collective(self, *row):
        self.rows.append(row)


def _worker(rank, world, port, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    dims = ParallelDims(dp=2, tp=2, pp=1, sp=False, nodes=1, rank=rank, world_size=world)
    dims.build_mesh("cpu")
    sink = ListSink()
    comm = Comm(dims, device=torch.device("cpu"), sink=sink)
    comm.begin_step(1)
    t = torch.full((4,), float(rank))
    comm.all_reduce(t, Axis.TP)
    out = torch.empty(8)
    comm.all_gather(out, torch.full((4,), float(rank)), Axis.DP)
    rs = torch.empty(2)
    comm.reduce_scatter(rs, torch.ones(4), Axis.TP)
    if rank == 1:
        time.sleep(0.3)  # rank 1 is late: its peers wait for it
    h = comm.all_reduce(torch.ones(1000), Axis.DP, async_op=True)
    time.sleep(0.05)
    h.wait()
    # p2p between ranks 0 and 2 (same tp index, different dp)
    if rank in (0, 2):
        peer = 2 - rank
        buf = torch.full((3,), float(rank))
        recv = torch.empty(3)
        for hh in comm.batch_p2p([(buf, peer)], [(recv, peer)]):
            hh.wait()
        assert recv[0].item() == peer
    stats = comm.end_step()
    queue.put((rank, t.tolist(), out.tolist(), rs.tolist(), sink.rows, stats.num_ops, stats.wait_s, comm.last_seq))
    dist.destroy_process_group()


def test_records_and_results():
    world = 4
    ctx = ranks.context()
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results = {}
    for _ in range(world):
        rank, *rest = queue.get(timeout=120)
        results[rank] = rest
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    # results are right: tp groups are {0,1} and {2,3}, dp groups {0,2} and {1,3}
    assert results[0][0] == [1.0] * 4 and results[2][0] == [5.0] * 4
    assert results[1][1] == [1.0] * 4 + [3.0] * 4
    assert results[3][2] == [2.0, 2.0]
    for rank, (_, _, _, rows, num_ops, wait_s, last_seq) in results.items():
        ops = [(r[3], r[4]) for r in rows]
        expected = [("all_reduce", "tp"), ("all_gather", "dp"), ("reduce_scatter", "tp"), ("all_reduce", "dp")]
        if rank in (0, 2):
            expected += [("recv", "pp"), ("send", "pp")]
        assert ops == expected
        assert num_ops == len(expected) and last_seq == len(expected) - 1
        assert [r[1] for r in rows] == list(range(len(expected)))  # seq
        for step, seq, gseq, op, axis, gid, peer, nbytes, start_ts, duration_s, w in rows:
            assert step == 1 and nbytes > 0 and 0 <= w <= duration_s + 1e-3
            assert abs(start_ts - time.time()) < 120
        dp_ar = [r for r in rows if r[3] == "all_reduce" and r[4] == "dp"][0]
        assert dp_ar[5] == rank % 2  # group_id: the lowest global rank of the dp group
    # the async dp all_reduce: rank 1 arrived 0.3 s late, so its dp peer (rank 3) waited
    late = [r for r in results[1][3] if r[3] == "all_reduce" and r[4] == "dp"][0]
    peer = [r for r in results[3][3] if r[3] == "all_reduce" and r[4] == "dp"][0]
    assert late[2] == peer[2]  # same group_seq: the same collective, matched across ranks
    assert peer[9] > 0.2 and late[9] < 0.2  # peer's duration includes waiting for the late rank
    assert late[8] - peer[8] > 0.2  # start_ts says who was late
