"""Where the dashboard's data comes from: one interface, two implementations.

- `HttpSource`: a live collector's query API (`--collector URL`), with the read
  token as a bearer token. It is how a dashboard watches a run in progress: the
  collector holds the DuckDB file and nothing else may open it.
- `DbSource`: a finished run's DuckDB file (`--db PATH`), opened read-only with the
  collector's lockdown settings (no file or network access from SQL).

Both answer with the same rows because both run the same read-side functions
(collector/read/queries.py, collector/read/views.py): the collector serves them over HTTP,
the file source calls them on a cursor. No query is written here.

Errors a page should show, not crash on, are `SourceError` (the collector is
down, the token is refused, the file cannot be opened) and `SqlError` (a query
the SQL console refused, with the collector's reason).
"""

from __future__ import annotations

import json
import threading
import time
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

from agent.api import ApiClient, ApiError, quote

Rows = list[dict[str, Any]]

HTTP_TIMEOUT_S = 15.0
SQL_MAX_ROWS = 5000  # the console shows at most this many rows


class SourceError(RuntimeError):
    """The data is not reachable: a page says so instead of drawing nothing."""


class SqlError(ValueError):
    """The SQL console's query was refused; the message is the collector's reason."""


class Source(ABC):
    """What every page reads. Run-scoped views take the step range and size limits of
    collector/read/views.py (`view(run, "overview", step_from=..., max_points=...)`)."""

    live: bool = False  # a running collector: pages poll it

    @abstractmethod
    def describe(self) -> str: ...

    @abstractmethod
    def runs(self) -> Rows:
        """The newest runs, newest first, with last step, attempts, incidents and actions."""

    @abstractmethod
    def run(self, run_id: str) -> dict[str, Any] | None: ...

    @abstractmethod
    def view(self, run_id: str, name: str, **params: Any) -> Rows:
        """One of collector/read/views.py VIEWS."""

    @abstractmethod
    def table(self, run_id: str, name: str) -> Rows:
        """A run's rows of one of TABLES: incidents, actions, nodes, checkpoints, bad_batches, goodput."""

    @abstractmethod
    def sql(self, query: str, *, max_rows: int = SQL_MAX_ROWS) -> dict[str, Any]:
        """{"columns", "types", "rows", "truncated"} or SqlError."""

    @abstractmethod
    def report_html(self, run_id: str) -> str:
        """The run's postmortem report (collector/offline/postmortem.py)."""

    def fleet(self, since_s: float | None = None) -> dict[str, Any]:
        """Every node and run of the last `since_s` seconds (None: the rules' window) across runs
        (collector/read/fleet.py `node_records`: `nodes`, `runs`, `cells`)."""
        raise SourceError(f"{self.describe()} has no fleet view")

    def close(self) -> None:
        pass


TABLES = ("incidents", "actions", "nodes", "checkpoints", "bad_batches", "goodput")


class HttpSource(Source):
    live = True

    def __init__(self, url: str, token: str | None, *, ca_file: str | None = None,
                 timeout_s: float = HTTP_TIMEOUT_S) -> None:
        self.url = url.rstrip("/")
        self._api = ApiClient(url, token, timeout_s=timeout_s, ca_file=ca_file)
        self.timeout_s = timeout_s

    def describe(self) -> str:
        return f"live: collector {self.url}"

    def _request(self, path: str, *, params: dict[str, Any] | None = None, body: dict | None = None) -> bytes:
        try:
            return self._api.request("POST" if body is not None else "GET", path, params=params, body=body)
        except ApiError as e:
            raise _source_error(e) from None

    def _json(self, path: str, **params: Any) -> Any:
        return json.loads(self._request(path, params=params))

    def runs(self) -> Rows:
        return self._json("/v1/runs", detail="true")

    def run(self, run_id: str) -> dict[str, Any] | None:
        try:
            return self._json(f"/v1/runs/{_quote(run_id)}")
        except _NotFound:
            return None

    def view(self, run_id: str, name: str, **params: Any) -> Rows:
        return self._json(f"/v1/runs/{_quote(run_id)}/view/{_quote(name)}", **params)

    def table(self, run_id: str, name: str) -> Rows:
        if name not in TABLES:
            raise ValueError(f"unknown table {name!r}")
        return self._json(f"/v1/runs/{_quote(run_id)}/{name}")

    def sql(self, query: str, *, max_rows: int = SQL_MAX_ROWS) -> dict[str, Any]:
        try:
            return json.loads(self._request("/v1/sql", body={"sql": query, "format": "json", "max_rows": max_rows}))
        except _BadRequest as e:
            raise SqlError(str(e)) from None

    def report_html(self, run_id: str) -> str:
        return self._request(f"/v1/runs/{_quote(run_id)}/report").decode("utf-8")

    def fleet(self, since_s: float | None = None) -> dict[str, Any]:
        return self._json("/v1/fleet/nodes", since_s=since_s)  # the collector's runs and its --archive


