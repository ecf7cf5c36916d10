"""OTLP metrics decoding: every data point kind -> scalars rows."""

from __future__ import annotations

import gzip
import json
import time
import zlib

import pytest
from google.protobuf import json_format
from hypothesis import given, settings
from hypothesis import strategies as st
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue

from collector.ingest import otlp


def kv(key, **value) -> KeyValue:
    return KeyValue(key=key, value=AnyValue(**value))


def request() -> ExportMetricsServiceRequest:
    req = ExportMetricsServiceRequest()
    rm = req.resource_metrics.add()
    rm.resource.attributes.extend([kv("service.name", string_value="trainer"), kv("run_id", string_value="runA")])
    sm = rm.scope_metrics.add()
    sm.scope.name = "test"
    sm.scope.attributes.append(kv("scope_attr", bool_value=True))
    t = 1_700_000_000_500_000_000
    g = sm.metrics.add(name="eval_loss")
    g.gauge.data_points.add(time_unix_nano=t, as_double=2.5,
                            attributes=[kv("rank", int_value=3), kv("step", int_value=40)])
    s = sm.metrics.add(name="tokens")
    s.sum.data_points.add(time_unix_nano=t, as_int=1000, attributes=[kv("rank", string_value="1")])
    h = sm.metrics.add(name="step_time")
    h.histogram.data_points.add(time_unix_nano=t, count=4, sum=2.0, min=0.25, max=1.0, bucket_counts=[1, 3],
                                explicit_bounds=[0.5])
    e = sm.metrics.add(name="grad")
    e.exponential_histogram.data_points.add(time_unix_nano=t, count=2, sum=0.5)
    q = sm.metrics.add(name="lat")
    sp = q.summary.data_points.add(time_unix_nano=t, count=10, sum=5.0)
    sp.quantile_values.add(quantile=0.99, value=0.9)
    n = sm.metrics.add(name="weird")
    n.gauge.data_points.add(time_unix_nano=t, as_double=1.0,
                            attributes=[kv("x", double_value=float("nan")), kv("rank", bool_value=True),
                                        kv("blob", bytes_value=b"\x00\x01"),
                                        kv("arr", array_value={"values": [AnyValue(int_value=1)]})])
    return req


def rows_of(req: ExportMetricsServiceRequest) -> list[dict]:
    return otlp.scalars_table(req).to_pylist()


def test_every_point_kind_becomes_rows():
    rows = rows_of(request())
    assert [(r["name"], r["value"]) for r in rows] == [
        ("eval_loss", 2.5), ("tokens", 1000.0),
        ("step_time.count", 4.0), ("step_time.sum", 2.0), ("step_time.min", 0.25), ("step_time.max", 1.0),
        ("grad.count", 2.0), ("grad.sum", 0.5),
        ("lat.count", 10.0), ("lat.sum", 5.0), ("lat.q0.99", 0.9),
        ("weird", 1.0)]
    first = rows[0]
    assert (first["run_id"], first["rank"], first["step"], first["attempt"]) == ("runA", 3, 40, 0)
    assert first["ts"] == pytest.approx(1_700_000_000.5)
    assert json.loads(first["attrs"]) == {"service.name": "trainer", "run_id": "runA", "scope_attr": True,
                                          "rank": 3, "step": 40}
    assert (rows[1]["rank"], rows[1]["step"]) == (1, -1)  # "1" as a string still a rank
    weird = json.loads(rows[-1]["attrs"])
    assert (rows[-1]["rank"], weird["x"], weird["blob"], weird["arr"]) == (-1, "nan", "AAE=", [1])


def test_defaults_without_attributes():
    req = ExportMetricsServiceRequest()
    metric = req.resource_metrics.add().scope_metrics.add().metrics.add(name="x")
    metric.gauge.data_points.add(as_double=1.0)
    (row,) = rows_of(req)
    assert (row["run_id"], row["rank"], row["step"], row["attempt"]) == (otlp.DEFAULT_RUN_ID, -1, -1, 0)


def test_protobuf_and_json_bodies_decode_alike():
    req = request()
    from_pb = otlp.parse_request(req.SerializeToString(), otlp.PROTOBUF)
    from_json = otlp.parse_request(json_format.MessageToJson(req).encode(), otlp.JSON)
    assert rows_of(from_pb) == rows_of(from_json) == rows_of(req)
    assert otlp.response_body(otlp.JSON) == b"{}"
    assert otlp.response_body(otlp.PROTOBUF) == b""


@pytest.mark.parametrize("body, ctype", [
    (b"\xff\xff\xff", otlp.PROTOBUF),
    (b"{not json", otlp.JSON),
    (b'{"resourceMetrics": 5}', otlp.JSON),
    (b"{}", "text/plain"),
])
def test_bad_bodies_refused(body, ctype):
    with pytest.raises(otlp.OtlpError):
        otlp.parse_request(body, ctype)


# -- bounds: decompression, data points, text --------------------------------------------
def empty_points(n: int, kind: str = "gauge") -> bytes:
    req = ExportMetricsServiceRequest()
    metric = req.resource_metrics.add().scope_metrics.add().metrics.add(name="x")
    points = getattr(metric, kind).data_points
    for _ in range(n):
        points.add()
    return req.SerializeToString()


