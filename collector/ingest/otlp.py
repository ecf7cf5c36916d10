"""OTLP/HTTP metrics -> rows of the `scalars` table.

Any OpenTelemetry SDK's OTLP/HTTP exporter can send here, in protobuf
(application/x-protobuf) or JSON (application/json), plain, gzip or deflate.
Every data point becomes one row: gauges and sums as they are; histograms and
exponential histograms as `name.count`, `name.sum` (and `name.min`/`name.max`
when set); summaries as `name.count`, `name.sum` and `name.q<quantile>`. `attrs`
holds the resource, scope and point attributes as one JSON object (point wins
over scope wins over resource); `run_id`, `rank`, `step` and `attempt` come from
those attributes when present (defaults "otlp", -1, -1, 0).

Row-by-row Python is fine here: OTLP is the side door, the agent's own batches
are the bulk path. What is not fine is letting a small request cost a lot, so
`decode_request` bounds every stage before it spends: the decompressed size
(`max_bytes`), the data points (`max_points`, counted on the protobuf wire, or
while json.loads builds the objects, before any message exists: an empty point
is 2 bytes on the wire, ~70 bytes parsed and ~500 bytes as a Python row), and
the text the rows would store (resource and scope attributes repeat on every
row of theirs). Past a bound it raises `OtlpTooLarge` (413); a body that is not
OTLP raises `OtlpError` (400). It is meant to run on a worker thread.
"""

from __future__ import annotations

import base64
import json
import math
import zlib
from collections.abc import Iterator
from typing import Any

import pyarrow as pa
from google.protobuf import json_format
from google.protobuf.message import DecodeError
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
    ExportMetricsServiceResponse,
)
from opentelemetry.proto.metrics.v1 import metrics_pb2

PROTOBUF = "application/x-protobuf"
JSON = "application/json"
DEFAULT_RUN_ID = "otlp"
_INT32 = 2**31 - 1
_INT64 = 2**63 - 1


class OtlpError(ValueError):
    """A request body that is not an OTLP metrics export (400)."""


class OtlpTooLarge(OtlpError):
    """A request past one of the bounds (413)."""


def decompress(body: bytes, encoding: str | None, max_bytes: int) -> bytes:
    """gzip or deflate (zlib) bodies, of which at most `max_bytes` come out: zlib
    stops there, so a small bomb costs `max_bytes` of memory and time, no more.
    A stream that ends early or is followed by anything but another gzip member is
    refused (a truncated body would otherwise decode as a shorter valid one)."""
    encoding = (encoding or "").strip().lower()
    if encoding in ("", "identity"):
        return body
    if encoding not in ("gzip", "x-gzip", "deflate"):
        raise OtlpError(f"Content-Encoding {encoding!r} is not supported (gzip, deflate)")
    wbits = 47 if encoding != "deflate" else 15  # 47: a gzip or zlib header
    out: list[bytes] = []
    size = 0
    rest = body
    while True:
        d = zlib.decompressobj(wbits=wbits)
        try:
            chunk = d.decompress(rest, max_bytes - size + 1)
        except zlib.error as e:
            raise OtlpError(f"body is not valid {encoding}: {e}") from None
        size += len(chunk)
        if size > max_bytes:
            raise OtlpTooLarge(f"body decompresses to more than {max_bytes} bytes")
        out.append(chunk)
        if not d.eof:
            raise OtlpError(f"{encoding} body is truncated")
        rest = d.unused_data
        if not rest:
            return out[0] if len(out) == 1 else b"".join(out)
        if wbits == 15 or rest[:2] != b"\x1f\x8b":
            raise OtlpError(f"{len(rest)} bytes follow the {encoding} stream")


# -- counting data points on the protobuf wire, before parsing -----------------------
def _number(message, field: str) -> int:
    return message.DESCRIPTOR.fields_by_name[field].number


_RESOURCE_METRICS = _number(ExportMetricsServiceRequest, "resource_metrics")
_SCOPE_METRICS = _number(metrics_pb2.ResourceMetrics, "scope_metrics")
_METRICS = _number(metrics_pb2.ScopeMetrics, "metrics")
# Metric's data oneof (gauge, sum, histogram, ...): field number -> its data_points' number
_POINTS = {f.number: f.message_type.fields_by_name["data_points"].number
           for f in metrics_pb2.Metric.DESCRIPTOR.oneofs_by_name["data"].fields}
