"""The collector over real HTTP: auth, size limits, ingest, query API, SQL, commands,
metrics, TCP_NODELAY, group commit, and a clean SIGTERM shutdown."""

from __future__ import annotations

import json
import signal
import statistics
import subprocess
import sys
import threading
import time

import httpx
import pyarrow as pa
import pytest

from agent import wire
from tests.polling import wait_until
from tests.unit.collector.collector_batches import columns, make_batch, steps_section
from tests.unit.collector.collector_server import ROOT, CollectorProcess

pytestmark = pytest.mark.integration

BATCH = {"Content-Type": wire.CONTENT_TYPE}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    proc = CollectorProcess(tmp_path_factory.mktemp("http") / "c.duckdb",
                            args=("--group-linger-s", "0", "--max-batch-bytes", str(256 * 1024))).start()
    yield proc
    assert proc.stop() == 0


def post_batch(client, body: bytes):
    return client.post("/v1/ingest", content=body, headers=BATCH)


AUTHED = [("POST", "/v1/ingest"), ("POST", "/v1/metrics"), ("POST", "/v1/sql"), ("GET", "/v1/runs"),
          ("GET", "/v1/runs/r/steps"), ("GET", "/v1/runs/r/ranks"), ("POST", "/v1/runs/r/commands"),
          ("GET", "/v1/runs/r/heartbeats/latest"), ("GET", "/metrics"), ("GET", "/openapi.json"),
          ("GET", "/no/such/route")]


@pytest.mark.parametrize("method, path", AUTHED)
@pytest.mark.parametrize("token", [None, "wrong"])
def test_every_data_endpoint_needs_the_token(server, method, path, token):
    headers = {} if token is None else {"Authorization": f"Bearer {token}"}
    r = httpx.request(method, server.url + path, headers=headers, content=b"{}", timeout=10)
    assert r.status_code == 401
    assert r.json() == {"error": "missing or wrong bearer token"}


def test_health_needs_no_token_and_metrics_the_read_token(server):
    assert httpx.get(server.url + "/healthz").json()["status"] == "ok"
    with server.client() as c:
        text = c.get("/metrics").text
    assert "llmwatch_collector_rejects_total" in text and "llmwatch_collector_write_queue_depth" in text


def test_size_limit_declared_and_streamed(server):
    big = make_batch(sections={wire.COLLECTIVE: (5000, columns(wire.COLLECTIVE, 5000))})
    assert len(big) > 256 * 1024
    with server.client() as c:
        r = post_batch(c, big)
        assert r.status_code == 413 and "limit" in r.json()["error"]
        chunks = (big[i:i + 65536] for i in range(0, len(big), 65536))  # no Content-Length: chunked
        r = c.post("/v1/ingest", content=chunks, headers=BATCH)
        assert r.status_code == 413 and "limit" in r.json()["error"]
        assert c.get("/healthz").status_code == 200


