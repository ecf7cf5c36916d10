"""OTLP metrics decoding: every data point kind -> scalars rows."""

from __future__ import annotations

import json

import pytest
from google.protobuf import json_format
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue

from collector import otlp


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
