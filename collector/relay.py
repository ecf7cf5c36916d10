"""A node's relay: its ranks post to it on loopback, it posts their batches upstream as one bundle.

A collector pays per request (the HTTP exchange, the gate, a hop to the writer,
the answer) as well as per row, and a job of 100,000 ranks that each flush every
few seconds sends thousands of small requests a second: past what one collector
takes, however few rows each carries (docs/scale.md). One relay per node turns the
node's 8 requests per flush into one.

    collector relay --upstream https://collector:8428 --ca-file ca.pem   # on each node
    LLMWATCH_URL=http://127.0.0.1:8429 torchrun ...                      # its ranks

What the ranks see is the collector's ingest endpoint, unchanged: a rank's POST
to `/v1/ingest` is held until the bundle that carries it is committed upstream,
and then answered with that batch's own answer (its status, its commands, its
watermark, `raw_ops_s`, ...), so nothing an agent does with an answer changes.
The relay keeps nothing: when the collector is away or refuses the bundle, every
rank in it gets 503 (Retry-After), and its agent spools the batch as in any
outage. A batch the collector stored but whose answer the relay never got comes
back as a duplicate, which the collector acknowledges and stores once.

Bundling: the first request to arrive opens a bundle, which leaves `linger_s`
later (or at once when full: `max_items` batches or `max_bytes`). One bundle is in
flight at a time; what arrives meanwhile waits for the next one, so under load the
bundles grow rather than the requests (as the collector's group commit does).

Clocks: an answer carries the relay's estimate of the collector's clock at the
middle of its hold, the hold, and the estimate's error bound, so an agent's clock
sync (agent/clock.py) is as good through the relay as without it.

Security: the relay binds loopback by default, checks each rank's ingest token
before reading a byte of its body (the collector's gate, collector/http/gate.py,
with the same bounds on head, body size and time), forwards only POST /v1/ingest
(every other path is a 401), and uses the same token upstream.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Protocol

from agent import wire
from agent.transport import PostResult
from collector.http.routes.common import dumps, receive_body

log = logging.getLogger("llmwatch.relay")
_BATCH_TYPES = (wire.CONTENT_TYPE.encode(), b"application/octet-stream")
MiB = 1 << 20


class Upstream(Protocol):
    """What the relay posts bundles with (agent.transport.HttpClient for the bundle path)."""

    clock: object

    def post(self, body: bytes, *, timeout_s: float | None = None) -> PostResult: ...

    def close(self) -> None: ...


@dataclass(kw_only=True, slots=True, frozen=True)
class RelaySettings:
    linger_s: float = 0.05  # a bundle leaves this long after its first batch arrived ...
    max_items: int = 1024  # ... or at once with this many batches ...
    max_bytes: int = 32 * MiB  # ... or this many bytes (the collector's --max-bundle-bytes is 64 MiB)
    max_batch_bytes: int = 32 * MiB  # one rank's batch (413 above), as the collector's --max-batch-bytes
    # a bundle not answered by then counts as "collector away" (503 to its ranks): keep it below
    # the agents' own request timeout (AgentConfig.timeout_s, 2 s), or they give up first and
    # send the batch again later (stored once: the collector dedupes)
    upstream_timeout_s: float = 1.8


@dataclass(slots=True)
class _Held:
    body: bytes
    arrived: float  # time.monotonic()
    answer: asyncio.Future = field(repr=False)


@dataclass(slots=True)
class RelayStats:
    bundles: int = 0
    batches: int = 0
    failed_bundles: int = 0
    max_bundle_items: int = 0


class Relay:
    """The holding and the upstream loop; an ASGI app for POST /v1/ingest and GET /healthz.
    Run `run()` as a task on the serving loop (the app starts it on its lifespan)."""

    def __init__(self, upstream: Upstream, settings: RelaySettings = RelaySettings()) -> None:
        self.upstream = upstream
        self.settings = settings
        self.stats = RelayStats()
        self._pending: list[_Held] = []
        self._pending_bytes = 0
        self._arrived: asyncio.Event | None = None
        self._task: asyncio.Task | None = None

    # -- the ASGI app ----------------------------------------------------------------------
    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["method"] == "POST" and scope["path"] == "/v1/ingest":
            status, content, extra = await self._ingest(scope, receive)
        elif scope["method"] in ("GET", "HEAD") and scope["path"] == "/healthz":
            status, content, extra = 200, dumps({"ok": True, "relay": True, **self._health()}), []
        else:
            status, content, extra = 404, dumps({"error": "a relay serves POST /v1/ingest only"}), []
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(content)).encode()), *extra]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": content})

    async def _lifespan(self, receive, send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                self.start()
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.stop()
                await send({"type": "lifespan.shutdown.complete"})
                return

    def _health(self) -> dict:
        s = self.stats
        return {"bundles": s.bundles, "batches": s.batches, "failed_bundles": s.failed_bundles,
                "pending": len(self._pending)}

    async def _ingest(self, scope, receive) -> tuple[int, bytes, list]:
        body = await receive_body(scope, receive, _BATCH_TYPES, wire.CONTENT_TYPE, self.settings.max_batch_bytes)
        if isinstance(body, tuple):
            return body
        if not body:
            return 400, dumps({"error": "empty body: not an llmwatch batch"}), []
        return await self.hold(body)

    # -- holding -------------------------------------------------------------------------------
    def start(self) -> None:
        if self._task is None:
            self._arrived = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._run(), name="llmwatch-relay")

    async def stop(self) -> None:
        """Send what is held, then stop (uvicorn's graceful shutdown has let in-flight requests finish)."""
        if self._task is None:
            return
        self._task.cancel()
        try:
            await self._task
        except asyncio.CancelledError:
            pass
        self._task = None
        while self._pending:
            await self._send(self._take())
        await asyncio.to_thread(self.upstream.close)

    async def hold(self, body: bytes) -> tuple[int, bytes, list]:
        """Queue one rank's batch for the next bundle; its answer once the bundle's came back."""
        held = _Held(body, time.monotonic(), asyncio.get_running_loop().create_future())
        self._pending.append(held)
        self._pending_bytes += len(body)
        assert self._arrived is not None, "Relay.start() first"
        self._arrived.set()
        return await held.answer

    async def _run(self) -> None:
        s = self.settings
        while True:
            await self._arrived.wait()
            first = self._pending[0].arrived
            while len(self._pending) < s.max_items and self._pending_bytes < s.max_bytes:
                left = first + s.linger_s - time.monotonic()
                if left <= 0:
                    break
                self._arrived.clear()
                try:
                    await asyncio.wait_for(self._arrived.wait(), left)
                except asyncio.TimeoutError:
                    break
            await self._send(self._take())
            if not self._pending:
                self._arrived.clear()

    def _take(self) -> list[_Held]:
        s, taken, size = self.settings, [], 0
        while self._pending and len(taken) < s.max_items and (not taken or size + len(self._pending[0].body) <= s.max_bytes):
            held = self._pending.pop(0)
            taken.append(held)
            size += len(held.body)
        self._pending_bytes -= size
        return taken

    async def _send(self, bundle: list[_Held]) -> None:
        """Post one bundle and answer its ranks. Every held rank gets an answer, whatever
        happens here (a 503 when nothing better is known), and the loop goes on."""
        try:
            body = wire.encode_bundle([h.body for h in bundle])
            res = await asyncio.to_thread(self.upstream.post, body, timeout_s=self.settings.upstream_timeout_s)
            self._answer_all(bundle, res)
        except BaseException as e:
            self._answer_all(bundle, PostResult("unavailable", reason=f"{type(e).__name__}: {e}"))
            if not isinstance(e, Exception):  # cancelled: stopping
                raise
            log.exception("llmwatch relay: a bundle failed in the relay itself")

    def _answer_all(self, bundle: list[_Held], res: PostResult) -> None:
        st = self.stats
        st.bundles += 1
        st.batches += len(bundle)
        st.max_bundle_items = max(st.max_bundle_items, len(bundle))
        results = (res.body or {}).get("results") if res.status == "ok" else None
        if not isinstance(results, list) or len(results) != len(bundle):
            st.failed_bundles += 1
            why = res.reason or f"HTTP {res.code}: the bundle's answer has no result per batch"
            retry = str(max(1, math.ceil(res.retry_after_s or 1))).encode()
            content = dumps({"error": f"relay: the collector did not take the bundle ({why}); retry later"})
            for h in bundle:
                _settle(h.answer, (503, content, [(b"retry-after", retry)]))
            return
        clock = self.upstream.clock
        offset, error = getattr(clock, "offset_s", 0.0), getattr(clock, "error_s", math.inf)
        now_wall, now = time.time(), time.monotonic()
        for h, item in zip(bundle, results):
            if not isinstance(item, dict):
                item = {"status": 502, "error": "relay: malformed result from the collector"}
            item = dict(item)
            status = item.pop("status", 502)
            status = status if isinstance(status, int) and 200 <= status < 600 else 502
            if status == 200:
                hold = now - h.arrived
                item["server_ts"] = now_wall - 0.5 * hold + offset
                item["relayed"] = {"hold_s": hold, "error_s": error if math.isfinite(error) else None}
            extra = [(b"retry-after", b"1")] if status == 503 else []
            _settle(h.answer, (status, json.dumps(item, separators=(",", ":")).encode(), extra))


def _settle(fut: asyncio.Future, value) -> None:
    if not fut.done():
        fut.set_result(value)