def test_ingest_query_api_and_duplicates(server):
    run = {"run_id": "api", "config": {"model": "tiny"}, "mesh": {"dp": 2, "tp": 1, "pp": 1}, "world_size": 2,
           "node_map": {"0": "n0", "1": "n1"}, "code_version": "abc", "data_version": "d1", "started_ts": 1.0}
    with server.client() as c:
        for rank in (0, 1):
            sections = {wire.STEP: steps_section(range(10), loss=[10.0 - s for s in range(10)], step_s=1.0 + rank),
                        wire.COLLECTIVE: (4, columns(wire.COLLECTIVE, 4, step=[0, 0, 1, 1], attempt=0, op=0, axis=0)),
                        wire.HEARTBEAT: (1, columns(wire.HEARTBEAT, 1, ts=5.0, step=9, phase=0, last_seq=42))}
            body = make_batch("api", rank, 0, sections=sections, run=run if rank == 0 else None,
                              events=[{"ts": 2.0, "step": 5, "kind": "checkpoint_saved",
                                       "data": {"step": 5, "path": f"/ck/{rank}", "num_shards": 2, "bytes": 10}}])
            r = post_batch(c, body)
            assert r.status_code == 200, r.text
            answer = r.json()
            assert abs(answer.pop("server_ts") - time.time()) < 60  # the collector's clock (agent/clock.py)
            answer.pop("clean_through")  # the known-good watermark: as far as detection has got (below)
            assert answer.pop("end_wait_s") == 30.0  # detection and an acting policy: the rules' end_of_run_wait_s
            assert answer == {"accepted": 10 + 4 + 1 + 1, "duplicate": False, "commands": []}
            again = post_batch(c, body)
            assert {k: v for k, v in again.json().items() if k not in ("server_ts", "clean_through", "end_wait_s")} == {
                "accepted": 0, "duplicate": True, "commands": []}
        assert c.get("/v1/runs").json()[0]["run_id"] == "api"
        detail = c.get("/v1/runs/api").json()
        assert (detail["world_size"], detail["config"], detail["num_ranks"], detail["last_step"]) == (
            2, {"model": "tiny"}, 2, 9)
        assert c.get("/v1/runs/nope").status_code == 404
        pts = c.get("/v1/runs/api/steps", params={"metric": "loss", "max_points": 5}).json()["points"]
        assert [(p["step"], p["step_to"], p["max"], p["num_points"]) for p in pts] == [
            (0, 1, 10.0, 4), (2, 3, 8.0, 4), (4, 5, 6.0, 4), (6, 7, 4.0, 4), (8, 9, 2.0, 4)]
        assert c.get("/v1/runs/api/steps", params={"metric": "loss", "rank": "", "max_points": 5}).json()["points"] == pts
        assert c.get("/v1/runs/api/steps", params={"metric": "loss", "rank": "x"}).status_code == 422
        summary = c.get("/v1/runs/api/step_summary").json()
        assert [(s["step"], s["max_step_s"], s["slowest_rank"]) for s in summary][:2] == [(0, 2.0, 1), (1, 2.0, 1)]
        ranks = c.get("/v1/runs/api/ranks").json()
        assert [(k["rank"], k["node"], k["phase"], k["last_seq"]) for k in ranks] == [
            (0, "node0", "forward", 42), (1, "node0", "forward", 42)]
        coll = c.get("/v1/runs/api/collectives", params={"step_from": 0, "step_to": 0}).json()
        assert [(x["step"], x["num_ops"]) for x in coll] == [(0, 4)]
        assert [n["node"] for n in c.get("/v1/runs/api/nodes").json()] == ["n0", "n1"]
        assert [k["path"] for k in c.get("/v1/runs/api/checkpoints").json()] == ["/ck/1"]
        assert len(c.get("/v1/runs/api/events", params={"kind": "checkpoint_saved"}).json()) == 2
        assert [h["last_seq"] for h in c.get("/v1/runs/api/heartbeats/latest").json()] == [42, 42]
        assert c.get("/v1/runs/api/incidents").json() == [] and c.get("/v1/runs/api/actions").json() == []
        # the verdict on everything acknowledged so far: detection caught up first (bounded)
        settled = c.get("/v1/runs/api/incidents", params={"settle_s": 5})
        assert settled.status_code == 200 and settled.headers["x-llmwatch-settled"] == "true"
        assert settled.json() == []
        assert c.get("/v1/runs/api/incidents", params={"settle_s": 11}).status_code == 422  # past the bound
        # every step 0-9 came from both ranks and was judged clean: known-good through 9 (step 10: rank 0's alone)
        more = post_batch(c, make_batch("api", 0, 1, sections={wire.STEP: steps_section([10], loss=[0.5])}))
        assert more.json()["clean_through"] == {"attempt": 0, "step": 9, "judged": 9}
        # and so the checkpoint of step 5 is known-good (sent with the next pass: bounded wait)
        assert wait_until(lambda: c.get("/v1/runs/api/checkpoints").json()[0]["known_good"], timeout_s=5.0)


def test_sql_json_arrow_and_refusals(server):
    with server.client() as c:
        post_batch(c, make_batch("sql", 0, 0, sections={wire.STEP: steps_section([1, 2, 3])}))
        r = c.post("/v1/sql", json={"sql": "SELECT step FROM steps WHERE run_id = 'sql' ORDER BY step", "max_rows": 2})
        assert r.json() == {"columns": ["step"], "types": ["BIGINT"], "rows": [[1], [2]], "truncated": True}
        r = c.post("/v1/sql", json={"sql": "SELECT step FROM steps WHERE run_id = 'sql'", "format": "arrow"})
        assert r.headers["content-type"] == "application/vnd.apache.arrow.stream"
        assert sorted(pa.ipc.open_stream(r.content).read_all().column("step").to_pylist()) == [1, 2, 3]
        for bad in ("DROP TABLE steps", "SELECT * FROM read_csv('/etc/passwd')", "SELECT 1; DELETE FROM steps",
                    "COPY steps TO '/tmp/x.csv'", "ATTACH '/tmp/x.db'", "INSTALL httpfs"):
            r = c.post("/v1/sql", json={"sql": bad})
            assert r.status_code == 400 and r.json()["error"], bad
        assert c.post("/v1/sql", json={"nosql": 1}).status_code == 422
        assert c.post("/v1/sql", content=b"{not json", headers={"Content-Type": "application/json"}).status_code == 422


