"""What hostile, unauthenticated clients cost the collector: memory and answer time.

A real `collector serve` in its own process; this script plays the attacker:

1. oversized   N unauthenticated POSTs, each announcing and trying to send a
               --body-mb body (spread over /v1/sql, /v1/ingest, /v1/metrics and
               /v1/runs/x/commands). Printed: the collector's RSS before and after
               and its peak (VmHWM), and how long each refusal took to come back.
2. nested      an unauthenticated body of 100,000 nested brackets: answered 401
               (from the headers), not parsed.
3. peer        the same number of authenticated, well-formed small SQL requests,
               as the yardstick for the refusal latency.

    python bench/bench_gate.py                       # 20 x 200 MB
    python bench/bench_gate.py --count 5 --body-mb 50
    python bench/bench_gate.py --root /path/to/an/older/checkout   # the same attack on other code
"""

from __future__ import annotations

import argparse
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from collector_proc import rss_kib, start_collector  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "bench-gate-token-0123456789"
PATHS = ("/v1/sql", "/v1/ingest", "/v1/metrics", "/v1/runs/x/commands")


def oversized_post(port: int, path: str, body_bytes: int, timeout_s: float = 60.0) -> tuple[int, float, int]:
    """(status, seconds until the answer, bytes the server let us send)."""
    chunk = b"x" * (1 << 20)
    t0 = time.perf_counter()
    sent = 0
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as s:
        s.sendall((f"POST {path} HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
                   f"Content-Length: {body_bytes}\r\n\r\n").encode())
        s.setblocking(False)
        answer = b""
        while time.perf_counter() - t0 < timeout_s:
            try:
                got = s.recv(65536)
                if not got:
                    break
                answer += got
                if b"\r\n\r\n" in answer:
                    break
            except BlockingIOError:
                pass
            except (ConnectionResetError, BrokenPipeError):
                break
            if sent < body_bytes:
                try:
                    sent += s.send(chunk[:min(len(chunk), body_bytes - sent)])
                except BlockingIOError:
                    time.sleep(0.001)
                except (ConnectionResetError, BrokenPipeError):
                    break
            else:
                time.sleep(0.001)
    status = int(answer.split(b" ", 2)[1]) if answer.startswith(b"HTTP/1.1 ") else 0
    return status, time.perf_counter() - t0, sent


def authed_sql(port: int) -> float:
    body = b'{"sql": "SELECT 1"}'
    t0 = time.perf_counter()
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall((f"POST /v1/sql HTTP/1.1\r\nHost: bench\r\nAuthorization: Bearer {TOKEN}\r\nConnection: close\r\n"
                   f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode() + body)
        while s.recv(65536):
            pass
    return time.perf_counter() - t0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--count", type=int, default=20)
    p.add_argument("--body-mb", type=int, default=200)
    p.add_argument("--root", type=Path, default=ROOT, help="the checkout whose collector to attack")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        # --token: the attacked checkout may predate token files (the gate's own baseline)
        proc, url = start_collector(args.root, Path(tmp) / "gate.duckdb", TOKEN, "--token", TOKEN)
        port = int(url.rsplit(":", 1)[1])
        try:
            for _ in range(5):
                authed_sql(port)  # warm: imports, first query
            before, _ = rss_kib(proc.pid)
            statuses, times, sent = [], [], []
            for i in range(args.count):
                st, dt, n = oversized_post(port, PATHS[i % len(PATHS)], args.body_mb << 20)
                statuses.append(st)
                times.append(dt)
                sent.append(n)
            after, peak = rss_kib(proc.pid)
            st, dt, _ = oversized_post(port, "/v1/sql", 200_000)  # nested brackets: content does not matter
            peer = [authed_sql(port) for _ in range(args.count)]
            print(f"collector {args.root}")
            print(f"{args.count} unauthenticated POSTs of {args.body_mb} MB: statuses {sorted(set(statuses))}")
            print(f"  RSS before {before / 1024:8.1f} MiB   after {after / 1024:8.1f} MiB   "
                  f"(+{(after - before) / 1024:.1f} MiB)   peak {peak / 1024:.1f} MiB")
            print(f"  refusal came back after median {statistics.median(times) * 1e3:8.1f} ms "
                  f"(max {max(times) * 1e3:.1f} ms), having let the client send median "
                  f"{statistics.median(sent) / 1e6:.1f} MB of {args.body_mb} MB")
            print(f"  peer: an authenticated SELECT 1, median {statistics.median(peer) * 1e3:.1f} ms")
            print(f"unauthenticated 200 kB body to /v1/sql: status {st} in {dt * 1e3:.1f} ms")
        finally:
            proc.terminate()
            proc.wait(30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
