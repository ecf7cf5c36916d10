"""What read-only SQL can cost the rest of the collector: latency of the other routes
while every SQL slot is busy, and the biggest answer a query can get out.

A real `collector serve` in its own process; this script plays the analyst (or the
attacker with a read token):

1. idle        /healthz and GET /v1/runs latency (p50, p99) with no SQL running:
               the yardstick.
2. saturated   the same while --slow slow queries are in flight (sql_max_concurrent
               of them run, the rest wait for a slot; measured only once the
               collector's /metrics shows every slot taken).
3. sizes       the largest answer each query gets out of the collector, against the
               byte cap, with the time it took and how much the collector's peak RSS
               (VmHWM) grew: the repeat() attack, many rows, a wide join, a value
               built by concatenation (allowed: its growth is bounded only by time).

    python bench/bench_sql_limits.py
    python bench/bench_sql_limits.py --slow 44 --probes 500
    python bench/bench_sql_limits.py --root /path/to/an/older/checkout --parts idle,saturated
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from collector_proc import rss_kib, start_collector  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "bench-sql-token-0123456789"
SLOW = "SELECT count(*) FROM range(1000000000000) a, range(10) b"
X1000 = "lpad('', 1000, 'x')"
SIZES = [  # (what, sql, format)
    ("repeat() attack", "SELECT repeat('a', 100000000) AS s FROM range(5)", "json"),
    ("many rows", "SELECT i, i * 2 AS j, 'row ' || i AS s FROM range(100000000) t(i)", "json"),
    ("many rows", "SELECT i, i * 2 AS j, 'row ' || i AS s FROM range(100000000) t(i)", "arrow"),
    ("wide join", f"WITH t AS (SELECT i, {X1000} AS s FROM range(1000) t(i)) SELECT * FROM t a, t b, t c", "json"),
    ("wide join", f"WITH t AS (SELECT i, {X1000} AS s FROM range(1000) t(i)) SELECT * FROM t a, t b, t c", "arrow"),
    ("concat to 100 MB", "WITH a AS (SELECT " + X1000 + " AS s), " + ", ".join(
        f"{n} AS (SELECT {'||'.join(['s'] * 10)} AS s FROM {p})" for p, n in zip("abcde", "bcdef"))
     + " SELECT s FROM f", "json"),
]


def client(url: str) -> httpx.Client:
    return httpx.Client(base_url=url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=120)


def sql_gauges(c: httpx.Client) -> dict[str, float]:
    out = {}
    for line in c.get("/metrics").text.splitlines():
        for name in ("running", "waiting"):
            if line.startswith(f"llmwatch_collector_sql_{name} "):
                out[name] = float(line.split()[1])
    return out


def latencies(c: httpx.Client, path: str, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        c.get(path).raise_for_status()
        out.append(time.perf_counter() - t0)
    return out


def pct(xs: list[float], q: int) -> float:
    return statistics.quantiles(xs, n=100)[q - 1] * 1e3


def saturate(url: str, num: int) -> tuple[list[threading.Thread], list[int]]:
    statuses: list[int] = []

    def one() -> None:
        with client(url) as c:
            statuses.append(c.post("/v1/sql", json={"sql": SLOW}).status_code)

    threads = [threading.Thread(target=one, daemon=True) for _ in range(num)]
    for t in threads:
        t.start()
    return threads, statuses


def wait_saturated(c: httpx.Client, num: int) -> str:
    """Until every slot runs a query and the rest wait; older collectors have no
    gauges: then a fixed second after the requests went out."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        g = sql_gauges(c)
        if not g:
            time.sleep(1.0)
            return "1 s after sending (no SQL gauges on this collector)"
        if g["running"] > 0 and g["running"] + g["waiting"] >= num * 0.9:
            return f"{g['running']:.0f} running, {g['waiting']:.0f} waiting"
    return "not saturated within 30 s"


