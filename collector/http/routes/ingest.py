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

import asyncio
import time

from fastapi import APIRouter, Request
from starlette.concurrency import run_in_threadpool
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from agent import wire
from collector.http.routes.common import BodyTooLarge, dumps, error_response, read_limited, receive_body
from collector.ingest import otlp
from collector.ingest.decode import BatchRejected, DecodedBatch, decode
from collector.storage import Storage
from collector.store.writer import IngestOutcome, QueueFull, StorageError

_REASONS = {400: "bad_batch", 401: "unauthorized", 409: "conflict", 413: "too_large", 415: "content_type",
            422: "invalid", 503: "busy"}
_BATCH_TYPES = (wire.CONTENT_TYPE.encode(), b"application/octet-stream")
_BUNDLE_TYPES = (wire.BUNDLE_CONTENT_TYPE.encode(),)
# how long a rank 0 told that an action may come any moment flushes more often (renewed with each answer
# while the policy watches; agent/agent.py `followup_s`)
FOLLOWUP_S = 2.0
# how long a summarizing agent ships op rows, told while an incident whose evidence is the collectives is
# open on its run (renewed with each answer; agent/summary.py `raw_ops_s`)
RAW_OPS_S = 5.0


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
        body = await receive_body(scope, receive, _BATCH_TYPES, wire.CONTENT_TYPE, self.settings.gate.max_batch_bytes)
        if isinstance(body, tuple):
            return body
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
        return 200, dumps(self._answer(batch, outcome, time.time())), []

    def _answer(self, batch: DecodedBatch, outcome: IngestOutcome, now: float) -> dict:
        # server_ts: this collector's clock, for the agents' offset estimates (agent/clock.py);
        # clean_through: the run's known-good watermark (collector/live/watermark.py), for the trainer
        # (present, maybe null, only when this collector runs detection: the trainer then keeps checkpoints for it)
        answer = {"accepted": outcome.accepted, "duplicate": outcome.duplicate, "commands": outcome.commands,
                  "server_ts": now}
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
        return answer


def _decode_items(items: list[memoryview]) -> list[DecodedBatch | BatchRejected]:
    out: list[DecodedBatch | BatchRejected] = []
    for item in items:
        try:
            out.append(decode(item))
        except BatchRejected as e:
            out.append(e)
    return out


class BundleEndpoint(IngestEndpoint):
    """ASGI app for POST /v1/ingest/bundle: a node relay's batches (collector/relay.py).

    Each item is decoded, stored and answered exactly as if it had been posted alone
    to /v1/ingest: the answer is `{"results": [...]}`, one object per item in order,
    each the item's own answer with its HTTP status as `status` (a refused item does not
    refuse the others). What a bundle saves is per request: one HTTP exchange, one
    pass of the gate, one await for a group commit that takes every item."""

    async def _handle(self, scope: Scope, receive: Receive) -> tuple[int, bytes, list]:
        gate = self.settings.gate
        body = await receive_body(scope, receive, _BUNDLE_TYPES, wire.BUNDLE_CONTENT_TYPE, gate.max_bundle_bytes)
        if isinstance(body, tuple):
            return body
        try:
            items = wire.decode_bundle(body, max_items=gate.max_bundle_items, max_item_bytes=gate.max_batch_bytes)
        except wire.WireError as e:
            return 400, dumps({"error": str(e)}), []
        if len(body) <= gate.inline_decode_max_bytes:
            decoded = _decode_items(items)
        else:
            decoded = await run_in_threadpool(_decode_items, items)
        results: list[dict | None] = [None] * len(decoded)
        waits: list[tuple[int, DecodedBatch, asyncio.Future]] = []
        rejects = self.storage.metrics.rejects
        for i, d in enumerate(decoded):
            if isinstance(d, BatchRejected):
                results[i] = {"status": d.status, "error": str(d)}
                rejects.labels(_REASONS[d.status]).inc()
                continue
            try:
                waits.append((i, d, self.storage.submit(d)))
            except QueueFull as e:
                results[i] = {"status": 503, "error": f"busy, retry later: {e}"}
                rejects.labels("busy").inc()
        outcomes = await asyncio.gather(*(f for _, _, f in waits), return_exceptions=True)
        now = time.time()
        for (i, batch, _), outcome in zip(waits, outcomes):
            if isinstance(outcome, (StorageError, BatchRejected)):
                results[i] = {"status": outcome.status, "error": str(outcome)}
                rejects.labels("storage" if isinstance(outcome, StorageError) else _REASONS[outcome.status]).inc()
            elif isinstance(outcome, BaseException):
                raise outcome
            else:
                results[i] = {"status": 200, **self._answer(batch, outcome, now)}
        return 200, dumps({"results": results, "server_ts": now}), []


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
