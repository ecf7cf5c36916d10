"""The ASGI app: FastAPI routers around one `Storage`.

`create_app(storage)` wires the routes; the app closes the storage when its
lifespan ends (uvicorn's graceful shutdown on SIGTERM/SIGINT: stop accepting,
finish in-flight requests, then drain the write queue and checkpoint).

TCP_NODELAY: both event loops uvicorn may run on set it on every accepted TCP
socket (asyncio's selector transport calls `base_events._set_nodelay`; uvloop's
TCP transport does the same), so a response's head and body writes are not
held back by Nagle's algorithm, which with the client's delayed ACK adds ~40 ms
to every request (measured here: 44 ms median with it disabled, 0.5 ms with it).
tests/integration/test_collector_http.py measures a round trip to keep it so.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from agent import wire
from collector.http.gate import Gate
from collector.http.routes import commands, ingest, ops, query, sql
from collector.http.routes.common import error_response
from collector.storage import Storage


class CollectorApp:
    """The ASGI entry point: POST /v1/ingest goes straight to its endpoint (no
    middleware, no routing: it is the one hot path, thousands of requests a second
    with ranks flushing often), everything else to the FastAPI app."""

    def __init__(self, api: FastAPI, ingest_endpoint: ingest.IngestEndpoint,
                 bundle_endpoint: ingest.BundleEndpoint) -> None:
        self.api = api
        self._ingest = ingest_endpoint
        self._bundle = bundle_endpoint

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            if scope["path"] == "/v1/ingest":
                await self._ingest(scope, receive, send)
                return
            if scope["path"] == wire.BUNDLE_PATH:
                await self._bundle(scope, receive, send)
                return
        await self.api(scope, receive, send)


def create_app(storage: Storage, *, close_storage: bool = True) -> Gate:
    """The collector as one ASGI app: the gate (auth, bounds) in front of the routes."""
    if storage.settings.tokens.empty:
        raise ValueError("the collector needs bearer tokens (Settings.tokens or Settings.token)")
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        if close_storage:
            await run_in_threadpool(storage.close)

    app = FastAPI(title="llmwatch collector", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.storage = storage
    app.state.settings = storage.settings
    endpoint = ingest.IngestEndpoint(storage)
    bundle = ingest.BundleEndpoint(storage)
    app.router.routes.append(Route("/v1/ingest", endpoint, methods=["POST"]))
    app.router.routes.append(Route(wire.BUNDLE_PATH, bundle, methods=["POST"]))
    for r in (ingest.router, query.router, query.fleet_router, sql.router, commands.router, ops.router):
        app.include_router(r)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException):
        return error_response(exc.status_code, str(exc.detail), exc.headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
        where = ".".join(str(p) for p in first.get("loc", ()))
        return error_response(422, f"{where}: {first.get('msg')}" if where else str(first.get("msg")))

    return Gate(CollectorApp(app, endpoint, bundle), storage.settings, storage.metrics)
