"""The agent inside every rank: the record API plus the flusher thread behind it.

The training thread only ever runs the `Recorder` stores (agent/ring.py) and
a few cheap setters. Everything else happens on one daemon thread, the
flusher, every `flush_interval_s`:

    heartbeat row and device-health sample (when due) -> swap buffers -> encode one wire batch
    -> bridges (OTel spans, Prometheus gauges) -> loss baseline -> POST, or
    spool -> replay spool

`flush_interval_s` is 1 s, on a grid of the wall clock (`flush_phase`): the ranks of
a job flush in the same instant, so the collector stores them in one commit and
judges them in one detection pass, not one of each per rank (a dp2 job's
collector spent half as much CPU beside its ranks); past 128 ranks the grid
points are spread over the interval by node, a node's ranks together (the
batches its relay bundles). A step a detector must see now (a non-finite loss or
grad norm, a finite flag 0, a skipped step, a loss-scale backoff, a loss far
above the rank's running baseline: agent/urgent.py) wakes the flusher at once,
at most once per `urgent_min_interval_s` (a step inside that limit is served when
it has passed), so a flood of NaN steps costs ten flushes a second, not one per
step. The training thread only sets an Event; it never waits. After an urgent
flush, and while the collector's answers carry `followup_s` (to a run's rank 0,
the one that picks the job's commands, while the policy watches a slow-down it
may act on any moment), the flusher ships every `urgent_followup_interval_s`:
the command rides back within a fraction of a second, not a flush interval.

`close()` first queues an `agent_closed` event, so that the last batch tells
the collector this rank finished cleanly (its silence is no crash).

While batches go to the spool (the collector away, or a backlog to replay
first), a batch is cut only every `spool_flush_interval_s` (or when a buffer is
half full): replaying costs one round trip per batch, ~0.5 s against the
collector's group commit, so ten 0.2 s batches would take five seconds where one
2 s batch takes half of one. The bridges then see rows that often too.

`flush()` and `close()` work to a deadline: they cut a batch and replay the
spool at once, whatever the backoff state, and give up when the deadline
passes; `close()` then logs how many batches it left in the spool, and where.

Nothing here raises into the host program: failures are logged once on the
"llmwatch.agent" logger and counted in `stats()`. The token is never logged,
spooled or put in a batch; `run_info` is scrubbed of secret-looking keys
(`scrub_secrets`) before it is encoded, in case a config with one slips in.
"""

from __future__ import annotations

import atexit
import logging
import math
import operator
import os
import re
import socket
import tempfile
import threading
import time
import uuid
import zlib
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from agent import summary, wire
from agent.device_health import DeviceHealthSampler
from agent.ring import EVENT, MAX_EVENTS, STATS_KINDS, BufferSet, KindBuffer, Recorder
from agent.spool import Spool, SpoolBusy
from agent.transport import HttpClient, Shipper, ShipStats

log = logging.getLogger("llmwatch.agent")

_MAX_FOLLOWUP_S = 10.0  # a collector's follow-up request is honoured this long at most (renewed per answer)
_MAX_RAW_OPS_S = 30.0  # and its request for op rows (agent/summary.py)
_HEALTH_ROWS = 256  # device-health samples held while batches wait (one per heartbeat); more are dropped
FLUSH_SLOT_RANKS = 64  # about this many ranks flush in the same instant in a large job (`flush_phase`)
FLUSH_SLOTS_MAX = 64
_HB_EARLY = 0.25  # a heartbeat due this fraction of its interval later rides with the flush now
HW_ID_ENV = "LLMWATCH_HW_ID"  # this rank's hardware id, when NVML has none to give (a CPU host, a test)
# The flush and heartbeat periods of an agent made without them (`watch()`, llmwatch-instrument, the
# integrations): a job too large to post every second (docs/scale.md) sets both, with no code change
FLUSH_ENV, HEARTBEAT_ENV = "LLMWATCH_FLUSH_S", "LLMWATCH_HEARTBEAT_S"


