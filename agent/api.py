"""The one client of the collector's JSON API (stdlib only), for whatever reads it or
posts to it other than the agent's ingest (agent/transport.py `HttpClient`, which keeps
one connection open for batches): the supervisor's node watch (trainer/supervisor.py),
the incident feed (trainer/incident_feed.py), the dashboard's live source
(dashboard/source.py) and `collector sql --url` (collector/cli.py).

    api = ApiClient("https://collector:8080", token, ca_file="ca.pem")
    rows = api.get_json(api.run_path(run_id, "incidents"))
    out = api.post_json("/v1/sql", {"sql": "SELECT 1"})

- Paths are built with `run_path`: a run id is one URL path segment, quoted (a run id
  with a slash or a `?` in it reads that run, not another route).
- https:// verifies the collector's certificate against `ca_file` (a private CA or a
  self-signed certificate), else the system's trust store; a bad `ca_file` is a
  ValueError when the client is made, not on every request.
- Errors are `ApiError`: `status` the HTTP status (None: no answer at all) and `reason`
  the collector's own (`{"error": ...}` or `{"detail": ...}` in its body). The token is
  sent only in the Authorization header and never appears in a reason.
- A GET that got no answer (connection refused or reset, a timeout) is tried again
  `retries` times, `retry_wait_s` apart; a POST is not (it may have been done), nor
  is a request the collector answered.
- A GET answered with an `ETag` is asked again with `If-None-Match`: a 304 (nothing
  changed) is answered from the body kept, and costs the collector no database read.
  The pollers (the node watch twice a second, the incident feed once) mostly get 304s.
"""

from __future__ import annotations

import json
import ssl
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

USER_AGENT = "llmwatch-api"
_KEPT_ANSWERS = 32  # tagged answers kept for conditional GETs (a poller asks a few URLs)


class ApiError(Exception):
    def __init__(self, status: int | None, reason: str) -> None:
        super().__init__(reason if status is None else f"HTTP {status}: {reason}")
        self.status = status
        self.reason = reason


def quote(part: str) -> str:
    """One URL path segment (nothing is safe: `/` and `?` are quoted too)."""
    return urllib.parse.quote(str(part), safe="")


class ApiClient:
    def __init__(self, url: str, token: str | None = None, *, timeout_s: float = 10.0, ca_file: str | None = None,
                 retries: int = 0, retry_wait_s: float = 0.2) -> None:
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"collector url must be http(s)://host[:port], got {url!r}")
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        self.retries = max(0, int(retries))
        self.retry_wait_s = retry_wait_s
        self._token = token or ""
        self._lock = threading.Lock()
        self._kept: dict[str, tuple[str, bytes]] = {}  # url -> (ETag, body) of the latest tagged answers
        self._context: ssl.SSLContext | None = None
        if parts.scheme == "https":
            try:
                self._context = ssl.create_default_context(cafile=ca_file)
            except (OSError, ssl.SSLError) as e:
                raise ValueError(f"cannot load the CA file {ca_file!r}: {e}") from None

    def __repr__(self) -> str:
        return f"ApiClient({self.url})"

    @staticmethod
    def run_path(run_id: str, *parts: str) -> str:
        """`/v1/runs/<run_id>[/<part>...]`, each segment quoted."""
        return "/".join(["/v1/runs", quote(run_id), *(quote(p) for p in parts)])

    def request(self, method: str, path: str, *, params: dict[str, Any] | None = None, body: Any = None,
                timeout_s: float | None = None) -> bytes:
        """The answer's body; ApiError for an error status or no answer."""
        return self._send(method, self._url(path, params), body=body, timeout_s=timeout_s)[0]

    def _url(self, path: str, params: dict[str, Any] | None) -> str:
        query = {k: v for k, v in (params or {}).items() if v is not None}
        return self.url + path + (f"?{urllib.parse.urlencode(query)}" if query else "")

    def _send(self, method: str, url: str, *, body: Any = None, timeout_s: float | None = None,
              etag: str | None = None) -> tuple[bytes | None, str | None]:
        """(the answer's body, its ETag); (None, etag) for a 304 to `If-None-Match: etag`."""
        headers = {"User-Agent": USER_AGENT, "Accept": "application/json"}
        if self._token:
            headers["Authorization"] = f"Bearer {self._token}"
        if etag is not None:
            headers["If-None-Match"] = etag
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        req = urllib.request.Request(url, data=data, headers=headers, method=method)
        tries = 1 + (self.retries if method == "GET" else 0)
        for attempt in range(tries):
            try:
                with urllib.request.urlopen(req, timeout=timeout_s or self.timeout_s, context=self._context) as r:
                    return r.read(), r.headers.get("ETag")
            except urllib.error.HTTPError as e:
                if e.code == 304 and etag is not None:
                    return None, e.headers.get("ETag") or etag
                raise ApiError(e.code, self._mask(_reason(e))) from None
            except (urllib.error.URLError, OSError) as e:
                if attempt + 1 >= tries:
                    why = getattr(e, "reason", e)
                    raise ApiError(None, f"cannot reach the collector at {self.url}: {why}") from None
                time.sleep(self.retry_wait_s)
        raise AssertionError("unreachable")

    def get_json(self, path: str, *, timeout_s: float | None = None, **params: Any) -> Any:
        url = self._url(path, params)
        with self._lock:
            kept = self._kept.get(url)
        raw, etag = self._send("GET", url, timeout_s=timeout_s, etag=kept[0] if kept else None)
        if raw is None:  # 304: what we hold is current
            return _loads(kept[1])
        with self._lock:
            if etag:
                self._kept.pop(url, None)
                self._kept[url] = (etag, raw)
                while len(self._kept) > _KEPT_ANSWERS:
                    self._kept.pop(next(iter(self._kept)))
            else:
                self._kept.pop(url, None)
        return _loads(raw)

    def post_json(self, path: str, body: Any, *, timeout_s: float | None = None) -> Any:
        return _loads(self.request("POST", path, body=body, timeout_s=timeout_s))

    def _mask(self, text: str) -> str:
        """The server's reason with the token masked (a server may echo a header back)."""
        return text.replace(self._token, "***") if self._token else text


def _reason(e: urllib.error.HTTPError) -> str:
    try:
        body = json.loads(e.read() or b"null")
    except (ValueError, OSError):
        body = None
    if isinstance(body, dict):
        for key in ("error", "detail"):
            if body.get(key):
                return str(body[key])
    return str(e.reason)


def _loads(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except ValueError as e:
        raise ApiError(None, f"the collector's answer is not JSON: {e}") from None