def test_count_points_reads_the_wire_like_the_parser():
    body = request().SerializeToString()
    assert otlp.count_points(body, 100) == 7  # 6 points, and the summary's one quantile
    with pytest.raises(otlp.OtlpTooLarge, match="more than 6 data points"):
        otlp.count_points(body, 6)
    assert otlp.count_points(b"", 0) == 0


@pytest.mark.parametrize("kind", ["gauge", "sum", "histogram", "exponential_histogram", "summary"])
def test_every_point_kind_is_counted(kind):
    assert otlp.count_points(empty_points(3, kind), 10) == 3


def test_a_million_empty_points_are_refused_before_the_parse():
    """2 KB of gzip, 2 MB of protobuf: it took 12 s and 440 MB when every point became a row."""
    body = gzip.compress(empty_points(1_000_000))
    assert len(body) < 4096
    t0 = time.perf_counter()
    with pytest.raises(otlp.OtlpTooLarge, match="more than 100000 data points"):
        otlp.decode_request(body, content_type=otlp.PROTOBUF, content_encoding="gzip", max_bytes=8 << 20,
                            max_points=100_000, max_text_chars=32 << 20)
    assert time.perf_counter() - t0 < 2.0


def test_json_points_are_counted_while_parsing():
    body = json_format.MessageToJson(request()).encode()
    assert otlp.parse_request(body, otlp.JSON, max_points=7).resource_metrics
    with pytest.raises(otlp.OtlpTooLarge):
        otlp.parse_request(body, otlp.JSON, max_points=6)
    with pytest.raises(otlp.OtlpError, match="duplicate key"):
        otlp.parse_request(b'{"resourceMetrics": [], "resourceMetrics": []}', otlp.JSON)


def test_decompression_is_bounded_and_complete():
    data = request().SerializeToString()
    assert otlp.decompress(gzip.compress(data), "gzip", len(data)) == data
    assert otlp.decompress(zlib.compress(data), "deflate", len(data)) == data
    assert otlp.decompress(gzip.compress(data[:10]) + gzip.compress(data[10:]), "GZIP", len(data)) == data
    with pytest.raises(otlp.OtlpTooLarge, match="more than 1048576 bytes"):
        otlp.decompress(gzip.compress(bytes(64 << 20)), "gzip", 1 << 20)  # a 64 KB bomb
    with pytest.raises(otlp.OtlpError, match="truncated"):
        otlp.decompress(gzip.compress(data)[:-12], "gzip", 1 << 20)
    with pytest.raises(otlp.OtlpError, match="follow the gzip stream"):
        otlp.decompress(gzip.compress(data) + b"junk", "gzip", 1 << 20)
    with pytest.raises(otlp.OtlpError, match="not valid gzip"):
        otlp.decompress(b"not gzip at all", "gzip", 1 << 20)
    with pytest.raises(otlp.OtlpError, match="not supported"):
        otlp.decompress(data, "br", 1 << 20)


def test_repeated_resource_attributes_are_bounded_across_rows():
    req = ExportMetricsServiceRequest()
    rm = req.resource_metrics.add()
    rm.resource.attributes.append(kv("big", string_value="x" * 10_000))
    metric = rm.scope_metrics.add().metrics.add(name="m")
    for _ in range(100):
        metric.gauge.data_points.add(as_double=1.0)
    assert otlp.scalars_table(req, max_text_chars=2_000_000).num_rows == 100
    with pytest.raises(otlp.OtlpTooLarge, match="more than 500000 characters"):
        otlp.scalars_table(req, max_text_chars=500_000)


@settings(max_examples=300, deadline=None, database=None, derandomize=True)
@given(st.binary(max_size=300) | st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 7)), min_size=1, max_size=4))
def test_malformed_protobuf_is_an_otlp_error(mutation):
    """Random bytes and bit flips of a real request: parsed, or refused with OtlpError."""
    if isinstance(mutation, bytes):
        body = mutation
    else:
        buf = bytearray(request().SerializeToString())
        for i, bit in mutation:
            buf[i % len(buf)] ^= 1 << bit
        body = bytes(buf)
    try:
        otlp.decode_request(body, content_type=otlp.PROTOBUF, content_encoding=None, max_bytes=1 << 20,
                            max_points=1000, max_text_chars=1 << 20)
    except otlp.OtlpError:
        pass


def test_json_objects_are_bounded_before_json_loads():
    points = ",".join(["{}"] * 2000)
    body = ('{"resourceMetrics":[{"scopeMetrics":[{"metrics":[{"name":"x","gauge":{"dataPoints":[%s]}}]}]}]}'
            % points).encode()
    with pytest.raises(otlp.OtlpTooLarge, match="JSON objects"):
        otlp.parse_request(body, otlp.JSON, max_points=10)
    with pytest.raises(otlp.OtlpTooLarge, match="more than 1000 data points"):
        otlp.parse_request(body, otlp.JSON, max_points=1000)
    assert len(otlp.parse_request(body, otlp.JSON, max_points=2000).resource_metrics) == 1
