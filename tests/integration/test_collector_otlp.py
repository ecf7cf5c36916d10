"""The official OpenTelemetry SDK exporter (OTLP/HTTP protobuf) lands rows in scalars;
so does an OTLP/JSON body."""

from __future__ import annotations

import gzip
import time

import httpx
import pytest
from google.protobuf import json_format
from opentelemetry.exporter.otlp.proto.http import Compression
from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
    ExportMetricsServiceResponse,
)
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
from opentelemetry.sdk.resources import Resource

from tests.unit.collector.collector_server import CollectorProcess

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    proc = CollectorProcess(tmp_path_factory.mktemp("otlp") / "o.duckdb", args=("--group-linger-s", "0")).start()
    yield proc
    assert proc.stop() == 0


@pytest.mark.parametrize("compression", [Compression.NoCompression, Compression.Gzip])
def test_sdk_exporter_lands_rows_in_scalars(server, compression):
    run_id = f"sdk-{compression.value}"
    exporter = OTLPMetricExporter(endpoint=server.url + "/v1/metrics", compression=compression,
                                  headers={"Authorization": f"Bearer {server.token}"})
    reader = PeriodicExportingMetricReader(exporter, export_interval_millis=3_600_000)
    provider = MeterProvider(metric_readers=[reader], resource=Resource.create({"run_id": run_id, "service.name": "trainer"}))
    meter = provider.get_meter("llmwatch-test")
    meter.create_counter("train.tokens").add(4096, {"rank": 1, "step": 7})
    hist = meter.create_histogram("train.step_s")
    for v in (0.5, 1.5):
        hist.record(v, {"rank": 1, "step": 7})
    meter.create_gauge("eval.loss").set(2.25, {"rank": 0, "step": 8})
    assert provider.force_flush(10_000)
    provider.shutdown()
    rows = server.sql(f"SELECT name, value, rank, step, attrs->>'service.name' FROM scalars "
                      f"WHERE run_id = '{run_id}' ORDER BY name")
    got = {name: (value, rank, step) for name, value, rank, step, _ in rows}
    assert got["train.tokens"] == (4096.0, 1, 7)
    assert got["train.step_s.count"] == (2.0, 1, 7)
    assert got["train.step_s.sum"] == (2.0, 1, 7)
    assert got["train.step_s.min"] == (0.5, 1, 7) and got["train.step_s.max"] == (1.5, 1, 7)
    assert got["eval.loss"] == (2.25, 0, 8)
    assert {svc for *_, svc in rows} == {"trainer"}  # resource attributes kept in attrs


def test_json_body_and_json_answer(server):
    req = ExportMetricsServiceRequest()
    rm = req.resource_metrics.add()
    metric = rm.scope_metrics.add().metrics.add(name="json.metric")
    point = metric.gauge.data_points.add(as_double=1.5, time_unix_nano=2_000_000_000)
    kv = point.attributes.add(key="run_id")
    kv.value.string_value = "json-run"
    headers = {"Authorization": f"Bearer {server.token}", "Content-Type": "application/json"}
    r = httpx.post(server.url + "/v1/metrics", content=json_format.MessageToJson(req), headers=headers)
    assert r.status_code == 200 and r.headers["content-type"].startswith("application/json")
    assert r.json() == {}
    assert server.sql("SELECT name, value, ts FROM scalars WHERE run_id = 'json-run'") == [["json.metric", 1.5, 2.0]]
    pb = httpx.post(server.url + "/v1/metrics", content=gzip.compress(req.SerializeToString()),
                    headers={**headers, "Content-Type": "application/x-protobuf", "Content-Encoding": "gzip"})
    assert pb.status_code == 200
    ExportMetricsServiceResponse().ParseFromString(pb.content)
    for body, ctype in ((b"\x08\x96", "application/x-protobuf"), (b"[1,2]", "application/json"),
                        (b"{}", "text/plain")):
        bad = httpx.post(server.url + "/v1/metrics", content=body, headers={**headers, "Content-Type": ctype})
        assert bad.status_code in (400, 415) and bad.json()["error"]


def _empty_points(n: int) -> bytes:
    req = ExportMetricsServiceRequest()
    points = req.resource_metrics.add().scope_metrics.add().metrics.add(name="bomb").gauge.data_points
    for _ in range(n):
        points.add()
    return req.SerializeToString()


def test_small_bodies_that_would_expand_are_413(server):
    """2 KB of gzip holding 1,000,000 empty points (it took 12 s and 440 MB), and
    64 KB of gzip holding 64 MiB: refused with a reason, quickly, and the
    collector keeps serving."""
    headers = {"Authorization": f"Bearer {server.token}", "Content-Type": "application/x-protobuf",
               "Content-Encoding": "gzip"}
    with httpx.Client(base_url=server.url, headers=headers, timeout=30.0) as c:
        points = gzip.compress(_empty_points(1_000_000))
        assert len(points) < 4096
        t0 = time.perf_counter()
        r = c.post("/v1/metrics", content=points)
        assert r.status_code == 413 and "data points" in r.json()["error"]
        assert time.perf_counter() - t0 < 5.0
        r = c.post("/v1/metrics", content=gzip.compress(bytes(64 << 20)))
        assert r.status_code == 413 and "decompresses to more than" in r.json()["error"]
        r = c.post("/v1/metrics", content=gzip.compress(_empty_points(3))[:-10])
        assert r.status_code == 400 and "truncated" in r.json()["error"]
        assert c.get("/healthz").status_code == 200
    assert server.sql("SELECT count(*) FROM scalars WHERE name = 'bomb'") == [[0]]
