"""The dashboard's read API: JSON, bearer auth, every query in collector/read.py.

Handlers are plain `def`s: FastAPI runs them in its thread pool, where a
storage query blocks only its own thread (each gets its own DuckDB cursor).
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, HTTPException, Query, Request
from pydantic import BeforeValidator, Field
from starlette.responses import Response

from collector.routes.common import json_response
from collector.storage import Storage

router = APIRouter(prefix="/v1/runs")  # the read role: collector/gate.py


def _storage(request: Request) -> Storage:
    return request.app.state.storage


StorageDep = Annotated[Storage, Depends(_storage)]
# An empty query value (`?rank=`) means "not given", as a dashboard's empty field sends it.
_EmptyIsNone = BeforeValidator(lambda v: None if v == "" else v)
Step = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]
StepFrom = Annotated[Step | None, _EmptyIsNone, Query()]
StepTo = Annotated[Step | None, _EmptyIsNone, Query()]
Rank = Annotated[Annotated[int, Field(ge=0, lt=2**31)] | None, _EmptyIsNone, Query()]


@router.get("")
def list_runs(storage: StorageDep) -> Response:
    return json_response(storage.runs())


@router.get("/{run_id}")
def get_run(run_id: str, storage: StorageDep) -> Response:
    run = storage.run(run_id)
    if run is None:
        raise HTTPException(404, f"unknown run {run_id!r}")
    return json_response(run)


@router.get("/{run_id}/steps")
def get_steps(run_id: str, storage: StorageDep, metric: str = "loss",
              rank: Rank = None, step_from: StepFrom = None,
              step_to: StepTo = None, max_points: Annotated[int, Query(ge=1, le=100_000)] = 2000) -> Response:
    """Effective curve of a steps column (or a scalar name), min/max/avg per step bucket."""
    return json_response({"run_id": run_id, "metric": metric, "rank": rank,
                          "points": storage.steps(run_id, metric, rank=rank, step_from=step_from,
                                                  step_to=step_to, max_points=max_points)})


@router.get("/{run_id}/step_summary")
def get_step_summary(run_id: str, storage: StorageDep, step_from: StepFrom = None, step_to: StepTo = None,
                     limit: Annotated[int, Query(ge=1, le=100_000)] = 2000) -> Response:
    return json_response(storage.step_summary(run_id, step_from=step_from, step_to=step_to, limit=limit))


@router.get("/{run_id}/ranks")
def get_ranks(run_id: str, storage: StorageDep) -> Response:
    return json_response(storage.ranks(run_id))


@router.get("/{run_id}/collectives")
def get_collectives(run_id: str, storage: StorageDep, step_from: StepFrom = None, step_to: StepTo = None,
                    last_steps: Annotated[int, Query(ge=1, le=100_000)] = 20) -> Response:
    return json_response(storage.collectives(run_id, step_from=step_from, step_to=step_to, last_steps=last_steps))


@router.get("/{run_id}/incidents")
def get_incidents(run_id: str, storage: StorageDep, status: str | None = None) -> Response:
    return json_response(storage.incidents(run_id, status=status))


@router.get("/{run_id}/actions")
def get_actions(run_id: str, storage: StorageDep) -> Response:
    return json_response(storage.actions(run_id))


@router.get("/{run_id}/goodput")
def get_goodput(run_id: str, storage: StorageDep) -> Response:
    """The share of the run's wall time in steps that counted (collector/postmortem.py)."""
    return json_response(storage.goodput(run_id))


@router.get("/{run_id}/bad_batches")
def get_bad_batches(run_id: str, storage: StorageDep) -> Response:
    """The sample windows the run's rollbacks skipped (from batch_skipped events)."""
    return json_response(storage.bad_batches(run_id))


@router.get("/{run_id}/checkpoints")
def get_checkpoints(run_id: str, storage: StorageDep) -> Response:
    return json_response(storage.checkpoints(run_id))


@router.get("/{run_id}/nodes")
def get_nodes(run_id: str, storage: StorageDep) -> Response:
    return json_response(storage.nodes(run_id))


@router.get("/{run_id}/events")
def get_events(run_id: str, storage: StorageDep, kind: str | None = None,
               limit: Annotated[int, Query(ge=1, le=100_000)] = 500) -> Response:
    return json_response(storage.events(run_id, kind=kind, limit=limit))


@router.get("/{run_id}/heartbeats/latest")
def get_heartbeats_latest(run_id: str, storage: StorageDep) -> Response:
    return json_response(storage.heartbeats_latest(run_id))
