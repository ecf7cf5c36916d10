"""POST /v1/ingest (native batches) and POST /v1/metrics (OTLP/HTTP metrics).

/v1/ingest is the hot path, so it is a plain ASGI callable (no request object,
no dependency injection): check the size, read the body, decode it, hand it to
the writer and await the commit. The answer carries the pending commands of the
sender's run and rank, and to a run's rank 0 while the policy watches a slow-down
that may be acted on any moment, `followup_s`: flush more often for that long; to
every rank while an incident whose evidence is the collectives is open on its run,
`raw_ops_s`: an agent that summarizes its collectives ships op rows for that long. Decoding is vectorised but not free: its cost follows the
header's JSON and the body's hash (~1 ms per MB), so a body up to
`inline_decode_max_bytes` is decoded on the event loop (tens of microseconds,
less than the ~60 us a hop to a worker thread costs) and a larger one on a
worker thread, where hashing runs without the GIL and no request can stall the
loop for the others.

Refusals: 413 size (declared or read), 415 content type, 400 framing, 409 a batch
key already stored with other content, 422 content, 503 write queue full
(Retry-After) or storage unavailable (the gate in front answers 401 for the
token). A body that is too large is read and discarded up to twice the limit
before the 413 goes out, so an ordinary client (one that sends its whole body
before reading) sees the reason instead of a reset connection.

/v1/metrics decompresses, parses and converts on a worker thread, within the
bounds `otlp.decode_request` enforces (413 past them).
"""

from __future__ import annotations

import time

from fastapi import APIRouter, Request
from starlette.concurrency import run_in_threadpool
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from agent import wire
from collector.http.routes.common import BodyTooLarge, dumps, error_response, read_limited
from collector.ingest import otlp
from collector.ingest.decode import BatchRejected, decode
from collector.storage import Storage
from collector.store.writer import QueueFull, StorageError

_REASONS = {400: "bad_batch", 401: "unauthorized", 409: "conflict", 413: "too_large", 415: "content_type",
            422: "invalid", 503: "busy"}
_BATCH_TYPES = (wire.CONTENT_TYPE.encode(), b"application/octet-stream")
# how long a rank 0 told that an action may come any moment flushes more often (renewed with each answer
# while the policy watches; agent/agent.py `followup_s`)
FOLLOWUP_S = 2.0
# how long a summarizing agent ships op rows, told while an incident whose evidence is the collectives is
# open on its run (renewed with each answer; agent/summary.py `raw_ops_s`)
RAW_OPS_S = 5.0


class _Disconnected(Exception):
    pass


class IngestEndpoint:
    """ASGI app for POST /v1/ingest."""

    def __init__(self, storage: Storage) -> None:
        self.storage = storage
        self.settings = storage.settings

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            status, content, extra = await self._handle(scope, receive)
        except StorageError as e:
            status, content, extra = e.status, dumps({"error": str(e)}), []
            self.storage.metrics.rejects.labels("storage").inc()
        else:
            if status != 200:
                self.storage.metrics.rejects.labels(_REASONS[status]).inc()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(content)).encode()), *extra]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": content})

    async def _handle(self, scope: Scope, receive: Receive) -> tuple[int, bytes, list]:
        content_type = content_length = None  # the token was checked by collector/http/gate.py
        for name, value in scope["headers"]:
            if name == b"content-type":
                content_type = value
            elif name == b"content-length":
                content_length = value
        limit = self.settings.gate.max_batch_bytes
        if content_type is not None and content_type.split(b";")[0].strip().lower() not in _BATCH_TYPES:
            return 415, dumps({"error": f"Content-Type must be {wire.CONTENT_TYPE}"}), []
        declared = int(content_length) if content_length is not None and content_length.isdigit() else None
        if declared is not None and declared > 2 * limit:
            return 413, dumps({"error": f"body of {declared} bytes exceeds the limit of {limit}"}), [(b"connection", b"close")]
        try:
            body = await self._read(receive, limit)
        except BodyTooLarge:
            return 413, dumps({"error": f"body exceeds the limit of {limit} bytes"}), [(b"connection", b"close")]
        except _Disconnected:
            return 400, dumps({"error": "client disconnected"}), []
        try:
            if len(body) <= self.settings.gate.inline_decode_max_bytes:
                batch = decode(body)
            else:
                batch = await run_in_threadpool(decode, body)
            outcome = await self.storage.ingest(batch)
        except BatchRejected as e:
            return e.status, dumps({"error": str(e)}), []
        except QueueFull as e:
            return 503, dumps({"error": f"busy, retry later: {e}"}), [(b"retry-after", b"1")]
        # server_ts: this collector's clock, for the agents' offset estimates (agent/clock.py);
        # clean_through: the run's known-good watermark (collector/live/watermark.py), for the trainer
        # (present, maybe null, only when this collector runs detection: the trainer then keeps checkpoints for it)
        answer = {"accepted": outcome.accepted, "duplicate": outcome.duplicate, "commands": outcome.commands,
                  "server_ts": time.time()}
        marks = self.storage.watermarks
        if marks is not None:
            answer["clean_through"], answer["end_wait_s"] = marks.get(batch.run_id), marks.end_wait_s
        # followup_s: the policy may decide an action for the run any moment; rank 0 (the one that
        # picks the job's commands and broadcasts them) flushes more often for this long, so the
        # command rides back within a fraction of a second instead of a flush interval
        policy = self.storage.policy
        if batch.rank == 0 and policy is not None and policy.watching(batch.run_id):
            answer["followup_s"] = FOLLOWUP_S
        if self.storage.wants_ops(batch.run_id):
            answer["raw_ops_s"] = RAW_OPS_S
        return 200, dumps(answer), []

    @staticmethod
    async def _read(receive: Receive, limit: int) -> bytes:
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise _Disconnected
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


router = APIRouter()


@router.post("/v1/metrics")
async def otlp_metrics(request: Request) -> Response:
    """OTLP/HTTP metrics export (protobuf or JSON); every data point -> scalars."""
    storage: Storage = request.app.state.storage
    settings = storage.settings
    limit = settings.gate.otlp_max_bytes
    content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if content_type not in (otlp.PROTOBUF, otlp.JSON):
        storage.metrics.rejects.labels("content_type").inc()
        return error_response(415, f"Content-Type must be {otlp.PROTOBUF} or {otlp.JSON}")
    try:
        body = await read_limited(request, limit)
        table = await run_in_threadpool(
            otlp.decode_request, body, content_type=content_type,
            content_encoding=request.headers.get("content-encoding"), max_bytes=limit,
            max_points=settings.gate.otlp_max_points, max_text_chars=settings.gate.max_batch_bytes)
    except BodyTooLarge:
        storage.metrics.rejects.labels("too_large").inc()
        return error_response(413, f"body exceeds the limit of {limit} bytes")
    except otlp.OtlpTooLarge as e:
        storage.metrics.rejects.labels("too_large").inc()
        return error_response(413, str(e))
    except otlp.OtlpError as e:
        storage.metrics.rejects.labels("bad_otlp").inc()
        return error_response(400, str(e))
    if table.num_rows:
        try:
            await storage.ingest_tables({"scalars": table})
        except QueueFull as e:
            return error_response(503, f"busy, retry later: {e}", {"retry-after": "1"})
        except StorageError as e:
            return error_response(e.status, str(e))
    return Response(otlp.response_body(content_type), media_type=content_type)
