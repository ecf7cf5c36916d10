"""`dashboard`: serve the dashboard for a live collector or a finished run's file.

    dashboard --collector http://127.0.0.1:8428 [--token-file PATH]   live
    dashboard --db runs/demo/telemetry.duckdb                          postmortem
    both: --host 127.0.0.1 (loopback by default) --port 8050

The read token comes from --token-file, else $LLMWATCH_TOKEN; it is sent to the
collector and never printed. The app is served by waitress (a production WSGI
server: threads, bounded request sizes and time-outs), not Flask's dev server.
Bound beyond loopback, every viewer signs in with the viewer token first
(dashboard/access.py): the read token in live mode, --viewer-token-file in either.
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import sys

from agent.secrets import read_token_file
from dashboard.source import DbSource, HttpSource, SourceError

DEFAULT_PORT = 8050
TOKEN_ENV = "LLMWATCH_TOKEN"


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dashboard", description=__doc__.split("\n\n")[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--collector", metavar="URL", help="a running collector's URL (live mode)")
    src.add_argument("--db", metavar="PATH", help="a finished run's DuckDB file (postmortem mode, read-only)")
    p.add_argument("--archive", metavar="DIR",
                   help="with --db: the Parquet archive (`collector archive --out DIR`) the Fleet page reads with the "
                        "file's runs (a live collector's page reads the archive it was started with)")
    p.add_argument("--token-file", metavar="PATH",
                   help=f"file holding the collector's read token (default: ${TOKEN_ENV})")
    p.add_argument("--ca-file", metavar="PEM", help="CA bundle to verify an https:// --collector")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"port (default {DEFAULT_PORT}; 0: any free port)")
    p.add_argument("--viewer-token-file", metavar="PATH",
                   help="token viewers sign in with when bound beyond loopback (default: the read token)")
    p.add_argument("--refresh-s", type=float, default=2.0, help="live refresh interval (default 2 s)")
    p.add_argument("--threads", type=int, default=8, help="server threads (default 8)")
    p.add_argument("--url-file", metavar="PATH", help="write the dashboard's URL here once it listens")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        token = read_token_file(args.token_file) if args.token_file else os.environ.get(TOKEN_ENV) or None
        viewer = read_token_file(args.viewer_token_file) if args.viewer_token_file else None
    except (OSError, ValueError) as e:
        print(f"dashboard: {e}", file=sys.stderr)
        return 2
    remote = not is_loopback(args.host)
    viewer = viewer or (token if args.collector else None)
    if remote and not viewer:
        print(f"dashboard: --host {args.host} is beyond loopback: viewers must sign in; give --viewer-token-file "
              "(or, with --collector, the read token)", file=sys.stderr)
        return 2
    try:
        source = (HttpSource(args.collector, token, ca_file=args.ca_file) if args.collector
                  else DbSource(args.db, archive_dir=args.archive))
    except SourceError as e:
        print(f"dashboard: {e}", file=sys.stderr)
        return 2

    from waitress.server import create_server

    from dashboard.access import require_sign_in
    from dashboard.app import create_app

    app = create_app(source, refresh_ms=int(max(0.5, args.refresh_s) * 1000))
    if remote:
        require_sign_in(app.server, viewer)
    server = create_server(app.server, host=args.host, port=args.port, threads=max(1, args.threads),
                           channel_timeout=60, max_request_body_size=1 << 20, ident="llmwatch")
    port = server.effective_port
    url = f"http://{'127.0.0.1' if args.host in ('0.0.0.0', '::') else args.host}:{port}/"
    if args.url_file:
        with open(args.url_file, "w") as f:
            f.write(url + "\n")
    print(f"dashboard: {url}  ({source.describe()})", flush=True)
    try:
        server.run()
    except KeyboardInterrupt:
        pass
    finally:
        source.close()
    return 0
