"""The gate: every HTTP request passes it before any route sees a byte of its body.

In this order, from headers alone:

1. concurrency: past `max_inflight_requests` requests in flight, 503 with
   Retry-After (`/healthz` is exempt: a monitor must see an overloaded collector
   as overloaded, not as dead);
2. authentication: the route's role (see `rule_for`) against the bearer token;
   401 otherwise, also for paths that do not exist, so a scan learns nothing;
3. size: a declared Content-Length over the route's limit is a 413.

Then the body, bounded in bytes and in time (`body_timeout_s`, 408): routes
other than ingest get it buffered by the gate (their limits are small, and a
route that reads a body the gate has not bounded cannot exist); the ingest
endpoint streams it itself (it has its own limit) through a receive that
enforces the deadline.

A refused request's body is not parsed or kept. So that an ordinary client,
which sends its whole body before reading the answer, sees the reason rather
than a reset connection, up to `DRAIN_BYTES` of it are read and discarded before
the refusal goes out, with `connection: close`; a larger body is cut off.
uvicorn itself holds at most 64 KiB of unread body per connection (it stops
reading the socket past that), so memory does not grow with what a client sends.
"""

from __future__ import annotations

import asyncio
import re
import time
from dataclasses import dataclass

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from agent import wire
from collector.http.auth import Role
from collector.http.routes.common import dumps
from collector.metrics import CollectorMetrics
from collector.settings import Settings

KiB = 1024
DRAIN_BYTES = 1024 * KiB
DRAIN_S = 2.0
_COMMANDS = re.compile(r"^/v1/runs/[^/]+/commands/?$")


@dataclass(frozen=True, slots=True)
class Rule:
    role: Role | None  # None: no token needed
    max_body_bytes: int
    streamed: bool = False  # the route reads its body itself (bounded there too)


def rule_for(method: str, path: str, settings: Settings) -> Rule:
    """Which role a request needs and how big its body may be. The one table."""
    if path == "/healthz" and method in ("GET", "HEAD"):
        return Rule(None, 0)
    if method == "POST":
        if path == "/v1/ingest":
            return Rule(Role.INGEST, settings.gate.max_batch_bytes, streamed=True)
        if path == wire.BUNDLE_PATH:
            return Rule(Role.INGEST, settings.gate.max_bundle_bytes, streamed=True)
        if path == "/v1/metrics":
            return Rule(Role.INGEST, settings.gate.otlp_max_bytes)
        if path == "/v1/sql":
            return Rule(Role.READ, settings.gate.max_sql_request_bytes)
        if _COMMANDS.match(path):
            return Rule(Role.CONTROL, settings.gate.max_command_request_bytes)
    if path == "/metrics" and method in ("GET", "HEAD"):
        return Rule(None if settings.public_metrics else Role.READ, 0)
    return Rule(Role.READ, 16 * KiB)  # the query API, /openapi.json, and whatever does not exist


class BodyTimeout(Exception):
    pass


class Gate:
    """ASGI middleware around the whole collector app."""

    def __init__(self, app: ASGIApp, settings: Settings, metrics: CollectorMetrics) -> None:
        self.app = app
        self.settings = settings
        self.metrics = metrics
        self.inflight = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)  # lifespan
            return
        rule = rule_for(scope["method"], scope["path"], self.settings)
        if rule.role is None and scope["path"] == "/healthz":
            await self.app(scope, receive, send)
            return
        if self.inflight >= self.settings.gate.max_inflight_requests:
            await self._refuse(scope, receive, send, 503, "busy", "too many requests in flight, retry later",
                               [(b"retry-after", b"1")])
            return
        self.inflight += 1
        try:
            await self._admit(scope, receive, send, rule)
        finally:
            self.inflight -= 1

    async def _admit(self, scope: Scope, receive: Receive, send: Send, rule: Rule) -> None:
        headers = dict(scope["headers"])  # the last of a repeated header wins, as everywhere here
        if rule.role is not None and not self.settings.tokens.allows(headers.get(b"authorization"), rule.role):
            await self._refuse(scope, receive, send, 401, "unauthorized", "missing or wrong bearer token",
                               [(b"www-authenticate", b"Bearer")])
            return
        declared = headers.get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > rule.max_body_bytes):
            if not declared.isdigit():
                await self._refuse(scope, receive, send, 400, "bad_request", "Content-Length is not a number")
            else:
                await self._refuse(scope, receive, send, 413, "too_large",
                                   f"body of {int(declared)} bytes exceeds the limit of {rule.max_body_bytes}")
            return
        deadline = time.monotonic() + self.settings.gate.body_timeout_s
        started = False

        async def send_tracked(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            if rule.streamed:
                await self.app(scope, _deadline_receive(receive, deadline), send_tracked)
                return
            body, status = await _read_body(receive, rule.max_body_bytes, deadline)
            if status == 413:
                await self._answer(send, 413, "too_large", f"body exceeds the limit of {rule.max_body_bytes} bytes",
                                   [(b"connection", b"close")])
                return
            if status == 499:
                return  # the client went away: nobody to answer
            await self.app(scope, _replay(body, receive), send_tracked)
        except BodyTimeout:
            if not started:
                await self._answer(send, 408, "timeout",
                                   f"request body not received within {self.settings.gate.body_timeout_s:g} s",
                                   [(b"connection", b"close")])

    async def _refuse(self, scope: Scope, receive: Receive, send: Send, status: int, reason: str, message: str,
                      extra: list | None = None) -> None:
        await _drain(receive, scope)
        await self._answer(send, status, reason, message, [*(extra or []), (b"connection", b"close")])

    async def _answer(self, send: Send, status: int, reason: str, message: str, extra: list) -> None:
        self.metrics.rejects.labels(reason).inc()
        body = dumps({"error": message})
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                *extra]})
        await send({"type": "http.response.body", "body": body})


async def _drain(receive: Receive, scope: Scope) -> None:
    """Read and discard up to DRAIN_BYTES of a refused body for at most DRAIN_S."""
    declared = dict(scope["headers"]).get(b"content-length")
    if declared is not None and declared.isdigit() and int(declared) == 0:
        return
    if declared is None and b"chunked" not in dict(scope["headers"]).get(b"transfer-encoding", b""):
        return  # no body at all
    deadline = time.monotonic() + DRAIN_S
    size = 0
    try:
        while size <= DRAIN_BYTES:
            message = await asyncio.wait_for(receive(), max(0.001, deadline - time.monotonic()))
            if message["type"] == "http.disconnect":
                return
            size += len(message.get("body", b""))
            if not message.get("more_body", False):
                return
    except asyncio.TimeoutError:
        return


def _deadline_receive(receive: Receive, deadline: float) -> Receive:
    async def bounded() -> Message:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise BodyTimeout
        try:
            return await asyncio.wait_for(receive(), remaining)
        except asyncio.TimeoutError:
            raise BodyTimeout from None
    return bounded


async def _read_body(receive: Receive, limit: int, deadline: float) -> tuple[bytes, int]:
    """(body, 200) | (b"", 413) past `limit` | (b"", 499) when the client left."""
    bounded = _deadline_receive(receive, deadline)
    chunks, size = [], 0
    while True:
        message = await bounded()
        if message["type"] == "http.disconnect":
            return b"", 499
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            return b"", 413
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks), 200


def _replay(body: bytes, receive: Receive) -> Receive:
    """A receive that hands the buffered body over once, then waits on the real one
    (which reports the disconnect when it comes)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()
    return replay