_SUMMARY = _number(metrics_pb2.Metric, "summary")
_QUANTILES = _number(metrics_pb2.SummaryDataPoint, "quantile_values")


def _varint(data: bytes, i: int, end: int) -> tuple[int, int]:
    result = shift = 0
    while i < end:
        b = data[i]
        i += 1
        result |= (b & 0x7F) << shift
        if b < 0x80:
            return result, i
        shift += 7
        if shift > 63:
            break
    raise OtlpError("not an OTLP ExportMetricsServiceRequest: a varint is truncated or too long")


def _submessages(data: bytes, start: int, end: int, numbers: frozenset[int]) -> Iterator[tuple[int, int, int]]:
    """(field number, start, end) of each length-delimited field of data[start:end]
    whose number is in `numbers`; every other field is skipped unread."""
    i = start
    while i < end:
        tag, i = _varint(data, i, end)
        wire = tag & 7
        if wire == 2:
            n, i = _varint(data, i, end)
            if i + n > end:
                raise OtlpError("not an OTLP ExportMetricsServiceRequest: a field runs past its message")
            if tag >> 3 in numbers:
                yield tag >> 3, i, i + n
            i += n
        elif wire == 0:
            _, i = _varint(data, i, end)
        elif wire == 1:
            i += 8
        elif wire == 5:
            i += 4
        else:  # groups: not in OTLP (and would need a parser of their own)
            raise OtlpError(f"not an OTLP ExportMetricsServiceRequest: wire type {wire}")
    if i > end:
        raise OtlpError("not an OTLP ExportMetricsServiceRequest: a field runs past its message")


_ONE = {n: frozenset([n]) for n in (_RESOURCE_METRICS, _SCOPE_METRICS, _METRICS, _QUANTILES, *_POINTS.values())}
_DATA = frozenset(_POINTS)


def count_points(data: bytes, limit: int) -> int:
    """Data points in a protobuf ExportMetricsServiceRequest (a summary's quantiles
    count too), read off the wire without building a message; `OtlpTooLarge` as
    soon as the count passes `limit`, so the walk costs at most ~1 us per point
    allowed. Every point of every copy of a metric's data field is counted: an
    over-count (a message the parser would merge or drop) only refuses early."""
    num_points = 0
    end = len(data)
    for _, rs, re_ in _submessages(data, 0, end, _ONE[_RESOURCE_METRICS]):
        for _, ss, se in _submessages(data, rs, re_, _ONE[_SCOPE_METRICS]):
            for _, ms, me in _submessages(data, ss, se, _ONE[_METRICS]):
                for kind, ks, ke in _submessages(data, ms, me, _DATA):
                    for _, ps, pe in _submessages(data, ks, ke, _ONE[_POINTS[kind]]):
                        num_points += 1
                        if kind == _SUMMARY:
                            num_points += sum(1 for _ in _submessages(data, ps, pe, _ONE[_QUANTILES]))
                        if num_points > limit:
                            raise OtlpTooLarge(f"more than {limit} data points in one request")
    return num_points


# OTLP/JSON objects a request may hold per data point it may hold: the point, its
# attributes (two objects each), exemplars; past it the body is refused unparsed.
JSON_OBJECTS_PER_POINT = 16


