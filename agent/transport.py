"""Shipping encoded batches: HTTP(S) POST to the collector, the spool when it is away.

Only the agent's flusher thread calls into this module, so all of its I/O and
all of its waiting (connect, send, a slow collector, backoff) happen off the
training thread.

Outcome of a POST to `{url}/v1/ingest`:
  2xx            delivered; the JSON body may carry control commands.
  401, 403       the collector refuses this agent's token: nothing is wrong with
                 the batch, so it is not dropped. It is spooled like in an
                 outage (and probed with the same backoff), and the log says so
                 once: fix the token, and the next incarnation, or
                 `python -m agent.replay --token-file`, ships what was spooled.
  other 4xx      rejected for good (bad batch, too large, 409 for a key already
                 stored with other bytes): counted, logged once, dropped;
                 retrying would fail the same way. Spooled batches being
                 replayed are treated the same.
  408, 429, 502, 503, 504, connection refused or reset, timeout, TLS failure
                 the collector is away or busy ("retry later"): the batch goes to
                 the spool and is replayed in order once a probe (backoff 0.5 s
                 doubling to 10 s; at least the answer's Retry-After, within
                 that cap) gets an answer. These say nothing about the batch
                 and never count against it.
  other 5xx      a real error answer. A batch that gets `max_failures` of them
                 in a row (at the head of the spool) is set aside in the spool's
                 quarantine (`<spool>/quarantine`, itself a spool that
                 `python -m agent.replay` can replay) and counted, so one batch
                 the collector cannot take does not block the rank for good.

Order: while the spool holds anything, new batches are appended behind it, so
the collector receives every batch of a rank in `batch_seq` order (those of an
earlier incarnation first), quarantined ones excepted.

Throughput of a replay: one batch per round trip, and the collector answers a
POST only once its group commit is done (`group_min_interval_s`, 0.5 s by
default), so a rank replays about two batches a second however small they are.
That is why the agent cuts fewer, larger batches while they go to the spool
(`AgentConfig.spool_flush_interval_s`).

At flush and close, `drain` replays the spool at once, whatever the backoff
state, until it is empty or the deadline passes; a busy, slow or failing
collector is retried within the deadline, one that does not answer at all
(connection refused or reset, TLS failure) is not waited for: the spool keeps
the batches for the next incarnation or `agent.replay`. Every request's timeout
is cut to what is left of the deadline.
"""

from __future__ import annotations

import http.client
import json
import logging
import math
import os
import socket
import ssl
import time
from dataclasses import dataclass, field
from typing import Callable
from urllib.parse import urlsplit

from agent import wire
from agent.clock import ClockSync, is_loopback
from agent.ring import STATS_KINDS
from agent.spool import QUARANTINE, Spool, SpoolBusy

log = logging.getLogger("llmwatch.agent")

INGEST_PATH = "/v1/ingest"
_RETRYABLE_4XX = (408, 429)  # timeouts and rate limits: the batch itself is fine
_AWAY_5XX = (502, 503, 504)  # a proxy without its backend, back-pressure: the collector is away or busy
_REFUSED_TOKEN = (401, 403)  # the credentials, not the batch: keep the batch


@dataclass(slots=True)
class PostResult:
    status: str  # "ok" | "rejected" | "unavailable"
    code: int = 0  # HTTP status, 0 when there was no answer
    body: dict | None = None  # parsed JSON of a 2xx
    reason: str = ""
    retry_after_s: float | None = None  # the answer's Retry-After (seconds form), when it had one
    timed_out: bool = False  # no answer within the timeout (the request may still be processed)

    @property
    def counts_against_batch(self) -> bool:
        """A real error answer: evidence that this batch may be the problem (see module doc)."""
        return self.code >= 500 and self.code not in _AWAY_5XX


def _number(value, default: float = 0.0) -> float:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else default


def _retry_after_s(value: str | None) -> float | None:
    try:
        return max(0.0, float(value)) if value else None
    except ValueError:
        return None  # the HTTP-date form: not worth a parser here


