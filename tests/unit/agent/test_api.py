"""agent/api.py against a real HTTP server on loopback: quoting, the token, the
collector's reasons, retries of GETs that got no answer (and never of a POST)."""

from __future__ import annotations

import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from agent.api import ApiClient, ApiError


class _Handler(BaseHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass

    def _answer(self, status: int, body) -> None:
        raw = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def do_GET(self) -> None:
        self.server.seen.append(("GET", self.path, self.headers.get("Authorization")))
        if self.path.startswith("/v1/runs/missing"):
            self._answer(404, {"error": "no run 'missing'"})
        elif self.path.startswith("/echo"):
            self._answer(401, {"detail": f"bad token {self.headers.get('Authorization')}"})
        else:
            self._answer(200, {"path": self.path})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.seen.append(("POST", self.path, body))
        self._answer(200, {"got": body})


@pytest.fixture
def server():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    srv.seen = []
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield srv
    srv.shutdown()
    srv.server_close()


def _url(srv) -> str:
    return f"http://127.0.0.1:{srv.server_address[1]}"


def test_a_run_id_is_one_quoted_path_segment_and_the_token_goes_in_the_header(server):
    api = ApiClient(_url(server), "s3cret")
    path = ApiClient.run_path("team/a?b=1", "nodes")
    assert path == "/v1/runs/team%2Fa%3Fb%3D1/nodes"
    assert api.get_json(path, limit=5, skip=None) == {"path": "/v1/runs/team%2Fa%3Fb%3D1/nodes?limit=5"}
    assert server.seen[-1] == ("GET", "/v1/runs/team%2Fa%3Fb%3D1/nodes?limit=5", "Bearer s3cret")
    assert api.post_json("/v1/sql", {"sql": "SELECT 1"}) == {"got": {"sql": "SELECT 1"}}


def test_an_error_carries_the_status_and_the_collectors_reason_never_the_token(server):
    api = ApiClient(_url(server), "s3cret")
    with pytest.raises(ApiError) as e:
        api.get_json(ApiClient.run_path("missing", "incidents"))
    assert (e.value.status, e.value.reason) == (404, "no run 'missing'")
    with pytest.raises(ApiError) as e:
        api.get_json("/echo")
    assert e.value.status == 401 and "s3cret" not in str(e.value) and "***" in e.value.reason


def _closing_listener():
    """A socket that accepts and closes at once, counting the connections: no answer."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    count = [0]
    stop = threading.Event()

    def serve():
        sock.settimeout(0.1)
        while not stop.is_set():
            try:
                conn, _ = sock.accept()
            except OSError:
                continue
            count[0] += 1
            conn.close()

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    return sock, count, stop, t


def test_a_get_without_an_answer_is_tried_again_and_a_post_is_not():
    sock, count, stop, t = _closing_listener()
    try:
        api = ApiClient(f"http://127.0.0.1:{sock.getsockname()[1]}", "t", timeout_s=2.0, retries=2,
                        retry_wait_s=0.01)
        with pytest.raises(ApiError) as e:
            api.get_json("/v1/runs")
        assert e.value.status is None and "cannot reach the collector" in e.value.reason
        assert count[0] == 3
        with pytest.raises(ApiError):
            api.post_json("/v1/sql", {"sql": "SELECT 1"})
        assert count[0] == 4
    finally:
        stop.set()
        t.join(2.0)
        sock.close()


def test_a_bad_url_or_ca_file_is_refused_when_the_client_is_made(tmp_path):
    with pytest.raises(ValueError, match="http"):
        ApiClient("collector:8080")
    bad = tmp_path / "ca.pem"
    bad.write_text("not a certificate")
    with pytest.raises(ValueError, match="CA file"):
        ApiClient("https://127.0.0.1:1", ca_file=str(bad))