def env_seconds(name: str, default: float) -> float:
    """$name as a number of seconds > 0, or `default` when unset or empty; anything else is
    a ValueError that names the variable (at the agent's start, not a silent default)."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"${name} must be a number of seconds > 0, not {raw[:40]!r}")
    return value


_UNKNOWN = object()


def flush_phase(node: str, world_size: int, interval_s: float) -> float:
    """Where in each `interval_s` this rank flushes, on the wall clock: 0 for every rank of
    a job under 2 x FLUSH_SLOT_RANKS ranks (one commit and one detection pass for all of
    them); past that, one of up to FLUSH_SLOTS_MAX evenly spaced points, chosen by the
    node's name, so that a node's ranks flush together and the job's load is spread."""
    slots = min(FLUSH_SLOTS_MAX, max(1, int(world_size) // FLUSH_SLOT_RANKS))
    return (zlib.crc32(node.encode()) % slots) / slots * interval_s


def until_grid(now_wall: float, interval_s: float, phase_s: float) -> float:
    """Seconds from `now_wall` to the next point of the grid `phase_s + k * interval_s`, in
    (0, interval_s]."""
    return interval_s - (now_wall - phase_s) % interval_s


@dataclass(kw_only=True, slots=True)
class AgentConfig:
    url: str | None = None  # collector base URL (http:// or https://); None: nothing is sent (bridges only)
    token: str | None = field(default=None, repr=False)  # bearer token; kept out of repr() and so out of logs
    ca_file: str | None = None  # https: PEM bundle that verifies the collector; None: the system's trust store
    # The flusher's period. A step a detector must see now (agent/urgent.py) is flushed
    # at once instead, at most one such urgent flush per urgent_min_interval_s.
    # ($LLMWATCH_FLUSH_S when not given)
    flush_interval_s: float = field(default_factory=lambda: env_seconds(FLUSH_ENV, 1.0))
    urgent_min_interval_s: float = 0.1
    # After an urgent flush the collector is likely to answer with a command (a rollback
    # for that NaN): for this long the flusher ships every urgent_followup_interval_s, so
    # the command rides back on an ingest answer within a fraction of a second.
    urgent_followup_s: float = 3.0
    urgent_followup_interval_s: float = 0.2
    # Each heartbeat ships a batch, and says this interval: the collector reads a rank as silent
    # after 3 of them at least ([crash] silence_beats). $LLMWATCH_HEARTBEAT_S when not given.
    heartbeat_interval_s: float = field(default_factory=lambda: env_seconds(HEARTBEAT_ENV, 1.0))
    # A device-health sample (agent/device_health.py) rides with every heartbeat: NVML
    # when `pynvml` and a GPU are there, host memory and CPU time always. gpu_index None:
    # the rank's LOCAL_RANK through CUDA_VISIBLE_DEVICES.
    device_health: bool = True
    gpu_index: int | None = None
    spool_dir: str | None = None  # default: <tmp>/llmwatch-spool/<run_id>/rank<rank>
    spool_bytes: int = 256 * 1024 * 1024
    capacity: int = 65536  # rows per kind per buffer (two buffers)
    otlp_endpoint: str | None = None  # e.g. http://127.0.0.1:4318; spans go to <endpoint>/v1/traces
    prometheus_port: int | None = None  # 0 picks a free port (see stats()["prometheus_port"])
    timeout_s: float = 2.0  # per HTTP request
    retry_min_s: float = 0.5  # probe backoff while the collector is away
    retry_max_s: float = 10.0
    # While batches go to the spool, cut one this often (not every flush_interval_s):
    # each spooled batch costs one round trip when it is replayed.
    spool_flush_interval_s: float = 2.0
    # A batch answered with this many real 5xx errors in a row (not 502/503/504, not a
    # timeout or refused connection) is set aside in <spool_dir>/quarantine, at most
    # quarantine_bytes of them, so that it does not block the rank's telemetry for good.
    max_batch_failures: int = 5
    quarantine_bytes: int = 32 * 1024 * 1024
    # Collectives (agent/summary.py): "ops" ships every op row; "summary" one row per
    # (step, op, axis, group, peer) instead, op rows only for every raw_every_steps-th
    # step and while the collector asks; "auto" (default, or $LLMWATCH_COLLECTIVES):
    # summary in a job of summarize_from_ranks ranks or more.
    collectives: str = field(default_factory=lambda: os.environ.get("LLMWATCH_COLLECTIVES", "auto"))
    summarize_from_ranks: int = 256
    raw_every_steps: int = 100

    def __post_init__(self) -> None:
        if self.flush_interval_s <= 0 or self.heartbeat_interval_s <= 0 or self.timeout_s <= 0:
            raise ValueError("flush_interval_s, heartbeat_interval_s and timeout_s must be > 0")
        if self.urgent_min_interval_s < 0 or self.urgent_followup_s < 0 or self.urgent_followup_interval_s <= 0:
            raise ValueError("urgent_min_interval_s, urgent_followup_s must be >= 0, urgent_followup_interval_s > 0")
        if self.capacity < 1 or self.spool_bytes < 1:
            raise ValueError("capacity and spool_bytes must be >= 1")
        if not 0 < self.retry_min_s <= self.retry_max_s:
            raise ValueError("need 0 < retry_min_s <= retry_max_s")
        if self.spool_flush_interval_s <= 0:
            raise ValueError("spool_flush_interval_s must be > 0")
        if self.max_batch_failures < 1 or self.quarantine_bytes < 1:
            raise ValueError("max_batch_failures and quarantine_bytes must be >= 1")
        if self.collectives not in summary.MODES:
            raise ValueError(f"collectives must be one of {', '.join(summary.MODES)}, not {self.collectives!r}")
        if self.summarize_from_ranks < 1 or self.raw_every_steps < 1:
            raise ValueError("summarize_from_ranks and raw_every_steps must be >= 1")
        if self.prometheus_port is not None and not 0 <= self.prometheus_port <= 65535:
            raise ValueError(f"prometheus_port {self.prometheus_port} is not a TCP port")


def _seconds(body: dict, key: str) -> float | None:
    """A finite, non-negative number of seconds the collector's answer gives under `key`, else None."""
    x = body.get(key)
    if isinstance(x, (int, float)) and not isinstance(x, bool) and 0 <= x < float("inf"):
        return float(x)
    return None


@dataclass(frozen=True, slots=True)
class Command:
    """A control command from the collector, read at a step boundary."""

    id: str
    kind: str
    args: dict = field(default_factory=dict)
    issued_ts: float = 0.0


def json_safe(value, depth: int = 0):
    """A copy of `value` that `json.dumps(allow_nan=False)` accepts: non-finite
    floats become "nan"/"inf"/"-inf", unknown objects their str()."""
    if value is None or type(value) in (bool, str, int):
        return value
    if isinstance(value, float):  # numpy float64 too
        return float(value) if math.isfinite(value) else repr(float(value))
    if isinstance(value, str):  # a str enum: its plain value
        return str.__str__(value)
    if isinstance(value, dict) and depth < 32:
        return {str(k): json_safe(v, depth + 1) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)) and depth < 32:
        return [json_safe(v, depth + 1) for v in value]
    try:
        return operator.index(value)  # bool/int subclasses, numpy integers
    except TypeError:
        return str(value)


REDACTED = "<redacted>"
_SECRET_WORDS = frozenset(("token", "secret", "secrets", "password", "passwords", "passwd", "authorization",
                           "apikey"))
_CAMEL_BOUNDARY = re.compile(r"([a-z0-9])([A-Z])")
_NOT_WORD = re.compile(r"[^a-z0-9]+")


def is_secret_key(key: str) -> bool:
    """A key that names a secret: one of its words (snake, kebab or camel case, any
    case) is token, secret(s), password(s), passwd or authorization, or it says api
    key(s). Whole words only: "tokens", "num_tokens" and "tokenizer" count tokens
    of text in a training config and are not secrets."""
    words = _NOT_WORD.split(_CAMEL_BOUNDARY.sub(r"\1_\2", key).lower())
    return (not _SECRET_WORDS.isdisjoint(words)
            or any(a == "api" and b in ("key", "keys") for a, b in zip(words, words[1:])))


def scrub_secrets(value):
    """A copy of a JSON-safe `value` with the value of every secret-looking key
    (`is_secret_key`, at any depth, in lists too) replaced by "<redacted>".
    None and "" stay: there is nothing to hide, and "<redacted>" would claim a
    secret was set."""
    if isinstance(value, dict):
        return {k: REDACTED if v not in (None, "") and is_secret_key(k) else scrub_secrets(v)
                for k, v in value.items()}
    if isinstance(value, list):
        return [scrub_secrets(v) for v in value]
    return value


def default_spool_dir(run_id: str, rank: int) -> str:
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", run_id)[:100] or "run"
    # per user: another user's directory of the same name in /tmp is not ours to write into
    user = os.getuid() if hasattr(os, "getuid") else "user"
    return os.path.join(tempfile.gettempdir(), f"llmwatch-spool-{user}", safe, f"rank{rank}")


class Agent(Recorder):
    """Telemetry of one rank. See the package docstring for an example."""

    def __init__(self, config: AgentConfig, run_id: str, rank: int, node: str = "", coords: dict | None = None,
                 world_size: int = 1, run_info: dict | None = None, clock: Callable[[], float] = time.time,
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        """`clock`: the rows' timestamps (unix s); `monotonic`: the urgent flushes'
        rate limit (both injectable for tests)."""
        super().__init__(config.capacity, clock)
        self._monotonic = monotonic
        self.config = config
        self.run_id = str(run_id)
        self.rank = int(rank)
        self.node = node or socket.gethostname()
        self.coords = json_safe(dict(coords or {}))
        self.world_size = int(world_size)
        self.incarnation = uuid.uuid4().hex
        self._run_info = scrub_secrets(json_safe(run_info)) if run_info is not None else None
        self._batch_seq = 0
        self._seq_source: Callable[[], int | tuple] | None = None
        self._pollers: list[Callable[[], object]] = []
        self._poll_at = math.inf  # monotonic: a poller asked to be called again by then
        # urgent flushes: the training thread asks (`_urgent`), the flusher serves
        self._urgent_ok_at = -math.inf  # monotonic: no urgent wake before this (the rate limit)
        self._urgent_requested = False  # a wake is pending
        self._urgent_missed = False  # an urgent step came inside the rate limit: flush at _urgent_ok_at
        self.num_urgent_flushes = 0
        self._mailbox: deque[Command] = deque()
        self._seen_commands: set[str] = set()
        self._clean_through: tuple[int, int, int] | None = None  # (attempt, step, judged): the collector's watermark
        self._watermarked = False  # the collector answers with a watermark (it runs detection)
        self._end_wait_s: float | None = None  # how long a finished run waits for the last verdicts (the collector's)
        self._followup_until = -math.inf  # monotonic: the collector asked for a follow-up until then
        self._summarize = summary.summarizes(config.collectives, self.world_size, config.summarize_from_ranks)
        self._flush_phase = flush_phase(self.node, self.world_size, config.flush_interval_s)
        self._raw_ops_until = -math.inf  # monotonic: the collector asked for op rows until then
        self._done_step: int | None = None  # flusher: the step record_step was given last
        self._held_ops: list[tuple] = []  # flusher: op rows of a step not finished at the last batch
        self._recorded = {k: 0 for k in STATS_KINDS}
        self._buffer_dropped = {k: 0 for k in STATS_KINDS}
        self._drops_reported = {k: 0 for k in STATS_KINDS}
        self._drops_in_flight = self._drops_reported
        self._shipper: Shipper | None = None
        self._bridges: list = []
        self._opened = False
        self._thread: threading.Thread | None = None
        self._wake = threading.Event()
        self._stopping = False
        self._close_deadline = 0.0
        self._cv = threading.Condition()
        self._flush_requested = 0
        self._flush_done = 0
        self._flush_ok = False
        self._lost_since_flush = False  # a periodic cycle's batch was rejected or dropped since the last flush
        self._flush_deadline = 0.0  # monotonic; of the newest flush request
        self._next_cut = 0.0  # monotonic; while batches go to the spool, no batch is cut before this
        self._last_fill = 0.0  # of the fullest active buffer at the last cycle (0..1)
        self._io_lock = threading.Lock()  # one cycle at a time (flusher, or inline when there is none)
        self._next_hb = 0.0
        # flusher thread only (under _io_lock): no lock with the training thread
        self._health: DeviceHealthSampler | None = DeviceHealthSampler(config.gpu_index) if config.device_health else None
        self._hw_id: object = _UNKNOWN  # _hardware_id(), asked once on the flusher thread
        self._health_overlay: Callable[[tuple, int], tuple] | None = None
        self._health_buf = KindBuffer(wire.DEVICE_HEALTH, _HEALTH_ROWS)
        self._closed = False
        self._logged: set[str] = set()
        self._last_error = ""

    # -- lifecycle ---------------------------------------------------------
    def start(self) -> None:
        """Open the spool, bridges and the flusher thread. Idempotent."""
        if self._thread is not None or self._closed:
            return
        try:
            with self._io_lock:
                self._open()
            self._thread = threading.Thread(target=self._run, name=f"llmwatch-agent-flusher-rank{self.rank}",
                                            daemon=True)
            self._thread.start()
            atexit.register(self.close)
        except Exception as e:  # noqa: BLE001 - without a flusher, flush()/close() still ship inline
            self._log_once("start", "llmwatch agent: cannot start the flusher: %r", e)

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Ship everything recorded so far now, replaying the spool too. True when
        all of it (and the spool) reached the collector within `timeout_s`."""
        try:
            if self._closed:
                return False
            deadline = time.monotonic() + timeout_s
            if self._thread is None or not self._thread.is_alive():
                return self._cycle_guarded(deadline=deadline)
            with self._cv:
                self._flush_requested += 1
                self._flush_deadline = deadline
                target = self._flush_requested
                self._wake.set()
                done = self._cv.wait_for(lambda: self._flush_done >= target, timeout_s)
                return done and self._flush_ok
        except Exception as e:  # noqa: BLE001 - never raise into training
            self._log_once("flush", "llmwatch agent: flush failed: %r", e)
            return False

    def close(self, timeout_s: float = 5.0) -> None:
        """Final flush: cut the last batch and deliver it and the spool now, whatever
        the backoff state, within `timeout_s`; what cannot be delivered by then stays
        in the spool (logged: how many batches, where). Stops the threads. Returns
        within `timeout_s` plus ~0.5 s, never raises. Idempotent."""
        if self._closed:
            return
        # before the final drain, so it rides in the last batch: a clean finish, not a crash
        self.event("agent_closed", step=self._hb_step)
        self._closed = True
        try:
            atexit.unregister(self.close)
            thread = self._thread
            if thread is not None and thread.is_alive():
                self._close_deadline = time.monotonic() + timeout_s
                self._stopping = True
                self._wake.set()
                thread.join(timeout_s + 0.5)
                if thread.is_alive():
                    log.warning("llmwatch agent: flusher still busy after %.1f s; leaving it to finish", timeout_s)
            else:
                self._stopping = True  # the last batch: every held row goes (agent/summary.py)
                self._cycle_guarded(deadline=time.monotonic() + timeout_s - 0.1)
                self._release()
        except Exception as e:  # noqa: BLE001
            self._log_once("close", "llmwatch agent: close failed: %r", e)

    # -- cheap API for the training thread -----------------------------------
    def event(self, kind: str, step: int = -1, *, of_attempt: int | None = None, **data) -> None:
        """Something that happened (checkpoint saved, restart...). Rare: builds a dict.
        `of_attempt`: the attempt it belongs to when not the current one (a save queued
        before a rollback and reported after it)."""
        try:
            self._add_event({"ts": self._clock(), "step": int(step),
                             "attempt": int(self.attempt if of_attempt is None else of_attempt), "kind": str(kind),
                             "data": json_safe(data)})
        except Exception as e:  # noqa: BLE001
            self._log_once("event", "llmwatch agent: dropped event %r: %r", kind, e)

    def bind_seq_source(self, fn: Callable[[], int | tuple]) -> None:
        """`fn()` gives the last collective this rank ENTERED: its sequence number, or
        `(seq, op, axis, group_id, group_seq)` (`trainer.comm.Comm.last_entered`).
        The heartbeat reports it (a hung rank's number falls behind its peers', and
        the op, axis and group name the collective it waits in). Called on the
        flusher thread: it must only read."""
        self._seq_source = fn

    def add_poller(self, fn: Callable[[], object]) -> None:
        """Call `fn()` on the flusher thread at the start of every flush cycle, before the
        heartbeat: a source that records rows of its own (agent/flight.py, the Flight
        Recorder's collectives). It may return the seconds within which it wants to be
        called again (sooner than the next flush: the flusher wakes for it). It must be
        quick and never touch the training thread's state; one that raises is logged once
        and called again next cycle."""
        self._pollers = [*self._pollers, fn]  # a new list: the flusher iterates the old one

    def remove_poller(self, fn: Callable[[], object]) -> None:
        self._pollers = [p for p in self._pollers if p != fn]

    def clock_offset(self) -> tuple[float, float]:
        """(offset_s, error_s): add offset_s to this host's clock to read the collector's,
        to within error_s (agent/clock.py; (0, 0) with the collector on this host)."""
        client = self._shipper.client if self._shipper is not None else None
        sync = getattr(client, "clock", None)
        return (sync.offset_s, sync.error_s) if sync is not None else (0.0, math.inf)

    def set_health_overlay(self, fn: Callable[[tuple, int], tuple] | None) -> None:
        """`fn(sample, step) -> sample` rewrites each device-health sample (the values of
        agent/device_health.py FIELDS; `step` the heartbeat's) before it is stored: the
        trainer's injected device faults (trainer/faults.py `devhealth`, a simulated
        device). Called on the flusher thread right after the sampler, so it must be
        cheap and only read what the training thread writes; one that raises costs
        that sample (counted as dropped, logged once). None removes it.

        The next heartbeat, and its sample, come at once: the sample taken when the agent
        started did not have the overlay, and a detector takes the first sample it sees as
        the device's state at start (the ECC count new errors are counted from); a heartbeat
        later, a fast job's fault may already show (a CI run's ECC fault at step 40 was in
        the baseline, 35 steps a second)."""
        self._health_overlay = fn
        self._next_hb = 0.0
        self._wake.set()

    def set_attempt(self, n: int) -> None:
        self.attempt = int(n)

    def clean_through(self) -> int | None:
        """The newest step of this rank's attempt the collector vouches for (every detector
        judged it, nothing that spoils the weights at or before it; collector/live/watermark.py):
        a checkpoint at or below it is known-good. -1: the collector keeps a watermark but has
        vouched for nothing of this attempt yet (it trails the ranks; a rollback's lineage
        starts over): none is known-good, every one may become it. None: no watermark comes
        (no collector answered yet, or it runs no detection)."""
        mark = self._clean_through
        if mark is not None and mark[0] == self.attempt:
            return mark[1]
        return -1 if self._watermarked else None

    def judged_through(self) -> int | None:
        """The newest step of this rank's attempt every detector has judged, with nothing
        unsettled at or before it (the watermark without the checksum bound: no checksum
        comes after a run's last step). None: not known."""
        mark = self._clean_through
        return mark[2] if mark is not None and mark[0] == self.attempt else None

    def end_wait_s(self) -> float | None:
        """How long a finished run may wait for the verdict on its last steps, as the collector
        said (0: its policy would not act); None: no answer said (no collector, or none yet).
        0 while the collector is away (batches go to the spool): no verdict can come then."""
        if self._end_wait_s is not None and self._shipper is not None and self._shipper.away:
            return 0.0
        return self._end_wait_s

    def commands(self) -> list[Command]:
        """Drain the mailbox: commands received since the last call, oldest first."""
        out = []
        while self._mailbox:
            try:
                out.append(self._mailbox.popleft())
            except IndexError:
                break
        return out

    def ack(self, command_id: str, status: str, detail: str = "") -> None:
        """Tell the collector what became of a command (an event "command_ack")."""
        self.event("command_ack", step=self._hb_step, command_id=str(command_id), status=str(status),
                   detail=str(detail))

    def stats(self) -> dict:
        """Counters since this Agent was created (rows per kind, batches, last error)."""
        ship = self._shipper.stats if self._shipper is not None else ShipStats()
        active = self._active
        spool = self._shipper.spool if self._shipper is not None else None
        recorded = dict(self._recorded)
        for buf in active.kinds():
            recorded[buf.kind] += buf.n
        recorded[EVENT] += len(active.events)
        prom = next((b.port for b in self._bridges if hasattr(b, "port")), None)
        return {
            "run_id": self.run_id, "rank": self.rank, "incarnation": self.incarnation,
            "recorded": recorded, "sent": dict(ship.sent), "spooled": dict(ship.spooled),
            "replayed": dict(ship.replayed), "rejected": dict(ship.rejected),
            "quarantined": dict(ship.quarantined),
            "dropped": {k: self._buffer_dropped[k] + ship.dropped.get(k, 0) for k in STATS_KINDS},
            "batches": {"encoded": self._batch_seq, "sent": ship.num_batches_sent,
                        "spooled": ship.num_batches_spooled, "replayed": ship.num_batches_replayed,
                        "rejected": ship.num_batches_rejected, "quarantined": ship.num_batches_quarantined,
                        "dropped": ship.num_batches_dropped},
            "spool_bytes": spool.disk_bytes if spool is not None else 0,
            "spool_corrupt": spool.num_corrupt if spool is not None else 0,
            "commands_received": len(self._seen_commands),
            "urgent": {"steps": self.num_urgent, "flushes": self.num_urgent_flushes},
            "last_error": ship.last_error or self._last_error,
            "prometheus_port": prom,
        }

    # -- flusher -------------------------------------------------------------
    def _open(self) -> None:
        if self._opened:
            return
        self._opened = True
        cfg = self.config
        if cfg.url:
            try:
                client = HttpClient(cfg.url, cfg.token, cfg.timeout_s, ca_file=cfg.ca_file)
            except ValueError as e:  # a bad URL or CA file
                client = None
                self._log_once("url", "llmwatch agent: %s; nothing will be sent (batches go to the spool)", e)
            self._shipper = Shipper(client, self._open_spool(), self._on_response, retry_min_s=cfg.retry_min_s,
                                    retry_max_s=cfg.retry_max_s, max_failures=cfg.max_batch_failures,
                                    quarantine_bytes=cfg.quarantine_bytes)
        if cfg.otlp_endpoint or cfg.prometheus_port is not None:
            from agent import bridges  # lazy: the SDKs load only when a bridge is asked for

            self._bridges = bridges.open_bridges(cfg, {"run_id": self.run_id, "rank": self.rank, "node": self.node})

    def _open_spool(self) -> Spool | None:
        directory = self.config.spool_dir or default_spool_dir(self.run_id, self.rank)
        try:
            try:
                return Spool(directory, self.config.spool_bytes)
            except SpoolBusy:
                # Another live agent spools for this (run, rank): use a private directory.
                private = os.path.join(directory, f"incarnation-{self.incarnation}")
                log.warning("llmwatch agent: spool %s is in use; spooling to %s", directory, private)
                return Spool(private, self.config.spool_bytes)
        except OSError as e:
            self._log_once("spool", "llmwatch agent: cannot open spool %s (%s); unsendable batches will be dropped",
                           directory, e)
            return None

    # -- urgent flushes --------------------------------------------------------
    def _urgent(self) -> None:
        """Training thread, after a step a detector must see now: wake the flusher
        (an Event.set, never a wait), unless an urgent flush was asked for within
        `urgent_min_interval_s`; then the flusher serves it when that has passed."""
        self.num_urgent += 1
        now = self._monotonic()
        if now >= self._urgent_ok_at:
            self._urgent_ok_at = now + self.config.urgent_min_interval_s
            self._urgent_requested = True
            self._wake.set()
        else:
            self._urgent_missed = True

    def _take_urgent(self) -> tuple[bool, float]:
        """Flusher thread: (flush now for an urgent step?, when to look again for
        one that came inside the rate limit; inf: no need)."""
        if self._urgent_requested:
            self._urgent_requested = False
            self._urgent_missed = False
            return True, self._urgent_ok_at
        if self._urgent_missed:
            now = self._monotonic()
            if now < self._urgent_ok_at:
                return False, self._urgent_ok_at
            self._urgent_missed = False
            self._urgent_ok_at = now + self.config.urgent_min_interval_s
            return True, self._urgent_ok_at
        return False, math.inf

    def _run(self) -> None:
        cfg = self.config
        next_flush = time.monotonic()
        fast_until = -math.inf  # monotonic: the follow-up window of the last urgent flush
        recheck = math.inf  # on the `monotonic` clock: look for a rate-limited urgent step then
        while True:
            wait_s = min(next_flush, self._next_hb, self._poll_at) - time.monotonic()
            if recheck < math.inf:
                wait_s = min(wait_s, recheck - self._monotonic())
            self._wake.wait(max(0.0, wait_s))
            self._wake.clear()
            if time.monotonic() >= self._poll_at:
                self._poll()  # a source that asked to be read between flushes (agent/flight.py)
            stopping = self._stopping
            with self._cv:
                target = self._flush_requested
                flush_deadline = self._flush_deadline
            urgent, recheck = self._take_urgent()
            now = time.monotonic()
            forced = stopping or target > self._flush_done
            if not forced and not urgent and now < next_flush and now < self._next_hb:
                continue
            if urgent:
                self.num_urgent_flushes += 1
                fast_until = now + cfg.urgent_followup_s
            next_flush = now + (cfg.urgent_followup_interval_s if now < fast_until
                                else until_grid(time.time(), cfg.flush_interval_s, self._flush_phase))
            # close: leave 0.1 s of close()'s join for releasing the spool and bridges
            deadline = (self._close_deadline - 0.1) if stopping else (flush_deadline if forced else None)
            ok = self._cycle_guarded(deadline=deadline)
            fast_until = max(fast_until, self._followup_until)  # the answer may have asked for one
            if now < fast_until:
                next_flush = min(next_flush, now + cfg.urgent_followup_interval_s)
            if forced:  # a periodic cycle's result must not overwrite the one a flush() waits for
                with self._cv:
                    self._flush_done = target
                    self._flush_ok = ok
                    self._cv.notify_all()
            if stopping:
                break
        self._release()

    def _poll(self) -> None:
        """Run the pollers (flusher thread); each may ask to be called again sooner than the
        next flush (its answer, in seconds): `_poll_at` is the soonest such time."""
        soonest = math.inf
        for poll in self._pollers:
            try:
                again = poll()
            except Exception as e:  # noqa: BLE001 - a source's failure costs its rows, never the cycle
                self._log_once(f"poll-{getattr(poll, '__qualname__', poll)}", "llmwatch agent: a source failed: %r", e)
                continue
            if isinstance(again, (int, float)) and again >= 0:
                soonest = min(soonest, float(again))
        self._poll_at = time.monotonic() + soonest

    def _cycle_guarded(self, *, deadline: float | None) -> bool:
        # A deadline bounds the wait for the lock too (an inline flush() on another thread).
        wait_s = -1 if deadline is None else max(0.0, deadline - time.monotonic())
        if not self._io_lock.acquire(timeout=wait_s):
            return False
        try:
            self._open()
            return self._cycle(deadline)
        except Exception as e:  # noqa: BLE001 - the flusher must survive anything
            self._last_error = f"{type(e).__name__}: {e}"
            self._log_once("cycle", "llmwatch agent: flush cycle failed: %r", e)
            return False
        finally:
            self._io_lock.release()

    def _cycle(self, deadline: float | None) -> bool:
        """One flush. `deadline` None: periodic; else (flush, close) cut a batch and
        deliver it and the spool by then (monotonic), backoff or not."""
        self._poll()
        now = time.monotonic()
        every = self.config.heartbeat_interval_s
        if now >= self._next_hb - _HB_EARLY * every:  # not a wake of its own a moment later
            gap = until_grid(time.time(), every, self._flush_phase)  # with the flushes
            self._next_hb = now + (gap if gap >= (1.0 - _HB_EARLY) * every else gap + every)
            self._heartbeat()
        shipper = self._shipper
        if (deadline is None and shipper is not None and now < self._next_cut and shipper.away
                and not self._buffers_filling()):
            return shipper.pump()  # the rows wait in the buffers: fewer, larger spooled batches
        self._next_cut = now + self.config.spool_flush_interval_s
        self._last_fill = 0.0
        drained = self._swap()
        try:
            rows = self._account(drained)
            has_rows = any(rows.values()) or bool(self._held_ops)
            payload = self._encode(drained, rows) if shipper is not None and has_rows else None
            self._feed_bridges(drained)
            try:
                self._learn_losses(drained.step)  # the spike threshold record_step compares with
            except Exception as e:  # noqa: BLE001
                self._log_once("baseline", "llmwatch agent: the loss baseline failed: %r", e)
        finally:
            self._recycle(drained)
            self._health_buf.n = 0  # encoded (copied into the payload) or dropped with the batch
        if shipper is None:
            return True
        num_quarantined = shipper.stats.num_batches_quarantined
        if payload is not None:
            fate = shipper.ship(payload, rows, deadline=deadline)
            if fate in ("sent", "spooled"):  # its drop counts reached (or will reach) the collector
                self._drops_reported = self._drops_in_flight
        else:
            fate = "dropped" if has_rows else "sent"  # an encoding failure, or nothing to send
        delivered = shipper.pump() if deadline is None else shipper.drain(deadline=deadline)
        ok = (delivered and fate in ("sent", "spooled")
              and shipper.stats.num_batches_quarantined == num_quarantined)
        if deadline is None:  # periodic: a lost batch held rows the next flush() answers for
            self._lost_since_flush |= fate not in ("sent", "spooled")
            return ok
        ok, self._lost_since_flush = ok and not self._lost_since_flush, False
        return ok

    def _buffers_filling(self) -> bool:
        """Cut now rather than drop rows before the next cycle: the fullest buffer is
        half full, or would fill if it grew twice as fast as since the last cycle.
        (So holding rows back never drops more than a cut every cycle would.)"""
        bufs = self._active
        fill = max(len(bufs.events) / MAX_EVENTS, *(b.n / b.capacity for b in bufs.kinds()))
        growth, self._last_fill = fill - self._last_fill, fill
        return fill >= 0.5 or fill + 2 * growth >= 1.0

    def _heartbeat(self) -> None:
        last_seq, op, axis, group_id, group_seq = -1, None, None, -1, -1
        if self._seq_source is not None:
            try:
                entered = self._seq_source()
                if isinstance(entered, tuple):
                    seq, op, axis, group_id, group_seq = entered
                    last_seq, group_id, group_seq = int(seq), int(group_id), int(group_seq)
                    op = None if op is None else str.__str__(op) if isinstance(op, str) else str(op)
                    axis = None if axis is None else str.__str__(axis) if isinstance(axis, str) else str(axis)
                else:
                    last_seq = int(entered)
                if last_seq < 0:  # nothing entered yet: no collective to name
                    op, axis, group_id, group_seq = None, None, -1, -1
            except Exception as e:  # noqa: BLE001
                last_seq, op, axis, group_id, group_seq = -1, None, None, -1, -1
                self._log_once("seq", "llmwatch agent: the seq source failed: %r", e)
        ts, step = self._clock(), self._hb_step
        self._record_heartbeat(ts, step, self._phase, last_seq, op, axis, group_id, group_seq,
                               self.config.heartbeat_interval_s)
        if self._health is not None:
            self._sample_health(ts, step)

    def _sample_health(self, ts: float, step: int) -> None:
        """Flusher thread: one device-health row (agent/device_health.py)."""
        buf = self._health_buf
        if buf.n >= buf.capacity:
            buf.num_dropped += 1
            return
        try:
            sample = self._health.sample()
            overlay = self._health_overlay
            if overlay is not None:
                sample = overlay(sample, step)
            values = (ts, step, *sample)
            i = buf.n
            for col, arr, value in zip(wire.SCHEMA[wire.DEVICE_HEALTH], buf.cols, values):
                arr[i] = (wire.NULL_F64 if col.fmt == "d" else wire.NOT_MEASURED) if value is None else value
            buf.n = i + 1
        except Exception as e:  # noqa: BLE001 - a value out of range, a sampler bug: no row, never a raise
            buf.num_dropped += 1
            self._log_once("health", "llmwatch agent: the device-health sample failed: %r", e)

    def _account(self, bufs: BufferSet) -> dict[str, int]:
        rows = bufs.num_rows()
        rows[EVENT] = len(bufs.events)
        health = self._health_buf
        rows[wire.DEVICE_HEALTH] = health.n
        self._buffer_dropped[wire.DEVICE_HEALTH] += health.num_dropped
        health.num_dropped = 0
        for kind, n in rows.items():
            self._recorded[kind] += n
        for buf in bufs.kinds():
            self._buffer_dropped[buf.kind] += buf.num_dropped
        self._buffer_dropped[EVENT] += bufs.num_events_dropped
        return rows

    def _hardware_id(self) -> str | None:
        """This rank's hardware id, asked once on the flusher thread: $LLMWATCH_HW_ID, else its
        GPU's NVML UUID (agent/device_health.py), else None. A node's history across runs follows
        it (a renamed host keeps its record; a host whose GPU was replaced starts a new one)."""
        if self._hw_id is _UNKNOWN:
            self._hw_id = os.environ.get(HW_ID_ENV, "").strip()[:200] or (
                self._health.hw_id() if self._health is not None else None)
        return self._hw_id

    def _encode(self, bufs: BufferSet, rows: dict[str, int]) -> bytes | None:
        ship = self._shipper.stats
        # stats.dropped carries the drops not yet carried by a batch that was sent or
        # spooled: the collector adds them up, and a batch that is itself lost hands its
        # counts on to the next one.
        totals = {k: self._buffer_dropped[k] + ship.dropped[k] for k in STATS_KINDS}
        dropped = {k: totals[k] - self._drops_reported[k] for k in STATS_KINDS}
        self._drops_in_flight = totals
        header = {
            "run_id": self.run_id, "rank": self.rank, "incarnation": self.incarnation,
            "batch_seq": self._batch_seq, "node": self.node, "pid": os.getpid(), "hw_id": self._hardware_id(),
            "coords": self.coords,
            "world_size": self.world_size, "sent_ts": self._clock(), "dicts": self._dict_snapshot(bufs),
            "events": bufs.events, "run": self._run_info if self._batch_seq == 0 else None,
            "stats": {"dropped": dropped, "spooled": ship.num_batches_spooled,
                      "replayed": ship.num_batches_replayed, "rejected": ship.num_batches_rejected,
                      "quarantined": ship.num_batches_quarantined, "recorded": dict(self._recorded)},
        }
        sections = {b.kind: (b.n, b.views()) for b in (*bufs.kinds(), self._health_buf) if b.n}
        if self._summarize:
            self._summarize_collectives(bufs, sections)
        try:
            payload = wire.encode_batch(header, sections)
        except (wire.WireError, ValueError, TypeError) as e:
            for kind, n in rows.items():
                self._buffer_dropped[kind] += n
            self._log_once("encode", "llmwatch agent: cannot encode a batch (%r); its rows are dropped", e)
            return None
        self._batch_seq += 1
        return payload

    def _summarize_collectives(self, bufs: BufferSet, sections: dict) -> None:
        """The op rows of the finished steps as summaries (agent/summary.py), those of the
        sampled steps and of every step while the collector asks as op rows; the rows of a
        step not finished yet (after the newest `record_step`) wait for the next batch. A
        closing agent ships everything."""
        coll = bufs.collective
        sections.pop(wire.COLLECTIVE, None)
        steps = bufs.step
        if steps.n:  # the step recorded last (not the highest: after a rollback the steps run again)
            self._done_step = steps.cols[0][steps.n - 1]
        rows = self._held_ops + list(zip(*(col[:coll.n] for col in coll.cols))) if coll.n else self._held_ops
        if not rows:
            return
        every, asked = self.config.raw_every_steps, time.monotonic() < self._raw_ops_until
        hold = math.inf if self._stopping or self._done_step is None else self._done_step
        raw, cols, n, held, plain = summary.summarize(rows, lambda step: asked or step % every == 0, hold)
        if len(held) > coll.capacity:  # steps that never finish (no record_step for them): not held forever
            raw, held = raw + held[:-coll.capacity], held[-coll.capacity:]
        self._held_ops = held
        if raw or plain:
            sections[wire.COLLECTIVE] = (len(raw) + len(plain), summary.op_section(raw + plain, len(plain)))
        if n:
            sections[wire.COLLECTIVE_SUMMARY] = (n, cols)
            self._recorded[wire.COLLECTIVE_SUMMARY] += n

    def _feed_bridges(self, bufs: BufferSet) -> None:
        if not self._bridges:
            return
        stats = self.stats()
        for bridge in self._bridges:
            try:
                bridge.on_drain(bufs, stats)
            except Exception as e:  # noqa: BLE001
                self._log_once(f"bridge-{type(bridge).__name__}", "llmwatch agent: %s failed: %r",
                               type(bridge).__name__, e)

    def _on_response(self, body: dict) -> None:
        if "clean_through" in body:
            self._watermarked = True
        mark = body.get("clean_through")
        if isinstance(mark, dict):
            try:
                step = int(mark["step"])
                self._clean_through = (int(mark["attempt"]), step, max(step, int(mark.get("judged", step))))
            except (KeyError, TypeError, ValueError):
                pass
        follow = _seconds(body, "followup_s")
        if follow:
            self._followup_until = time.monotonic() + min(follow, _MAX_FOLLOWUP_S)
        raw = _seconds(body, "raw_ops_s")
        if raw:
            self._raw_ops_until = time.monotonic() + min(raw, _MAX_RAW_OPS_S)
        wait = _seconds(body, "end_wait_s")
        if wait is not None:
            self._end_wait_s = wait
        for c in body.get("commands") or ():
            if not isinstance(c, dict) or c.get("id") is None:
                continue
            cid = str(c["id"])
            if cid in self._seen_commands:
                continue
            self._seen_commands.add(cid)
            args = c.get("args")
            try:
                issued_ts = float(c.get("issued_ts") or 0.0)
            except (TypeError, ValueError):
                issued_ts = 0.0
            self._mailbox.append(Command(cid, str(c.get("kind", "")), args if isinstance(args, dict) else {},
                                         issued_ts))

    def _release(self) -> None:
        if self._health is not None:
            self._health.close()
        for bridge in self._bridges:
            try:
                bridge.close()
            except Exception as e:  # noqa: BLE001
                self._log_once("bridge-close", "llmwatch agent: closing %s failed: %r", type(bridge).__name__, e)
        if self._shipper is not None:
            try:
                self._shipper.close()
            except OSError as e:
                self._log_once("ship-close", "llmwatch agent: closing the transport failed: %r", e)

    def _log_once(self, key: str, msg: str, *args) -> None:
        if key not in self._logged:
            self._logged.add(key)
            log.warning(msg, *args)
