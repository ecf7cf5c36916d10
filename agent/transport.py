"""Shipping encoded batches: HTTP POST to the collector, the spool when it is away.

Only the agent's flusher thread calls into this module, so all of its I/O and
all of its waiting (connect, send, a slow collector, backoff) happen off the
training thread.

Outcome of a POST to `{url}/v1/ingest`:
  2xx            delivered; the JSON body may carry control commands.
  other 4xx      rejected for good (bad batch, bad token, too large): counted,
                 logged once, dropped; retrying would fail the same way.
  5xx, 408, 429, connection error, timeout
                 the collector is away or overloaded: the batch goes to the
                 spool and is replayed in order once a probe (backoff 0.5 s
                 doubling to 10 s) gets an answer.

Order: while the spool holds anything, new batches are appended behind it, so
the collector receives every batch of a rank in `batch_seq` order (those of an
earlier incarnation first).
"""

from __future__ import annotations

import http.client
import json
import logging
import socket
import time
from dataclasses import dataclass, field
from typing import Callable
from urllib.parse import urlsplit

from agent import wire
from agent.ring import STATS_KINDS
from agent.spool import Spool

log = logging.getLogger("llmwatch.agent")

INGEST_PATH = "/v1/ingest"
_RETRYABLE_4XX = (408, 429)  # timeouts and rate limits: the batch itself is fine


@dataclass(slots=True)
class PostResult:
    status: str  # "ok" | "rejected" | "unavailable"
    code: int = 0  # HTTP status, 0 when there was no answer
    body: dict | None = None  # parsed JSON of a 2xx
    reason: str = ""


class HttpClient:
    """One persistent HTTP/1.1 connection to the collector, TCP_NODELAY set.

    Without TCP_NODELAY a POST whose body follows its headers in a second
    segment waits for the peer's delayed ACK (~40 ms per batch)."""

    def __init__(self, url: str, token: str | None, timeout_s: float) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"collector url must be http(s)://host[:port], got {url!r}")
        self._https = parts.scheme == "https"
        self._host = parts.hostname
        self._port = parts.port or (443 if self._https else 80)
        self._path = parts.path.rstrip("/") + INGEST_PATH
        self._timeout_s = timeout_s
        self._headers = {"Content-Type": wire.CONTENT_TYPE, "Connection": "keep-alive"}
        if token:
            self._headers["Authorization"] = f"Bearer {token}"
        self._conn: http.client.HTTPConnection | None = None

    def post(self, body: bytes) -> PostResult:
        reused = self._conn is not None
        try:
            return self._post_once(body)
        except (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError) as e:
            self.close()
            if not reused:
                return PostResult("unavailable", reason=f"{type(e).__name__}: {e}")
            # The server closed an idle keep-alive connection: one retry on a fresh one.
            # Should the first attempt have been stored after all, the collector dedupes.
        except (OSError, http.client.HTTPException) as e:
            self.close()
            return PostResult("unavailable", reason=f"{type(e).__name__}: {e}")
        try:
            return self._post_once(body)
        except (OSError, http.client.HTTPException) as e:
            self.close()
            return PostResult("unavailable", reason=f"{type(e).__name__}: {e}")

    def _post_once(self, body: bytes) -> PostResult:
        conn = self._connection()
        conn.request("POST", self._path, body=body, headers=self._headers)
        resp = conn.getresponse()
        data = resp.read()
        code = resp.status
        if resp.will_close:
            self.close()
        if 200 <= code < 300:
            try:
                parsed = json.loads(data) if data else {}
            except ValueError:
                parsed = None
            return PostResult("ok", code, parsed if isinstance(parsed, dict) else None)
        reason = data[:300].decode("utf-8", "replace")
        if code >= 500 or code in _RETRYABLE_4XX:
            return PostResult("unavailable", code, reason=f"HTTP {code}: {reason}")
        return PostResult("rejected", code, reason=f"HTTP {code}: {reason}")

    def _connection(self) -> http.client.HTTPConnection:
        if self._conn is None:
            cls = http.client.HTTPSConnection if self._https else http.client.HTTPConnection
            conn = cls(self._host, self._port, timeout=self._timeout_s)
            conn.connect()
            conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
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
    dropped: dict[str, int] = field(default_factory=_per_kind)  # spool full (or no spool) while away
    num_batches_sent: int = 0
    num_batches_spooled: int = 0
    num_batches_replayed: int = 0
    num_batches_rejected: int = 0
    num_batches_dropped: int = 0
    last_error: str = ""


