"""The fleet queries (docs/fleet.md) over an archive of many runs: DuckDB and Spark, side by side.

Builds `--runs` synthetic finished runs (tests/fleet_runs.py `fleet_file`: 4 of 6 nodes each, 2
ranks a node, `--steps` steps, a slow node, rollbacks, stragglers, hangs and spikes), archives
them with `collector archive`, then times every query of docs/fleet.md on DuckDB
(`open_archive`) and on pyspark in local mode (`register_spark_views`), each run once to warm up
and then `--repeats` times (the median printed), and checks that both engines agree.

    python bench/bench_fleet.py                 # 100 runs
    python bench/bench_fleet.py --runs 20 --repeats 3
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from collector.offline.archive import archive, open_archive, register_spark_views  # noqa: E402
from tests.docs_sql import DOCS, sql_blocks  # noqa: E402
from tests.fleet_runs import fleet_file  # noqa: E402


def _timed(fn, repeats: int) -> tuple[float, object]:
    out = fn()  # warm-up (Spark compiles, DuckDB reads the footers)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times), out


def _agree(a: list, b: list) -> bool:
    def same(x, y):
        if isinstance(x, float) or isinstance(y, float):
            return math.isclose(float(x), float(y), rel_tol=1e-9, abs_tol=1e-12)
        return x == y
    return len(a) == len(b) and all(len(x) == len(y) and all(map(same, x, y)) for x, y in zip(a, b))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=100)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    from pyspark.sql import SparkSession

    queries = sql_blocks(DOCS / "fleet.md")
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        t = time.perf_counter()
        src = fleet_file(d / "fleet.duckdb", num_runs=args.runs, t0=time.time() - 40 * 86400.0, steps=args.steps)
        result = archive(src, d / "archive")
        files = sum(1 for _ in (d / "archive").rglob("*.parquet"))
        print(f"{args.runs} runs, {result.rows['steps']:,} step rows, {files} Parquet files "
              f"(built and archived in {time.perf_counter() - t:.1f} s)")
        t = time.perf_counter()
        spark = (SparkSession.builder.master("local[2]").appName("bench-fleet").config("spark.ui.enabled", "false").config("spark.ui.showConsoleProgress", "false")
                 .config("spark.sql.session.timeZone", "UTC")
                 .config("spark.sql.sources.partitionColumnTypeInference.enabled", "false")
                 .config("spark.sql.shuffle.partitions", "4").getOrCreate())
        spark.sparkContext.setLogLevel("ERROR")
        register_spark_views(spark, d / "archive")
        print(f"Spark local[2] up and the archive registered in {time.perf_counter() - t:.1f} s")
        con = open_archive(d / "archive")
        print(f"{'query':<28} {'duckdb ms':>10} {'spark ms':>10} {'spark/duckdb':>13}  agree")
        try:
            for name, sql in queries.items():
                td, rd = _timed(lambda: con.execute(sql).fetchall(), args.repeats)
                ts, rs = _timed(lambda: [tuple(r) for r in spark.sql(sql).collect()], args.repeats)
                print(f"{name:<28} {1e3 * td:>10.1f} {1e3 * ts:>10.1f} {ts / td:>12.1f}x  {_agree(rd, rs)}")
        finally:
            con.close()
            spark.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
