"""POST /v1/sql: read-only SQL (see collector/sql/guard.py), as JSON or Arrow.

The route is async and the query runs on the SQL slots' own threads
(collector/sql/slots.py): a request waiting for a slot holds no thread of the
shared pool, so /healthz, ingest and the query API answer while every slot is busy.
The rows are encoded on the slot's thread as they are fetched (the byte cap
counts that text), and the event loop only joins them.
"""

from __future__ import annotations

from typing import Literal

import pyarrow as pa
from fastapi import APIRouter, Request
from pydantic import BaseModel, Field
from starlette.responses import Response

from collector.http.routes.common import JSON_TYPE, dumps, error_response
from collector.sql.guard import SelectResult, SqlRefused
from collector.sql.slots import SqlBusy
from collector.storage import Storage

ARROW_STREAM = "application/vnd.apache.arrow.stream"

router = APIRouter()  # the read role: collector/http/gate.py


class SqlRequest(BaseModel):
    sql: str = Field(max_length=100_000)
    format: Literal["json", "arrow"] = "json"
    max_rows: int = Field(default=10_000, ge=1, le=10_000_000)


def arrow_stream(table: pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return sink.getvalue().to_pybytes()


def json_body(result: SelectResult) -> bytes:
    """{"columns", "types", "rows", "truncated"} from rows already encoded."""
    return b"".join((b'{"columns":', dumps(result.columns), b',"types":', dumps(result.types), b',"rows":[',
                     b",".join(result.rows_json or ()), b'],"truncated":', b"true" if result.truncated else b"false",
                     b"}"))


@router.post("/v1/sql")
async def post_sql(req: SqlRequest, request: Request) -> Response:
    """One SELECT; at most max_rows rows (capped by the server's --sql-max-rows) and
    --sql-max-bytes of them; `truncated` says whether there were more. Arrow answers
    carry it in the X-Llmwatch-Truncated header. 503 + Retry-After when every SQL
    slot stays busy for --sql-queue-timeout-s."""
    storage: Storage = request.app.state.storage
    try:
        result = await storage.sql_async(req.sql, fmt=req.format, max_rows=req.max_rows, encode_row=dumps)
    except SqlRefused as e:
        storage.metrics.rejects.labels("sql").inc()
        return error_response(400, str(e))
    except SqlBusy as e:
        storage.metrics.rejects.labels("sql_busy").inc()
        return error_response(503, f"busy, retry later: {e}", {"retry-after": "1"})
    if req.format == "arrow":
        return Response(arrow_stream(result.table), media_type=ARROW_STREAM,
                        headers={"x-llmwatch-truncated": str(result.truncated).lower()})
    return Response(json_body(result), media_type=JSON_TYPE)
