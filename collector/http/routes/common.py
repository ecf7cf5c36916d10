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
