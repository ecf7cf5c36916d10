"""The dashboard's read API: JSON, bearer auth, every query in collector/read/queries.py.

Handlers are plain `def`s: FastAPI runs them in its thread pool, where a
storage query blocks only its own thread (each gets its own DuckDB cursor). The
polled ones (a run's nodes, incidents and actions) are conditional GETs: `async`, they
answer a 304 on the event loop when the tables' ETag (`Storage.etag`) is the
client's, and read in the thread pool otherwise.
"""

from __future__ import annotations

import inspect
import time
from typing import Annotated

from fastapi import APIRouter, Depends, HTTPException, Query, Request
from pydantic import BeforeValidator, Field
from starlette.concurrency import run_in_threadpool
from starlette.responses import HTMLResponse, Response

from analysis import load_rules
from collector.http.routes.common import json_response
from collector.offline import postmortem
from collector.read import fleet, queries, views
from collector.storage import Storage

router = APIRouter(prefix="/v1/runs")  # the read role: collector/http/gate.py
fleet_router = APIRouter(prefix="/v1/fleet")  # the read role too


def _storage(request: Request) -> Storage:
    return request.app.state.storage


StorageDep = Annotated[Storage, Depends(_storage)]
# An empty query value (`?rank=`) means "not given", as a dashboard's empty field sends it.
_EmptyIsNone = BeforeValidator(lambda v: None if v == "" else v)
Step = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]
StepFrom = Annotated[Step | None, _EmptyIsNone, Query()]
StepTo = Annotated[Step | None, _EmptyIsNone, Query()]
Rank = Annotated[Annotated[int, Field(ge=0, lt=2**31)] | None, _EmptyIsNone, Query()]
Points = Annotated[Annotated[int, Field(ge=1, le=10_000)] | None, _EmptyIsNone, Query()]


@router.get("")
def list_runs(storage: StorageDep, detail: bool = False) -> Response:
    """Every run; `detail=true`: the newest 50 with their last step, attempts, incidents
    and actions (the dashboard's runs page)."""
    return json_response(storage.read(views.runs_overview) if detail else storage.read(queries.runs))


@router.get("/{run_id}")
def get_run(run_id: str, storage: StorageDep) -> Response:
    run = storage.read(queries.run, run_id)
    if run is None:
        raise HTTPException(404, f"unknown run {run_id!r}")
    return json_response(run)


@router.get("/{run_id}/view/{name}")
def get_view(run_id: str, name: str, storage: StorageDep, step_from: StepFrom = None, step_to: StepTo = None,
             max_points: Points = None, max_steps: Points = None, last_steps: Points = None,
             prefix: Annotated[str | None, Query(max_length=200)] = None) -> Response:
    """One of collector/read/views.py's aggregate views (what a dashboard chart draws),
    with the parameters that view takes; the others are ignored."""
    fn = views.VIEWS.get(name)
    if fn is None:
        raise HTTPException(404, f"unknown view {name!r}; views: {', '.join(sorted(views.VIEWS))}")
    given = {"step_from": step_from, "step_to": step_to, "max_points": max_points, "max_steps": max_steps,
             "last_steps": last_steps, "prefix": prefix}
    accepted = inspect.signature(fn).parameters
    return json_response(storage.read(fn, run_id, **{k: v for k, v in given.items()
                                                     if v is not None and k in accepted}))


@router.get("/{run_id}/report")
def get_report(run_id: str, storage: StorageDep) -> Response:
    """The run's postmortem report as one self-contained HTML page (collector/offline/postmortem.py)."""
    try:
        report = storage.read(postmortem.gather, run_id)
    except LookupError:
        raise HTTPException(404, f"unknown run {run_id!r}") from None
    return HTMLResponse(postmortem.render_html(report))


@router.get("/{run_id}/steps")
def get_steps(run_id: str, storage: StorageDep, metric: str = "loss",
              rank: Rank = None, step_from: StepFrom = None,
              step_to: StepTo = None, max_points: Annotated[int, Query(ge=1, le=100_000)] = 2000) -> Response:
    """Effective curve of a steps column (or a scalar name), min/max/avg per step bucket."""
    return json_response({"run_id": run_id, "metric": metric, "rank": rank,
                          "points": storage.read(queries.steps, run_id, metric, rank=rank, step_from=step_from,
                                                  step_to=step_to, max_points=max_points)})


@router.get("/{run_id}/step_summary")
def get_step_summary(run_id: str, storage: StorageDep, step_from: StepFrom = None, step_to: StepTo = None,
                     limit: Annotated[int, Query(ge=1, le=100_000)] = 2000) -> Response:
    return json_response(storage.read(queries.step_summary, run_id, step_from=step_from, step_to=step_to, limit=limit))


@router.get("/{run_id}/ranks")
def get_ranks(run_id: str, storage: StorageDep) -> Response:
    return json_response(storage.read(queries.ranks, run_id))


