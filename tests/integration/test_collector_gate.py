"""The gate over real HTTP: roles, refusals from headers alone, body bounds in size and
time, the in-flight bound, TLS, and a /healthz that tells the truth."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time

import httpx
import pytest
from fastapi.testclient import TestClient

from agent import wire
from collector.http.auth import write_secret_file
from collector.http.server import create_app
from collector.settings import Settings, WriterSettings
from collector.storage import Storage
from tests.unit.collector.collector_batches import make_batch, steps_section
from tests.unit.collector.collector_server import ROOT, CollectorProcess

pytestmark = pytest.mark.integration
ROLE_TOKENS = {"ingest": "ingest-token-0123456789", "read": "read-token-0123456789",
               "control": "control-token-0123456789"}
BATCH = {"Content-Type": wire.CONTENT_TYPE}


@pytest.fixture(scope="module")
def roles(tmp_path_factory):
    d = tmp_path_factory.mktemp("roles")
    args = []
    for role, token in ROLE_TOKENS.items():
        args += [f"--{role}-token-file", str(write_secret_file(d / role, token))]
    proc = CollectorProcess(d / "r.duckdb", token=None, args=(*args, "--group-linger-s", "0", "--body-timeout-s", "1",
                                                               "--head-timeout-s", "2",
                                                               "--max-inflight-requests", "3")).start()
    yield proc
    assert proc.stop() == 0


def client(proc, role: str) -> httpx.Client:
    return proc.client(ROLE_TOKENS[role])


def test_each_role_reaches_only_its_routes(roles):
    with client(roles, "ingest") as c:
        assert c.post("/v1/ingest", content=make_batch("roles", 0, 0, run={"world_size": 1}), headers=BATCH
                      ).status_code == 200
        assert c.post("/v1/sql", json={"sql": "SELECT 1"}).status_code == 401
        assert c.get("/v1/runs").status_code == 401
        assert c.post("/v1/runs/roles/commands", json={"kind": "stop"}).status_code == 401
    with client(roles, "read") as c:
        assert c.post("/v1/sql", json={"sql": "SELECT count(*) FROM runs"}).json()["rows"] == [[1]]
        assert c.get("/v1/runs").status_code == 200 and c.get("/metrics").status_code == 200
        assert c.get("/openapi.json").json()["info"]["title"] == "llmwatch collector"
        assert c.post("/v1/runs/roles/commands", json={"kind": "stop"}).status_code == 401  # cannot stop the run
        assert c.post("/v1/ingest", content=make_batch("roles", 0, 1), headers=BATCH).status_code == 401
    with client(roles, "control") as c:
        assert c.post("/v1/runs/roles/commands", json={"kind": "stop"}).status_code == 201
        assert c.get("/v1/runs/roles/commands").status_code == 200  # control may read
        assert c.post("/v1/ingest", content=make_batch("roles", 0, 2), headers=BATCH).status_code == 401


def _raw(proc, request: bytes, body_prefix: bytes = b"", timeout_s: float = 10.0) -> tuple[int, bytes]:
    """Send a request head (and the start of a body), then read the answer until the
    server closes; the rest of the body is never sent."""
    with socket.create_connection(("127.0.0.1", proc.port), timeout=timeout_s) as s:
        s.sendall(request + body_prefix)
        data = b""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:  # refusals close the connection: read to the end
            try:
                chunk = s.recv(65536)
            except (ConnectionResetError, socket.timeout):
                break
            if not chunk:
                break
            data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1]) if head.startswith(b"HTTP/1.1 ") else 0
    return status, rest


@pytest.mark.parametrize("path", ["/v1/sql", "/v1/ingest", "/v1/runs/x/commands", "/v1/metrics"])
def test_an_unauthenticated_huge_body_is_refused_from_the_headers(roles, path):
    head = (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {200 * 1024 * 1024}\r\n\r\n").encode()
    status, body = _raw(roles, head, b"x" * (256 * 1024))  # 200 MB announced, 256 KiB sent, then we wait
    assert status == 401 and b"bearer token" in body
    chunked = f"POST {path} HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n".encode()
    status, _ = _raw(roles, chunked, b"10000\r\n" + b"y" * 0x10000 + b"\r\n")
    assert status == 401


def test_unauthenticated_garbage_is_401_not_a_parse_error(roles):
    nested = b"[" * 100_000 + b"]" * 100_000
    r = httpx.post(roles.url + "/v1/sql", content=nested, headers={"Content-Type": "application/json"}, timeout=10)
    assert r.status_code == 401
    r = httpx.post(roles.url + "/v1/runs/x/commands", content=b"{" * 5000, timeout=10,
                   headers={"Authorization": "Bearer " + ROLE_TOKENS["read"]})  # wrong role: still before parsing
    assert r.status_code == 401


def test_every_route_has_a_body_limit(roles):
    with client(roles, "control") as c:
        r = c.post("/v1/sql", content=b" " * (2 * 1024 * 1024), headers={"Content-Type": "application/json"})
        assert r.status_code == 413 and "limit" in r.json()["error"]
        r = c.post("/v1/runs/x/commands", content=(b" " * 8192 for _ in range(16)),  # chunked: counted as read
                   headers={"Content-Type": "application/json"})
        assert r.status_code == 413
        assert c.get("/healthz").status_code == 200
    head = (f"GET /v1/runs HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {ROLE_TOKENS['read']}\r\n"
            "Content-Length: 999999\r\n\r\n").encode()
    assert _raw(roles, head)[0] == 413  # a GET with a body is bounded too


def test_a_body_that_does_not_arrive_in_time_is_408(roles):
    head = (f"POST /v1/sql HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {ROLE_TOKENS['read']}\r\n"
            "Content-Type: application/json\r\nContent-Length: 100\r\n\r\n").encode()
    t0 = time.monotonic()
    status, body = _raw(roles, head, b'{"sql": ', timeout_s=20)
    assert status == 408 and b"not received" in body
    assert time.monotonic() - t0 < 15  # the 1 s body timeout, not the client's patience


def test_past_the_inflight_bound_503_with_retry_after(roles):
    head = (f"POST /v1/sql HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {ROLE_TOKENS['read']}\r\n"
            "Content-Type: application/json\r\nContent-Length: 100\r\n\r\n").encode()
    held = []
    try:
        for _ in range(3):  # --max-inflight-requests 3, each stuck waiting for its body
            s = socket.create_connection(("127.0.0.1", roles.port), timeout=10)
            s.sendall(head)
            held.append(s)
        deadline = time.monotonic() + 0.9  # before the held bodies time out (1 s)
        got = None
        with client(roles, "read") as c:
            while time.monotonic() < deadline:
                r = c.get("/v1/runs")
                if r.status_code == 503:
                    got = r
                    break
            assert got is not None, "the bound was never reached"
            assert got.headers["retry-after"] == "1" and "retry later" in got.json()["error"]
            assert c.get("/healthz").status_code == 200  # exempt
    finally:
        for s in held:
            s.close()


def test_healthz_reports_a_dead_writer(tmp_path):
    storage = Storage(Settings(db_path=tmp_path / "h.duckdb", token="health-token-123",
                               writer=WriterSettings(linger_s=0.0)))
    try:
        with TestClient(create_app(storage, close_storage=False)) as c:
            assert c.get("/healthz").json()["status"] == "ok"
            storage._writer.stop()  # as if the writer thread had died
            r = c.get("/healthz")
            assert r.status_code == 503 and r.json()["status"] == "unhealthy" and "writer" in r.json()["reason"]
    finally:
        storage.close()


def _self_signed(tmp_path):
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
                    "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True, timeout=60)
    return cert, key


def test_tls_serving_and_the_sql_client(tmp_path):
    cert, key = _self_signed(tmp_path)
    proc = CollectorProcess(tmp_path / "tls.duckdb", scheme="https",
                            args=("--tls-cert", str(cert), "--tls-key", str(key))).start()
    try:
        with httpx.Client(base_url=proc.url, verify=str(cert), timeout=30,
                          headers={"Authorization": f"Bearer {proc.token}"}) as c:
            assert c.post("/v1/ingest", content=make_batch("tls", 0, 0, sections={wire.STEP: steps_section([1])}),
                          headers=BATCH).status_code == 200
        with pytest.raises(httpx.ConnectError):  # untrusted without the CA
            httpx.get(proc.url + "/healthz", timeout=10)
        token_file = write_secret_file(tmp_path / "tok", proc.token)
        out = subprocess.run([sys.executable, "-m", "collector", "sql", "--url", proc.url, "--ca-file", str(cert),
                              "--token-file", str(token_file), "--format", "json", "SELECT count(*) FROM steps"],
                             cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout)["rows"] == [[1]]
    finally:
        assert proc.stop() == 0


def test_plain_http_beyond_loopback_is_refused(tmp_path):
    out = subprocess.run([sys.executable, "-m", "collector", "serve", "--db", str(tmp_path / "x.duckdb"),
                          "--host", "0.0.0.0", "--token", "t" * 20], cwd=ROOT, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 2 and "--tls-cert" in out.stderr
    assert not (tmp_path / "x.duckdb").exists()


def test_a_request_head_is_bounded_in_bytes_and_time(roles):
    """uvicorn's parser would buffer an endless header; the protocol answers 431."""
    with socket.create_connection(("127.0.0.1", roles.port), timeout=10) as s:
        s.sendall(b"GET /v1/runs HTTP/1.1\r\nHost: x\r\nX-Big: ")
        sent, answer = 0, b""
        try:
            while sent < 64 << 20:
                s.sendall(b"a" * 65536)
                sent += 65536
        except (ConnectionResetError, BrokenPipeError):
            pass
        try:
            answer = s.recv(4096)
        except ConnectionResetError:
            pass
    assert sent < 4 << 20  # cut off early, not after 64 MB
    assert answer == b"" or answer.startswith(b"HTTP/1.1 431")
    # a head that trickles in is closed, not kept open
    with socket.create_connection(("127.0.0.1", roles.port), timeout=30) as s:
        s.sendall(b"GET /v1/runs HTTP/1.1\r\n")
        t0 = time.monotonic()
        closed = False
        while time.monotonic() - t0 < 25:
            try:
                s.sendall(b"X-A: b\r\n")
                s.settimeout(0.5)
                if s.recv(1) == b"":
                    closed = True
                    break
            except socket.timeout:
                continue
            except (ConnectionResetError, BrokenPipeError):
                closed = True
                break
        assert closed
