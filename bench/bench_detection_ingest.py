"""Collector ingest with detection on vs off: rows/s of the same load, side by side in one run.

Two `collector serve` processes on fresh files, one as deployed (the detection
thread runs analysis/ on every commit) and one with `--no-detect`, each driven by
`bench/loadgen.py throughput` (the same 64 simulated ranks, realistic batches of
step and collective rows) for the same time, alternated over --rounds so that the
shared machine's load drifts over both alike. Detection runs off the writer
thread, so the goal is a ratio (on / off) of at least 0.95. CPU per row of the
collector is printed too: detection costs CPU even where it costs no throughput.

    python bench/bench_detection_ingest.py                 # 3 rounds of 8 s each way
    python bench/bench_detection_ingest.py --rounds 5 --seconds 10
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench_ingest import Collector, cpu_s, fresh_db, run_loadgen  # noqa: E402


def one(tmp: Path, name: str, args, *extra: str) -> dict:
    server = Collector(fresh_db(tmp, name), "--group-linger-s", str(args.linger_s), *extra)
    cpu0 = cpu_s(server.proc.pid)
    summary, _ = run_loadgen(server.url, "--ranks", "64", "--connections", str(args.connections), "--collectives",
                             "20", "--duration", str(args.seconds), "throughput", "--steps-per-batch",
                             str(args.steps_per_batch))
    server_cpu = cpu_s(server.proc.pid) - cpu0
    incidents = server.sql("SELECT count(*) FROM incidents")[0][0]
    server.stop()
    return {"rows_per_s": summary["rows_per_s"], "rows": summary["rows"],
            "cpu_us_per_row": server_cpu / summary["rows"] * 1e6, "incidents": incidents}


def main() -> int:
    p = argparse.ArgumentParser(description="collector ingest, detection on vs off")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seconds", type=float, default=8.0, help="loadgen duration per collector per round")
    p.add_argument("--connections", type=int, default=8)
    p.add_argument("--steps-per-batch", type=int, default=50, help="batch = steps x 21 rows")
    p.add_argument("--linger-s", type=float, default=0.05)
    args = p.parse_args()
    print(f"load average at start: {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores")
    on, off = [], []
    with tempfile.TemporaryDirectory(prefix="bench_detect_ingest_") as d:
        tmp = Path(d)
        for i in range(args.rounds):
            first, second = (("on", ()), ("off", ("--no-detect",))) if i % 2 == 0 else \
                (("off", ("--no-detect",)), ("on", ()))
            for name, extra in (first, second):
                r = one(tmp, f"{name}{i}", args, *extra)
                (on if name == "on" else off).append(r)
                print(f"round {i + 1} detection {name:<3}: {r['rows_per_s']:>10,.0f} rows/s, "
                      f"collector {r['cpu_us_per_row']:.2f} us CPU/row, {r['incidents']} incidents", flush=True)
    med_on = statistics.median(r["rows_per_s"] for r in on)
    med_off = statistics.median(r["rows_per_s"] for r in off)
    cpu_on = statistics.median(r["cpu_us_per_row"] for r in on)
    cpu_off = statistics.median(r["cpu_us_per_row"] for r in off)
    print(f"\nmedian rows/s: detection on {med_on:,.0f}, off {med_off:,.0f}; ratio on/off {med_on / med_off:.3f} "
          f"(goal >= 0.95)")
    print(f"median collector CPU per row: on {cpu_on:.2f} us, off {cpu_off:.2f} us")
    print(f"load average at end: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
