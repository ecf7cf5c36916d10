"""The agent's hot path: preallocated columnar buffers and the record methods.

Why it looks like this: a training step must not pay for telemetry. A record is
a handful of stores into `array.array` columns that were allocated once, under
one `threading.Lock` held only for those stores. No dict, tuple or object is
built per record, nothing is formatted, nothing touches a socket.

Layout: one `KindBuffer` per `wire.SCHEMA` kind, one array per column in
`SCHEMA` order, so a drained buffer is already the batch's column area
(`memoryview(column)[:n]` goes straight into `wire.encode_batch`). String
columns (`op`, `axis`, `name`, `phase`) are dictionary-encoded: a seen string
costs one dict subscript, a new one appends to the column's code list.

Double buffering instead of a wrap-around ring: the flusher swaps the whole
active `BufferSet` for an empty spare under the lock (a few attribute stores)
and encodes the drained set outside it. A full buffer drops the new record and
counts it; it never blocks and never overwrites rows not yet shipped.

Cost, measured by bench/bench_agent_hotpath.py: `record_step` is about a
microsecond of CPython, ~2.5x ten stores into a numpy row (23 columns and the
urgent-flush comparisons: agent/urgent.py). Memory: 296
bytes of columns per row (all four kinds) x capacity x 2 buffers, ~37 MiB at
the default 65,536 rows.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from array import array
from typing import Callable

from agent import wire
from agent.urgent import LossBaseline
from agent.wire import NULL_F64

log = logging.getLogger("llmwatch.agent")

MAX_EVENTS = 4096  # per buffer: events are rare; a flood of them is dropped and counted
EVENT = "event"  # the stats key for dropped events (not a wire kind: events ride in the header)
STATS_KINDS = wire.KINDS + (EVENT,)


class Codes(dict):
    """Dictionary encoding of one string column: str -> int16 code.

    A seen string is one dict subscript; `__missing__` runs only the first time
    a string is seen. `values[code]` is the string, in code order, and only
    grows, so a reader can take `values[:n]` without the lock."""

    __slots__ = ("values",)

    def __init__(self) -> None:
        super().__init__()
        self.values: list[str] = []

    def __missing__(self, key) -> int:
        code = len(self.values)
        if code >= wire.MAX_DICT_ENTRIES:
            raise OverflowError(f"more than {wire.MAX_DICT_ENTRIES} distinct strings")
        # str.__str__ turns a str-mixin enum (Axis.DP) into its plain value "dp".
        self.values.append(str.__str__(key) if isinstance(key, str) else str(key))
        self[key] = code
        return code


class KindBuffer:
    """Fixed-capacity columns of one record kind (`wire.RECORDED[kind]`, in `wire.SCHEMA` order)."""

    __slots__ = ("kind", "capacity", "cols", "n", "num_dropped")

    def __init__(self, kind: str, capacity: int) -> None:
        self.kind = kind
        self.capacity = capacity
        self.cols = tuple(array(c.fmt, bytes(c.itemsize * capacity)) for c in wire.RECORDED[kind])
        self.n = 0
        self.num_dropped = 0

    def views(self) -> dict[str, memoryview]:
        """The filled rows, zero-copy, ready for `wire.encode_batch`."""
        n = self.n
        return {c.name: memoryview(col)[:n] for c, col in zip(wire.RECORDED[self.kind], self.cols)}

    def column(self, name: str) -> array:
        return self.cols[_COLUMN_INDEX[self.kind][name]]


_COLUMN_INDEX = {kind: {c.name: i for i, c in enumerate(cols)} for kind, cols in wire.RECORDED.items()}


class BufferSet:
    """One buffer per kind plus the pending events: what one flush drains."""

    __slots__ = ("step", "collective", "scalar", "heartbeat", "events", "num_events_dropped", "dict_sizes")

    def __init__(self, capacity: int) -> None:
        self.step = KindBuffer(wire.STEP, capacity)
        self.collective = KindBuffer(wire.COLLECTIVE, capacity)
        self.scalar = KindBuffer(wire.SCALAR, capacity)
        self.heartbeat = KindBuffer(wire.HEARTBEAT, capacity)
        self.events: list[dict] = []
        self.num_events_dropped = 0
        self.dict_sizes: dict[str, int] = {}  # code-list lengths at the swap

    def kinds(self) -> tuple[KindBuffer, ...]:
        return (self.step, self.collective, self.scalar, self.heartbeat)

    def num_rows(self) -> dict[str, int]:
        return {b.kind: b.n for b in self.kinds()}

    def is_empty(self) -> bool:
        return not self.events and not any(b.n for b in self.kinds())

    def reset(self) -> None:
        for b in self.kinds():
            b.n = 0
            b.num_dropped = 0
        self.events = []
        self.num_events_dropped = 0
        self.dict_sizes = {}


def _coerce(fmt: str, value):
    """Slow path for a value the array refused (None, a float for an int column...).
    None is "not measured": NULL_F64 for a float, -1 for an integer."""
    if fmt == "d":
        return NULL_F64 if value is None else float(value)
    return -1 if value is None else int(value)


class Recorder:
    """The record methods and the buffers behind them. `Agent` adds the flusher.

    `attempt` is read on every record (rollback lineage); set it between steps."""

    def __init__(self, capacity: int, clock: Callable[[], float] = time.time) -> None:
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        self.attempt = 0
        self._clock = clock
        self._lock = threading.Lock()
        self._capacity = capacity
        self._codes = {"op": Codes(), "axis": Codes(), "name": Codes(), "phase": Codes()}
        self._op_codes = self._codes["op"]
        self._axis_codes = self._codes["axis"]
        self._name_codes = self._codes["name"]
        self._phase_codes = self._codes["phase"]
        self._spare: BufferSet | None = BufferSet(capacity)
        self._install(BufferSet(capacity))
        self._num_invalid = 0
        self._phase = "init"  # set_phase / record_step store these; heartbeats read them
        self._hb_step = -1
        # A loss above spike_above is urgent. The flusher feeds the drained losses to the
        # baseline and publishes its threshold (`_learn_losses`): one compare per step here.
        self.loss_baseline = LossBaseline()
        self.spike_above = math.inf  # inf during the baseline's warm-up
        self._prev_scale = -math.inf  # the previous step's loss scale (none yet: no backoff)
        self._prev_step = -2  # the previous record_step's step and time: a step_s not given is their gap
        self._prev_ts = 0.0
        self.num_urgent = 0  # steps that asked for an urgent flush

    def _install(self, bufs: BufferSet) -> None:
        # Direct attributes: one attribute load per record instead of two.
        self._active = bufs
        self._step_buf = bufs.step
        self._coll_buf = bufs.collective
        self._scalar_buf = bufs.scalar
        self._hb_buf = bufs.heartbeat

    # -- hot path ----------------------------------------------------------
    def record_step(self, step, *, loss=None, grad_norm=None, loss_scale=None, lr=None, tokens=None, step_s=None,
                    fwd_s=None, bwd_s=None, opt_s=None, data_s=None, comm_exposed_s=None, mem_bytes=None,
                    skipped=False, local_loss=None, finite_fwd=-1, finite_bwd=-1, sample_epoch=-1, sample_from=-1,
                    sample_to=-1) -> None:
        """One optimizer step of this rank; every value but `step` by keyword and optional.
        Pass Python numbers (a tensor here would be converted with a device sync).
        Never raises; a full buffer drops.

        A value not given (or None) is "not measured": NULL in the tables, never NaN
        or 0, so a loop that only knows its loss records `record_step(step, loss=x)`
        and opens no NaN detector. `loss`, `grad_norm`: global (after the data-parallel
        average); `loss_scale`: the dynamic loss scale; `lr`; `tokens`: what this rank's
        replica processed; `*_s`: seconds of the whole step, forward, backward,
        optimizer, data wait, exposed communication; `mem_bytes`; `skipped`: the
        optimizer step was skipped (an inf under fp16).

        `step_s` not given: the time on the agent's clock since the previous
        `record_step`, when that was of the previous step (`step - 1`); else NULL (the
        first step, and the first after a jump: a resume, a rollback). That interval
        holds everything between the calls (data, eval, a checkpoint), and in
        synchronous data parallel it is the same on every rank (they wait for each
        other at the gradient all-reduce): it gives the step time and throughput, not
        a straggler's name, which takes `fwd_s`/`bwd_s`/`opt_s` net of communication
        (analysis/detectors/straggler.py).

        The local signals (analysis/frames.py) name the origin rank of a NaN or spike:
        `local_loss`: this replica's loss before the DP average; `finite_fwd`/
        `finite_bwd`: 1 when this rank's stage output / local grads were all finite, 0
        when not (-1: not measured); `sample_*`: the replica's sample window
        [sample_from, sample_to) of epoch `sample_epoch` (-1: not measured).

        A step a detector must see now (`agent.urgent`) asks for an immediate flush
        (`_urgent`, which never blocks)."""
        ts = self._clock()
        # "Not measured" is the NaN NULL_F64 (floats) or -1 (integers): a store like any value.
        if loss is None:
            loss = NULL_F64
        if grad_norm is None:
            grad_norm = NULL_F64
        if loss_scale is None:
            loss_scale = NULL_F64
        if step_s is None:
            step_s = ts - self._prev_ts if step == self._prev_step + 1 else NULL_F64
        self._prev_ts = ts
        self._prev_step = step
        lock = self._lock
        lock.acquire()
        try:
            buf = self._step_buf
            i = buf.n
            if i < buf.capacity:
                (c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14, c15, c16, c17, c18, c19, c20,
                 c21, c22) = buf.cols
                c0[i] = step
                c1[i] = self.attempt
                c2[i] = ts
                c3[i] = loss
                c4[i] = grad_norm
                c5[i] = loss_scale
                c6[i] = NULL_F64 if lr is None else lr
                c7[i] = -1 if tokens is None else tokens
                c8[i] = step_s
                c9[i] = NULL_F64 if fwd_s is None else fwd_s
                c10[i] = NULL_F64 if bwd_s is None else bwd_s
                c11[i] = NULL_F64 if opt_s is None else opt_s
                c12[i] = NULL_F64 if data_s is None else data_s
                c13[i] = NULL_F64 if comm_exposed_s is None else comm_exposed_s
                c14[i] = -1 if mem_bytes is None else mem_bytes
                c15[i] = skipped
                if local_loss is None:
                    c16[i] = 0.0
                    c17[i] = 0
                else:
                    c16[i] = local_loss
                    c17[i] = 1
                c18[i] = finite_fwd
                c19[i] = finite_bwd
                c20[i] = sample_epoch
                c21[i] = sample_from
                c22[i] = sample_to
                buf.n = i + 1
            else:
                buf.num_dropped += 1
        except Exception:
            self._store_slow(self._step_buf, (step, self.attempt, ts, loss, grad_norm, loss_scale, lr, tokens,
                                              step_s, fwd_s, bwd_s, opt_s, data_s, comm_exposed_s, mem_bytes,
                                              skipped, 0.0 if local_loss is None else local_loss,
                                              0 if local_loss is None else 1, finite_fwd, finite_bwd,
                                              sample_epoch, sample_from, sample_to))
        finally:
            lock.release()
        self._hb_step = step
        # Must a detector see this step now? (agent/urgent.py) Comparisons only: x - x != 0 is
        # NaN or +-inf (NULL_F64, not measured, is a NaN too: told apart by identity, only then);
        # the spike threshold comes from the loss baseline the flusher keeps. A NULL loss scale
        # compares False: no backoff is seen across a step without one.
        try:
            if (skipped or finite_fwd == 0 or finite_bwd == 0 or (loss - loss != 0.0 and loss is not NULL_F64)
                    or (grad_norm - grad_norm != 0.0 and grad_norm is not NULL_F64)
                    or loss_scale < self._prev_scale or loss > self.spike_above):
                self._urgent()
            self._prev_scale = loss_scale
        except Exception:  # noqa: BLE001 - a value the test cannot compare: no urgent flush, never a raise
            pass

    def _learn_losses(self, buf: KindBuffer) -> None:
        """Flusher side: feed a drained step buffer's losses (not the skipped steps') to
        the baseline, in order, and publish its new spike threshold."""
        baseline = self.loss_baseline
        losses, skipped = buf.column("loss"), buf.column("skipped")
        for i in range(buf.n):
            if not skipped[i]:
                baseline.far(losses[i])
        self.spike_above = baseline.threshold()

    def _urgent(self) -> None:
        """A step a detector must see now was just recorded. The agent wakes its
        flusher; a bare Recorder only counts it."""
        self.num_urgent += 1

    def collective(self, step, seq, group_seq, op, axis, group_id, peer, nbytes, start_ts, duration_s,
                   wait_s, attempt=None) -> None:
        """One completed communication op: exactly `trainer.comm.CommSink`. `attempt`: the
        op's lineage when not the current one (agent/flight.py reads ops a while after they
        ran, perhaps across a rollback)."""
        lock = self._lock
        lock.acquire()
        try:
            buf = self._coll_buf
            i = buf.n
            if i < buf.capacity:
                c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11 = buf.cols
                c0[i] = step
                c1[i] = self.attempt if attempt is None else attempt
                c2[i] = seq
                c3[i] = group_seq
                c4[i] = self._op_codes[op]
                c5[i] = self._axis_codes[axis]
                c6[i] = group_id
                c7[i] = peer
                c8[i] = nbytes
                c9[i] = start_ts
                c10[i] = duration_s
                c11[i] = wait_s
                buf.n = i + 1
            else:
                buf.num_dropped += 1
        except Exception:
            self._store_slow(self._coll_buf, (step, self.attempt if attempt is None else attempt, seq, group_seq, op,
                                              axis, group_id, peer, nbytes, start_ts, duration_s, wait_s))
        finally:
            lock.release()

    def record_scalar(self, step, name, value) -> None:
        """A free-form scalar (eval loss, a custom metric) named `name`."""
        ts = self._clock()
        lock = self._lock
        lock.acquire()
        try:
            buf = self._scalar_buf
            i = buf.n
            if i < buf.capacity:
                c0, c1, c2, c3, c4 = buf.cols
                c0[i] = step
                c1[i] = self.attempt
                c2[i] = ts
                c3[i] = self._name_codes[name]
                c4[i] = value
                buf.n = i + 1
            else:
                buf.num_dropped += 1
        except Exception:
            self._store_slow(self._scalar_buf, (step, self.attempt, ts, name, value))
        finally:
            lock.release()

    def set_phase(self, phase: str, step: int) -> None:
        """What the training thread is doing now; read by the next heartbeat."""
        self._phase = phase
        self._hb_step = step

    # -- flusher side ------------------------------------------------------
    def _record_heartbeat(self, ts: float, step: int, phase: str, last_seq: int, last_op: str | None = None,
                          last_axis: str | None = None, last_group_id: int = -1, last_group_seq: int = -1,
                          interval_s: float = wire.NULL_F64) -> None:
        """`last_op` ... `last_group_seq`: the collective `last_seq` names (None / -1:
        unknown, NULL in the tables); `interval_s`: the heartbeat interval (the time until
        the next, which the collector waits some of before it reads silence as a crash)."""
        with self._lock:
            buf = self._hb_buf
            i = buf.n
            if i >= buf.capacity:
                buf.num_dropped += 1
                return
            op = -1 if last_op is None else last_op
            axis = -1 if last_axis is None else last_axis
            try:
                c0, c1, c2, c3, c4, c5, c6, c7, c8 = buf.cols
                c0[i] = ts
                c1[i] = step
                c2[i] = self._phase_codes[phase]
                c3[i] = last_seq
                c4[i] = -1 if last_op is None else self._op_codes[last_op]
                c5[i] = -1 if last_axis is None else self._axis_codes[last_axis]
                c6[i] = last_group_id
                c7[i] = last_group_seq
                c8[i] = interval_s
                buf.n = i + 1
            except Exception:
                self._store_slow(buf, (ts, step, phase, last_seq, op, axis, last_group_id, last_group_seq, interval_s))

    def _add_event(self, event: dict) -> None:
        """Queue an already JSON-safe event dict (rare: the caller builds it)."""
        with self._lock:
            bufs = self._active
            if len(bufs.events) < MAX_EVENTS:
                bufs.events.append(event)
            else:
                bufs.num_events_dropped += 1

    def _swap(self) -> BufferSet:
        """Take the filled buffers and install the empty spare. Hand the result back
        with `_recycle` once it is encoded."""
        spare = self._spare or BufferSet(self._capacity)
        self._spare = None
        with self._lock:
            drained = self._active
            self._install(spare)
            drained.dict_sizes = {col: len(codes.values) for col, codes in self._codes.items()}
        return drained

    def _recycle(self, bufs: BufferSet) -> None:
        bufs.reset()
        self._spare = bufs

    def _dict_snapshot(self, bufs: BufferSet) -> dict[str, list[str]]:
        """The code lists as they were when `bufs` was swapped out (codes only grow)."""
        return {col: self._codes[col].values[:n] for col, n in bufs.dict_sizes.items()}

    def _store_slow(self, buf: KindBuffer, values: tuple) -> None:
        """A value the fast path refused: coerce it, or drop the record and count it.
        Called with the lock held; row `buf.n` may be half written and is rewritten."""
        i = buf.n
        if i >= buf.capacity:
            buf.num_dropped += 1
            return
        try:
            for col, arr, value in zip(wire.RECORDED[buf.kind], buf.cols, values):
                if col.dict_encoded:
                    arr[i] = -1 if value == -1 and col.null == -1 else self._codes[col.dict_name][value]
                else:
                    arr[i] = _coerce(col.fmt, value)
            buf.n = i + 1
        except Exception as e:  # noqa: BLE001 - telemetry must never raise into training
            buf.num_dropped += 1
            self._num_invalid += 1
            if self._num_invalid == 1:
                log.warning("llmwatch agent: dropped a %s record it cannot store (%s: %s); further ones are only "
                            "counted", buf.kind, type(e).__name__, e)