class _JsonPointCounter:
    """object_pairs_hook for json.loads: counts the data points of each list as it
    is completed (bottom-up, so before the document around it exists) and refuses
    duplicate keys as protobuf's own JSON parser does."""

    _KEYS = frozenset({"dataPoints", "data_points", "quantileValues", "quantile_values"})

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.num_points = 0

    def __call__(self, pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        out = {}
        for key, value in pairs:
            if key in out:
                raise OtlpError(f"not an OTLP ExportMetricsServiceRequest: duplicate key {key!r}")
            if key in self._KEYS and isinstance(value, list):
                self.num_points += len(value)
                if self.num_points > self.limit:
                    raise OtlpTooLarge(f"more than {self.limit} data points in one request")
            out[key] = value
        return out


def parse_request(body: bytes, content_type: str, *, max_points: int | None = None) -> ExportMetricsServiceRequest:
    """The request message; with `max_points`, refused (`OtlpTooLarge`) past that many
    data points before the message is built."""
    req = ExportMetricsServiceRequest()
    try:
        if content_type == JSON:
            # json.loads builds a list before the hook sees it, so first an upper bound on
            # the objects it could build at all (braces inside strings count too)
            if max_points is not None and body.count(b"{") > JSON_OBJECTS_PER_POINT * max_points + 1024:
                raise OtlpTooLarge(f"more than {JSON_OBJECTS_PER_POINT * max_points + 1024} JSON objects "
                                   f"({JSON_OBJECTS_PER_POINT} per data point allowed)")
            counter = _JsonPointCounter(max_points if max_points is not None else math.inf)
            js = json.loads(body.decode("utf-8"), object_pairs_hook=counter)
            json_format.ParseDict(js, req, ignore_unknown_fields=True)
        elif content_type == PROTOBUF:
            if max_points is not None:
                count_points(body, max_points)
            req.ParseFromString(body)
        else:
            raise OtlpError(f"Content-Type must be {PROTOBUF} or {JSON}, not {content_type or 'missing'!r}")
    except OtlpError:
        raise
    except (DecodeError, json_format.ParseError, UnicodeDecodeError, ValueError, RecursionError) as e:
        raise OtlpError(f"not an OTLP ExportMetricsServiceRequest: {e}") from None
    return req


def decode_request(body: bytes, *, content_type: str, content_encoding: str | None, max_bytes: int,
                   max_points: int, max_text_chars: int) -> pa.Table:
    """An OTLP/HTTP request body -> its `scalars` rows, every bound enforced before
    the work it bounds: decompressed size, data points, the rows' text. CPU-bound
    (decompression, parsing, a Python loop per point): run it on a worker thread."""
    if len(body) > max_bytes:
        raise OtlpTooLarge(f"body of {len(body)} bytes exceeds the limit of {max_bytes}")
    data = decompress(body, content_encoding, max_bytes)
    return scalars_table(parse_request(data, content_type, max_points=max_points), max_text_chars=max_text_chars)


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


def scalars_table(req: ExportMetricsServiceRequest, *, max_text_chars: int | None = None) -> pa.Table:
    """The request's data points as a table with the columns of `scalars`.

    `max_text_chars` bounds the names and attributes JSON of all rows together
    (`OtlpTooLarge` past it): resource and scope attributes are copied into every
    row of theirs, so a few KB of them times many points would otherwise be GBs."""
    cols: dict[str, list] = {k: [] for k in ("run_id", "attempt", "step", "rank", "ts", "name", "value", "attrs")}
    text_chars = 0
    limit = math.inf if max_text_chars is None else max_text_chars
    for rm in req.resource_metrics:
        res = _attrs(rm.resource.attributes)
        for sm in rm.scope_metrics:
            scope = _attrs(sm.scope.attributes)
            for metric in sm.metrics:
                last_point = None
                for name, value, t_ns, point in _points(metric):
                    if point is not last_point:  # a histogram's or summary's rows share their point's attributes
                        last_point = point
                        attrs = {**res, **scope, **point}
                        attrs_json = _json(attrs)
                        run_id = attrs.get("run_id")
                        run_id = run_id if isinstance(run_id, str) and 0 < len(run_id) <= 200 else DEFAULT_RUN_ID
                        attempt = _int_attr(attrs, "attempt", 0, _INT32)
                        step = _int_attr(attrs, "step", -1, _INT64)
                        rank = _int_attr(attrs, "rank", -1, _INT32)
                    text_chars += len(name) + len(attrs_json)
                    if text_chars > limit:
                        raise OtlpTooLarge(f"the rows' names and attributes would hold more than {max_text_chars} "
                                           f"characters (resource and scope attributes repeat on every row)")
                    cols["run_id"].append(run_id)
                    cols["attempt"].append(attempt)
                    cols["step"].append(step)
                    cols["rank"].append(rank)
                    cols["ts"].append(t_ns / 1e9)
                    cols["name"].append(name)
                    cols["value"].append(value)
                    cols["attrs"].append(attrs_json)
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
