"""`collector serve`, `collector sql`, `collector replay`, `collector postmortem`,
`collector nodes` and the retention commands `collector archive`, `collector rollup`, `collector compact` (also
`python -m collector`)."""

from __future__ import annotations

import argparse
import csv
import json
import os
import re
import signal
import sys
from pathlib import Path
from typing import Callable

from agent import wire
from agent.api import ApiClient, ApiError
from collector.http.auth import ALL_ROLES_ENV, Role, TokenSources, client_token
from collector.offline.files import open_closed
from collector.offline.retention import MIN_ROLLUP_AGE_S, parse_age
from collector.settings import (
    AlertSettings,
    DuckDBSettings,
    GateSettings,
    MiB,
    RetentionSettings,
    Settings,
    SqlSettings,
    WriterSettings,
)
from collector.store.schema import SchemaTooNew

LOOPBACK = ("127.0.0.1", "::1", "localhost")


def _tokens(args: argparse.Namespace, db_path: Path):
    """The serve command's tokens (collector/http/auth.py): files, environment, --token;
    with none of them, role tokens generated into DB.tokens/ (0700, files 0600)."""
    sources = TokenSources(token=args.token, token_file=args.token_file,
                           role_files={role: path for role, path in (
                               (Role.INGEST, args.ingest_token_file), (Role.READ, args.read_token_file),
                               (Role.CONTROL, args.control_token_file)) if path})
    if args.token:
        print("collector: warning: --token is visible to every user in `ps`; prefer --token-file or "
              f"${ALL_ROLES_ENV}", file=sys.stderr, flush=True)
    return sources.resolve(os.environ, default_dir=Path(str(db_path) + ".tokens"))