class HttpClient:
    """One persistent HTTP/1.1 connection to the collector, TCP_NODELAY set.

    Without TCP_NODELAY a POST whose body follows its headers in a second
    segment waits for the peer's delayed ACK (~40 ms per batch).

    https:// verifies the collector's certificate and host name against
    `ca_file` (a PEM bundle: a private CA, or a self-signed certificate), or the
    system's trust store when it is None. The context is built once, here: a
    bad `ca_file` is a ValueError now, not a failure on every POST. A
    certificate that does not verify is "unavailable" (no answer), so batches
    go to the spool rather than to a server that cannot prove who it is.

    The token is sent only in the Authorization header and is masked in every
    reason string (a server might echo a header back in an error body)."""

    def __init__(self, url: str, token: str | None, timeout_s: float, *, ca_file: str | None = None,
                 path: str = INGEST_PATH, content_type: str = wire.CONTENT_TYPE) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"collector url must be http(s)://host[:port], got {url!r}")
        self._https = parts.scheme == "https"
        self._host = parts.hostname
        self._port = parts.port or (443 if self._https else 80)
        self._path = parts.path.rstrip("/") + path
        self._timeout_s = timeout_s
        self._ssl_context: ssl.SSLContext | None = None
        if self._https:
            try:
                self._ssl_context = ssl.create_default_context(cafile=ca_file)
            except (OSError, ssl.SSLError) as e:  # FileNotFoundError, a file that is not PEM
                raise ValueError(f"cannot load the CA file {ca_file!r}: {e}") from None
        self._headers = {"Content-Type": content_type, "Connection": "keep-alive"}
        self._token = token or ""
        if token:
            self._headers["Authorization"] = f"Bearer {token}"
        self._conn: http.client.HTTPConnection | None = None
        self.clock = ClockSync(local=is_loopback(self._host))  # this host's clock against the collector's

    def __repr__(self) -> str:
        return f"HttpClient({'https' if self._https else 'http'}://{self._host}:{self._port})"

    def post(self, body: bytes, *, timeout_s: float | None = None) -> PostResult:
        """POST one batch. `timeout_s` caps this request's connect and each read
        below the client's timeout (a deadline's remainder); it never raises."""
        timeout_s = self._timeout_s if timeout_s is None else max(0.01, min(timeout_s, self._timeout_s))
        reused = self._conn is not None
        try:
            return self._post_once(body, timeout_s)
        except (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError) as e:
            self.close()
            if not reused:
                return self._no_answer(e)
            # The server closed an idle keep-alive connection: one retry on a fresh one.
            # Should the first attempt have been stored after all, the collector dedupes.
        except (OSError, http.client.HTTPException) as e:
            self.close()
            return self._no_answer(e)
        try:
            return self._post_once(body, timeout_s)
        except (OSError, http.client.HTTPException) as e:
            self.close()
            return self._no_answer(e)

    def _no_answer(self, e: BaseException) -> PostResult:
        return PostResult("unavailable", reason=self._redact(f"{type(e).__name__}: {e}"),
                          timed_out=isinstance(e, TimeoutError))

    def _redact(self, text: str) -> str:
        return text.replace(self._token, "<redacted>") if self._token else text

    def _post_once(self, body: bytes, timeout_s: float) -> PostResult:
        conn = self._connection(timeout_s)
        conn.sock.settimeout(timeout_s)
        t0 = time.time()
        conn.request("POST", self._path, body=body, headers=self._headers)
        resp = conn.getresponse()
        data = resp.read()
        t1 = time.time()
        code = resp.status
        if resp.will_close:
            self.close()
        if 200 <= code < 300:
            try:
                parsed = json.loads(data) if data else {}
            except ValueError:
                parsed = None
            if isinstance(parsed, dict):
                relayed = parsed.get("relayed")
                if isinstance(relayed, dict):  # through a node's relay (collector/relay.py)
                    self.clock.relayed()
                    self.clock.add(t0, t1, parsed.get("server_ts"), hold_s=_number(relayed.get("hold_s")),
                                   upstream_error_s=_number(relayed.get("error_s"), math.inf))
                else:
                    self.clock.add(t0, t1, parsed.get("server_ts"))
            return PostResult("ok", code, parsed if isinstance(parsed, dict) else None)
        reason = self._redact(f"HTTP {code}: {data[:300].decode('utf-8', 'replace')}")
        if code in _REFUSED_TOKEN:
            return PostResult("unavailable", code, reason=reason + " (the collector refuses this agent's token; "
                              "batches are kept in the spool)")
        if code >= 500 or code in _RETRYABLE_4XX:
            return PostResult("unavailable", code, reason=reason,
                              retry_after_s=_retry_after_s(resp.getheader("Retry-After")))
        return PostResult("rejected", code, reason=reason)

    def _connection(self, timeout_s: float) -> http.client.HTTPConnection:
        if self._conn is None:
            if self._https:
                conn = http.client.HTTPSConnection(self._host, self._port, timeout=timeout_s,
                                                   context=self._ssl_context)
            else:
                conn = http.client.HTTPConnection(self._host, self._port, timeout=timeout_s)
            try:
                conn.connect()  # TCP, and for https the handshake and certificate check
                conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except BaseException:
                conn.close()
                raise
            self._conn = conn
        return self._conn

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None


