"""Alert delivery: one `Lane` (a thread) per receiver, so a receiver that hangs does
not hold up the others, and the `Sender` that owns the lanes.

After the commit the writer hands the outbox's new rows to the sender
(`AlertOutbox.apply_incidents` -> `Sender.offer`, a deque append and a notify),
whose lane wakes and POSTs at once. A 2xx marks the row `delivered`; anything else
(an HTTP status, a refused connection, a timeout) counts an attempt and schedules
the next after `payloads.retry_delay_s` (exponential, with jitter, capped), until
the retry budget (`RetryPolicy`: an age and optionally a number of attempts) is
spent: then `failed`. Status changes go back through the writer as
`DeliveryResult` intents of the outbox projection (collector/alerts/outbox.py),
never written from the lane's thread.
"""

from __future__ import annotations

import heapq
import logging
import random
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from collector.alerts import payloads
from collector.alerts.receivers import Receiver, redact_url
from collector.threads import name_native

log = logging.getLogger("collector.alerts.delivery")

MAX_ERROR_CHARS = 300  # of a failure's reason, in the table


@dataclass(frozen=True, slots=True)
class Delivery:
    """One pending alert_outbox row, as the sender holds it."""

    id: int
    receiver: str
    body: bytes
    attempts: int
    next_attempt_ts: float
    created_ts: float


@dataclass(frozen=True, slots=True)
class DeliveryResult:
    """Intent for the `outbox` projection: what one delivery attempt came to."""

    id: int
    status: str  # 'pending' (will retry), 'delivered' or 'failed'
    attempts: int
    next_attempt_ts: float
    last_error: str | None = None  # None: keep the row's (a delivery after failures keeps the last one)
    delivered_ts: float | None = None


# -- sending ------------------------------------------------------------------------------
Transport = Callable[[str, bytes, Mapping[str, str], float], int]  # (url, body, headers, timeout_s) -> status


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, req, fp, code, msg, headers, newurl):  # a 3xx is an answer, not a detour
        return None


_OPENER = urllib.request.build_opener(_NoRedirect())


def urllib_transport(url: str, body: bytes, headers: Mapping[str, str], timeout_s: float) -> int:
    """POST `body`; the HTTP status (any, 2xx or not). Raises OSError when there is none
    (refused, reset, timed out: `timeout_s` bounds the connect and each read)."""
    req = urllib.request.Request(url, data=body, method="POST", headers=dict(headers))
    try:
        with _OPENER.open(req, timeout=timeout_s) as resp:
            resp.read(64 * 1024)
            return resp.status
    except urllib.error.HTTPError as e:
        e.close()
        return e.code


@dataclass(frozen=True, slots=True, kw_only=True)
class RetryPolicy:
    """When to try again and when to give up. Defaults: 1 s doubling to 5 min, for
    a day (an outage of a receiver up to a day loses nothing)."""

    base_s: float = 1.0
    cap_s: float = 300.0
    max_age_s: float = 86400.0  # give up once an alert is this old ...
    max_attempts: int = 0  # ... or has been tried this often (0: no limit but the age)

    def gives_up(self, *, attempts: int, age_s: float) -> bool:
        return age_s >= self.max_age_s or (self.max_attempts > 0 and attempts >= self.max_attempts)


def describe_error(e: BaseException) -> str:
    if isinstance(e, urllib.error.URLError) and not isinstance(e, urllib.error.HTTPError):
        reason = e.reason
        return f"{type(reason).__name__}: {reason}" if isinstance(reason, BaseException) else f"URLError: {reason}"
    return f"{type(e).__name__}: {e}"


