"""Every collective of every process group, from torch's Flight Recorder, read live.

torch records each collective it enqueues (DDP's bucket all-reduces, FSDP's
all-gathers and reduce-scatters, a user's `dist.all_reduce`) in a per-process
ring buffer, the Flight Recorder: process group, the group's collective
sequence number, op, sizes, dtypes and the wall-clock time the rank enqueued it;
on NCCL with `TORCH_NCCL_ENABLE_TIMING=1` also its start and duration. torch
reads it only after a watchdog time-out (`torchfrtrace`); `FlightReader` reads it
while the job runs, on the agent's flusher thread (`Agent.add_poller`), never
the training thread.

Each read dumps the buffer (`_dump_fr_trace`, pickle, no stack traces) and keeps
the entries not yet seen, by `record_id`. An entry becomes one `collectives` row
once torch retired it (the op completed): `seq` its record_id (per process,
over all groups), `group_seq` its `collective_seq_id` (per group: the same
number on every member for the same collective), `start_ts` its enqueue time
(plus this host's clock offset to the collector: agent/clock.py),
`duration_s` NCCL's (NULL otherwise), `wait_s` NULL: not measured, the
detectors infer waits from who enqueued last (analysis/attribution.py). The
entry still in flight that was enqueued last is what the heartbeat names
(`last_entered`): a hung rank's number stops while its peers' moves on.

The step of an entry is the step in progress when it was enqueued, from the
boundaries the caller gives (`step_of(time_ns) -> (step, attempt)`, agent/watch.py).
The axis of a group: the caller's names (`axes`: a DeviceMesh's dim names, or
`{group: "tp"}`), else "dp" for the world group (a plain DDP or FSDP job's
data-parallel group), else the group's description, else `pg<name>`; its
`group_id` the smallest global rank in it (the same on every member, distinct
between disjoint groups of one axis).

Cost: a dump copies the whole buffer under the GIL, ~12-15 us an entry plus ~3 us
to unpickle, whatever is new: torch's default 2,000 entries cost ~30 ms a read.
So a read comes once a second, or sooner when ops come fast enough to fill half
the buffer by then, and `enable_env` (llmwatch-instrument) sets a buffer of 512
entries where nobody set one: ~8 ms a second up to ~250 ops/s, and about
2 x 15 us per op above that. bench/bench_watch.py measures it. Entries evicted
before a read are counted in `num_lost`.

Where torch has no recorder (an old release, a build without distributed) or
its API changed, `FlightReader.create` logs one warning and returns None: the
rest of the telemetry is unchanged.
"""

from __future__ import annotations

import logging
import os
import pickle
import time
from typing import Callable

from agent.wire import NULL_F64

log = logging.getLogger("llmwatch.agent")

BUFFER_ENV = "TORCH_FR_BUFFER_SIZE"
NCCL_TIMING_ENV = "TORCH_NCCL_ENABLE_TIMING"
TORCH_DEFAULT_BUFFER = 2000
FLUSH_READ_SHARE = 0.5  # `FlightReader.tick` reads at a flush when its last read is this share of a period old
# what `enable_env` sets when nobody did: a dump costs every entry the buffer holds, so a
# smaller buffer read more often (FlightReader.poll) costs less at the same op rate
DEFAULT_BUFFER = 512
_ITEMSIZE = {"Float": 4, "Double": 8, "Half": 2, "BFloat16": 2, "Long": 8, "Int": 4, "Short": 2, "Char": 1,
             "Byte": 1, "Bool": 1, "ComplexFloat": 8, "ComplexDouble": 16, "Float8_e4m3fn": 1, "Float8_e5m2": 1,
             "UInt16": 2, "UInt32": 4, "UInt64": 8}
_PENDING_MAX = 4096  # in-flight entries remembered at most (a hung job's grow no further)


def enable_env(environ=os.environ, *, nccl_timing: bool = True) -> dict[str, str]:
    """Turn the recorder on for process groups created from now on: its buffer size
    (when not set) and, for NCCL, op timing. torch reads these when a process group is
    made, so call this before `init_process_group`. Returns what it set."""
    changed = {}
    if not environ.get(BUFFER_ENV) and not environ.get("TORCH_NCCL_TRACE_BUFFER_SIZE"):
        changed[BUFFER_ENV] = str(DEFAULT_BUFFER)
    if nccl_timing and not environ.get(NCCL_TIMING_ENV):
        changed[NCCL_TIMING_ENV] = "1"
    environ.update(changed)
    return changed


def buffer_size(environ=os.environ) -> int:
    """The recorder's entries per process, as torch reads them."""
    for name in (BUFFER_ENV, "TORCH_NCCL_TRACE_BUFFER_SIZE"):
        try:
            return max(1, int(environ.get(name, "")))
        except ValueError:
            continue
    return TORCH_DEFAULT_BUFFER


