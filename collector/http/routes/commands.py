"""POST/GET /v1/runs/{run_id}/commands: issue control commands, see their state."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, HTTPException, Request
from pydantic import BaseModel
from starlette.responses import Response

from collector.http.routes.common import json_response
from collector.read import queries
from collector.storage import Storage

router = APIRouter(prefix="/v1/runs")  # the control role: collector/http/gate.py


class CommandRequest(BaseModel):
    kind: str
    args: dict[str, Any] = {}
    ranks: list[int] | None = None


@router.post("/{run_id}/commands", status_code=201)
def post_command(run_id: str, req: CommandRequest, request: Request) -> Response:
    """Queue a command; each target rank gets it once, in its next ingest response."""
    storage: Storage = request.app.state.storage
    try:
        cmd = storage.issue_command(run_id, req.kind, req.args, req.ranks).result(timeout=30)
    except ValueError as e:
        raise HTTPException(422, str(e)) from None
    except KeyError as e:
        raise HTTPException(404, e.args[0]) from None
    return json_response(cmd, 201)


@router.get("/{run_id}/commands")
def get_commands(run_id: str, request: Request) -> Response:
    return json_response(request.app.state.storage.read(queries.commands, run_id))