class Lane:
    """One receiver's pending deliveries, tried in due order on a thread of their own.
    The lock guards the heap only; it is never held while a request runs."""

    def __init__(self, receiver: Receiver, *, report: Callable[[DeliveryResult], None], transport: Transport,
                 policy: RetryPolicy, clock: Callable[[], float], rand: Callable[[], float], timeout_s: float,
                 count: Callable[[str, str], None] | None = None) -> None:
        self.receiver = receiver
        self._report, self._transport, self._policy = report, transport, policy
        self._clock, self._rand, self._timeout_s = clock, rand, timeout_s
        self._count = count or (lambda receiver, outcome: None)
        self._heap: list[tuple[float, int, Delivery]] = []
        self._cond = threading.Condition()
        self._stopping = False
        self._drain = False  # when stopping: one last try of what is due first
        self._thread = threading.Thread(target=self._run, name=f"alerts-{receiver.name}", daemon=True)

    def offer(self, deliveries: Iterable[Delivery]) -> None:
        with self._cond:
            for d in deliveries:
                heapq.heappush(self._heap, (d.next_attempt_ts, d.id, d))
            self._cond.notify()

    def num_pending(self) -> int:
        with self._cond:
            return len(self._heap)

    def next_due_ts(self) -> float | None:
        with self._cond:
            return self._heap[0][0] if self._heap else None

    def _pop_due(self, now: float) -> Delivery | None:
        with self._cond:
            if self._heap and self._heap[0][0] <= now:
                return heapq.heappop(self._heap)[2]
        return None

    def deliver_due(self) -> int:
        """Try every delivery that is due now, once each; how many were tried."""
        tried = 0
        now = self._clock()
        while (d := self._pop_due(now)) is not None:
            self._attempt(d)
            tried += 1
        return tried

    def _attempt(self, d: Delivery) -> None:
        r = self.receiver
        error = None
        try:
            status = self._transport(r.endpoint, d.body, r.headers(d.body), self._timeout_s)
            if not 200 <= status < 300:
                error = f"HTTP {status}"
        except Exception as e:  # refused, reset, timed out, or a transport's bug: try again later
            error = describe_error(e)
        now = self._clock()
        attempts = d.attempts + 1
        if error is None:
            self._count(r.name, "delivered")
            self._report(DeliveryResult(d.id, "delivered", attempts, d.next_attempt_ts, None, now))
            return
        error = r.scrub(error)[:MAX_ERROR_CHARS]
        if self._policy.gives_up(attempts=attempts, age_s=now - d.created_ts):
            self._count(r.name, "failed")
            log.error("alert %d to %s (%s) given up after %d attempts: %s", d.id, r.name, redact_url(r.url),
                      attempts, error)
            self._report(DeliveryResult(d.id, "failed", attempts, d.next_attempt_ts, error))
            return
        delay_s = payloads.retry_delay_s(attempts, base_s=self._policy.base_s, cap_s=self._policy.cap_s,
                                       rand=self._rand)
        nxt = Delivery(d.id, d.receiver, d.body, attempts, now + delay_s, d.created_ts)
        self._count(r.name, "retry")
        log.warning("alert %d to %s (%s) not delivered (attempt %d): %s; next try in %.1f s", d.id, r.name,
                    redact_url(r.url), attempts, error, delay_s)
        self._report(DeliveryResult(d.id, "pending", attempts, nxt.next_attempt_ts, error))
        self.offer([nxt])

    # -- the thread -------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def request_stop(self, *, drain: bool = False) -> None:
        """End the thread; with `drain`, after one more try of every delivery due now."""
        with self._cond:
            self._stopping, self._drain = True, drain
            self._cond.notify()

    def join(self, timeout_s: float) -> None:
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    def alive(self) -> bool:
        return self._thread.is_alive()

    def _run(self) -> None:
        name_native("lw-alerts")
        while True:
            with self._cond:
                while not self._stopping:
                    wait_s = None if not self._heap else self._heap[0][0] - self._clock()
                    if wait_s is not None and wait_s <= 0:
                        break
                    self._cond.wait(wait_s)
                stopping, drain = self._stopping, self._drain
            if stopping and not drain:
                return
            try:
                self.deliver_due()
            except Exception:  # a bug: log it, keep the lane (the row stays pending in the table)
                log.exception("alert lane %s failed", self.receiver.name)
                if not stopping:
                    with self._cond:
                        self._cond.wait(1.0)
            if stopping:
                return


class Sender:
    """Every receiver's lane. `report(result)` hands a DeliveryResult to the writer
    (Storage: `submit_intent("outbox", ...)`, which never blocks)."""

    def __init__(self, receivers: Sequence[Receiver], *, report: Callable[[DeliveryResult], None],
                 transport: Transport = urllib_transport, policy: RetryPolicy = RetryPolicy(),
                 clock: Callable[[], float] = time.time, rand: Callable[[], float] = random.random,
                 timeout_s: float = 5.0, count: Callable[[str, str], None] | None = None) -> None:
        self.lanes = {r.name: Lane(r, report=report, transport=transport, policy=policy, clock=clock, rand=rand,
                                   timeout_s=timeout_s, count=count) for r in receivers}
        self._unknown_logged: set[str] = set()

    def offer(self, deliveries: Iterable[Delivery]) -> None:
        """Queue deliveries (from the writer thread after a commit, or at start): cheap."""
        by_lane: dict[str, list[Delivery]] = {}
        for d in deliveries:
            by_lane.setdefault(d.receiver, []).append(d)
        for name, ds in by_lane.items():
            lane = self.lanes.get(name)
            if lane is not None:
                lane.offer(ds)
            elif name not in self._unknown_logged:
                self._unknown_logged.add(name)
                log.warning("%d pending alert(s) for %s stay pending: no such receiver is configured now",
                            len(ds), name)

    def deliver_due(self) -> int:
        """Every lane's due deliveries, tried once each on this thread (tests)."""
        return sum(lane.deliver_due() for lane in self.lanes.values())

    def num_pending(self) -> int:
        return sum(lane.num_pending() for lane in self.lanes.values())

    def start(self) -> None:
        for lane in self.lanes.values():
            lane.start()

    def stop(self, timeout_s: float = 10.0, *, drain: bool = False) -> None:
        """Stop every lane, within `timeout_s`: one in a request finishes it (bounded by
        the request timeout); with `drain`, each first tries once what is due now."""
        for lane in self.lanes.values():
            lane.request_stop(drain=drain)
        deadline = time.monotonic() + timeout_s
        for lane in self.lanes.values():
            lane.join(max(0.0, deadline - time.monotonic()))

    def alive(self) -> bool:
        return all(lane.alive() for lane in self.lanes.values())