class _NotFound(SourceError):
    pass


class _BadRequest(SourceError):
    pass


def _quote(part: str) -> str:
    return quote(part)


def _source_error(e: ApiError) -> SourceError:
    if e.status is None:
        return SourceError(e.reason)
    if e.status == 404:
        return _NotFound(e.reason)
    if e.status == 400:
        return _BadRequest(e.reason)
    if e.status in (401, 403):
        return SourceError(f"the collector refused the read token (HTTP {e.status}: {e.reason}); "
                           "give it with LLMWATCH_TOKEN or --token-file")
    return SourceError(f"the collector answered HTTP {e.status}: {e.reason}")


class DbSource(Source):
    """A closed collector file, read-only. One connection; a cursor per call (DuckDB
    cursors are per thread, and the dashboard's server answers on several)."""

    def __init__(self, path: str | Path, *, sql_timeout_s: float = 10.0, archive_dir: str | Path | None = None,
                 rules: Any = None) -> None:
        """`archive_dir`: the Parquet archive the Fleet page reads with the file's runs;
        `rules`: the rules its window and fault kinds come from (default: analysis/rules.toml)."""
        import duckdb

        from collector.storage import connect

        self.path = Path(path)
        if not self.path.is_file():
            raise SourceError(f"no database file at {self.path}")
        try:
            self._con = connect(self.path, read_only=True)
        except duckdb.Error as e:
            hint = " (a running collector holds it: use --collector URL)" if "lock" in str(e).lower() else ""
            raise SourceError(f"cannot open {self.path}: {e}{hint}") from None
        self.sql_timeout_s = sql_timeout_s
        self.archive_dir = archive_dir
        self._rules = rules
        self._lock = threading.Lock()

    def describe(self) -> str:
        return f"postmortem: {self.path} (read-only)"

    def _read(self, fn, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            cur = self._con.cursor()
        try:
            return fn(cur, *args, **kwargs)
        finally:
            cur.close()

    def runs(self) -> Rows:
        from collector.read import views

        return self._read(views.runs_overview)

    def run(self, run_id: str) -> dict[str, Any] | None:
        from collector.read import queries

        return self._read(queries.run, run_id)

    def view(self, run_id: str, name: str, **params: Any) -> Rows:
        from collector.read import views

        fn = views.VIEWS.get(name)
        if fn is None:
            raise ValueError(f"unknown view {name!r}")
        return self._read(fn, run_id, **{k: v for k, v in params.items() if v is not None})

    def table(self, run_id: str, name: str) -> Rows:
        from collector.read import queries, views

        fns = {"incidents": queries.incidents, "actions": queries.actions, "nodes": queries.nodes,
               "checkpoints": queries.checkpoints, "bad_batches": queries.bad_batches, "goodput": views.run_goodput}
        if name not in fns:
            raise ValueError(f"unknown table {name!r}")
        return self._read(fns[name], run_id)

    def sql(self, query: str, *, max_rows: int = SQL_MAX_ROWS) -> dict[str, Any]:
        from collector.sql.guard import SqlRefused, run_select

        try:
            r = self._read(run_select, query, max_rows=max_rows, timeout_s=self.sql_timeout_s)
        except SqlRefused as e:
            raise SqlError(str(e)) from None
        return {"columns": r.columns, "types": r.types, "rows": [list(x) for x in r.rows], "truncated": r.truncated}

    def report_html(self, run_id: str) -> str:
        from collector.offline import postmortem

        try:
            return postmortem.render_html(self._read(postmortem.gather, run_id))
        except LookupError as e:
            raise _NotFound(str(e)) from None

    def fleet(self, since_s: float | None = None) -> dict[str, Any]:
        from analysis import load_rules
        from collector.read import fleet

        rules = self._rules or load_rules()
        now = time.time()
        since = now - (since_s if since_s is not None else 86400.0 * rules.node_history.window_days)
        return self._read(fleet.node_records, since_ts=since, until_ts=now, rules=rules, archive_dir=self.archive_dir)

    def close(self) -> None:
        self._con.close()