def _per_kind() -> dict[str, int]:
    return {k: 0 for k in STATS_KINDS}


@dataclass
class ShipStats:
    """Cumulative counters; rows per kind, batches as `num_batches_*`."""

    sent: dict[str, int] = field(default_factory=_per_kind)
    spooled: dict[str, int] = field(default_factory=_per_kind)
    replayed: dict[str, int] = field(default_factory=_per_kind)
    rejected: dict[str, int] = field(default_factory=_per_kind)
    quarantined: dict[str, int] = field(default_factory=_per_kind)  # set aside after max_failures 5xx
    dropped: dict[str, int] = field(default_factory=_per_kind)  # spool full (or no spool) while away
    num_batches_sent: int = 0
    num_batches_spooled: int = 0
    num_batches_replayed: int = 0
    num_batches_rejected: int = 0
    num_batches_quarantined: int = 0
    num_batches_dropped: int = 0
    last_error: str = ""


def _add(counter: dict[str, int], rows: dict[str, int]) -> None:
    for kind, n in rows.items():
        counter[kind] = counter.get(kind, 0) + n


def rows_of(payload: bytes) -> dict[str, int]:
    """Rows per kind of an encoded batch (events count under "event")."""
    batch = wire.decode_batch(payload, check_codes=False, typed=False)  # counted, not read
    rows = {kind: batch.num_rows(kind) for kind in batch.header.get("sections", {})}
    rows["event"] = len(batch.header.get("events") or ())
    return rows


