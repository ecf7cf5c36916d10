"""The one instrumented communication layer.

Every collective and point-to-point op of the trainer goes through `Comm`. Each
op is timed and handed to a `CommSink` as one flat call (no record object, no
dict): this is where the telemetry's "NCCL timing" comes from.

What is measured, per op:

- `start_ts`  wall-clock time (unix seconds) at which this rank entered the op.
  Comparable across ranks: the last rank to enter a collective is the one the
  others waited for.
- `duration_s` from entering the op to its completion.
- `wait_s`    time this rank's compute thread was blocked on the op: the whole
  duration for a synchronous op, only the time inside `wait()` for an async one.
  Summed per step this is the *exposed* communication time.

On CPU (gloo) times are `time.perf_counter` around the op; an async op's
completion time comes from its future's callback. On CUDA (nccl) the host does
not block, so times come from CUDA events recorded on the current stream
before the op and after `wait()`; they are resolved without a sync at the next
step boundary (`end_step`), when the events have long completed.

A degraded link (fault injection, `slowlink@...`, trainer/faults.py): the engine
passes `begin_step(step, slow_links=((axis, factor), ...))` and every op of that
axis this step really takes `factor` times as long on the link: after it
completes, the rank waits `(factor - 1)` times the op's *link time* before the op
returns, inside the timed region (so `duration_s` and `wait_s` include it, and
the thread's CPU time, the compute the engine measures, does not). The link time
is what the op (same op, axis and bytes) took on this rank while the link was
healthy: the median of its last `LINK_SAMPLES` healthy durations (CPU, kept
only in a run with a `slowlink` injection: `link_memory`), frozen when the link
turns slow. Not the slowed op's own duration: that also holds the time it waited
for peers, who arrive late because of the previous op's stretch, so stretching
it grew geometrically (a 4x link hung a dp4 job within five steps). The fault
injector keeps the healthy times on disk for the ranks of a later round, whose
own ops are all slowed (two slow ranks then kept each other waiting at 1.45 s
a step against 0.05). A link slow from a process's first op, with nothing
known, falls back to the shortest slowed duration it has seen. On CUDA the
wait is on the host after the op's `wait()`, stretching the host-measured time
the same way.

`seq` counts this rank's ops (monotonic, reported in heartbeats: a hung rank's
`seq` falls behind its peers'). `last_entered` names the op the latest `seq`
is: `(seq, op, axis, group_id, group_seq)`, one tuple stored per op (read by the
agent's heartbeat on its own thread: a single attribute, never torn). `group_seq` counts ops per process group and is
identical on every member of the group, so one collective can be matched
across ranks by `(axis, group_id, group_seq)`. `group_id` is the lowest global
rank in the group.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist

from trainer.parallel_dims import Axis, ParallelDims

LINK_SAMPLES = 32  # healthy durations per op a slow link's time is the median of

# torch 2.13 renamed the flat-tensor collectives; older releases only have the old names.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class CommSink(Protocol):
    """Receives one call per completed op. Must be cheap and must not raise."""

    def collective(
        self,
        step: int,
        seq: int,
        group_seq: int,
        op: str,
        axis: str,
        group_id: int,
        peer: int,
        nbytes: int,
        start_ts: float,
        duration_s: float,
        wait_s: float,
    ) -> None: ...


class NullSink:
    """The default sink: drops every record."""

    def collective(self, step, seq, group_seq, op, axis, group_id, peer, nbytes, start_ts, duration_s, wait_s) -> None:
        return None


@dataclass(slots=True)
class CommStepStats:
    """Totals of one step, read by the loop at the step boundary."""

    num_ops: int = 0
    nbytes: int = 0
    wait_s: float = 0.0  # exposed communication
    last_seq: int = -1


class _Clock:
    """Maps `perf_counter` readings to unix time with one offset taken at start."""

    __slots__ = ("offset",)

    def __init__(self) -> None:
        self.offset = time.time() - time.perf_counter()

    def wall(self, perf: float) -> float:
        return self.offset + perf


class Handle:
    """An in-flight async op. `wait()` blocks, records the timing and returns."""

    __slots__ = ("_comm", "_work", "_op", "_axis", "_group_id", "_peer", "_nbytes", "_t0", "_done", "_seq", "_gseq", "_step", "_ev0", "_waited")

    def __init__(self, comm: "Comm", work, op: str, axis: str, group_id: int, peer: int, nbytes: int, seq: int, gseq: int) -> None:
        self._comm = comm
        self._work = work
        self._op = op
        self._axis = axis
        self._group_id = group_id
        self._peer = peer
        self._nbytes = nbytes
        self._seq = seq
        self._gseq = gseq
        self._step = comm.step
        self._t0 = time.perf_counter()
        self._done: list[float] = []
        self._ev0 = None
        self._waited = False
        if comm.use_cuda_events:
            self._ev0 = torch.cuda.Event(enable_timing=True)
            self._ev0.record()
        else:
            # Gloo completes the future on its own thread; the callback stamps the
            # true completion time even when the op finishes long before wait().
            try:
                work.get_future().add_done_callback(lambda _f, d=self._done: d.append(time.perf_counter()))
            except (RuntimeError, AttributeError):  # some work objects have no future
                pass

    def wait(self) -> None:
        if self._waited:
            return
        self._waited = True
        comm = self._comm
        if self._ev0 is not None:
            w0 = torch.cuda.Event(enable_timing=True)
            w0.record()
            h0 = time.perf_counter()
            self._work.wait()
            factor = comm.slowness(self._axis)
            if factor > 1.0:  # a degraded link: host-side, the op returns (factor - 1) x its link time later
                torch.cuda.current_stream().synchronize()
                now = time.perf_counter()
                _wait_until(now + (factor - 1.0) * comm.link_time(self._op, self._axis, self._nbytes,
                                                                   now - min(h0, self._t0)))
            w1 = torch.cuda.Event(enable_timing=True)
            w1.record()
            comm._pending_cuda.append((self._step, self._seq, self._gseq, self._op, self._axis, self._group_id, self._peer, self._nbytes, self._t0, self._ev0, w0, w1))
            return
        w0, c0 = time.perf_counter(), time.thread_time()
        self._work.wait()
        w1 = time.perf_counter()
        done = self._done[0] if self._done else w1
        factor = comm.slowness(self._axis)
        if comm._healthy is not None and factor == 1.0:  # a run with a slowlink injection learns link times
            comm.learn_link(self._op, self._axis, self._nbytes, max(done, self._t0) - self._t0)
        if factor > 1.0:  # a degraded link: the op completes (factor - 1) x its link time later
            done = max(done, self._t0)
            late = done + (factor - 1.0) * comm.link_time(self._op, self._axis, self._nbytes, done - self._t0)
            w1 = _wait_until(late)
            done = late
        comm.blocked_cpu_s += time.thread_time() - c0
        # blocked on the op until it completed: on a loaded host the thread may get its core back
        # well after the completion, and that wait was the scheduler's, not the op's (an exposed
        # share above 1 on an axis of the cookbook's run)
        wait_s = max(0.0, min(w1, max(done, w0)) - w0)
        comm._emit(self._step, self._seq, self._gseq, self._op, self._axis, self._group_id, self._peer, self._nbytes, self._t0, max(done, self._t0) - self._t0, wait_s)

    def is_completed(self) -> bool:
        return self._work.is_completed()


def _wait_until(perf: float) -> float:
    """Sleep until `time.perf_counter()` reaches `perf`; returns the time it is then."""
    now = time.perf_counter()
    while now < perf:
        time.sleep(perf - now)
        now = time.perf_counter()
    return now


class _NoopHandle:
    __slots__ = ()

    def wait(self) -> None:
        return None

    def is_completed(self) -> bool:
        return True


NOOP_HANDLE = _NoopHandle()


class Comm:
    """Instrumented collectives over the groups of a `ParallelDims`.

    Ops on a group of size 1 are skipped entirely (no record): the single-process
    run and a dp=1 axis pay nothing.
    """

    def __init__(self, dims: ParallelDims, *, device: torch.device, sink: CommSink | None = None) -> None:
        self.dims = dims
        self.device = device
        self.sink: CommSink = sink or NullSink()
        self.use_cuda_events = device.type == "cuda"
        self.step = 0
        self._seq = -1
        self._entered: tuple = (-1, None, None, -1, -1)  # see last_entered
        self._gseq: dict[Axis, int] = {}
        self._groups: dict[Axis, object] = {}
        self._group_ids: dict[Axis, int] = {}
        self._sizes: dict[Axis, int] = {}
        self._clock = _Clock()
        self._stats = CommStepStats()
        # CPU time the calling thread spent inside blocking communication (gloo reduces
        # on the caller's thread), all steps: the engine takes it out of compute on CPU
        self.blocked_cpu_s = 0.0
        self._pending_cuda: list[tuple] = []
        self._slow: dict[str, float] = {}  # axis name -> factor: an injected degraded link, this step
        self._healthy: dict[tuple[str, str, int], deque] | None = None  # (op, axis, bytes) -> its last healthy times
        self._link_s: dict[tuple[str, str, int], float] = {}  # the link time a slow op is stretched by
        self._learned: set[tuple[str, str, int]] = set()  # keys of _link_s known from healthy ops (fixed)
        self._on_slow = None  # called with the link times when a link first turns slow (link_memory)
        for axis in Axis:
            try:
                members = dims.ranks_in(axis)
            except RuntimeError:
                continue
            self._sizes[axis] = len(members)
            self._group_ids[axis] = members[0]
            self._gseq[axis] = -1
        # the (a, b) pair's p2p ops are counted per peer pair: group_seq stays
        # identical on both ends because both ends issue the same sequence.
        self._p2p_seq: dict[int, int] = {}

    # -- bookkeeping -------------------------------------------------------
    def set_sink(self, sink: CommSink | None) -> None:
        self.sink = sink or NullSink()

    def begin_step(self, step: int, slow_links: tuple[tuple[str, float], ...] = ()) -> None:
        """Start a step; `slow_links`: (axis, factor) of an injected degraded link."""
        self.step = step
        if slow_links and self._healthy is not None and not self._slow:  # turning slow: freeze what was learned
            for key, times in self._healthy.items():
                if times:
                    self._link_s[key] = statistics.median(times)
                    self._learned.add(key)
            if self._on_slow is not None:  # once: handed to the fault injector for a later round
                self._on_slow, on_slow = None, self._on_slow
                on_slow({k: self._link_s[k] for k in self._learned})
        self._slow = dict(slow_links) if slow_links else {}

    def link_memory(self, known: dict[tuple[str, str, int], float], on_slow) -> None:
        """Learn healthy link times from now on (a run with a `slowlink` injection), start from
        `known` (an earlier round's: trainer/faults.py keeps them), and call `on_slow(link
        times)` when a link first turns slow in this process."""
        self._healthy = {}
        for key, s in known.items():
            self._link_s[key] = s
            self._learned.add(key)
        self._on_slow = on_slow

    def slowness(self, axis: str) -> float:
        """How many times as long this step's ops on `axis` take (1: a healthy link)."""
        return self._slow.get(axis, 1.0) if self._slow else 1.0

    def learn_link(self, op: str, axis: str, nbytes: int, measured_s: float) -> None:
        """A healthy op's duration, in a run that learns link times (`link_memory`; callers check
        `_healthy` first, so no other run pays a call per op)."""
        key = (op, axis, nbytes)
        times = self._healthy.get(key)
        if times is None:
            times = self._healthy[key] = deque(maxlen=LINK_SAMPLES)
        times.append(measured_s)

    def link_time(self, op: str, axis: str, nbytes: int, measured_s: float) -> float:
        """A slowed op's link time (the module doc): the healthy time frozen when the link turned
        slow, else the shortest slowed duration seen (this one included)."""
        key = (op, axis, nbytes)
        if key in self._learned:
            return self._link_s[key]
        best = min(self._link_s.get(key, measured_s), max(0.0, measured_s))
        self._link_s[key] = best
        return best

    def end_step(self) -> CommStepStats:
        """Resolve finished CUDA timings and return (and reset) the step's totals."""
        if self._pending_cuda:
            self._resolve_cuda()
        stats = self._stats
        stats.last_seq = self._seq
        self._stats = CommStepStats()
        return stats

    @property
    def last_seq(self) -> int:
        return self._seq

    @property
    def last_entered(self) -> tuple:
        """(seq, op, axis, group_id, group_seq) of the last op this rank entered;
        (-1, None, None, -1, -1) before the first. For `Agent.bind_seq_source`."""
        return self._entered

    @property
    def blocked_s(self) -> float:
        """Seconds this rank has been blocked on communication so far in this step
        (host time on CPU; on CUDA the timings resolve later, so this stays 0 and
        host-side phase times are what they are: launch times)."""
        return self._stats.wait_s

    def size(self, axis: Axis) -> int:
        return self._sizes.get(axis, 1)

    def group(self, axis: Axis):
        g = self._groups.get(axis)
        if g is None:
            g = self._groups[axis] = self.dims.group(axis)
        return g

    def _next(self, axis: Axis) -> tuple[int, int]:
        self._seq += 1
        self._gseq[axis] += 1
        return self._seq, self._gseq[axis]

    def _emit(self, step, seq, gseq, op, axis, group_id, peer, nbytes, t0, duration_s, wait_s) -> None:
        st = self._stats
        st.num_ops += 1
        st.nbytes += nbytes
        st.wait_s += wait_s
        self.sink.collective(step, seq, gseq, op, axis, group_id, peer, nbytes, self._clock.wall(t0), duration_s, wait_s)

    def _resolve_cuda(self) -> None:
        keep = []
        for rec in self._pending_cuda:
            step, seq, gseq, op, axis, gid, peer, nbytes, t0, ev0, w0, w1 = rec
            if not w1.query():
                keep.append(rec)
                continue
            duration_s = ev0.elapsed_time(w1) / 1e3
            wait_s = w0.elapsed_time(w1) / 1e3
            self._emit(step, seq, gseq, op, axis.value if isinstance(axis, Axis) else axis, gid, peer, nbytes, t0, duration_s, wait_s)
        self._pending_cuda = keep

    def _run(self, op: str, axis: Axis, nbytes: int, peer: int, fn, async_op: bool):
        seq, gseq = self._next(axis)
        self._entered = (seq, op, axis.value, self._group_ids[axis], gseq)
        return self._timed(op, axis.value, self._group_ids[axis], peer, nbytes, seq, gseq, fn, async_op)

    def _timed(self, op, axis_name, group_id, peer, nbytes, seq, gseq, fn, async_op):
        if async_op:
            work = fn(True)
            return Handle(self, work, op, axis_name, group_id, peer, nbytes, seq, gseq)
        if self.use_cuda_events:
            h = Handle(self, fn(True), op, axis_name, group_id, peer, nbytes, seq, gseq)
            h.wait()
            return None
        t0, c0 = time.perf_counter(), time.thread_time()
        fn(False)
        dt = time.perf_counter() - t0
        factor = self.slowness(axis_name)
        if self._healthy is not None and factor == 1.0:  # a run with a slowlink injection learns link times
            self.learn_link(op, axis_name, nbytes, dt)
        if factor > 1.0:  # a degraded link: the op returns (factor - 1) x its link time later
            dt = _wait_until(t0 + dt + (factor - 1.0) * self.link_time(op, axis_name, nbytes, dt)) - t0
        self.blocked_cpu_s += time.thread_time() - c0
        self._emit(self.step, seq, gseq, op, axis_name, group_id, peer, nbytes, t0, dt, dt)
        return None

    # -- collectives -------------------------------------------------------
    def all_reduce(self, tensor: torch.Tensor, axis: Axis, *, op=dist.ReduceOp.SUM, async_op: bool = False):
        if self.size(axis) == 1:
            return NOOP_HANDLE if async_op else None
        group = self.group(axis)
        return self._run("all_reduce", axis, tensor.numel() * tensor.element_size(), -1,
                         lambda a: dist.all_reduce(tensor, op=op, group=group, async_op=a), async_op)

    def all_gather(self, output: torch.Tensor, tensor: torch.Tensor, axis: Axis, *, async_op: bool = False):
        """Gather `tensor` from every member into `output` (concatenated on dim 0)."""
        if self.size(axis) == 1:
            output.copy_(tensor)
            return NOOP_HANDLE if async_op else None
        group = self.group(axis)
        return self._run("all_gather", axis, output.numel() * output.element_size(), -1,
                         lambda a: _all_gather_flat(output, tensor, group=group, async_op=a), async_op)

    def reduce_scatter(self, output: torch.Tensor, tensor: torch.Tensor, axis: Axis, *, op=dist.ReduceOp.SUM, async_op: bool = False):
        """Reduce `tensor` over the group and keep this member's dim-0 chunk in `output`."""
        if self.size(axis) == 1:
            output.copy_(tensor)
            return NOOP_HANDLE if async_op else None
        group = self.group(axis)
        return self._run("reduce_scatter", axis, tensor.numel() * tensor.element_size(), -1,
                         lambda a: _reduce_scatter_flat(output, tensor, op=op, group=group, async_op=a), async_op)

    def broadcast(self, tensor: torch.Tensor, axis: Axis, *, src_group_rank: int = 0, async_op: bool = False):
        if self.size(axis) == 1:
            return NOOP_HANDLE if async_op else None
        group = self.group(axis)
        src = self.dims.ranks_in(axis)[src_group_rank]
        return self._run("broadcast", axis, tensor.numel() * tensor.element_size(), src,
                         lambda a: dist.broadcast(tensor, src=src, group=group, async_op=a), async_op)

    def barrier(self, axis: Axis = Axis.WORLD) -> None:
        if self.size(axis) == 1:
            return
        group = self.group(axis)
        self._run("barrier", axis, 0, -1, lambda a: dist.barrier(group=group, async_op=a), False)

    # -- point to point (pipeline) ------------------------------------------
    def _p2p_next(self, peer: int) -> tuple[int, int]:
        self._seq += 1
        n = self._p2p_seq.get(peer, -1) + 1
        self._p2p_seq[peer] = n
        return self._seq, n

    def isend(self, tensor: torch.Tensor, peer: int) -> Handle:
        seq, gseq = self._p2p_next(peer)
        self._entered = (seq, "send", Axis.PP.value, min(self.dims.rank, peer), gseq)
        return self._timed("send", Axis.PP.value, min(self.dims.rank, peer), peer, tensor.numel() * tensor.element_size(),
                           seq, gseq, lambda a: dist.isend(tensor, dst=peer), True)

    def irecv(self, tensor: torch.Tensor, peer: int) -> Handle:
        seq, gseq = self._p2p_next(peer)
        self._entered = (seq, "recv", Axis.PP.value, min(self.dims.rank, peer), gseq)
        return self._timed("recv", Axis.PP.value, min(self.dims.rank, peer), peer, tensor.numel() * tensor.element_size(),
                           seq, gseq, lambda a: dist.irecv(tensor, src=peer), True)

    def batch_p2p(self, sends: list[tuple[torch.Tensor, int]], recvs: list[tuple[torch.Tensor, int]]) -> list[Handle]:
        """Post all receives and sends at once and return their handles.

        Goes through `batch_isend_irecv`, so the order in which two stages post
        their halves can never deadlock (NCCL needs this; gloo accepts it)."""
        ops, meta = [], []
        for tensor, peer in recvs:
            ops.append(dist.P2POp(dist.irecv, tensor, peer))
            meta.append(("recv", tensor, peer))
        for tensor, peer in sends:
            ops.append(dist.P2POp(dist.isend, tensor, peer))
            meta.append(("send", tensor, peer))
        if not ops:
            return []
        works = dist.batch_isend_irecv(ops)
        handles = []
        for (op, tensor, peer), work in zip(meta, works):
            seq, gseq = self._p2p_next(peer)
            self._entered = (seq, op, Axis.PP.value, min(self.dims.rank, peer), gseq)
            handles.append(Handle(self, work, op, Axis.PP.value, min(self.dims.rank, peer), peer,
                                  tensor.numel() * tensor.element_size(), seq, gseq))
        return handles


def wait_all(handles) -> None:
    for h in handles:
        h.wait()
