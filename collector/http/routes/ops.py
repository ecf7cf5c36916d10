"""GET /healthz (no token) and GET /metrics (Prometheus; the read token unless the
collector runs with --public-metrics: the gauges name runs and show live losses)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.concurrency import run_in_threadpool
from starlette.responses import Response

from collector.http.routes.common import json_response

router = APIRouter()


@router.get("/healthz")
async def healthz(request: Request) -> Response:
    """200 while the collector can store data, 503 with the reason when it cannot.
    Async and free of I/O: it answers on the event loop even while every worker
    thread is busy (slow SQL, a long commit)."""
    storage = request.app.state.storage
    ok, reason = storage.health()
    body = {"status": "ok" if ok else "unhealthy", "write_queue_depth": storage.queue_depth()}
    if not ok:
        body["reason"] = reason
    return json_response(body, 200 if ok else 503)


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    body = await run_in_threadpool(request.app.state.storage.metrics.exposition)
    return Response(body, media_type=CONTENT_TYPE_LATEST)