class Shipper:
    """Send-or-spool with ordered replay, backoff and quarantine. `client=None` spools only.

    `max_failures`: real error answers (see the module docstring) in a row that
    set the batch at the head of the spool aside; `quarantine_bytes` bounds that
    directory (past it, such a batch is dropped and counted)."""

    def __init__(self, client: HttpClient | None, spool: Spool | None, on_response: Callable[[dict], None], *,
                 retry_min_s: float = 0.5, retry_max_s: float = 10.0, max_failures: int = 5,
                 quarantine_bytes: int = 32 * 1024 * 1024, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep):
        if max_failures < 1:
            raise ValueError("max_failures must be >= 1")
        self.client = client
        self.spool = spool
        self.quarantine: Spool | None = None  # opened on first use: no directory until a batch needs it
        self.stats = ShipStats()
        self._on_response = on_response
        self._retry_min_s = retry_min_s
        self._retry_max_s = retry_max_s
        self._backoff_s = retry_min_s
        self._max_failures = max_failures
        self._quarantine_bytes = quarantine_bytes
        self._head_failures = 0  # real error answers in a row to the batch at the head of the spool
        self._clock = clock
        self._sleep = sleep
        self._down_until = 0.0  # no attempt before this (monotonic); 0.0 = collector believed up
        self._logged: set[str] = set()

    @property
    def backlog(self) -> bool:
        return self.spool is not None and self.spool.peek() is not None

    @property
    def away(self) -> bool:
        """New batches would go to the spool now (a backlog, or backing off)."""
        return self.client is None or self.backlog or self._clock() < self._down_until

    def ship(self, payload: bytes, rows: dict[str, int], *, deadline: float | None = None) -> str:
        """Deliver a new batch, or queue it behind the backlog, or spool it.
        `deadline` (monotonic; flush and close): try now even while backing off,
        within it. Returns "sent", "rejected", "spooled" or "dropped"."""
        now = self._clock()
        if self.client is not None and not self.backlog and (deadline is not None or now >= self._down_until):
            res = self.client.post(payload, timeout_s=None if deadline is None else deadline - now)
            if res.status != "unavailable":
                self._settle(res, rows, self.stats.sent, "num_batches_sent")
                return "sent" if res.status == "ok" else "rejected"
            self._went_down(res)
            fate = self._to_spool(payload, rows)
            if fate == "spooled" and res.counts_against_batch:
                self._head_failures = 1  # the spool was empty: this batch is its head now
            return fate
        return self._to_spool(payload, rows)

    def pump(self, *, budget_s: float = 1.0) -> bool:
        """Replay spooled batches oldest first for up to `budget_s`, unless backing
        off. Stops at the first batch that gets no delivery. True when the spool is empty."""
        if self.client is None or self.spool is None:
            return self.client is not None
        if self._down_until and self._clock() < self._down_until:
            return False
        deadline = self._clock() + budget_s
        while (payload := self.spool.peek()) is not None:
            rows = self._head_rows(payload)
            if rows is None:
                continue
            res = self.client.post(payload)
            if res.status == "unavailable":
                self._went_down(res)
                if not self._failed_head(payload, rows, res):
                    return False
            else:
                self._settle(res, rows, self.stats.replayed, "num_batches_replayed")
                self._pop_head()
            if self._clock() >= deadline:
                return self.spool.peek() is None
        return True

    def drain(self, *, deadline: float) -> bool:
        """Replay the spool now, whatever the backoff state, until it is empty or
        `deadline` (monotonic) passes; every request's timeout is cut to what is
        left. An answer that says busy or failed is retried after its Retry-After
        (else the backoff) while the deadline allows; no answer at all (refused,
        reset, TLS) ends the drain at once: nobody is there to wait for. A
        timeout is retried (the collector was there, only slow). True when empty."""
        if self.client is None or self.spool is None:
            return self.client is not None
        while (payload := self.spool.peek()) is not None:
            left_s = deadline - self._clock()
            if left_s <= 0:
                return False
            rows = self._head_rows(payload)
            if rows is None:
                continue
            res = self.client.post(payload, timeout_s=left_s)
            if res.status != "unavailable":
                self._settle(res, rows, self.stats.replayed, "num_batches_replayed")
                self._pop_head()
                continue
            wait_s = self._went_down(res)
            if self._failed_head(payload, rows, res):
                continue
            if (res.code == 0 and not res.timed_out) or res.code in _REFUSED_TOKEN:
                return False  # nobody there, or a token it will refuse again: no use waiting
            if self._clock() + wait_s >= deadline:
                return False
            self._sleep(wait_s)
        return True

    def _head_rows(self, payload: bytes) -> dict[str, int] | None:
        try:
            return rows_of(payload)
        except wire.WireError as e:
            self._log_once("corrupt", "llmwatch agent: dropping an unreadable spooled batch (%s)", e)
            self.spool.num_corrupt += 1
            self._pop_head()
            return None

    def _pop_head(self) -> None:
        self.spool.pop()
        self._head_failures = 0

    def _failed_head(self, payload: bytes, rows: dict[str, int], res: PostResult) -> bool:
        """Count a real error answer to the head batch; set it aside at `max_failures`.
        True when it left the spool (the next one may go now)."""
        if not res.counts_against_batch:
            return False
        self._head_failures += 1
        if self._head_failures < self._max_failures:
            return False
        self._pop_head()
        if self._quarantine_spool() is not None and self.quarantine.append(payload):
            _add(self.stats.quarantined, rows)
            self.stats.num_batches_quarantined += 1
            self._log_once("quarantine", "llmwatch agent: a batch got %d error answers in a row (last: %s); it is "
                           "set aside in %s (inspect it, or replay it with `python -m agent.replay %s`); further "
                           "ones are only counted", self._max_failures, res.reason, self.quarantine.directory,
                           self.quarantine.directory)
        else:
            _add(self.stats.dropped, rows)
            self.stats.num_batches_dropped += 1
            self._log_once("quarantine_full", "llmwatch agent: a batch got %d error answers in a row and the "
                           "quarantine is full or unavailable; it is dropped (counted in stats)", self._max_failures)
        # The collector did answer: the next batch need not wait out the backoff.
        self._down_until = 0.0
        return True

    def _quarantine_spool(self) -> Spool | None:
        if self.quarantine is None and self.spool is not None:
            try:
                self.quarantine = Spool(os.path.join(self.spool.directory, QUARANTINE), self._quarantine_bytes)
            except (OSError, SpoolBusy) as e:
                self._log_once("quarantine_open", "llmwatch agent: cannot open the quarantine (%s)", e)
        return self.quarantine

    def _settle(self, res: PostResult, rows: dict[str, int], ok_counter: dict[str, int], ok_batches: str) -> None:
        self._down_until = 0.0
        self._backoff_s = self._retry_min_s
        if res.status == "ok":
            _add(ok_counter, rows)
            setattr(self.stats, ok_batches, getattr(self.stats, ok_batches) + 1)
            if res.body:
                self._on_response(res.body)
            return
        _add(self.stats.rejected, rows)
        self.stats.num_batches_rejected += 1
        self.stats.last_error = res.reason
        self._log_once(f"reject{res.code}", "llmwatch agent: the collector rejected a batch (%s); it is dropped, "
                       "further rejections are only counted", res.reason)

    def _went_down(self, res: PostResult) -> float:
        """Back off after `res`; returns how long (at least the answer's Retry-After)."""
        self.stats.last_error = res.reason
        if not self._down_until:
            log.warning("llmwatch agent: collector unavailable (%s); spooling and retrying", res.reason)
        wait_s = min(max(self._backoff_s, res.retry_after_s or 0.0), self._retry_max_s)
        self._down_until = self._clock() + wait_s
        self._backoff_s = min(self._backoff_s * 2, self._retry_max_s)
        return wait_s

    def _to_spool(self, payload: bytes, rows: dict[str, int]) -> str:
        if self.spool is not None and self.spool.append(payload):
            _add(self.stats.spooled, rows)
            self.stats.num_batches_spooled += 1
            return "spooled"
        _add(self.stats.dropped, rows)
        self.stats.num_batches_dropped += 1
        self._log_once("spool_full", "llmwatch agent: spool %s; dropping batches (counted in stats)",
                       "full" if self.spool is not None else "unavailable")
        return "dropped"

    def _log_once(self, key: str, msg: str, *args) -> None:
        if key not in self._logged:
            self._logged.add(key)
            log.warning(msg, *args)

    def close(self) -> None:
        """Close the connection and the spools; say what is left behind in them."""
        if self.client is not None:
            self.client.close()
        for spool, msg in ((self.spool, "llmwatch agent: %s undelivered batches left in the spool %s; the next "
                            "incarnation of this rank replays them, or run `python -m agent.replay %s`"),
                           (self.quarantine, "llmwatch agent: %s batches are in the quarantine %s (error answers "
                            "from the collector); inspect them, or replay them with `python -m agent.replay %s`")):
            if spool is None:
                continue
            try:
                num_left = spool.num_pending()
            except OSError:
                num_left = "some"
            spool.close()
            if num_left:
                log.warning(msg, num_left, spool.directory, spool.directory)
