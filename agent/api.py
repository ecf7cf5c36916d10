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
"""

from __future__ import annotations

import json
import ssl
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

USER_AGENT = "llmwatch-api"


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
        query = {k: v for k, v in (params or {}).items() if v is not None}
        url = self.url + path + (f"?{urllib.parse.urlencode(query)}" if query else "")
        headers = {"User-Agent": USER_AGENT, "Accept": "application/json"}
        if self._token:
            headers["Authorization"] = f"Bearer {self._token}"
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        req = urllib.request.Request(url, data=data, headers=headers, method=method)
        tries = 1 + (self.retries if method == "GET" else 0)
        for attempt in range(tries):
            try:
                with urllib.request.urlopen(req, timeout=timeout_s or self.timeout_s, context=self._context) as r:
                    return r.read()
            except urllib.error.HTTPError as e:
                raise ApiError(e.code, self._mask(_reason(e))) from None
            except (urllib.error.URLError, OSError) as e:
                if attempt + 1 >= tries:
                    why = getattr(e, "reason", e)
                    raise ApiError(None, f"cannot reach the collector at {self.url}: {why}") from None
                time.sleep(self.retry_wait_s)
        raise AssertionError("unreachable")

    def get_json(self, path: str, *, timeout_s: float | None = None, **params: Any) -> Any:
        return _loads(self.request("GET", path, params=params, timeout_s=timeout_s))

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