def test_sql_cli_through_the_url(server):
    out = subprocess.run([sys.executable, "-m", "collector", "sql", "--url", server.url, "--token", server.token,
                          "--format", "json", "SELECT 40 + 2 AS answer"], cwd=ROOT, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["rows"] == [[42]]
    bad = subprocess.run([sys.executable, "-m", "collector", "sql", "--url", server.url, "--token", "wrong",
                          "SELECT 1"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0 and "HTTP 401" in bad.stderr


def test_commands_round_trip(server):
    with server.client() as c:
        post_batch(c, make_batch("cmd", 0, 0, run={"world_size": 2}))
        assert c.post("/v1/runs/missing/commands", json={"kind": "stop"}).status_code == 404
        assert c.post("/v1/runs/cmd/commands", json={"kind": "DROP TABLE"}).status_code == 422
        r = c.post("/v1/runs/cmd/commands", json={"kind": "skip", "args": {"steps": [5, 6]}, "ranks": [1]})
        assert r.status_code == 201
        cmd = r.json()
        got = post_batch(c, make_batch("cmd", 1, 0)).json()["commands"]
        assert got == [{"id": cmd["id"], "kind": "skip", "args": {"steps": [5, 6]}, "issued_ts": cmd["issued_ts"]}]
        assert post_batch(c, make_batch("cmd", 1, 1)).json()["commands"] == []
        assert post_batch(c, make_batch("cmd", 0, 1)).json()["commands"] == []  # not a target
        ack = {"ts": 1.0, "kind": "command_ack", "data": {"command_id": cmd["id"], "status": "ok", "detail": None}}
        post_batch(c, make_batch("cmd", 1, 2, events=[ack]))
        (row,) = c.get("/v1/runs/cmd/commands").json()
        assert (row["status"], row["delivered"], list(row["acks"])) == ("acked", [1], ["1"])


def test_concurrent_posts_are_group_committed(tmp_path):
    proc = CollectorProcess(tmp_path / "g.duckdb", args=("--group-linger-s", "0.2")).start()
    try:
        results = []

        def send(rank: int) -> None:
            with proc.client() as c:
                results.append(post_batch(c, make_batch("grp", rank, 0, sections={wire.STEP: steps_section([1])})))

        threads = [threading.Thread(target=send, args=(r,)) for r in range(24)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sorted(r.status_code for r in results) == [200] * 24
        with proc.client() as c:
            metrics = c.get("/metrics").text
        count = float(next(line.split()[-1] for line in metrics.splitlines()
                            if line.startswith("llmwatch_collector_group_requests_count")))
        assert count < 24  # several requests shared a commit
        assert proc.sql("SELECT count(*) FROM steps") == [[24]]
    finally:
        assert proc.stop() == 0


def test_no_nagle_delay_on_keep_alive(server):
    """Nagle + delayed ACK would make every small response take ~40 ms."""
    with server.client() as c:
        c.get("/healthz")
        times = []
        for _ in range(30):
            t0 = time.perf_counter()
            assert c.get("/healthz").status_code == 200
            times.append(time.perf_counter() - t0)
    assert statistics.median(times) < 0.02, times


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_drains_and_checkpoints(tmp_path, sig):
    db = tmp_path / "t.duckdb"
    proc = CollectorProcess(db).start()
    with proc.client() as c:
        for seq in range(5):
            assert post_batch(c, make_batch("term", 0, seq, sections={wire.STEP: steps_section([seq])})).status_code == 200
    assert proc.stop(sig) == 0
    assert not (tmp_path / "t.duckdb.wal").exists()  # checkpointed on the way out
    out = subprocess.run([sys.executable, "-m", "collector", "sql", "--db", str(db), "--format", "csv",
                          "SELECT count(*) AS n, max(step) AS last FROM steps"], cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["n,last", "5,4"]
