"""OTLP/HTTP metrics -> rows of the `scalars` table.

Any OpenTelemetry SDK's OTLP/HTTP exporter can send here, in protobuf
(application/x-protobuf) or JSON (application/json). Every data point becomes
one row: gauges and sums as they are; histograms and exponential histograms as
`name.count`, `name.sum` (and `name.min`/`name.max` when set); summaries as
`name.count`, `name.sum` and `name.q<quantile>`. `attrs` holds the resource,
scope and point attributes as one JSON object (point wins over scope wins over
resource); `run_id`, `rank`, `step` and `attempt` come from those attributes
when present (defaults "otlp", -1, -1, 0).

Row-by-row Python is fine here: OTLP is the side door, the agent's own batches
are the bulk path.
"""

from __future__ import annotations

import base64
import json
import math
from typing import Any

import pyarrow as pa
from google.protobuf import json_format
from google.protobuf.message import DecodeError
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
    ExportMetricsServiceResponse,
)

PROTOBUF = "application/x-protobuf"
JSON = "application/json"
DEFAULT_RUN_ID = "otlp"
_INT32 = 2**31 - 1
_INT64 = 2**63 - 1


class OtlpError(ValueError):
    """A request body that is not an OTLP metrics export."""


def parse_request(body: bytes, content_type: str) -> ExportMetricsServiceRequest:
    req = ExportMetricsServiceRequest()
    try:
        if content_type == JSON:
            json_format.Parse(body, req, ignore_unknown_fields=True)
        elif content_type == PROTOBUF:
            req.ParseFromString(body)
        else:
            raise OtlpError(f"Content-Type must be {PROTOBUF} or {JSON}, not {content_type or 'missing'!r}")
    except (DecodeError, json_format.ParseError, UnicodeDecodeError, ValueError, RecursionError) as e:
        if isinstance(e, OtlpError):
            raise
        raise OtlpError(f"not an OTLP ExportMetricsServiceRequest: {e}") from None
    return req


def response_body(content_type: str) -> bytes:
    resp = ExportMetricsServiceResponse()
    if content_type == JSON:
        return json_format.MessageToJson(resp).encode()
    return resp.SerializeToString()


def _any_value(v) -> Any:
    which = v.WhichOneof("value")
    if which is None:
        return None
    if which == "array_value":
        return [_any_value(x) for x in v.array_value.values]
    if which == "kvlist_value":
        return {kv.key: _any_value(kv.value) for kv in v.kvlist_value.values}
    if which == "bytes_value":
        return base64.b64encode(v.bytes_value).decode()
    return getattr(v, which)


def _attrs(kvs) -> dict[str, Any]:
    return {kv.key: _any_value(kv.value) for kv in kvs}


def _int_attr(attrs: dict[str, Any], key: str, default: int, limit: int) -> int:
    v = attrs.get(key)
    if isinstance(v, bool):
        return default
    if isinstance(v, str) and v.lstrip("-").isdigit() and v.isascii():
        v = int(v)
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    return v if isinstance(v, int) and -limit - 1 <= v <= limit else default


def _points(metric) -> list[tuple[str, float, int, dict[str, Any]]]:
    """(name, value, time_unix_nano, point attributes) of every data point."""
    name = metric.name
    kind = metric.WhichOneof("data")
    out = []
    if kind in ("gauge", "sum"):
        for p in getattr(metric, kind).data_points:
            value = p.as_double if p.WhichOneof("value") == "as_double" else float(p.as_int)
            out.append((name, value, p.time_unix_nano, _attrs(p.attributes)))
    elif kind in ("histogram", "exponential_histogram"):
        for p in getattr(metric, kind).data_points:
            a = _attrs(p.attributes)
            out.append((f"{name}.count", float(p.count), p.time_unix_nano, a))
            if p.HasField("sum"):
                out.append((f"{name}.sum", p.sum, p.time_unix_nano, a))
            if p.HasField("min"):
                out.append((f"{name}.min", p.min, p.time_unix_nano, a))
            if p.HasField("max"):
                out.append((f"{name}.max", p.max, p.time_unix_nano, a))
    elif kind == "summary":
        for p in metric.summary.data_points:
            a = _attrs(p.attributes)
            out.append((f"{name}.count", float(p.count), p.time_unix_nano, a))
            out.append((f"{name}.sum", p.sum, p.time_unix_nano, a))
            for q in p.quantile_values:
                out.append((f"{name}.q{q.quantile:g}", q.value, p.time_unix_nano, a))
    return out


def _finite(v: Any) -> Any:
    """JSON-storable: DuckDB's JSON type has no NaN/Infinity, so those become strings."""
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    if isinstance(v, list):
        return [_finite(x) for x in v]
    if isinstance(v, dict):
        return {k: _finite(x) for k, x in v.items()}
    return v


def _json(attrs: dict[str, Any]) -> str:
    return json.dumps(_finite(attrs), ensure_ascii=False, allow_nan=False, separators=(",", ":"))


def scalars_table(req: ExportMetricsServiceRequest) -> pa.Table:
    """The request's data points as a table with the columns of `scalars`."""
    cols: dict[str, list] = {k: [] for k in ("run_id", "attempt", "step", "rank", "ts", "name", "value", "attrs")}
    for rm in req.resource_metrics:
        res = _attrs(rm.resource.attributes)
        for sm in rm.scope_metrics:
            scope = _attrs(sm.scope.attributes)
            for metric in sm.metrics:
                for name, value, t_ns, point in _points(metric):
                    attrs = {**res, **scope, **point}
                    run_id = attrs.get("run_id")
                    cols["run_id"].append(run_id if isinstance(run_id, str) and 0 < len(run_id) <= 200 else DEFAULT_RUN_ID)
                    cols["attempt"].append(_int_attr(attrs, "attempt", 0, _INT32))
                    cols["step"].append(_int_attr(attrs, "step", -1, _INT64))
                    cols["rank"].append(_int_attr(attrs, "rank", -1, _INT32))
                    cols["ts"].append(t_ns / 1e9)
                    cols["name"].append(name)
                    cols["value"].append(value)
                    cols["attrs"].append(_json(attrs))
    return pa.table({
        "run_id": pa.array(cols["run_id"], pa.string()),
        "attempt": pa.array(cols["attempt"], pa.int32()),
        "step": pa.array(cols["step"], pa.int64()),
        "rank": pa.array(cols["rank"], pa.int32()),
        "ts": pa.array(cols["ts"], pa.float64()),
        "name": pa.array(cols["name"], pa.string()),
        "value": pa.array(cols["value"], pa.float64()),
        "attrs": pa.array(cols["attrs"], pa.string()),
    })
