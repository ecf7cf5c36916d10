"""What every route shares: bounded body reading, JSON answers. (Authentication
and the body bounds are the gate's, collector/http/gate.py, before any route runs.)

Errors are always `{"error": reason}` with a 4xx (or 503 for back-pressure).
JSON bodies keep NaN and Infinity as the literals Python's json module reads
(a NaN loss is data here, not something to hide); use format=arrow on /v1/sql
for strict typed output.
"""

from __future__ import annotations

import base64
import datetime as dt
import decimal
import json
import uuid
from typing import Any

from fastapi import Request
from starlette.responses import Response
from starlette.types import Receive, Scope

JSON_TYPE = "application/json"


def _default(v: Any) -> Any:
    if isinstance(v, (dt.datetime, dt.date, dt.time)):
        return v.isoformat()
    if isinstance(v, dt.timedelta):
        return v.total_seconds()
    if isinstance(v, decimal.Decimal):
        return float(v)
    if isinstance(v, uuid.UUID):
        return str(v)
    if isinstance(v, (bytes, bytearray, memoryview)):
        return base64.b64encode(bytes(v)).decode()
    if isinstance(v, (set, frozenset)):
        return sorted(v)
    return str(v)


def dumps(content: Any) -> bytes:
    return json.dumps(content, separators=(",", ":"), ensure_ascii=False, default=_default).encode("utf-8")


def json_response(content: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(dumps(content), status_code=status, media_type=JSON_TYPE, headers=headers)


def error_response(status: int, reason: str, headers: dict[str, str] | None = None) -> Response:
    return json_response({"error": reason}, status, headers)


class BodyTooLarge(Exception):
    pass


async def read_limited(request: Request, max_bytes: int) -> bytes:
    """The request body, refusing past `max_bytes` (declared or actual)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise BodyTooLarge
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise BodyTooLarge
        chunks.append(chunk)
    return b"".join(chunks)


class ClientDisconnected(Exception):
    pass


async def receive_body(scope: Scope, receive: Receive, types: tuple[bytes, ...], expected: str,
                       limit: int) -> bytes | tuple[int, bytes, list]:
    """A streamed route's body (the ingest endpoints, a relay's), or the refusal to answer
    as (status, JSON body, extra headers): 415 for a Content-Type not in `types`, 413 past
    `limit` (declared or read), 400 when the client left."""
    content_type = content_length = None  # the token was checked by collector/http/gate.py
    for name, value in scope["headers"]:
        if name == b"content-type":
            content_type = value
        elif name == b"content-length":
            content_length = value
    if content_type is not None and content_type.split(b";")[0].strip().lower() not in types:
        return 415, dumps({"error": f"Content-Type must be {expected}"}), []
    declared = int(content_length) if content_length is not None and content_length.isdigit() else None
    if declared is not None and declared > 2 * limit:
        return 413, dumps({"error": f"body of {declared} bytes exceeds the limit of {limit}"}), [(b"connection", b"close")]
    try:
        return await _read(receive, limit)
    except BodyTooLarge:
        return 413, dumps({"error": f"body exceeds the limit of {limit} bytes"}), [(b"connection", b"close")]
    except ClientDisconnected:
        return 400, dumps({"error": "client disconnected"}), []


async def _read(receive: Receive, limit: int) -> bytes:
    chunks, size, more = [], 0, True
    while more:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientDisconnected
        chunk = message.get("body", b"")
        size += len(chunk)
        more = message.get("more_body", False)
        if size > limit:
            while more and size <= 2 * limit:  # drain so the client can read our 413
                message = await receive()
                size += len(message.get("body", b""))
                more = message.get("more_body", False) and message["type"] != "http.disconnect"
            raise BodyTooLarge
        chunks.append(chunk)
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)