_UNITS = {"": 1, "B": 1, "KB": 1000, "MB": 1000**2, "GB": 1000**3, "KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30}


def parse_bytes(text: str) -> int:
    """'6GB', '512MiB', '1000000' -> bytes."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    if not m or m.group(2).upper() not in _UNITS:
        raise ValueError(f"not a size: {text!r} (e.g. 6GB, 512MiB)")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def limit_memory(max_bytes: int) -> None:
    """Cap the process's data segment (RLIMIT_DATA: heap and private mappings) at
    `max_bytes`. DuckDB's memory_limit bounds its buffer pool, not a value built
    inside one vector (a string concatenated with itself across CTEs reached 6 GB);
    past this cap such an allocation fails, DuckDB answers the query with an
    out-of-memory error, and the collector lives on instead of meeting the OOM killer.
    It counts address space reserved, not resident (an idle collector reserves
    ~1.8 GB to hold ~0.4 GB), hence a generous default."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
    if hard != resource.RLIM_INFINITY:
        max_bytes = min(max_bytes, hard)
    resource.setrlimit(resource.RLIMIT_DATA, (max_bytes, hard))


def _check_exposure(args: argparse.Namespace) -> str | None:
    """Why this bind would be unsafe, or None. Beyond loopback, tokens travel over the
    network: TLS, or an explicit --insecure-plaintext (e.g. behind a TLS proxy)."""
    if bool(args.tls_cert) != bool(args.tls_key):
        return "--tls-cert and --tls-key go together"
    if args.host not in LOOPBACK and not args.tls_cert and not args.insecure_plaintext:
        return (f"binding {args.host} would send bearer tokens in the clear: give --tls-cert and --tls-key, "
                "or --insecure-plaintext when a TLS proxy or a private network stands in front")
    return None


def _server(config, banner: Callable[[str], str]):
    """uvicorn's server, printing `banner(its URL)` once it listens (port 0 works), and
    asked to exit (gracefully) by SIGTERM and SIGINT."""
    import uvicorn

    class Server(uvicorn.Server):
        async def startup(self, sockets=None) -> None:
            await super().startup(sockets)
            if self.started:
                host, port = self.servers[0].sockets[0].getsockname()[:2]
                scheme = "https" if self.config.ssl_certfile else "http"
                print(banner(f"{scheme}://{host}:{port}"), flush=True)

    server = Server(config)

    # uvicorn replaces these while it serves and re-raises a caught signal after its
    # graceful shutdown; ours make that re-raise (and a signal during startup) a
    # request to exit instead of an abrupt default termination.
    def request_exit(signum, frame) -> None:
        server.should_exit = True

    signal.signal(signal.SIGTERM, request_exit)
    signal.signal(signal.SIGINT, request_exit)
    return server


def serve(args: argparse.Namespace) -> int:
    import duckdb
    import uvicorn

    from collector.http.protocol import BoundedHttpToolsProtocol
    from collector.http.server import create_app
    from collector.storage import Storage

    unsafe = _check_exposure(args)
    if unsafe:
        print(f"collector: error: {unsafe}", file=sys.stderr)
        return 2
    try:
        max_memory = parse_bytes(args.max_memory)
    except ValueError as e:
        print(f"collector: error: --max-memory: {e}", file=sys.stderr)
        return 2
    try:
        rollup_after_s = _rollup_age(args.rollup_after) if args.rollup_after else 0.0
        rollup_every_s = parse_age(args.rollup_every)
    except ValueError as e:
        print(f"collector: error: {e}", file=sys.stderr)
        return 2
    if max_memory:
        limit_memory(max_memory)
    db_path = Path(args.db).resolve()
    db_path.parent.mkdir(parents=True, exist_ok=True)
    try:
        tokens, where = _tokens(args, db_path)
    except ValueError as e:
        print(f"collector: error: {e}", file=sys.stderr)
        return 2
    print(f"collector: tokens from {where}", flush=True)
    from collector.alerts.receivers import WEBHOOK_SECRET_ENV, build_receivers
    from collector.http.auth import read_token_file

    if args.webhook_secret:
        print("collector: warning: --webhook-secret is visible to every user in `ps`; prefer "
              f"--webhook-secret-file or ${WEBHOOK_SECRET_ENV}", file=sys.stderr, flush=True)
    try:  # a receiver that cannot work is an error now, not a log line per alert later
        webhook_secret = (read_token_file(args.webhook_secret_file) if args.webhook_secret_file
                          else args.webhook_secret or os.environ.get(WEBHOOK_SECRET_ENV, ""))
        receivers = build_receivers(webhooks=args.webhook, alertmanagers=args.alertmanager,
                                    webhook_secret=webhook_secret)
    except ValueError as e:
        print(f"collector: error: {e}", file=sys.stderr)
        return 2
    if receivers:
        print(f"collector: alerts to {', '.join(repr(r) for r in receivers)}", flush=True)
    settings = Settings(
        db_path=db_path, host=args.host, port=args.port, tokens=tokens, public_metrics=args.public_metrics,
        gate=GateSettings(max_inflight_requests=args.max_inflight_requests, body_timeout_s=args.body_timeout_s,
                          max_batch_bytes=args.max_batch_bytes, max_bundle_bytes=args.max_bundle_bytes,
                          max_bundle_items=args.max_bundle_items, otlp_max_bytes=args.otlp_max_bytes,
                          otlp_max_points=args.otlp_max_points),
        writer=WriterSettings(linger_s=args.group_linger_s, min_interval_s=args.group_min_interval_s,
                              min_rows=args.group_min_rows),
        sql=SqlSettings(timeout_s=args.sql_timeout_s, max_rows=args.sql_max_rows, max_bytes=args.sql_max_bytes,
                        max_concurrent=args.sql_max_concurrent, queue_timeout_s=args.sql_queue_timeout_s,
                        max_waiting=args.sql_max_waiting),
        duckdb=DuckDBSettings(threads=args.duckdb_threads, memory_limit=args.duckdb_memory_limit,
                              max_temp_size=args.duckdb_max_temp_size),
        alerts=AlertSettings(webhooks=tuple(args.webhook), alertmanagers=tuple(args.alertmanager),
                             webhook_secret=webhook_secret, external_url=args.external_url,
                             timeout_s=args.alert_timeout_s, retry_base_s=args.alert_retry_base_s,
                             retry_cap_s=args.alert_retry_cap_s, max_age_s=args.alert_give_up_s,
                             max_attempts=args.alert_max_attempts),
        retention=RetentionSettings(rollup_after_s=rollup_after_s, rollup_every_s=rollup_every_s),
        archive_dir=Path(args.archive).resolve() if args.archive else None)
    from analysis import Analyzer, RulesError, load_rules
    from collector.live.policy import policy_for

    try:
        rules = load_rules(args.rules)  # a bad rules file is an error now, not on the detection thread
        policy = policy_for(rules, mode=args.policy, min_nodes=args.min_nodes) if not args.no_detect else None
    except (RulesError, OSError, ValueError) as e:
        print(f"collector: error: --rules: {e}", file=sys.stderr)
        return 2
    if policy is not None:
        print(f"collector: policy {policy.mode}", flush=True)
    try:
        storage = Storage(settings, analyzer=None if args.no_detect else Analyzer(rules), policy=policy)
    except (duckdb.Error, SchemaTooNew) as e:
        print(f"collector: cannot open {db_path}: {e}", file=sys.stderr)
        return 2
    config = uvicorn.Config(create_app(storage), host=args.host, port=args.port, log_level=args.log_level,
                            access_log=False, proxy_headers=False, timeout_graceful_shutdown=10,
                            server_header=False, ssl_certfile=args.tls_cert, ssl_keyfile=args.tls_key,
                            http=type("Protocol", (BoundedHttpToolsProtocol,), {"head_timeout_s": args.head_timeout_s}),
                            # idle keep-alive connections are closed after this; a slow client
                            # cannot hold a connection open for free
                            timeout_keep_alive=30)
    server = _server(config, lambda url: f"collector listening on {url} (db {db_path})")
    from collector import gctune

    gctune.tune()  # full collections over a large heap stalled every request (collector/gctune.py)
    try:
        server.run()  # uvicorn's own event loop choice (uvloop when installed)
        return 0 if server.started else 1
    finally:
        storage.close()  # no-op after the app's lifespan closed it


def relay(args: argparse.Namespace) -> int:
    import uvicorn

    from agent.transport import HttpClient
    from collector.http.auth import Tokens
    from collector.http.gate import Gate
    from collector.http.protocol import BoundedHttpToolsProtocol
    from collector.metrics import CollectorMetrics
    from collector.relay import Relay, RelaySettings

    unsafe = _check_exposure(args)
    if unsafe or not args.upstream:
        print(f"collector relay: error: {unsafe or 'no --upstream (or $LLMWATCH_URL)'}", file=sys.stderr)
        return 2
    try:
        token = client_token(token=None, token_file=args.token_file or os.environ.get("LLMWATCH_TOKEN_FILE"),
                             environ=os.environ)
        if not token:
            raise ValueError("no ingest token: --token-file, $LLMWATCH_TOKEN_FILE or $LLMWATCH_TOKEN")
        tokens = Tokens.build(by_role={Role.INGEST: [token]})
        upstream = HttpClient(args.upstream, token, args.upstream_timeout_s, ca_file=args.ca_file,
                              path=wire.BUNDLE_PATH, content_type=wire.BUNDLE_CONTENT_TYPE)
    except (ValueError, OSError) as e:
        print(f"collector relay: error: {e}", file=sys.stderr)
        return 2
    app = Relay(upstream, RelaySettings(linger_s=args.linger_s, max_items=args.max_items, max_bytes=args.max_bytes,
                                        max_batch_bytes=args.max_batch_bytes,
                                        upstream_timeout_s=args.upstream_timeout_s))
    # the collector's gate: the token before the body, the body's size and time; no database behind it
    settings = Settings(db_path=Path(os.devnull), host=args.host, port=args.port, tokens=tokens,
                        gate=GateSettings(max_inflight_requests=args.max_inflight_requests,
                                          body_timeout_s=args.body_timeout_s, max_batch_bytes=args.max_batch_bytes))
    config = uvicorn.Config(Gate(app, settings, CollectorMetrics()), host=args.host, port=args.port,
                            log_level=args.log_level, access_log=False, proxy_headers=False, server_header=False,
                            timeout_graceful_shutdown=5, ssl_certfile=args.tls_cert, ssl_keyfile=args.tls_key,
                            http=type("Protocol", (BoundedHttpToolsProtocol,), {"head_timeout_s": args.head_timeout_s}),
                            timeout_keep_alive=30)
    server = _server(config, lambda url: f"relay listening on {url} -> {upstream!r}")
    server.run()
    return 0 if server.started else 1


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

    from collector.sql.guard import SqlRefused, run_select
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
    try:
        token = client_token(token=args.token, token_file=args.token_file, environ=os.environ)
    except ValueError as e:
        raise SystemExit(f"collector sql: {e}") from None
    try:
        api = ApiClient(args.url, token, timeout_s=args.timeout_s + 30, ca_file=args.ca_file)
        return api.post_json("/v1/sql", {"sql": args.query, "format": "json", "max_rows": args.max_rows})
    except (ApiError, ValueError) as e:
        raise SystemExit(f"collector sql: {e}") from None


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
    t = s.add_argument_group("tokens", "by role: ingest (ranks), read (dashboard, SQL, /metrics), control (commands). "
                             f"A token without a role (--token-file, ${ALL_ROLES_ENV}, --token) has every role. "
                             "Role tokens also come from $LLMWATCH_INGEST_TOKEN, $LLMWATCH_READ_TOKEN, "
                             "$LLMWATCH_CONTROL_TOKEN. With none given, role tokens are generated into "
                             "DB.tokens/ (0600) and reused on the next start.")
    t.add_argument("--token-file", help="a file (0600) holding one token with every role")
    t.add_argument("--ingest-token-file", help="a file holding the ingest token")
    t.add_argument("--read-token-file", help="a file holding the read token")
    t.add_argument("--control-token-file", help="a file holding the control token")
    t.add_argument("--token", help="one token with every role, on the command line (visible in `ps`: prefer a file)")
    s.add_argument("--public-metrics", action="store_true", help="serve GET /metrics without a token")
    s.add_argument("--rules", help="detection rules (TOML) overriding analysis/rules.toml; see docs/rules.md")
    s.add_argument("--no-detect", action="store_true", help="store only: run no detectors")
    s.add_argument("--policy", choices=("auto", "shadow", "off"),
                   help="what is done about incidents (default: the rules' [policy] mode, auto): auto rolls back, "
                        "skips bad data and isolates nodes; shadow records what it would do; off only alerts")
    s.add_argument("--min-nodes", type=int, help="never isolate below this many healthy nodes (rules: min_nodes)")
    s.add_argument("--tls-cert", help="PEM certificate (chain): serve HTTPS")
    s.add_argument("--tls-key", help="PEM private key of --tls-cert")
    s.add_argument("--insecure-plaintext", action="store_true",
                   help="allow plain HTTP on a non-loopback --host (behind a TLS proxy or on a private network)")
    s.add_argument("--max-inflight-requests", type=int, default=2048, help="past this, 503 + Retry-After")
    s.add_argument("--body-timeout-s", type=float, default=30.0, help="a request body must arrive within this (408)")
    s.add_argument("--head-timeout-s", type=float, default=10.0,
                   help="a request line and headers must arrive within this (else the connection is closed)")
    s.add_argument("--max-batch-bytes", type=int, default=32 * MiB)
    s.add_argument("--max-bundle-bytes", type=int, default=64 * MiB,
                   help="a relay's bundle of batches (POST /v1/ingest/bundle), each within --max-batch-bytes")
    s.add_argument("--max-bundle-items", type=int, default=1024, help="batches in one bundle")
    s.add_argument("--sql-timeout-s", type=float, default=10.0)
    s.add_argument("--sql-max-rows", type=int, default=10_000)
    s.add_argument("--sql-max-bytes", type=int, default=8 * MiB, help="an answer stops (truncated) past this")
    s.add_argument("--sql-max-concurrent", type=int, default=4, help="queries running at once")
    s.add_argument("--sql-queue-timeout-s", type=float, default=5.0,
                   help="how long a query may wait for a slot (then 503 + Retry-After)")
    s.add_argument("--sql-max-waiting", type=int, default=64, help="queries waiting at once (then 503)")
    s.add_argument("--otlp-max-bytes", type=int, default=8 * MiB, help="OTLP body, compressed and decompressed")
    s.add_argument("--otlp-max-points", type=int, default=100_000, help="OTLP data points per request")
    s.add_argument("--group-linger-s", type=float, default=0.05,
                   help="how long a small group commit may wait for more requests (0: never)")
    s.add_argument("--group-min-rows", type=int, default=131_072, help="a group this big commits without waiting")
    s.add_argument("--group-min-interval-s", type=float, default=0.5,
                   help="start a commit at most this often: small requests share one (0: commit each at once)")
    s.add_argument("--duckdb-threads", type=int, default=2)
    s.add_argument("--duckdb-memory-limit", default="2GB")
    s.add_argument("--duckdb-max-temp-size", default="4GB", help="what queries may spill to disk beside the file")
    s.add_argument("--max-memory", default="8GB",
                   help="cap on the process's data segment (RLIMIT_DATA; 0: none): a query past it fails, "
                        "the collector lives on")
    a = s.add_argument_group("alerts", "incidents to webhooks (signed, Alertmanager's webhook JSON) and to "
                             "Alertmanager, from an outbox table that survives restarts; see docs/operations.md")
    a.add_argument("--webhook", action="append", default=[], metavar="URL",
                   help="POST each alert here (repeatable); needs a secret: every webhook is signed")
    a.add_argument("--webhook-secret-file", metavar="PATH",
                   help="a file (0600) holding the HMAC key of X-Signature-256 (or $LLMWATCH_WEBHOOK_SECRET)")
    a.add_argument("--webhook-secret", help="the HMAC key on the command line (visible in `ps`: prefer a file)")
    a.add_argument("--alertmanager", action="append", default=[], metavar="URL",
                   help="push alerts to this Alertmanager's /api/v2/alerts (repeatable)")
    a.add_argument("--external-url", default="", metavar="URL",
                   help="how people reach this collector (the alerts' generatorURL)")
    a.add_argument("--alert-timeout-s", type=float, default=5.0, help="one delivery attempt")
    a.add_argument("--alert-retry-base-s", type=float, default=1.0,
                   help="the first retry's delay; it doubles (with jitter) up to --alert-retry-cap-s")
    a.add_argument("--alert-retry-cap-s", type=float, default=300.0)
    a.add_argument("--alert-give-up-s", type=float, default=86400.0,
                   help="an alert not delivered after this long is marked failed")
    a.add_argument("--alert-max-attempts", type=int, default=0,
                   help="... or after this many attempts (0: no limit but the age)")
    k = s.add_argument_group("retention", "old per-collective rows rolled up into per-step summaries on the "
                             "writer thread (collectives_rollup); see docs/scale.md")
    k.add_argument("--rollup-after", metavar="AGE",
                   help="roll up collectives rows older than this (e.g. 7d, 36h; at least "
                        f"{MIN_ROLLUP_AGE_S / 3600:g}h; default: never)")
    k.add_argument("--rollup-every", metavar="AGE", default="1h",
                   help="how often the rollup looks for old rows (default 1h)")
    f = s.add_argument_group("fleet", "each node's record across runs (docs/rules.md [node_history])")
    f.add_argument("--archive", metavar="DIR",
                   help="the Parquet archive (`collector archive --out DIR`) read with this file's own runs for the "
                        "history of a new run's nodes (default: this file's runs only)")
    s.add_argument("--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"])
    s.set_defaults(func=serve)

    rl = sub.add_parser("relay", help="a node's relay: its ranks post to it, it posts their batches upstream "
                                      "as one bundle per flush (collector/relay.py)")
    rl.add_argument("--upstream", default=os.environ.get("LLMWATCH_URL"),
                    help="the collector's base URL (default: $LLMWATCH_URL)")
    rl.add_argument("--host", default="127.0.0.1")
    rl.add_argument("--port", type=int, default=8429, help="0 picks a free port (printed)")
    rl.add_argument("--token-file", help="a file holding the ingest token: the ranks must present it, and it is "
                                         "used upstream (default: $LLMWATCH_TOKEN_FILE, else $LLMWATCH_TOKEN)")
    rl.add_argument("--ca-file", help="PEM bundle to verify an https:// upstream with (default: the system's)")
    rl.add_argument("--linger-s", type=float, default=0.05, help="a bundle leaves this long after its first batch")
    rl.add_argument("--max-items", type=int, default=1024, help="batches in one bundle")
    rl.add_argument("--max-bytes", type=int, default=32 * MiB, help="bytes in one bundle")
    rl.add_argument("--max-batch-bytes", type=int, default=32 * MiB, help="one rank's batch (413 above)")
    rl.add_argument("--upstream-timeout-s", type=float, default=1.8,
                    help="a bundle unanswered by then is 503 to its ranks (keep below their timeout_s, 2 s)")
    rl.add_argument("--max-inflight-requests", type=int, default=2048, help="past this, 503 + Retry-After")
    rl.add_argument("--body-timeout-s", type=float, default=30.0, help="a request body must arrive within this")
    rl.add_argument("--head-timeout-s", type=float, default=10.0, help="a request head must arrive within this")
    rl.add_argument("--tls-cert", help="PEM certificate (chain): serve HTTPS")
    rl.add_argument("--tls-key", help="PEM private key of --tls-cert")
    rl.add_argument("--insecure-plaintext", action="store_true",
                    help="allow plain HTTP on a non-loopback --host (a relay for a rack, on a private network)")
    rl.add_argument("--log-level", default="warning")
    rl.set_defaults(func=relay)

    q = sub.add_parser("sql", help="run one read-only SELECT against a collector or a closed file")
    src = q.add_mutually_exclusive_group(required=True)
    src.add_argument("--url", help="a running collector, e.g. http://127.0.0.1:8428")
    src.add_argument("--db", help="a DuckDB file no collector holds (opened read-only)")
    q.add_argument("--token-file", help="a file holding the read token for --url")
    q.add_argument("--token", help=f"the read token for --url (default ${ALL_ROLES_ENV}; visible in `ps`)")
    q.add_argument("--ca-file", help="PEM bundle to verify an https:// collector")
    q.add_argument("--format", choices=["table", "json", "csv"], default="table")
    q.add_argument("--max-rows", type=int, default=10_000)
    q.add_argument("--timeout-s", type=float, default=10.0)
    q.add_argument("query", help='e.g. "SELECT step, loss FROM steps_effective WHERE rank = 0"')
    q.set_defaults(func=sql)

    r = sub.add_parser("replay", help="rerun the detectors over a closed run's file (read-only) and score them")
    r.add_argument("--db", required=True, help="a DuckDB file no collector holds (opened read-only, never written)")
    r.add_argument("--rules", help="detection rules (TOML) overriding analysis/rules.toml; see docs/rules.md")
    r.add_argument("--truth", help="the run's injections.jsonl (trainer --inject): score the incidents against it")
    r.add_argument("--run", help="replay this run only (default: every run in the file)")
    r.add_argument("--policy", choices=("auto", "shadow", "off"),
                   help="the policy mode whose decisions are judged with --truth (default: the rules' mode)")
    r.add_argument("--window-s", type=float, default=1.0,
                   help="rows are fed in commits of this many seconds of the ranks' clocks (default 1)")
    r.add_argument("--archive", metavar="DIR",
                   help="the Parquet archive read with the file's other runs for the history of a run's nodes")
    r.add_argument("--json", action="store_true", help="one JSON object: incidents per run and the score")
    r.set_defaults(func=_replay)

    nd = sub.add_parser("nodes", help="every node's record across runs (faults, isolations), worst first, from a "
                                      "closed file and the Parquet archive")
    nsrc = nd.add_mutually_exclusive_group()
    nsrc.add_argument("--db", help="a DuckDB file no collector holds, or a copy of a live one (opened read-only)")
    nsrc.add_argument("--url", help="a running collector (its runs, and the archive it was started with)")
    nd.add_argument("--token-file", help="a file holding the read token for --url")
    nd.add_argument("--ca-file", help="PEM bundle to verify an https:// collector")
    nd.add_argument("--archive", metavar="DIR", help="the Parquet archive (`collector archive --out DIR`)")
    nd.add_argument("--since", metavar="AGE",
                    help="how far back (e.g. 7d, 36h; default: the rules' [node_history] window_days)")
    nd.add_argument("--rules", help="detection rules (TOML) overriding analysis/rules.toml: the window, what counts "
                                    "as a fault and when a node is flagged ([node_history])")
    nd.add_argument("--json", action="store_true", help="one JSON object: a record per node, worst first")
    nd.set_defaults(func=_nodes)

    m = sub.add_parser("postmortem", help="write a run's postmortem report (HTML with charts, or Markdown)")
    m.add_argument("run_id", help="the run to report on")
    m.add_argument("--db", required=True, help="a DuckDB file no collector holds (opened read-only)")
    m.add_argument("--out", required=True, help="report.html (self-contained, charts embedded) or report.md")
    m.set_defaults(func=_postmortem)

    ar = sub.add_parser("archive", help="write finished runs to a Parquet archive partitioned by run and day")
    ar.add_argument("--db", required=True, help="a DuckDB file no collector holds, or a copy of a live one "
                                                "(opened read-only)")
    ar.add_argument("--out", required=True, metavar="DIR",
                    help="archive root: DIR/<table>/run_id=<id>/day=YYYY-MM-DD/*.parquet (hive layout)")
    ar.add_argument("--run", action="append", default=[], metavar="ID",
                    help="archive this run (repeatable; default: every run whose status is not running)")
    ar.add_argument("--force", action="store_true", help="archive a run that is still running, as far as it got")
    ar.add_argument("--json", action="store_true", help="one JSON object: runs archived and skipped, rows per table")
    ar.set_defaults(func=_archive)

    ru = sub.add_parser("rollup", help="roll old collectives rows up into per-step summaries (a closed file)")
    ru.add_argument("--db", required=True, help="a DuckDB file no collector holds (written in place)")
    ru.add_argument("--older-than", required=True, metavar="AGE",
                    help=f"roll up steps whose collectives all began before now minus this (e.g. 7d; at least "
                         f"{MIN_ROLLUP_AGE_S / 3600:g}h)")
    ru.add_argument("--run", metavar="ID", help="this run only (default: every run)")
    ru.add_argument("--compact", action="store_true",
                    help="then rewrite the file so that the freed space goes back to the disk (collector compact)")
    ru.add_argument("--json", action="store_true", help="one JSON object: steps and rows rolled up, file bytes")
    ru.set_defaults(func=_rollup)

    co = sub.add_parser("compact", help="rewrite a closed file into a fresh one, giving deleted rows' space back")
    co.add_argument("--db", required=True, help="a DuckDB file no collector holds (replaced by its compacted copy)")
    co.add_argument("--out", metavar="PATH", help="write the compacted copy here instead and leave --db as it is")
    co.add_argument("--json", action="store_true", help="one JSON object: bytes before and after, rows per table")
    co.set_defaults(func=_compact)
    return p