def body_size(c: httpx.Client, sql: str, fmt: str) -> tuple[int, int, str, float]:
    """(status, body bytes, truncated, seconds), streaming the answer."""
    t0 = time.perf_counter()
    with c.stream("POST", "/v1/sql", json={"sql": sql, "format": fmt, "max_rows": 10_000_000}) as r:
        size, tail = 0, b""
        for chunk in r.iter_bytes():
            size += len(chunk)
            tail = (tail + chunk)[-64:]
        truncated = r.headers.get("x-llmwatch-truncated", "")
        if fmt == "json":
            truncated = "true" if tail.endswith(b'"truncated":true}') else (
                "false" if tail.endswith(b'"truncated":false}') else "-")
        return r.status_code, size, truncated, time.perf_counter() - t0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--slow", type=int, default=40, help="slow queries in flight while measuring")
    p.add_argument("--probes", type=int, default=200)
    p.add_argument("--sql-timeout-s", type=float, default=5.0, help="how long each slow query holds its slot")
    p.add_argument("--max-bytes-mib", type=float, default=8.0, help="the collector's byte cap (for the table)")
    p.add_argument("--parts", default="idle,saturated,sizes")
    p.add_argument("--root", type=Path, default=ROOT, help="the checkout whose collector to measure")
    args = p.parse_args()
    parts = set(args.parts.split(","))
    with tempfile.TemporaryDirectory() as tmp:
        proc, url = start_collector(args.root, Path(tmp) / "sql.duckdb", TOKEN, "--sql-timeout-s", str(args.sql_timeout_s),
                                    "--sql-max-rows", "10000000")
        try:
            with client(url) as c:
                for _ in range(5):
                    c.post("/v1/sql", json={"sql": "SELECT 1"})  # warm: imports, first query
                print(f"collector {args.root}")
                print(f"{'':34} {'/healthz p50':>12} {'p99':>9} {'/v1/runs p50':>13} {'p99':>9}")
                if "idle" in parts:
                    h, q = latencies(c, "/healthz", args.probes), latencies(c, "/v1/runs", args.probes // 4)
                    print(f"{'idle':34} {pct(h, 50):9.2f} ms {pct(h, 99):6.2f} ms {pct(q, 50):10.2f} ms "
                          f"{pct(q, 99):6.2f} ms")
                if "saturated" in parts:
                    threads, statuses = saturate(url, args.slow)
                    state = wait_saturated(c, args.slow)
                    t0 = time.perf_counter()
                    h, q = latencies(c, "/healthz", args.probes), latencies(c, "/v1/runs", args.probes // 4)
                    span = time.perf_counter() - t0
                    print(f"{f'{args.slow} slow queries in flight':34} {pct(h, 50):9.2f} ms {pct(h, 99):6.2f} ms "
                          f"{pct(q, 50):10.2f} ms {pct(q, 99):6.2f} ms")
                    print(f"  (measured over {span:.1f} s from: {state}; now {sql_gauges(c) or 'no gauges'})")
                    for t in threads:
                        t.join()
                    counts = {s: statuses.count(s) for s in sorted(set(statuses))}
                    print(f"  the slow queries' answers: {counts}")
                if "sizes" in parts:
                    print()
                    print(f"{'query':18} {'format':6} {'status':>6} {'body':>12} {'cap':>9} {'truncated':>9} "
                          f"{'time':>8} {'peak RSS +':>11}")
                    for what, sql, fmt in SIZES:
                        _, hwm_before = rss_kib(proc.pid)
                        status, size, truncated, dt = body_size(c, sql, fmt)
                        _, hwm_after = rss_kib(proc.pid)
                        print(f"{what:18} {fmt:6} {status:6d} {size / 2**20:8.2f} MiB {args.max_bytes_mib:5.1f} MiB "
                              f"{truncated:>9} {dt:7.2f}s {(hwm_after - hwm_before) / 1024:7.0f} MiB")
        finally:
            proc.terminate()
            proc.wait(60)
    return 0


if __name__ == "__main__":
    sys.exit(main())
