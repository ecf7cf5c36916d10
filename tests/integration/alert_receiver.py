"""Helpers for the alert tests: a webhook receiver on loopback, and the rows that
make a real collector's NaN detector open an incident and close it again."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx

from agent import wire
from tests.unit.collector.collector_batches import make_batch, steps_section


class WebhookReceiver:
    """Records every POST (path, headers, body); answers `fail_first` of them 503."""

    def __init__(self, *, port: int = 0, fail_first: int = 0) -> None:
        self.requests: list[tuple[str, dict[str, str], bytes]] = []
        self.refused = 0
        self._lock = threading.Lock()
        self._fail_left = fail_first
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                with outer._lock:
                    fail = outer._fail_left > 0
                    if fail:
                        outer._fail_left -= 1
                        outer.refused += 1
                    else:
                        outer.requests.append((self.path, dict(self.headers), body))
                self.send_response(503 if fail else 200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.port = self.server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> "WebhookReceiver":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    def payloads(self, path: str | None = None) -> list[dict]:
        with self._lock:
            return [json.loads(b) for p, _, b in self.requests if path is None or p == path]

    def alerts(self, status: str, path: str | None = None) -> list[dict]:
        """Every alert received with `status` (firing or resolved), in arrival order."""
        return [a for p in self.payloads(path) for a in p["alerts"] if a["status"] == status]


AUTH = {"Content-Type": wire.CONTENT_TYPE}


class NanRun:
    """One rank's steps sent to a collector over HTTP: finite, then a NaN loss at
    `nan_step` (the nan detector opens an incident), then finite ones (it closes
    after `resolve_after_steps`, 3 by default)."""

    def __init__(self, url: str, token: str, *, run_id: str, nan_step: int = 3) -> None:
        self.client = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}", **AUTH}, timeout=30)
        self.run_id, self.nan_step = run_id, nan_step
        self.seq = 0

    def send(self, step: int) -> None:
        loss = float("nan") if step == self.nan_step else 2.0
        body = make_batch(self.run_id, 0, self.seq, world_size=1, sections={wire.STEP: steps_section(
            [step], loss=loss, grad_norm=1.0, local_loss=loss, finite_fwd=1, finite_bwd=1)})
        self.seq += 1
        r = self.client.post("/v1/ingest", content=body)
        assert r.status_code == 200, r.text

    def open_incident(self) -> None:
        for step in range(self.nan_step + 1):
            self.send(step)

    def close_incident(self, num_steps: int = 5) -> None:
        for step in range(self.nan_step + 1, self.nan_step + 1 + num_steps):
            self.send(step)

    def close(self) -> None:
        self.client.close()
