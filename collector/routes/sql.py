"""POST /v1/sql: read-only SQL (see collector/sqlguard.py), as JSON or Arrow."""

from __future__ import annotations

from typing import Literal

import pyarrow as pa
from fastapi import APIRouter, Request
from pydantic import BaseModel, Field
from starlette.responses import Response

from collector.routes.common import error_response, json_response
from collector.sqlguard import SqlRefused
from collector.storage import Storage

ARROW_STREAM = "application/vnd.apache.arrow.stream"

router = APIRouter()  # the read role: collector/gate.py


class SqlRequest(BaseModel):
    sql: str = Field(max_length=100_000)
    format: Literal["json", "arrow"] = "json"
    max_rows: int = Field(default=10_000, ge=1, le=10_000_000)


def arrow_stream(table: pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return sink.getvalue().to_pybytes()


@router.post("/v1/sql")
def post_sql(req: SqlRequest, request: Request) -> Response:
    """One SELECT; at most max_rows rows (capped by the server's --sql-max-rows),
    `truncated` says whether there were more. Arrow answers carry it in the
    X-Llmwatch-Truncated header."""
    storage: Storage = request.app.state.storage
    try:
        result = storage.sql(req.sql, fmt=req.format, max_rows=req.max_rows)
    except SqlRefused as e:
        storage.metrics.rejects.labels("sql").inc()
        return error_response(400, str(e))
    if req.format == "arrow":
        return Response(arrow_stream(result.table), media_type=ARROW_STREAM,
                        headers={"x-llmwatch-truncated": str(result.truncated).lower()})
    return json_response({"columns": result.columns, "types": result.types,
                          "rows": [list(r) for r in result.rows], "truncated": result.truncated})