def _rollup_age(text: str) -> float:
    from collector.offline.retention import check_age

    return check_age(parse_age(text))


def _archive(args: argparse.Namespace) -> int:
    from collector.offline.archive import ArchiveError, archive

    con = open_closed(args.db, "archive", read_only=True)
    try:
        result = archive(args.db, args.out, run_ids=args.run or None, force=args.force, con=con)
    except ArchiveError as e:
        raise SystemExit(f"collector archive: {e}") from None
    finally:
        con.close()
    if args.json:
        print(json.dumps({"archived": result.archived, "skipped": result.skipped, "rows": result.rows,
                          "files": result.files}))
    else:
        for run_id in result.archived:
            print(f"archived {run_id}")
        for run_id, why in result.skipped.items():
            print(f"skipped {run_id}: {why}")
        rows = ", ".join(f"{t} {n:,}" for t, n in result.rows.items() if n)
        print(f"{len(result.archived)} runs, {result.files} files under {args.out}" + (f" ({rows} rows)" if rows else ""))
    return 0 if result.archived or not args.run else 1


def _rollup(args: argparse.Namespace) -> int:
    from collector.offline import retention
    from collector.store.schema import migrate

    try:
        older_than_s = _rollup_age(args.older_than)
    except ValueError as e:
        print(f"collector rollup: error: {e}", file=sys.stderr)
        return 2
    before = retention.file_bytes(args.db) if Path(args.db).exists() else 0
    con = open_closed(args.db, "rollup", read_only=False)
    try:
        migrate(con)  # an older file gets the rollup tables
        r = retention.rollup(con, older_than_s=older_than_s, run_id=args.run)
    except SchemaTooNew as e:
        print(f"collector rollup: cannot open {args.db}: {e}", file=sys.stderr)
        return 2
    finally:
        con.close()
    after = retention.file_bytes(args.db)
    out = {"steps": r.num_steps, "collectives_rows": r.raw_rows, "rollup_rows": r.rollup_rows,
           "wait_rows": r.wait_rows, "bytes_before": before, "bytes_after": after}
    if args.compact:
        c = retention.compact(args.db)
        out["bytes_compacted"] = c.bytes_after
    if args.json:
        print(json.dumps(out))
    else:
        print(f"rolled up {r.num_steps:,} steps: {r.raw_rows:,} collectives rows -> {r.rollup_rows:,} summary rows "
              f"+ {r.wait_rows:,} wait rows; file {before:,} -> {after:,} bytes"
              + (f", compacted {out['bytes_compacted']:,} bytes" if args.compact else ""))
    return 0


def _compact(args: argparse.Namespace) -> int:
    import duckdb

    from collector.offline.retention import compact

    open_closed(args.db, "compact", read_only=True).close()  # exists, and no collector holds it
    try:
        c = compact(args.db, out=args.out)
    except (duckdb.Error, FileExistsError, RuntimeError) as e:
        raise SystemExit(f"collector compact: {e}") from None
    if args.json:
        print(json.dumps({"bytes_before": c.bytes_before, "bytes_after": c.bytes_after, "rows": c.rows}))
    else:
        print(f"compacted {args.out or args.db}: {c.bytes_before:,} -> {c.bytes_after:,} bytes "
              f"({sum(c.rows.values()):,} rows)")
    return 0


def _replay(args: argparse.Namespace) -> int:
    from collector.offline.replay import main as replay_main

    return replay_main(args)


def _nodes(args: argparse.Namespace) -> int:
    from collector.offline.nodes import main as nodes_main

    return nodes_main(args)


def _postmortem(args: argparse.Namespace) -> int:
    from collector.offline.postmortem import main as postmortem_main

    return postmortem_main(args)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)