def _dumper() -> Callable[[], bytes] | None:
    """The recorder's dump, or None where this torch has none (feature detection)."""
    try:
        from torch._C import _distributed_c10d as c10d
    except ImportError:
        return None
    dump = getattr(c10d, "_dump_fr_trace", None)
    if dump is None:
        return None
    return lambda: dump(True, False, False)  # collectives, no stack traces, retired ones too


def _nbytes(sizes, dtypes) -> int:
    total = 0
    for shape, dtype in zip(sizes or (), dtypes or ()):
        n = 1
        for d in shape:
            n *= int(d)
        total += n * _ITEMSIZE.get(str(dtype), 4)
    return total


class Groups:
    """Process-group name -> (axis, group_id), resolved from torch.distributed's own
    tables (refreshed when a name is new: a group made after the reader started)."""

    def __init__(self, axes: dict | None = None, mesh=None, world_axis: str = "dp") -> None:
        self._given = dict(axes or {})
        self._mesh = mesh
        self._world_axis = world_axis
        self._known: dict[str, tuple[str, int]] = {}

    def of(self, name: str, desc: str) -> tuple[str, int]:
        got = self._known.get(name)
        if got is None:
            self._refresh()
            got = self._known.get(name)
            if got is None:  # not in torch's tables (destroyed already): keep what the entry says
                got = (_axis_of_desc(desc) or f"pg{name}", 0)
                self._known[name] = got
        return got

    def _refresh(self) -> None:
        import torch.distributed as dist
        from torch.distributed import distributed_c10d as c10d

        world = getattr(c10d, "_world", None)
        names = dict(getattr(world, "pg_names", {}) or {})
        ranks = dict(getattr(world, "pg_group_ranks", {}) or {})
        given = {}
        for key, axis in self._given.items():  # {group or group name: axis}
            given[key if isinstance(key, str) else names.get(key, "")] = str(axis)
        mesh = self._mesh
        if mesh is not None and getattr(mesh, "mesh_dim_names", None):
            for i, axis in enumerate(mesh.mesh_dim_names):
                try:
                    given[names.get(mesh.get_group(i), "")] = str(axis)
                except Exception:  # noqa: BLE001 - a dim without its own group
                    continue
        default = dist.group.WORLD if dist.is_initialized() else None
        for pg, name in names.items():
            members = sorted(ranks.get(pg, {}) or ())
            axis = given.get(name)
            if axis is None:
                desc = getattr(pg, "group_desc", "") or ""
                axis = self._world_axis if pg is default else (_axis_of_desc(desc) or f"pg{name}")
            self._known[str(name)] = (axis, int(members[0]) if members else 0)


def _axis_of_desc(desc: str) -> str | None:
    """A DeviceMesh group's description ("mesh_tp") names its axis; torch's own are no axis."""
    if desc.startswith("mesh_") and len(desc) > 5:
        return desc[5:]
    return None if desc in ("", "undefined", "default_pg") else desc