@router.get("/{run_id}/collectives")
def get_collectives(run_id: str, storage: StorageDep, step_from: StepFrom = None, step_to: StepTo = None,
                    last_steps: Annotated[int, Query(ge=1, le=100_000)] = 20) -> Response:
    return json_response(storage.read(queries.collectives, run_id, step_from=step_from, step_to=step_to,
                                      last_steps=last_steps))


SETTLE_MAX_S = 10.0  # a read request holds a worker thread this long at most


@router.get("/{run_id}/incidents")
async def get_incidents(request: Request, run_id: str, storage: StorageDep, status: str | None = None,
                        settle_s: Annotated[float, Query(ge=0, le=SETTLE_MAX_S)] = 0.0) -> Response:
    """The run's incidents. `settle_s`: first wait (at most that long) until detection has
    judged every batch acknowledged before this request; the `X-Llmwatch-Settled` header
    says whether it had (`true`) or the wait ran out (`false`). Conditional (`_conditional`)
    without `settle_s`."""
    if settle_s > 0:
        settled = await run_in_threadpool(storage.wait_detected, settle_s)
        response = json_response(await run_in_threadpool(storage.read, queries.incidents, run_id, status=status))
        response.headers["X-Llmwatch-Settled"] = "true" if settled else "false"
        return response
    return await _conditional(request, storage, "incidents", queries.incidents, run_id, status=status)


@router.get("/{run_id}/actions")
async def get_actions(request: Request, run_id: str, storage: StorageDep) -> Response:
    """The run's healing actions. Conditional (`_conditional`): the demo terminal asks every second."""
    return await _conditional(request, storage, "actions", queries.actions, run_id)


@router.get("/{run_id}/goodput")
def get_goodput(run_id: str, storage: StorageDep) -> Response:
    """The share of the run's wall time in steps that counted (collector/offline/postmortem.py)."""
    return json_response(storage.read(views.run_goodput, run_id))


@router.get("/{run_id}/bad_batches")
def get_bad_batches(run_id: str, storage: StorageDep) -> Response:
    """The sample windows the run's rollbacks skipped (from batch_skipped events)."""
    return json_response(storage.read(queries.bad_batches, run_id))


@router.get("/{run_id}/checkpoints")
def get_checkpoints(run_id: str, storage: StorageDep) -> Response:
    return json_response(storage.read(queries.checkpoints, run_id))


@router.get("/{run_id}/nodes")
async def get_nodes(request: Request, run_id: str, storage: StorageDep) -> Response:
    """The run's nodes and their status (healthy, spare, isolated). Conditional (`_conditional`):
    the launcher asks twice a second, and the answer changes a few times a run."""
    return await _conditional(request, storage, "nodes", queries.nodes, run_id)


async def _conditional(request: Request, storage: Storage, table: str, fn, *args, **kwargs) -> Response:
    """`storage.read(fn, *args, **kwargs)` (rows of `table` only) as a conditional GET: tagged
    with `table`'s ETag, read before the rows; an `If-None-Match` naming it gets a 304 with no
    body and no database read, on the event loop. What a poller saves (the launcher's node
    watch, the demo's incident feed, once or twice a second each): a cursor, a query and the
    JSON, ~2 ms of the embedded collector's CPU, on the training job's cores."""
    etag = storage.etag(table)
    headers = {"ETag": etag, "Cache-Control": "private, no-cache"}
    given = request.headers.get("if-none-match")
    if given is not None and etag in [t.strip() for t in given.split(",")]:
        return Response(status_code=304, headers=headers)
    return json_response(await run_in_threadpool(storage.read, fn, *args, **kwargs), headers=headers)


@router.get("/{run_id}/events")
def get_events(run_id: str, storage: StorageDep, kind: str | None = None,
               limit: Annotated[int, Query(ge=1, le=100_000)] = 500) -> Response:
    return json_response(storage.read(queries.events, run_id, kind=kind, limit=limit))


@router.get("/{run_id}/heartbeats/latest")
def get_heartbeats_latest(run_id: str, storage: StorageDep) -> Response:
    return json_response(storage.read(queries.heartbeats_latest, run_id))


@fleet_router.get("/nodes")
def get_fleet_nodes(storage: StorageDep,
                    since_s: Annotated[float | None, _EmptyIsNone, Query(gt=0, le=366 * 86400)] = None) -> Response:
    """Every node's record across runs, worst first (collector/read/fleet.py `node_records`): this
    collector's runs and its archive's (`--archive`), over the last `since_s` seconds (default: the
    rules' [node_history] window_days). What `collector nodes --url` prints."""
    rules = storage.detection.analyzer.rules if storage.detection is not None else load_rules()
    now = time.time()
    since = now - (since_s if since_s is not None else 86400.0 * rules.node_history.window_days)
    return json_response(storage.read(fleet.node_records, since_ts=since, until_ts=now, rules=rules,
                                      archive_dir=storage.settings.archive_dir))
