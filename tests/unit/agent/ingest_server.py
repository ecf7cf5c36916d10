"""A stand-in for the collector's ingest route on loopback, for the agent's tests: it
answers every POST as the collector does (200, `{"server_ts", "commands": []}`)."""

from __future__ import annotations

import http.server
import json
import threading
import time


class IngestAnswer(http.server.BaseHTTPRequestHandler):
    """`answer()` is the JSON a POST gets (a subclass changes it); `ahead_s`: how far the
    answer's clock is ahead of this host's; `arrivals`: a list noting when each POST came."""

    ahead_s = 0.0
    arrivals: list[float] | None = None

    def answer(self) -> dict:
        return {"server_ts": time.time() + self.ahead_s, "commands": []}

    def do_POST(self):  # noqa: N802 - http.server's name
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if self.arrivals is not None:
            self.arrivals.append(time.time())
        body = json.dumps(self.answer()).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def serve(handler: type[IngestAnswer] = IngestAnswer, **attrs) -> http.server.ThreadingHTTPServer:
    """A server of `handler` (with `attrs` set on a subclass of it) on a free loopback port,
    serving on a daemon thread; the caller shuts it down."""
    cls = type(handler.__name__, (handler,), attrs) if attrs else handler
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), cls)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True).start()
    return server
