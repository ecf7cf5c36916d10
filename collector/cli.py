"""`collector serve` and `collector sql` (also `python -m collector`)."""

from __future__ import annotations

import argparse
import csv
import json
import os
import secrets
import signal
import sys
import urllib.error
import urllib.request
from pathlib import Path

from collector.settings import MiB, Settings

TOKEN_ENV = "LLMWATCH_TOKEN"


def _resolve_token(given: str | None, db_path: Path) -> str:
    """--token, else $LLMWATCH_TOKEN, else a new one printed and saved to DB.token (0600)."""
    token = given or os.environ.get(TOKEN_ENV)
    if token:
        return token
    token = secrets.token_urlsafe(32)
    path = Path(str(db_path) + ".token")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    os.chmod(path, 0o600)  # the file may have existed with wider permissions
    print(f"collector token: {token} (saved to {path})", flush=True)
    return token


def _server_class():
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server, announcing the bound address once it listens (port 0 works)."""

        db_path: Path

        async def startup(self, sockets=None) -> None:
            await super().startup(sockets)
            if self.started:
                host, port = self.servers[0].sockets[0].getsockname()[:2]
                print(f"collector listening on http://{host}:{port} (db {self.db_path})", flush=True)

    return Server


def serve(args: argparse.Namespace) -> int:
    import duckdb
    import uvicorn

    from collector.server import create_app
    from collector.storage import Storage

    db_path = Path(args.db).resolve()
    db_path.parent.mkdir(parents=True, exist_ok=True)
    settings = Settings(db_path=db_path, host=args.host, port=args.port, token=_resolve_token(args.token, db_path),
                        max_batch_bytes=args.max_batch_bytes, sql_timeout_s=args.sql_timeout_s,
                        sql_max_rows=args.sql_max_rows, group_linger_s=args.group_linger_s,
                        group_min_interval_s=args.group_min_interval_s,
                        group_min_rows=args.group_min_rows, duckdb_threads=args.duckdb_threads,
                        duckdb_memory_limit=args.duckdb_memory_limit)
    try:
        storage = Storage(settings)
    except duckdb.Error as e:
        print(f"collector: cannot open {db_path}: {e}", file=sys.stderr)
        return 2
    config = uvicorn.Config(create_app(storage), host=args.host, port=args.port, log_level=args.log_level,
                            access_log=False, proxy_headers=False, timeout_graceful_shutdown=10,
                            server_header=False)
    server = _server_class()(config)
    server.db_path = db_path

    # uvicorn replaces these while it serves and re-raises a caught signal after its
    # graceful shutdown; ours make that re-raise (and a signal during startup) a
    # request to exit instead of an abrupt default termination.
    def request_exit(signum, frame) -> None:
        server.should_exit = True

    signal.signal(signal.SIGTERM, request_exit)
    signal.signal(signal.SIGINT, request_exit)
    try:
        server.run()  # uvicorn's own event loop choice (uvloop when installed)
        return 0 if server.started else 1
    finally:
        storage.close()  # no-op after the app's lifespan closed it


def _format_table(columns: list[str], rows: list[list]) -> str:
    def cell(v) -> str:
        return "NULL" if v is None else str(v)

    text = [[cell(v) for v in row] for row in rows]
    widths = [max([len(c)] + [len(r[i]) for r in text]) for i, c in enumerate(columns)]
    numeric = [all(isinstance(row[i], (int, float)) and not isinstance(row[i], bool) for row in rows if row[i] is not None)
               for i in range(len(columns))]
    fmt = lambda vals: "  ".join(v.rjust(w) if num else v.ljust(w) for v, w, num in zip(vals, widths, numeric))  # noqa: E731
    lines = [fmt(columns), "  ".join("-" * w for w in widths)] + [fmt(r) for r in text]
    return "\n".join(line.rstrip() for line in lines)


def _sql_local(args: argparse.Namespace) -> dict:
    import duckdb

    from collector.sqlguard import SqlRefused, run_select
    from collector.storage import connect

    try:
        con = connect(args.db, read_only=True)
    except duckdb.Error as e:
        hint = " (a running collector holds it: use --url)" if "lock" in str(e).lower() else ""
        raise SystemExit(f"collector sql: cannot open {args.db}: {e}{hint}") from None
    try:
        r = run_select(con, args.query, max_rows=args.max_rows, timeout_s=args.timeout_s)
    except SqlRefused as e:
        raise SystemExit(f"collector sql: {e}") from None
    finally:
        con.close()
    return {"columns": r.columns, "types": r.types, "rows": [list(x) for x in r.rows], "truncated": r.truncated}


def _sql_remote(args: argparse.Namespace) -> dict:
    token = args.token or os.environ.get(TOKEN_ENV, "")
    body = json.dumps({"sql": args.query, "format": "json", "max_rows": args.max_rows}).encode()
    req = urllib.request.Request(args.url.rstrip("/") + "/v1/sql", data=body, method="POST",
                                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(req, timeout=args.timeout_s + 30) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as e:
        try:
            reason = json.loads(e.read()).get("error", e.reason)
        except ValueError:
            reason = e.reason
        raise SystemExit(f"collector sql: HTTP {e.code}: {reason}") from None
    except urllib.error.URLError as e:
        raise SystemExit(f"collector sql: cannot reach {args.url}: {e.reason}") from None


def sql(args: argparse.Namespace) -> int:
    result = _sql_remote(args) if args.url else _sql_local(args)
    if args.format == "json":
        print(json.dumps(result, default=str))
    elif args.format == "csv":
        w = csv.writer(sys.stdout)
        w.writerow(result["columns"])
        w.writerows(result["rows"])
    else:
        print(_format_table(result["columns"], result["rows"]))
        more = ", truncated: more rows exist" if result["truncated"] else ""
        print(f"({len(result['rows'])} rows{more})")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="collector", description="llmwatch telemetry collector")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("serve", help="run the collector service")
    s.add_argument("--db", required=True, help="DuckDB file (created if missing)")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8428, help="0 picks a free port (printed)")
    s.add_argument("--token", help=f"bearer token (default ${TOKEN_ENV}, else generated into DB.token)")
    s.add_argument("--max-batch-bytes", type=int, default=32 * MiB)
    s.add_argument("--sql-timeout-s", type=float, default=10.0)
    s.add_argument("--sql-max-rows", type=int, default=10_000)
    s.add_argument("--group-linger-s", type=float, default=0.05,
                   help="how long a small group commit may wait for more requests (0: never)")
    s.add_argument("--group-min-rows", type=int, default=131_072, help="a group this big commits without waiting")
    s.add_argument("--group-min-interval-s", type=float, default=0.5,
                   help="start a commit at most this often: small requests share one (0: commit each at once)")
    s.add_argument("--duckdb-threads", type=int, default=2)
    s.add_argument("--duckdb-memory-limit", default="2GB")
    s.add_argument("--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"])
    s.set_defaults(func=serve)

    q = sub.add_parser("sql", help="run one read-only SELECT against a collector or a closed file")
    src = q.add_mutually_exclusive_group(required=True)
    src.add_argument("--url", help="a running collector, e.g. http://127.0.0.1:8428")
    src.add_argument("--db", help="a DuckDB file no collector holds (opened read-only)")
    q.add_argument("--token", help=f"bearer token for --url (default ${TOKEN_ENV})")
    q.add_argument("--format", choices=["table", "json", "csv"], default="table")
    q.add_argument("--max-rows", type=int, default=10_000)
    q.add_argument("--timeout-s", type=float, default=10.0)
    q.add_argument("query", help='e.g. "SELECT step, loss FROM steps_effective WHERE rank = 0"')
    q.set_defaults(func=sql)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)
