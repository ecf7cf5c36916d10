"""`collector nodes`: every node's record across runs, worst first.

    collector nodes --db telemetry.duckdb --archive /data/llmwatch-archive --since 7d

Reads a closed file (or a copy of a live one), the Parquet archive (`collector
archive --out DIR`), or both: a run in both is read from the file. Per node, over
the window (`--since`, by default the rules' `[node_history] window_days`): the runs
it was seen in, the runs where it had a fault (an incident of the rules'
`fault_kinds` naming it, or an isolation), its faults by kind, and its latest fault.
A node with faults in `flag_runs` runs or more is *flagged*: the next run that
starts on it opens a `node_history` incident (docs/rules.md [node_history]).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
import time
from typing import Any

from analysis import RulesError, load_rules
from collector.offline.files import open_closed
from collector.offline.retention import DAY_S, parse_age
from collector.read import fleet


def _when(ts: float | None) -> str:
    return "-" if ts is None else dt.datetime.fromtimestamp(ts, dt.timezone.utc).strftime("%Y-%m-%d %H:%M")


def render(rows: list[dict[str, Any]], *, since_ts: float, flag_runs: int, sources: str) -> str:
    flagged = sum(r["flagged"] for r in rows)
    head = (f"{len(rows)} node(s) seen since {_when(since_ts)} UTC in {sources}; {flagged} flagged "
            f"(a fault in {flag_runs}+ runs: docs/rules.md [node_history])")
    if not rows:
        return head
    table = [("", "node", "runs", "fault runs", "faults", "isolated", "by kind", "last fault")]
    for r in rows:
        kinds = ", ".join(f"{k} {n}" for k, n in r["by_kind"].items()) or "-"
        last = (f"{_when(r['last_fault_ts'])} {r['last_fault_kind']} in {r['last_fault_run']}"
                if r["last_fault_ts"] is not None else "-")
        table.append(("!" if r["flagged"] else "", r["node"], str(r["runs"]), str(r["fault_runs"]), str(r["faults"]),
                      str(r["isolations"]), kinds, last))
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in table]
    return "\n".join([head, *lines])


def _remote(args: argparse.Namespace, window_s: float) -> dict[str, Any]:
    """GET /v1/fleet/nodes of a running collector (its runs and its own archive)."""
    import os

    from agent.api import ApiClient, ApiError
    from collector.http.auth import client_token

    try:
        token = client_token(token=None, token_file=args.token_file, environ=os.environ)
        api = ApiClient(args.url, token, ca_file=args.ca_file)
        return api.get_json("/v1/fleet/nodes", since_s=window_s)
    except (ApiError, ValueError) as e:
        raise SystemExit(f"collector nodes: {e}") from None


def main(args: argparse.Namespace) -> int:
    url = getattr(args, "url", None)
    if not args.db and not args.archive and not url:
        print("collector nodes: give --db FILE, --archive DIR (or both), or --url", file=sys.stderr)
        return 2
    if url and args.archive:
        print("collector nodes: --url reads the archive the collector was started with (--archive there)",
              file=sys.stderr)
        return 2
    try:
        rules = load_rules(args.rules)
        window_s = parse_age(args.since) if args.since else DAY_S * rules.node_history.window_days
    except (RulesError, OSError, ValueError) as e:
        print(f"collector nodes: error: {e}", file=sys.stderr)
        return 2
    if url:
        report, sources = _remote(args, window_s), f"the collector at {url}"
    else:
        now = time.time()
        con = open_closed(args.db, "nodes", read_only=True) if args.db else None
        try:
            report = fleet.node_records(con, since_ts=now - window_s, until_ts=now, rules=rules,
                                        archive_dir=args.archive)
        finally:
            if con is not None:
                con.close()
        sources = " and ".join(s for s in (args.db, args.archive and f"the archive {args.archive}") if s)
    if args.json:
        print(json.dumps(report))
        return 0
    print(render(report["nodes"], since_ts=report["since_ts"], flag_runs=report["flag_runs"],
                 sources=f"{report['num_runs']} run(s) of {sources}"))
    return 0