class FlightReader:
    """Reads new Flight Recorder entries into an agent's collectives buffer (see module doc)."""

    def __init__(self, dump: Callable[[], bytes], sink, *, step_of: Callable[[int], tuple[int, int]],
                 groups: Groups | None = None, offset_s: Callable[[], float] = lambda: 0.0,
                 interval_s: float = 1.0, min_interval_s: float = 0.05, fill_share: float = 0.5,
                 capacity: int | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        """`sink`: has `collective(...)` (an Agent, `trainer.comm.CommSink`'s signature);
        `step_of(enqueue time ns)`: (step, attempt) in progress then; `offset_s()`: add to
        this host's clock to get the collector's."""
        self._dump = dump
        self._sink = sink
        self._step_of = step_of
        self._groups = groups or Groups()
        self._offset_s = offset_s
        self.interval_s = interval_s
        self.min_interval_s = min_interval_s
        self.fill_share = fill_share
        self.capacity = capacity if capacity is not None else buffer_size()
        self._clock = clock
        self._next_read = 0.0
        self._last_read: float | None = None
        self._seen_upto = 0  # every record_id below this was emitted, or is in _pending
        self._pending: dict[int, None] = {}  # record_ids seen in flight, in order
        self._last_entered: tuple | int = -1
        self.num_reads = 0
        self.num_rows = 0
        self.num_lost = 0  # entries evicted from the buffer before a read saw them retire
        self.read_s = 0.0  # seconds spent dumping and parsing, in all
        self.max_read_s = 0.0

    @classmethod
    def create(cls, sink, **kw) -> FlightReader | None:
        dump = _dumper()
        if dump is None:
            log.warning("llmwatch: this torch has no Flight Recorder dump (torch._C._distributed_c10d."
                        "_dump_fr_trace): collectives are not recorded; steps, phases and heartbeats are")
            return None
        reader = cls(dump, sink, **kw)
        reader.skip_existing()
        return reader

    def skip_existing(self) -> None:
        """Start after what the buffer holds now: ops of before the watch (a model's set-up
        broadcasts, a previous fit's steps) are no rows of this one."""
        entries = pickle.loads(self._dump()).get("entries") or []
        if entries:
            self._seen_upto = int(entries[-1]["record_id"]) + 1

    def last_entered(self):
        """`Agent.bind_seq_source`'s answer: (record_id, op, axis, group_id, group_seq) of
        the op enqueued last, -1 before any. Read on the flusher thread."""
        return self._last_entered

    def tick(self) -> float:
        """`Agent.add_poller`'s call, at the start of each flush cycle and when it asked: read
        when due, or when the last read is `FLUSH_READ_SHARE` of `interval_s` old or more, so
        that a flush carries the ops of the steps it carries. The ranks flush in the same
        instant (agent/agent.py), and the collector judges a step's collectives once every
        rank's step rows are in: ops that came a flush after their steps were judged without
        (a DDP loop's straggler went unnamed). The seconds until the next read."""
        last = self._last_read
        self.poll(force=last is not None and self._clock() - last >= FLUSH_READ_SHARE * self.interval_s)
        return max(0.0, self._next_read - self._clock())

    def poll(self, force: bool = False) -> int:
        """Read when due (or `force`): rows added. Due: `interval_s` after the last read, or
        sooner when the ops come fast, so that at most `fill_share` of the buffer is new
        between two reads (none is lost): a dump costs the whole buffer, so a read per
        second is the cheapest until the buffer would wrap."""
        now = self._clock()
        if not force and now < self._next_read:
            return 0
        t0 = time.perf_counter()
        trace = pickle.loads(self._dump())
        entries = trace.get("entries") or []
        dt = time.perf_counter() - t0
        self.read_s += dt
        self.max_read_s = max(self.max_read_s, dt)
        self.num_reads += 1
        before = self._seen_upto
        n = self._take(entries)
        new = self._seen_upto - before
        elapsed = now - self._last_read if self._last_read is not None else 0.0
        self._last_read = now
        interval = self.interval_s
        if new > 0 and elapsed > 0:
            capacity = max(len(entries), self.capacity)
            interval = min(interval, max(self.min_interval_s, self.fill_share * capacity * elapsed / new))
        self._next_read = now + interval
        return n

    def _take(self, entries: list[dict]) -> int:
        if not entries:
            return 0
        first_id = int(entries[0]["record_id"])
        if first_id > self._seen_upto:  # the buffer wrapped past entries never seen
            self.num_lost += first_id - self._seen_upto
            self._seen_upto = first_id
        for rid in [r for r in self._pending if r < first_id]:  # evicted while in flight
            del self._pending[rid]
            self.num_lost += 1
        n = 0
        offset = self._offset_s()
        newest = None
        for e in entries:
            rid = int(e["record_id"])
            if rid >= self._seen_upto:
                newest = e
                if e.get("retired") or e.get("state") == "completed":
                    n += self._emit(e, offset)
                elif len(self._pending) < _PENDING_MAX:
                    self._pending[rid] = None
            elif rid in self._pending and (e.get("retired") or e.get("state") == "completed"):
                del self._pending[rid]
                n += self._emit(e, offset)
        if newest is not None:
            self._seen_upto = int(newest["record_id"]) + 1
            if not newest.get("is_p2p"):
                axis, group_id = self._group(newest)
                self._last_entered = (int(newest["record_id"]), _op(newest), axis, group_id,
                                      int(newest.get("collective_seq_id", -1)))
            else:
                self._last_entered = int(newest["record_id"])
        self.num_rows += n
        return n

    def _group(self, e: dict) -> tuple[str, int]:
        pg = e.get("process_group") or ("", "")
        return self._groups.of(str(pg[0]), str(pg[1]) if len(pg) > 1 else "")

    def _emit(self, e: dict, offset: float) -> int:
        axis, group_id = self._group(e)
        created_ns = int(e.get("time_created_ns") or 0)
        step, attempt = self._step_of(created_ns)
        duration_ms = e.get("duration_ms")
        duration_s = float(duration_ms) / 1e3 if isinstance(duration_ms, (int, float)) and duration_ms >= 0 else None
        p2p = bool(e.get("is_p2p"))
        # wait_s is not measured (NULL): who enqueued last tells who was waited for
        self._sink.collective(step, int(e["record_id"]), int(e.get("p2p_seq_id" if p2p else "collective_seq_id", -1)),
                              _op(e), axis, group_id, -1, _nbytes(e.get("input_sizes"), e.get("input_dtypes")),
                              created_ns / 1e9 + offset, NULL_F64 if duration_s is None else duration_s, NULL_F64,
                              attempt=attempt)
        return 1

    def stats(self) -> dict:
        return {"reads": self.num_reads, "rows": self.num_rows, "lost": self.num_lost,
                "read_s": round(self.read_s, 6), "max_read_s": round(self.max_read_s, 6),
                "in_flight": len(self._pending)}


def _op(e: dict) -> str:
    name = str(e.get("profiling_name") or "")
    return name.split(":", 1)[1] if ":" in name else (name or "unknown")