def _add(counter: dict[str, int], rows: dict[str, int]) -> None:
    for kind, n in rows.items():
        counter[kind] = counter.get(kind, 0) + n


def rows_of(payload: bytes) -> dict[str, int]:
    """Rows per kind of an encoded batch (events count under "event")."""
    batch = wire.decode_batch(payload, check_codes=False)
    rows = {kind: batch.num_rows(kind) for kind in batch.header.get("sections", {})}
    rows["event"] = len(batch.header.get("events") or ())
    return rows


class Shipper:
    """Send-or-spool with ordered replay and backoff. `client=None` spools only."""

    def __init__(self, client: HttpClient | None, spool: Spool | None, on_response: Callable[[dict], None], *,
                 retry_min_s: float = 0.5, retry_max_s: float = 10.0, clock: Callable[[], float] = time.monotonic):
        self.client = client
        self.spool = spool
        self.stats = ShipStats()
        self._on_response = on_response
        self._retry_min_s = retry_min_s
        self._retry_max_s = retry_max_s
        self._backoff_s = retry_min_s
        self._clock = clock
        self._down_until = 0.0  # no attempt before this (monotonic); 0.0 = collector believed up
        self._logged: set[str] = set()

    @property
    def backlog(self) -> bool:
        return self.spool is not None and self.spool.peek() is not None

    def ship(self, payload: bytes, rows: dict[str, int]) -> str:
        """Deliver a new batch, or queue it behind the backlog, or spool it.
        Returns what became of it: "sent", "rejected", "spooled" or "dropped"."""
        if self.client is not None and not self.backlog and self._clock() >= self._down_until:
            res = self.client.post(payload)
            if res.status != "unavailable":
                self._settle(res, rows, self.stats.sent, "num_batches_sent")
                return "sent" if res.status == "ok" else "rejected"
            self._went_down(res)
        return self._to_spool(payload, rows)

    def pump(self, *, force: bool = False, budget_s: float = 1.0) -> bool:
        """Replay spooled batches oldest first for up to `budget_s`. `force` skips
        the backoff wait (flush, close). True when the spool is empty."""
        if self.client is None or self.spool is None:
            return self.client is not None
        if not force and self._down_until and self._clock() < self._down_until:
            return False
        deadline = self._clock() + budget_s
        while (payload := self.spool.peek()) is not None:
            try:
                rows = rows_of(payload)
            except wire.WireError as e:
                self._log_once("corrupt", "llmwatch agent: dropping an unreadable spooled batch (%s)", e)
                self.spool.num_corrupt += 1
                self.spool.pop()
                continue
            res = self.client.post(payload)
            if res.status == "unavailable":
                self._went_down(res)
                return False
            self._settle(res, rows, self.stats.replayed, "num_batches_replayed")
            self.spool.pop()
            if self._clock() >= deadline:
                return self.spool.peek() is None
        return True

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

    def _went_down(self, res: PostResult) -> None:
        self.stats.last_error = res.reason
        if not self._down_until:
            log.warning("llmwatch agent: collector unavailable (%s); spooling and retrying", res.reason)
        self._down_until = self._clock() + self._backoff_s
        self._backoff_s = min(self._backoff_s * 2, self._retry_max_s)

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
        if self.client is not None:
            self.client.close()
        if self.spool is not None:
            self.spool.close()
