"""Collector ingest benchmark: DuckDB's own ceiling vs the whole HTTP path, in one run.

1. ceiling      DuckDB's Arrow bulk insert of the same rows (one transaction), and,
                for scale, the same batches committed one transaction per request
                (what ingest costs without group commit), the storage layer alone
                (decode + writer thread, no HTTP) given every batch at once, and
                the writer alone as a closed loop of --connections decoded batches
                in flight. A request is acknowledged after its commit, so K
                waiting clients never give the writer a commit of more than K
                batches: the closed loop is what the HTTP path could reach were
                HTTP, decoding and detection free.
2. http         `collector serve` in its own process, `bench/loadgen.py throughput`
                in another (several keep-alive connections, realistic batches built
                with agent.wire.encode_batch): rows/s end to end, CPU per row of
                both processes, and the ratio to the ceiling.
3. ranks        10,000 simulated ranks at 1 step/s with 20 collectives per step
                (210,000 rows/s offered), each rank flushing every --flush-s, held
                for --duration seconds: achieved rows/s, ingest-to-queryable
                latency, and the collector's RSS sampled every 0.5 s. --ranks,
                --step-hz, --collectives and --summaries (a rank-step's collectives
                as summary rows, agent/summary.py) size it: the 100,000-rank job is
                --ranks 100000 --step-hz 0.2 --collectives 200 --summaries 3;
                --per-node 8 sends each node's batches as one bundle, as a
                node's relay does (collector/relay.py).

Ingest-to-queryable: the collector answers a POST only after the batch's
transaction committed, so the ack latency (POST sent -> answer read) bounds the
time until the rows are visible to a SELECT. A probe also posts one marked batch a
second and times POST-sent -> a SELECT over /v1/sql that sees it.

The machine is shared; wall-clock figures move with everyone else's load, so
CPU seconds per row (from /proc) are printed too, with the rows/s that CPU cost
would give on two dedicated cores.

    python bench/bench_ingest.py                  # full run (scenario 3 held 60 s)
    python bench/bench_ingest.py --duration 15    # quick
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import Future
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import loadgen  # noqa: E402

from agent import wire  # noqa: E402
from collector.ingest import columns  # noqa: E402
from collector.ingest.decode import decode  # noqa: E402
from collector.settings import Settings, WriterSettings  # noqa: E402
from collector.storage import Storage, connect  # noqa: E402
from collector.store import schema  # noqa: E402

TOKEN = "bench-token"
CLK_TCK = os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK  # utime + stime


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def fresh_db(tmp: Path, name: str) -> Path:
    path = tmp / f"{name}.duckdb"
    for p in (path, Path(str(path) + ".wal")):
        p.unlink(missing_ok=True)
    return path


# -- 1. ceiling --------------------------------------------------------------------
def ceiling(tmp: Path, bodies: list[bytes], in_flight: int) -> dict:
    decoded = [decode(b) for b in bodies]
    rows = sum(b.num_rows for b in decoded)
    tables = columns.ingest_tables(decoded)
    con = connect(fresh_db(tmp, "ceiling"))
    schema.migrate(con)
    t0 = time.perf_counter()
    con.execute("BEGIN TRANSACTION")
    for name, table in tables.items():
        con.register("t", table)
        con.execute(f"INSERT INTO {name} BY NAME SELECT * FROM t")
        con.unregister("t")
    con.execute("COMMIT")
    bulk_s = time.perf_counter() - t0
    con.close()

    def through_storage(name: str, in_flight: int | None = None, **writer) -> float:
        """Seconds to store every body. `in_flight` K: the writer alone, as a closed loop of
        batches decoded beforehand, the next K submitted once the last K were acknowledged
        (K connections waiting for their acks)."""
        storage = Storage(Settings(db_path=fresh_db(tmp, name), writer=WriterSettings(linger_s=0.0, **writer)))
        batches = decoded if in_flight else None
        t = time.perf_counter()
        k = in_flight or len(bodies)
        for i in range(0, len(bodies), k):
            futures = []
            for j in range(i, min(i + k, len(bodies))):
                f: Future = Future()
                storage._writer.submit_batch(batches[j] if batches else decode(bodies[j]), f)
                futures.append(f)
            for f in futures:
                f.result()
        elapsed = time.perf_counter() - t
        storage.close()
        return elapsed

    per_request_s = through_storage("per_request", max_rows=1)
    grouped_s = through_storage("grouped")
    closed_s = through_storage("closed", in_flight=in_flight)
    return {"rows": rows, "bulk_rows_per_s": rows / bulk_s, "per_request_rows_per_s": rows / per_request_s,
            "storage_rows_per_s": rows / grouped_s, "closed_rows_per_s": rows / closed_s}


# -- processes ---------------------------------------------------------------------
class Collector:
    def __init__(self, db: Path, *extra: str) -> None:
        cmd = [sys.executable, "-m", "collector", "serve", "--db", str(db), "--port", "0", "--token", TOKEN, *extra]
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env={**os.environ, "PYTHONPATH": str(ROOT)})
        for line in self.proc.stdout:
            if line.startswith("collector listening on "):
                self.url = line.split()[3]
                break
        else:
            raise RuntimeError("collector did not start")
        threading.Thread(target=self._drain, daemon=True).start()
        self.port = int(self.url.rsplit(":", 1)[1])

    def _drain(self) -> None:
        for _ in self.proc.stdout:  # keep the pipe from filling up
            pass

    def sql(self, query: str) -> list:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        conn.request("POST", "/v1/sql", json.dumps({"sql": query}),
                     {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"})
        body = json.loads(conn.getresponse().read())
        conn.close()
        return body["rows"]

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(120)


def run_loadgen(url: str, *args: str) -> tuple[dict, float]:
    """Run bench/loadgen.py to completion; (its JSON summary, its CPU seconds)."""
    proc = subprocess.Popen([sys.executable, str(ROOT / "bench" / "loadgen.py"), "--url", url, "--token", TOKEN,
                             "--json", *args], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    out = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode:
        raise RuntimeError(f"loadgen failed ({proc.returncode})")
    return json.loads(out), usage.ru_utime + usage.ru_stime


# -- 2. http -------------------------------------------------------------------------
def http_path(tmp: Path, args) -> dict:
    server = Collector(fresh_db(tmp, "http"), "--group-linger-s", str(args.linger_s))
    cpu0 = cpu_s(server.proc.pid)
    summary, loadgen_cpu = run_loadgen(
        server.url, "--ranks", "64", "--connections", str(args.connections), "--collectives", "20",
        "--duration", str(args.throughput_s), "throughput", "--steps-per-batch", str(args.steps_per_batch))
    server_cpu = cpu_s(server.proc.pid) - cpu0
    stored = sum(server.sql(f"SELECT count(*) FROM {t}")[0][0] for t in ("steps", "collectives"))
    server.stop()
    rows = summary["rows"]
    return {**summary, "stored_rows": stored, "server_cpu_us_per_row": server_cpu / rows * 1e6,
            "loadgen_cpu_us_per_row": loadgen_cpu / rows * 1e6,
            "two_core_rows_per_s": 2.0 / ((server_cpu + loadgen_cpu) / rows)}


# -- 3. many ranks -------------------------------------------------------------------
def probe(server: Collector, stop: threading.Event, latencies: list[float], misses: list[int]) -> None:
    """Once a second: POST a marked batch, then SELECT until it is visible."""
    maker = loadgen.BatchMaker("probe", steps=1, collectives=0)
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    headers = {"Authorization": f"Bearer {TOKEN}", "Content-Type": wire.CONTENT_TYPE}
    seq = 0
    while not stop.wait(1.0):
        body = maker.make(0, seq)
        t0 = time.perf_counter()
        conn.request("POST", "/v1/ingest", body, headers)
        conn.getresponse().read()
        first_try = True
        while not server.sql(f"SELECT count(*) FROM steps WHERE run_id = 'probe' AND step = {seq}")[0][0]:
            first_try = False
            time.sleep(0.005)
        latencies.append(time.perf_counter() - t0)
        misses.append(0 if first_try else 1)
        seq += 1
    conn.close()


def many_ranks(tmp: Path, args) -> dict:
    server = Collector(fresh_db(tmp, "ranks"), "--group-linger-s", str(args.linger_s))
    stop = threading.Event()
    rss: list[int] = []
    probe_s: list[float] = []
    misses: list[int] = []

    def sample_rss() -> None:
        while not stop.wait(0.5):
            rss.append(rss_bytes(server.proc.pid))

    threads = [threading.Thread(target=sample_rss), threading.Thread(target=probe, args=(server, stop, probe_s, misses))]
    for t in threads:
        t.start()
    cpu0 = cpu_s(server.proc.pid)
    t0 = time.perf_counter()
    try:
        summary, loadgen_cpu = run_loadgen(
            server.url, "--ranks", str(args.ranks), "--connections", str(args.rank_connections), "--collectives",
            str(args.collectives), "--summaries", str(args.summaries), "--heartbeat", "--duration", str(args.duration),
            "ranks", "--step-hz", str(args.step_hz), "--flush-s", str(args.flush_s), "--per-node", str(args.per_node))
    finally:
        stop.set()
        for t in threads:
            t.join()
    wall_s = time.perf_counter() - t0
    server_cpu = cpu_s(server.proc.pid) - cpu0
    stored = sum(server.sql(f"SELECT count(*) FROM {t} WHERE run_id = 'loadgen'")[0][0]
                 for t in ("steps", "collectives", "collectives_rollup", "heartbeats"))
    # the load generator's job is healthy: any incident is a false positive of the detectors at this scale
    incidents = server.sql("SELECT kind || ' (' || count(*) || ')' FROM incidents WHERE run_id = 'loadgen' "
                           "GROUP BY kind ORDER BY kind")
    server.stop()
    lat = np.array(probe_s) if probe_s else np.zeros(1)
    return {**summary, "stored_rows": stored, "wall_s": wall_s, "server_cpu_s": server_cpu,
            "server_cores_used": server_cpu / wall_s, "loadgen_cpu_s": loadgen_cpu,
            "rss_max_mib": max(rss, default=0) / 2**20, "rss_end_mib": (rss[-1] if rss else 0) / 2**20,
            "probe_n": len(probe_s), "probe_p50_ms": float(np.percentile(lat, 50)) * 1e3,
            "probe_p99_ms": float(np.percentile(lat, 99)) * 1e3, "probe_max_ms": float(lat.max()) * 1e3,
            "probe_needed_second_select": int(sum(misses)), "incidents": [k for k, in incidents]}


def main() -> int:
    p = argparse.ArgumentParser(description="collector ingest benchmark")
    p.add_argument("--duration", type=float, default=60.0, help="seconds scenario 3 is held")
    p.add_argument("--throughput-s", type=float, default=10.0, help="seconds of scenario 2")
    p.add_argument("--connections", type=int, default=8)
    p.add_argument("--steps-per-batch", type=int, default=200, help="scenario 2: batch = steps x 21 rows")
    p.add_argument("--linger-s", type=float, default=0.05, help="the collector's --group-linger-s")
    p.add_argument("--ranks", type=int, default=10_000)
    p.add_argument("--rank-connections", type=int, default=1024)
    p.add_argument("--flush-s", type=float, default=5.0, help="scenario 3: each rank's flush period")
    p.add_argument("--step-hz", type=float, default=1.0, help="scenario 3: each rank's steps per second")
    p.add_argument("--collectives", type=int, default=20, help="scenario 3: collectives per rank-step")
    p.add_argument("--summaries", type=int, default=0,
                   help="scenario 3: > 0, a rank-step's collectives as this many summary rows (agent/summary.py)")
    p.add_argument("--per-node", type=int, default=0,
                   help="scenario 3: > 0, ranks per node, each node's batches one bundle (its relay's)")
    p.add_argument("--skip", nargs="*", default=[], choices=["ceiling", "http", "ranks"])
    args = p.parse_args()

    print(f"load average at start: {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores")
    maker = loadgen.BatchMaker("ceiling", args.steps_per_batch, 20)
    bodies = [maker.make(rank, seq) for seq in range(12) for rank in range(64)]
    with tempfile.TemporaryDirectory(prefix="bench_ingest_") as d:
        tmp = Path(d)
        ceil = None
        if "ceiling" not in args.skip:
            ceil = ceiling(tmp, bodies, args.connections)
            print(f"\n[1] same {ceil['rows']:,} rows ({len(bodies)} batches of {maker.rows} rows)")
            print(f"    DuckDB Arrow bulk insert, one transaction : {ceil['bulk_rows_per_s']:>12,.0f} rows/s  (ceiling)")
            print(f"    storage layer, group commit (no HTTP)      : {ceil['storage_rows_per_s']:>12,.0f} rows/s")
            print(f"    storage layer, one commit per batch        : {ceil['per_request_rows_per_s']:>12,.0f} rows/s")
            print(f"    writer alone, {args.connections:>3} batches in flight         : "
                  f"{ceil['closed_rows_per_s']:>12,.0f} rows/s  ({ceil['closed_rows_per_s'] / ceil['bulk_rows_per_s']:.2f}x: "
                  f"acked after their commit, {args.connections} waiting\n"
                  f"{'':50}clients never make a commit larger than {args.connections * maker.rows:,} rows)")
        if "http" not in args.skip:
            h = http_path(tmp, args)
            print(f"\n[2] HTTP path: loadgen ({args.connections} connections, {args.steps_per_batch * 21}-row batches) "
                  f"-> collector -> DuckDB, {h['elapsed_s']:.1f} s")
            print(f"    rows/s end to end        : {h['rows_per_s']:>12,.0f}   ({h['requests_per_s']:.0f} requests/s, "
                  f"{h['stored_rows']:,} rows stored)")
            if ceil:
                print(f"    ratio to the ceiling     : {h['rows_per_s'] / ceil['bulk_rows_per_s']:12.2f}   "
                      f"(to the writer alone with as many in flight: "
                      f"{h['rows_per_s'] / ceil['closed_rows_per_s']:.2f})")
            print(f"    ack latency p50 / p99    : {h['latency_p50_ms']:.0f} / {h['latency_p99_ms']:.0f} ms")
            print(f"    CPU per row              : collector {h['server_cpu_us_per_row']:.2f} us, "
                  f"loadgen {h['loadgen_cpu_us_per_row']:.2f} us")
            print(f"    rows/s that CPU cost gives on 2 dedicated cores: {h['two_core_rows_per_s']:,.0f}")
        if "ranks" not in args.skip:
            r = many_ranks(tmp, args)
            colls = (f"{args.collectives} collectives as {args.summaries} summary rows" if args.summaries
                     else f"{args.collectives} collectives")
            print(f"\n[3] {args.ranks:,} ranks x {args.step_hz:g} step/s x (1 step + {colls}) + a heartbeat a flush, "
                  f"flush every {args.flush_s:g} s, held {args.duration:g} s"
                  + (f", through a relay per {args.per_node} ranks (one bundle per node per flush)" if args.per_node else ""))
            print(f"    offered / achieved rows/s: {r['offered_rows_per_s']:,} / {r['rows_per_s']:,} "
                  f"({r['requests_per_s']:.0f} requests/s, {r['errors']} errors, dispatch lag max "
                  f"{r['dispatch_lag_max_s']:.2f} s)")
            print(f"    rows stored              : {r['stored_rows']:,} (acknowledged {r['rows']:,})")
            print(f"    ack latency p50/p99/max  : {r['latency_p50_ms']:.0f} / {r['latency_p99_ms']:.0f} / "
                  f"{r['latency_max_ms']:.0f} ms  (ack = committed = queryable)")
            print(f"    probe POST->visible      : p50 {r['probe_p50_ms']:.0f} ms, p99 {r['probe_p99_ms']:.0f} ms, "
                  f"max {r['probe_max_ms']:.0f} ms over {r['probe_n']} probes "
                  f"({r['probe_needed_second_select']} needed a second SELECT)")
            print(f"    collector RSS            : max {r['rss_max_mib']:.0f} MiB, at end {r['rss_end_mib']:.0f} MiB")
            print(f"    incidents (a healthy job): {', '.join(r['incidents']) or 'none'}")
            print(f"    collector CPU            : {r['server_cores_used']:.2f} cores; loadgen {r['loadgen_cpu_s']:.1f} "
                  f"CPU-s")
    print(f"\nload average at end: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
