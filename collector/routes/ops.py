"""GET /healthz and GET /metrics (Prometheus). No token: neither exposes data rows."""

from __future__ import annotations

from fastapi import APIRouter, Request
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.concurrency import run_in_threadpool
from starlette.responses import Response

from collector.routes.common import json_response

router = APIRouter()


@router.get("/healthz")
def healthz(request: Request) -> Response:
    return json_response({"status": "ok", "write_queue_depth": request.app.state.storage.queue_depth()})


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    body = await run_in_threadpool(request.app.state.storage.metrics.exposition)
    return Response(body, media_type=CONTENT_TYPE_LATEST)
